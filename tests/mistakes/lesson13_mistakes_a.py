"""Lesson 13 exercise: tensor and sequence parallelism, from the operators up to async TP.

Five tasks. The first writes Megatron's two conjugate operators as autograd functions (f:
identity forward, all-reduce backward; g: the mirror); the second builds the column- and
row-parallel linear layers on them; the third is sequence parallelism's pair (all-gather
forward / reduce-scatter backward, and its mirror); the fourth is the vocabulary-parallel
cross-entropy, whose logits are never gathered; the fifth is async TP's all-gather →
matmul, cut into p pieces, each piece's transfer running while the piece before it is
multiplied.

Check your work:

    make check LESSON=13                                                # one PASS/FAIL line per task
    .venv/bin/python lessons/13_tensor_parallel/exercise.py --task 2 --verbose    # one task, every problem
    .venv/bin/torchrun --nproc-per-node 4 lessons/13_tensor_parallel/exercise.py  # the same, under torchrun
    make grade LESSON=13                                                # the same verdicts, as points

The checks are the grader's own judges, run outside your ranks: weights, inputs and
gradients are drawn at random on every run, and every message you send is recorded where
your code cannot reach it. Use lesson 4's ring (below), not ``dist.*`` collectives.

Course functions you may call (the sheet is checked against the code):

    collectives.ring.ring_all_reduce(tensor, op=ReduceOp.SUM, group=None) -> None
        All-reduce ``tensor`` in place: ring reduce-scatter, then ring all-gather.
    collectives.ring.ring_all_gather(output, input, group=None) -> None
        ``output`` ← every rank's ``input``, concatenated in rank order.
    collectives.ring.ring_reduce_scatter(output, input, op=ReduceOp.SUM, group=None) -> None
        ``output`` ← chunk ``rank`` of the reduction of every rank's ``input`` (input
        unchanged).
    ops.group_rank_and_size(group=None) -> tuple[int, int]
        This rank's index in ``group`` and the group's size (the world when ``group`` is
        None).
    ops.global_rank(group, group_rank) -> int
        The global rank of ``group_rank`` in ``group``: what ``send``/``recv`` take.
    ops.sendrecv(send_buf, dst, recv_buf, src, group=None, *, post_empty=False)
        Post a receive of ``recv_buf`` from ``src`` and a send of ``send_buf`` to ``dst``;
        return the ``(receive, send)`` handles. ``dst``/``src`` are global ranks.

The reference is ``collectives/tensor_parallel/`` (``steps.py`` for these five); the lesson
page is docs/lessons/13-tensor-parallel.md.
"""

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

# Every task right but for one natural mistake each: g's backward sums the gradient; the row layer adds its bias
# before the sum; the sequence gathered flat; no max before exp; the transfer waited for before the matmul.


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
        out = grad.contiguous().clone()
        ring_all_reduce(out, group=ctx.group)  # the mistake: g's backward sums too
        return out, None


def copy_to_parallel(x, group=None):
    return _Copy.apply(x, group)


def reduce_from_parallel(x, group=None):
    return _Reduce.apply(x, group)


def column_parallel_linear(x, weight, bias, group=None):
    return F.linear(copy_to_parallel(x, group), weight, bias)


def row_parallel_linear(x, weight, bias, group=None):
    return reduce_from_parallel(F.linear(x, weight, bias), group)  # the mistake: the bias before the sum


def _gather1(x, group):
    p = ops.group_rank_and_size(group)[1]
    out = x.new_empty((x.shape[0], p * x.shape[1]) + tuple(x.shape[2:]))
    ring_all_gather(out, x.detach().contiguous(), group=group)  # the mistake: gathered flat, batch interleaved
    return out


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
