"""Lesson 14 exercise, natural mistakes (set A): every task written as the reference
writes it, with one mistake planted in each, which the grader must fail with a message
that names it:

    task 1: the shape sent (and received) before every activation, not once per link
    task 2: the last rank starts the backward from one micro-batch's loss gradient (m = 1):
            every gradient m times too large
    task 3: rank r warms up with r forwards instead of p − 1 − r: rank 0 waits for a gradient
            while rank 1 waits for its activation, a deadlock
    task 4: B always runs the full backward (stage.backward) and the W steps are skipped
    task 5: each W runs at once after its B: no W is left to fill the gaps
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from collectives import ops
from collectives.course.grading.runner import run_tasks
from tests.solutions.lesson14_written import *  # noqa: F401,F403 - every task as written there, but:
from tests.solutions.lesson14_written import SHAPE_SLOTS, shape_from, shape_message  # noqa: F401

LESSON = 14


def pipeline_forward(stage, micro_batches: list, group=None) -> list[torch.Tensor]:
    rank, p = ops.group_rank_and_size(group)
    prev = ops.global_rank(group, rank - 1) if rank > 0 else None
    nxt = ops.global_rank(group, rank + 1) if rank < p - 1 else None
    dtype = stage.weights[0][0].dtype
    outputs, sends, shape = [], [], None
    for i, x in enumerate(micro_batches):
        if prev is not None:
            if True:  # the mistake: the shape before every activation
                msg = torch.empty(SHAPE_SLOTS, dtype=torch.int64)
                dist.recv(msg, prev, group=group)
                shape = shape_from(msg)
            x = torch.empty(shape, dtype=dtype)
            dist.recv(x, prev, group=group)
        y = stage.forward(x, i)
        if nxt is not None:
            if True:  # the mistake: the shape before every activation
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
            kept[i] = stage.loss_grad(y, targets[i], 1)  # the mistake: not divided by m
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
    warmup = min(rank, m)  # the mistake: r forwards, not p - 1 - r
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
            gx = stage.backward(g, i)  # the mistake: the full backward at every B
            if prev is not None:
                sends.append(dist.isend(gx, prev, group=group))
        else:
            pass  # the mistake: no W
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
            if len(owed[r]) > 0:  # the mistake: each W right after its B
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
