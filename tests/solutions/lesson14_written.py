"""Lesson 14 exercise, written: every task as the reference writes it, in the exercise's own
functions, their docstrings left out (the base of every fixture in tests/mistakes/).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from collectives import ops
from collectives.course.grading.runner import run_tasks
from tests.mistakes.given import given

LESSON = 14
SHAPE_SLOTS, shape_message, shape_from = given(14, "SHAPE_SLOTS", "shape_message", "shape_from")


def pipeline_forward(stage, micro_batches: list, group=None) -> list[torch.Tensor]:
    rank, p = ops.group_rank_and_size(group)
    prev = ops.global_rank(group, rank - 1) if rank > 0 else None
    nxt = ops.global_rank(group, rank + 1) if rank < p - 1 else None
    dtype = stage.weights[0][0].dtype
    outputs, sends, shape = [], [], None
    for i, x in enumerate(micro_batches):
        if prev is not None:
            if shape is None:
                msg = torch.empty(SHAPE_SLOTS, dtype=torch.int64)
                dist.recv(msg, prev, group=group)
                shape = shape_from(msg)
            x = torch.empty(shape, dtype=dtype)
            dist.recv(x, prev, group=group)
        y = stage.forward(x, i)
        if nxt is not None:
            if i == 0:
                sends.append(dist.isend(shape_message(y.shape), nxt, group=group))
            sends.append(dist.isend(y, nxt, group=group))
        outputs.append(y)
    for work in sends:
        work.wait()
    return outputs


def gpipe_step(stage, micro_batches: list, targets: list, group=None) -> list[float]:
    rank, p = ops.group_rank_and_size(group)
    prev = ops.global_rank(group, rank - 1) if rank > 0 else None
    nxt = ops.global_rank(group, rank + 1) if rank < p - 1 else None
    dtype = stage.weights[0][0].dtype
    m = len(micro_batches)
    sends, shape, out_shape, kept, losses = [], None, None, {}, []
    for i in range(m):
        x = micro_batches[i]
        if prev is not None:
            if shape is None:
                msg = torch.empty(SHAPE_SLOTS, dtype=torch.int64)
                dist.recv(msg, prev, group=group)
                shape = shape_from(msg)
            x = torch.empty(shape, dtype=dtype)
            dist.recv(x, prev, group=group)
        y = stage.forward(x, i)
        out_shape = y.shape
        if nxt is None:
            kept[i] = stage.loss_grad(y, targets[i], m)
            losses.append(stage.loss_value(y, targets[i], m))
        else:
            if i == 0:
                sends.append(dist.isend(shape_message(y.shape), nxt, group=group))
            sends.append(dist.isend(y, nxt, group=group))
    for i in range(m):
        if nxt is None:
            g = kept.pop(i)
        else:
            g = torch.empty(out_shape, dtype=dtype)
            dist.recv(g, nxt, group=group)
        gx = stage.backward(g, i)
        if prev is not None:
            sends.append(dist.isend(gx, prev, group=group))
    for work in sends:
        work.wait()
    return losses


def one_f_one_b_order(p: int, m: int, rank: int) -> list[tuple[str, int]]:
    warmup = min(p - 1 - rank, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def run_schedule(stage, order: list, micro_batches: list, targets: list, group=None) -> list[float]:
    rank, p = ops.group_rank_and_size(group)
    prev = ops.global_rank(group, rank - 1) if rank > 0 else None
    nxt = ops.global_rank(group, rank + 1) if rank < p - 1 else None
    dtype = stage.weights[0][0].dtype
    m = len(micro_batches)
    split = {mb for kind, mb in order if kind == "W"}
    sends, shape, out_shape, kept, losses, told = [], None, None, {}, [], False
    for kind, i in order:
        if kind == "F":
            x = micro_batches[i]
            if prev is not None:
                if shape is None:
                    msg = torch.empty(SHAPE_SLOTS, dtype=torch.int64)
                    dist.recv(msg, prev, group=group)
                    shape = shape_from(msg)
                x = torch.empty(shape, dtype=dtype)
                dist.recv(x, prev, group=group)
            y = stage.forward(x, i)
            out_shape = y.shape
            if nxt is None:
                kept[i] = stage.loss_grad(y, targets[i], m)
                losses.append(stage.loss_value(y, targets[i], m))
            else:
                if not told:
                    sends.append(dist.isend(shape_message(y.shape), nxt, group=group))
                    told = True
                sends.append(dist.isend(y, nxt, group=group))
        elif kind == "B":
            if nxt is None:
                g = kept.pop(i)
            else:
                g = torch.empty(out_shape, dtype=dtype)
                dist.recv(g, nxt, group=group)
            gx = stage.backward_input(g, i) if i in split else stage.backward(g, i)
            if prev is not None:
                sends.append(dist.isend(gx, prev, group=group))
        else:
            stage.backward_weight(i)
    for work in sends:
        work.wait()
    return losses


def zb_h1_order(p: int, m: int, rank: int) -> list[tuple[str, int]]:
    done = {}
    nf, nb = [0] * p, [0] * p
    owed = [[] for _ in range(p)]
    orders = [[] for _ in range(p)]
    t = 0
    while any(len(o) < 3 * m for o in orders):
        chosen = []
        for r in range(p):
            grad_from = ("F", nb[r], r) if r == p - 1 else ("B", nb[r], r + 1)
            if len(owed[r]) > p - 1:
                chosen.append((r, "W", owed[r][0]))
            elif nb[r] < nf[r] and done.get(grad_from, t + 1) <= t:
                chosen.append((r, "B", nb[r]))
            elif nf[r] < m and nf[r] - nb[r] < p - r and (r == 0 or done.get(("F", nf[r], r - 1), t + 1) <= t):
                chosen.append((r, "F", nf[r]))
            elif owed[r]:
                chosen.append((r, "W", owed[r][0]))
        for r, kind, mb in chosen:
            orders[r].append((kind, mb))
            done[(kind, mb, r)] = t + 1
            if kind == "F":
                nf[r] += 1
            elif kind == "B":
                nb[r] += 1
                owed[r].append(mb)
            else:
                owed[r].pop(0)
        t += 1
    return orders[rank]


if __name__ == "__main__":
    run_tasks(LESSON)
