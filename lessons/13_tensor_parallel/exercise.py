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


def copy_to_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Lesson 13, task 1: f -- identity forward, all-reduce of the gradient backward.

    TODO:     return a tensor equal to ``x`` whose gradient, in the backward, is the sum over
              the group of every rank's gradient of it. The column layer's entry: each rank
              computes only its outputs, so each holds only part of d loss / d x.
    APPROACH: a ``torch.autograd.Function`` with ``forward(ctx, x)`` returning ``x.view_as(x)``
              and ``backward(ctx, grad)`` returning a summed copy (``ring_all_reduce`` on
              ``grad.contiguous().clone()``). Pass ``group`` through ``ctx``.
    EXAMPLE:  p = 2, rank 0's gradient [1, 2], rank 1's [10, 20]: both get [11, 22].
    HINT:     never all-reduce the gradient in place: autograd may hand the same tensor to
              another consumer.
    CALLS:    collectives.ring.ring_all_reduce
    """
    raise NotImplementedError("Lesson 13, task 1: copy_to_parallel")


def reduce_from_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Lesson 13, task 1: g -- all-reduce forward, identity backward.

    TODO:     return ``x`` summed over the group (a new tensor; ``x`` unchanged); in the
              backward, the gradient passes unchanged. The row layer's exit: each rank holds
              a partial sum of every output.
    APPROACH: the mirror of :func:`copy_to_parallel`.
    EXAMPLE:  p = 2, rank 0 holds [1, 2], rank 1 [10, 20]: both return [11, 22].
    HINT:     why is the identity the right backward? d(x_0 + x_1)/d x_r = 1.
    CALLS:    collectives.ring.ring_all_reduce
    """
    raise NotImplementedError("Lesson 13, task 1: reduce_from_parallel")


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias, group=None) -> torch.Tensor:
    """Lesson 13, task 2: a linear layer split by its outputs (the columns of Wᵀ).

    TODO:     ``x`` is whole on every rank; ``weight`` (out/p, in) and ``bias`` (out/p, or
              None) are this rank's rows of the full layer's. Return this rank's out/p
              outputs, ``x·weightᵀ + bias``, with x entering through f so that ``x``'s
              gradient is complete on every rank.
    APPROACH: ``F.linear(copy_to_parallel(x, group), weight, bias)``.
    EXAMPLE:  a Linear(4, 6) on p = 2: rank 0 computes outputs 0-2, rank 1 outputs 3-5.
    HINT:     no message forward at all; one all-reduce of x's size backward.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 13, task 2: column_parallel_linear")


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias, group=None) -> torch.Tensor:
    """Lesson 13, task 2: a linear layer split by its inputs (the rows of Wᵀ).

    TODO:     ``x`` holds this rank's in/p input features (a column layer's output);
              ``weight`` (out, in/p) is this rank's columns of the full weight and ``bias``
              (out, or None) the whole bias. Return the full output, the same on every rank.
    APPROACH: the partial product ``F.linear(x, weight)``, summed by g, then the bias --
              added once, after the sum.
    EXAMPLE:  Linear(6, 4) on p = 2: rank 0 multiplies inputs 0-2 by columns 0-2 of W.
    HINT:     add the bias before the sum and it is counted p times.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 13, task 2: row_parallel_linear")


def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Lesson 13, task 3: sequence parallelism's entry -- all-gather forward, reduce-scatter backward.

    TODO:     ``x`` (batch, s/p, hidden) is this rank's piece of the sequence. Return the
              whole sequence (batch, s, hidden), rank r's piece at positions [r·s/p, (r+1)·s/p).
              Backward: the gradient (batch, s, hidden) summed over the group, this rank's
              piece of the sequence kept.
    APPROACH: an autograd Function. The ring gathers rank-major on a flat buffer, so move the
              sequence to the front (``x.movedim(1, 0).contiguous()``), ``ring_all_gather``,
              move it back; the backward likewise with ``ring_reduce_scatter``.
    EXAMPLE:  p = 2, batch 1: rank 0 holds tokens 0-3, rank 1 tokens 4-7; both get 0-7.
    HINT:     gathering ``x`` flat without moving the sequence first interleaves the batch.
    CALLS:    collectives.ring.ring_all_gather, collectives.ring.ring_reduce_scatter
    """
    raise NotImplementedError("Lesson 13, task 3: gather_sequence")


def scatter_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Lesson 13, task 3: sequence parallelism's exit -- reduce-scatter forward, all-gather backward.

    TODO:     ``x`` (batch, s, hidden) is a partial sum (a row layer's output). Return this
              rank's piece of the sequence (batch, s/p, hidden) of the sum over the group.
              Backward: every rank's gradient piece gathered back to (batch, s, hidden).
              Raise ValueError when s does not split over the group.
    APPROACH: the mirror of :func:`gather_sequence`.
    EXAMPLE:  p = 2, s = 8: rank 1 returns tokens 4-7 of the sum.
    HINT:     check the size before any message, on every rank alike.
    CALLS:    collectives.ring.ring_all_gather, collectives.ring.ring_reduce_scatter
    """
    raise NotImplementedError("Lesson 13, task 3: scatter_sequence")


def vocab_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """Lesson 13, task 4: cross-entropy over a vocabulary split across the group.

    TODO:     ``logits`` (..., n) are this rank's classes [r·n, (r+1)·n) of a vocabulary of
              p·n; ``targets`` (...) are class ids in [0, p·n). Return every token's loss,
              log Σ_v exp(logit_v) − logit_target (shape of ``targets``), the same on every
              rank, differentiable with respect to ``logits``. Never send the logits:
              only a few numbers per token may travel.
    APPROACH: the max over the whole vocabulary (local max, then ``ring_all_reduce`` with
              ``ReduceOp.MAX``; no gradient needed); subtract it; the sum of exp and the
              target's logit (0 where this rank does not own the target) summed over the
              group with g (:func:`reduce_from_parallel`: its identity backward is right).
    EXAMPLE:  p = 2, n = 3, target 4: rank 1 owns it (its local class 1).
    HINT:     without the max, exp overflows for logits of 100.
    CALLS:    collectives.ring.ring_all_reduce
    """
    raise NotImplementedError("Lesson 13, task 4: vocab_cross_entropy")


def chunked_all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, group=None,
                              matmul=torch.matmul) -> torch.Tensor:
    """Lesson 13, task 5: async TP -- all-gather → matmul in p pieces, transfers hidden.

    TODO:     ``x`` (m, k) is this rank's rows, ``weight`` (k, n). Return
              ``all_gather(x) @ weight`` (p·m, n), rank j's rows at block j, computing each
              block with ``matmul(piece, weight)`` (call the ``matmul`` you are given, once per
              piece). Send the pieces round the ring with ``ops.sendrecv``, and start the
              transfer of the next piece *before* multiplying the current one, on a side
              thread, so the two overlap.
    APPROACH: step s (0 ≤ s < p): the piece you hold is c = (rank − s) mod p. Submit to a
              ``concurrent.futures.ThreadPoolExecutor(1)`` the exchange "send piece c right,
              receive piece c − 1 from the left, wait both" (not at the last step); then
              multiply piece c; then wait for the exchange.
    EXAMPLE:  p = 2, rank 0: send x₀ / receive x₁ while y₀ = x₀·W; then y₁ = x₁·W.
    HINT:     no all-gather collective: p − 1 messages of m·k elements each.
    CALLS:    ops.group_rank_and_size, ops.global_rank, ops.sendrecv
    """
    raise NotImplementedError("Lesson 13, task 5: chunked_all_gather_matmul")


if __name__ == "__main__":
    run_tasks(LESSON)
