"""Lesson 13 exercise, natural mistakes (set A): every task as ``lesson13_none`` writes it
(imported below), but for the functions defined here, each with the one mistake the comment
above them names (and those that call them, unchanged)."""

from __future__ import annotations

import concurrent.futures  # noqa: F401  (task 5's side thread)

import torch
import torch.distributed as dist  # noqa: F401
import torch.nn.functional as F  # noqa: F401

from collectives import ops  # noqa: F401
from collectives.core.ops import ReduceOp  # noqa: F401
from collectives.course.grading.runner import run_tasks
from collectives.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter  # noqa: F401
from tests.mistakes.lesson13_none import *  # noqa: F401,F403 - every task as written there, but:
from tests.mistakes.lesson13_none import _scatter1  # noqa: F401

# Every task right but for one natural mistake each: g's backward sums the gradient; the row layer adds its bias
# before the sum; the sequence gathered flat; no max before exp; the transfer waited for before the matmul.


LESSON = 13


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.detach().contiguous().clone()
        ring_all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.contiguous().clone()
        ring_all_reduce(out, group=ctx.group)  # the mistake: g's backward sums too
        return out, None


def reduce_from_parallel(x, group=None):
    return _Reduce.apply(x, group)


def row_parallel_linear(x, weight, bias, group=None):
    return reduce_from_parallel(F.linear(x, weight, bias), group)  # the mistake: the bias before the sum


def _gather1(x, group):
    p = ops.group_rank_and_size(group)[1]
    out = x.new_empty((x.shape[0], p * x.shape[1]) + tuple(x.shape[2:]))
    ring_all_gather(out, x.detach().contiguous(), group=group)  # the mistake: gathered flat, batch interleaved
    return out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather1(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _scatter1(grad, ctx.group), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter1(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather1(grad, ctx.group), None


def gather_sequence(x, group=None):
    return _Gather.apply(x, group)


def scatter_sequence(x, group=None):
    p = ops.group_rank_and_size(group)[1]
    if x.shape[1] % p:
        raise ValueError(f"scatter_sequence: a sequence of {x.shape[1]} does not split over {p} ranks")
    return _Scatter.apply(x, group)


def vocab_cross_entropy(logits, targets, group=None):
    rank, p = ops.group_rank_and_size(group)
    n = logits.shape[-1]
    z = logits  # the mistake: no max taken off, exp overflows
    mine = (targets >= rank * n) & (targets < (rank + 1) * n)
    local = (targets - rank * n).masked_fill(~mine, 0)
    target_z = z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
    total = reduce_from_parallel(z.exp().sum(-1), group)
    return total.log() - reduce_from_parallel(target_z, group)


def chunked_all_gather_matmul(x, weight, group=None, matmul=torch.matmul):
    rank, p = ops.group_rank_and_size(group)
    m = x.shape[0]
    pieces = x.new_empty((p, m, x.shape[1]))
    pieces[rank].copy_(x)
    out = x.new_empty((p * m, weight.shape[1]))
    right, left = ops.global_rank(group, (rank + 1) % p), ops.global_rank(group, (rank - 1) % p)

    def exchange(step):
        recv, send = ops.sendrecv(pieces[(rank - step) % p], right, pieces[(rank - step - 1) % p], left, group)
        recv.wait()
        send.wait()

    with concurrent.futures.ThreadPoolExecutor(1) as side:
        for step in range(p):
            c = (rank - step) % p
            pending = side.submit(exchange, step) if step < p - 1 else None
            if pending is not None:
                pending.result()  # the mistake: waits for the transfer before the matmul
            out[c * m:(c + 1) * m] = matmul(pieces[c], weight)
            if pending is not None:
                pending.result()
    return out


if __name__ == "__main__":
    run_tasks(LESSON)
