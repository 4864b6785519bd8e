"""Lesson 13 exercise, written: every task as the reference writes it, in the exercise's own
functions, their docstrings left out (the base of lesson 13's mistake fixtures)."""

from __future__ import annotations

import concurrent.futures  # noqa: F401  (task 5's side thread)

import torch
import torch.distributed as dist  # noqa: F401
import torch.nn.functional as F  # noqa: F401

from collectives import ops  # noqa: F401
from collectives.core.ops import ReduceOp  # noqa: F401
from collectives.course.grading.runner import run_tasks
from collectives.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter  # noqa: F401

LESSON = 13

# A student's solution, written out: every task right (the control).


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        out = grad.contiguous().clone()
        ring_all_reduce(out, group=ctx.group)
        return out, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.detach().contiguous().clone()
        ring_all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_parallel(x, group=None):
    return _Copy.apply(x, group)


def reduce_from_parallel(x, group=None):
    return _Reduce.apply(x, group)


def column_parallel_linear(x, weight, bias, group=None):
    return F.linear(copy_to_parallel(x, group), weight, bias)


def row_parallel_linear(x, weight, bias, group=None):
    y = reduce_from_parallel(F.linear(x, weight), group)
    return y + bias if bias is not None else y


def _gather1(x, group):
    p = ops.group_rank_and_size(group)[1]
    front = x.detach().movedim(1, 0).contiguous()
    out = front.new_empty((p * front.shape[0],) + tuple(front.shape[1:]))
    ring_all_gather(out, front, group=group)
    return out.movedim(0, 1)


def _scatter1(x, group):
    p = ops.group_rank_and_size(group)[1]
    front = x.detach().movedim(1, 0).contiguous()
    out = front.new_empty((front.shape[0] // p,) + tuple(front.shape[1:]))
    ring_reduce_scatter(out, front, group=group)
    return out.movedim(0, 1)


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
    peak = logits.detach().amax(-1).contiguous()
    ring_all_reduce(peak, op=ReduceOp.MAX, group=group)
    z = logits - peak.unsqueeze(-1)
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
            out[c * m:(c + 1) * m] = matmul(pieces[c], weight)
            if pending is not None:
                pending.result()
    return out


if __name__ == "__main__":
    run_tasks(LESSON)
