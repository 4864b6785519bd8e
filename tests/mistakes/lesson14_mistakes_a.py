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
    """Lesson 14, task 1: every micro-batch forward through the p stages; return this rank's
    outputs, one per micro-batch, in order.

    TODO:     rank 0 takes ``micro_batches[i]``; rank r > 0 receives micro-batch i's activation
              from rank r − 1. Run ``stage.forward(x, i)`` and send the output to rank r + 1
              (the last rank sends nothing). Before the FIRST activation on each link, send its
              shape once: ``shape_message(y.shape)``, received into an int64 tensor of
              SHAPE_SLOTS; every later activation reuses it.
    APPROACH: ``isend`` the outputs and keep the handles; wait for them at the end. Receive
              into ``torch.empty(shape, dtype=stage.weights[0][0].dtype)``.
    EXAMPLE:  p = 3, m = 2: rank 1 receives [shape, act 0, act 1] from rank 0 and sends
              [shape, out 0, out 1] to rank 2; 3 messages on each link.
    HINT:     the shape travels once per link, not once per micro-batch.
    CALLS:    ops.group_rank_and_size, ops.global_rank
    """
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
    """Lesson 14, task 2: one GPipe training step; return the m losses on the last rank,
    ``[]`` elsewhere.

    TODO:     all forwards first (as task 1, shape once), micro-batch 0 to m − 1; the last
              rank keeps ``stage.loss_grad(y, targets[i], m)`` and ``stage.loss_value(...)``.
              Then all backwards, micro-batch 0 to m − 1: the gradient of the output comes from
              rank r + 1 (the last rank: the kept loss gradient); ``stage.backward(g, i)``
              returns the input's gradient, sent to rank r − 1 (rank 0 sends nothing).
    APPROACH: one loop for the forwards, one for the backwards; isend everything, wait at the
              end. The gradient has the output's shape (``stage.output_shape``).
    EXAMPLE:  p = 2, m = 2, rank 1: recv shape, recv a0, F0, recv a1, F1, B0 -> send g0,
              B1 -> send g1. Rank 0: F0 -> send shape, a0; F1 -> send a1; recv g0, B0; ...
    HINT:     the stage adds each micro-batch's gradient itself: call backward once per
              micro-batch, and in the forward's order -- the order one process adds them in.
    CALLS:    ops.group_rank_and_size, ops.global_rank
    """
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
    """Lesson 14, task 3: rank ``rank``'s 1F1B order as a list of ``("F", mb)`` and
    ``("B", mb)``.

    TODO:     warm up with min(p − 1 − rank, m) forwards; then, while forwards are left, one
              forward and one backward in turn; then the backwards left. Micro-batches in
              order within each kind.
    APPROACH: w = warm-up count; F 0..w−1; for i in range(m − w): F(w + i), B(i); B the rest.
    EXAMPLE:  p = 4, m = 6, rank 1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5.
    HINT:     the last rank has no warm-up: F0 B0 F1 B1 ...; rank r holds at most p − r
              micro-batches, where GPipe holds m.
    CALLS:    none
    """
    warmup = min(rank, m)  # the mistake: r forwards, not p - 1 - r
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def run_schedule(stage, order: list, micro_batches: list, targets: list, group=None) -> list[float]:
    """Lesson 14, task 4: run this rank's ``order`` of ``(kind, mb)`` steps -- F, B, W --
    and return the losses on the last rank (``[]`` elsewhere), in micro-batch order.

    TODO:     F as in task 2 (the shape once, before the first activation). B: receive the
              output's gradient (the last rank: its kept loss gradient), then
              ``stage.backward_input`` if ``order`` also lists ("W", mb), else
              ``stage.backward``; send the input's gradient back. W: ``stage.backward_weight``.
    APPROACH: never wait for a send until the end; receive only what the step needs now.
    EXAMPLE:  p = 2, m = 2, rank 1 with ZB-H1's order F0 B0 F1 B1 W0 W1: B0 and B1 are
              ``backward_input``, the W's add the weight gradients.
    HINT:     gloo's ``send`` waits until the peer receives: with 1F1B, two ranks blocked in
              ``send`` to each other never return.
    CALLS:    ops.group_rank_and_size, ops.global_rank
    """
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
    """Lesson 14, task 5: rank ``rank``'s ZB-H1 order, ``("F" | "B" | "W", mb)``, every
    backward split into B and W.

    TODO:     play the pipeline with F = B = W = one unit of time. At every unit, each rank runs
              the first that applies: W of the oldest owed micro-batch when more than p − 1 are
              owed; B of the next micro-batch when its gradient is there (the last rank: after
              its F); F of the next when its activation is there (rank 0: always) and fewer than
              p − rank micro-batches await B; an owed W; else it waits.
    APPROACH: per rank: next F, next B, the owed W's and a list of steps; a dict of when each
              (kind, mb, rank) finished. A step can start at unit t if what it needs finished
              by t. Run every rank's choice for unit t, then t + 1.
    EXAMPLE:  p = 2, m = 2: rank 0 F0 F1 B0 W0 B1 W1, rank 1 F0 B0 F1 B1 W0 W1.
    HINT:     any order passes that is complete, cannot deadlock, keeps 1F1B's limit and
              finishes in 3m + p − 1 units; the rule above is one.
    CALLS:    none
    """
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
