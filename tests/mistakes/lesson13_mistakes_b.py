"""Lesson 13 exercise, natural mistakes (set B): every task as ``lesson13_none`` writes it
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

# Every task right but for one natural mistake each: f's backward does not sum; the column layer's input enters
# without f; the scatter's backward keeps only this rank's piece; the logits gathered; each block stored at its
# step, not its piece.


LESSON = 13


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        out = grad.contiguous().clone()
        # the mistake: f's backward passes the gradient on unsummed
        return out, None


def copy_to_parallel(x, group=None):
    return _Copy.apply(x, group)


def column_parallel_linear(x, weight, bias, group=None):
    return F.linear(x, weight, bias)  # the mistake: x enters without f


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter1(x, group)

    @staticmethod
    def backward(ctx, grad):
        rank, p = ops.group_rank_and_size(ctx.group)  # the mistake: only this rank's piece of the gradient
        full = grad.new_zeros((grad.shape[0], grad.shape[1] * p) + tuple(grad.shape[2:]))
        full[:, rank * grad.shape[1]:(rank + 1) * grad.shape[1]] = grad
        return full, None


def scatter_sequence(x, group=None):
    p = ops.group_rank_and_size(group)[1]
    if x.shape[1] % p:
        raise ValueError(f"scatter_sequence: a sequence of {x.shape[1]} does not split over {p} ranks")
    return _Scatter.apply(x, group)


def vocab_cross_entropy(logits, targets, group=None):
    rank, p = ops.group_rank_and_size(group)
    full = logits.new_empty((p,) + tuple(logits.shape))  # the mistake: the logits gathered
    ring_all_gather(full, logits.detach().contiguous(), group=group)
    pieces = list(full.unbind(0))
    pieces[rank] = logits
    whole = torch.cat(pieces, -1)
    return F.cross_entropy(whole.flatten(0, -2), targets.flatten(), reduction="none").view(targets.shape)


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
            out[step * m:(step + 1) * m] = matmul(pieces[c], weight)  # the mistake: block of the step, not of the piece
            if pending is not None:
                pending.result()
    return out


if __name__ == "__main__":
    run_tasks(LESSON)
