"""Lesson 4 exercise: the bandwidth-optimal ring and its rivals.

Seven functions, seven tasks. The first three build the ring all-reduce out of its two
halves; the fourth pipelines it; the last three are the algorithms that beat it on small
tensors. Every all-reduce has ``dist.all_reduce``'s contract: in place, every op and
dtype, views, subgroups, any world size (the ring is graded on 1 to 6 ranks; 3 and 5 are
not powers of two!).

Check your work:

    make check LESSON=04                                      # one PASS/FAIL line per task
    .venv/bin/python lessons/04_ring/exercise.py --task 3 --verbose     # one task, every problem
    .venv/bin/torchrun --nproc-per-node 4 lessons/04_ring/exercise.py   # the same, under torchrun
    make grade LESSON=04                                      # the same verdicts, as points

The checks are the grader's own judges, run outside your ranks: your inputs are drawn at
random on every run, and every message you send is recorded where your code cannot
reach it. A correct all-reduce that sends the wrong pattern -- say, the naive ring for
task 3 -- does not pass. A PASS here means the points.

Course functions you may call (the sheet is checked against the code):

    ops.check_all_reduce_args(tensor, op=ReduceOp.SUM, group=None, *, what='all_reduce',
                              compare=True, agree=None) -> bool
        Raise a clear error for input an in-place all-reduce cannot honour; return whether
        this rank takes part.
    ops.work_buffer(tensor) -> torch.Tensor
        A flat, contiguous buffer holding ``tensor``'s elements: the tensor's own memory
        when it is contiguous, else a copy (to be written back with :func:`write_back`).
    ops.write_back(tensor, flat) -> None
        Copy ``flat`` into ``tensor`` (its data, detached) unless it already is ``tensor``'s
        memory.
    ops.combine_(acc, incoming, op) -> torch.Tensor
        ``acc <- acc (op) incoming``, in place. AVG accumulates as SUM (see
        :func:`finish_`).
    ops.finish_(tensor, op, group_size) -> torch.Tensor
        Apply what remains after the combining: for AVG, one division by the group size.
    ops.group_rank_and_size(group=None) -> tuple[int, int]
        This rank's index in ``group`` and the group's size (the world when ``group`` is
        None).
    ops.global_rank(group, group_rank) -> int
        The global rank of ``group_rank`` in ``group``: what ``send``/``recv`` take.
    ops.chunk_bounds(numel, parts) -> list[tuple[int, int]]
        Split ``numel`` elements into ``parts`` contiguous chunks whose sizes differ by at
        most one.
    ops.sendrecv(send_buf, dst, recv_buf, src, group=None, *, post_empty=False)
        Post a receive of ``recv_buf`` from ``src`` and a send of ``send_buf`` to ``dst``;
        return the ``(receive, send)`` handles. ``dst``/``src`` are global ranks.

The reference is ``collectives/ring.py`` and ``collectives/topologies.py``; the lesson page is
docs/lessons/04-ring.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from collectives import ops, trace, verify
from collectives.core.ops import ReduceOp
from collectives.course.grading.runner import run_tasks

LESSON = 4


def ring_neighbours(group=None) -> tuple[int, int, int, int]:
    """Given: (my rank in the group, group size, right neighbour, left neighbour), the
    neighbours as global ranks -- what ``dist.isend``/``dist.irecv`` take."""
    rank, p = ops.group_rank_and_size(group)
    return rank, p, ops.global_rank(group, (rank + 1) % p), ops.global_rank(group, (rank - 1) % p)


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                        group=None) -> None:
    """Lesson 4, task 1: ``output`` <- chunk ``rank`` of the reduction of every rank's ``input``.

    TODO:     like ``dist.reduce_scatter_tensor(output, input, op, group)``: split ``input``
              with ``ops.chunk_bounds(input.numel(), p)``; rank r's ``output`` gets chunk r,
              reduced over all ranks. Do not modify ``input``.
    APPROACH: work on a flat copy of the input. p − 1 steps: at step s send chunk
              (rank − 1 − s) % p to the right, receive chunk (rank − 2 − s) % p from the left
              into a landing buffer, and combine it into that chunk of the copy. What you
              send at step s is what you finished combining at step s − 1.
    EXAMPLE:  p = 2, input [1, 2, 3, 4] on rank 0 and [10, 20, 30, 40] on rank 1
              -> output [11, 22] on rank 0, [33, 44] on rank 1.
    HINT:     ``if not ops.check_all_reduce_args(input, op, group): return`` first; AVG: ``ops.finish_`` on
              your chunk. Chunks may be empty when numel < p: sending 0 elements is fine.
              Allocate the landing buffer once (the size of the largest chunk), not per step.
    CALLS:    ops.check_all_reduce_args, ops.finish_, ops.chunk_bounds
    """
    raise NotImplementedError("Lesson 4, task 1: ring_reduce_scatter")


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Lesson 4, task 2: ``output`` <- every rank's ``input``, concatenated in rank order.

    TODO:     like ``dist.all_gather_into_tensor(output, input, group)``; rank r's ``input``
              is chunk r of ``output`` under ``ops.chunk_bounds(output.numel(), p)``.
    APPROACH: copy ``input`` into chunk ``rank`` of a flat view of ``output``. p − 1 steps:
              at step s send chunk (rank − s) % p to the right and receive chunk
              (rank − 1 − s) % p from the left straight into its place -- no copies.
    EXAMPLE:  p = 3, input [r] on rank r  ->  output [0, 1, 2] everywhere.
    HINT:     ``flat = ops.work_buffer(output)`` ... ``ops.write_back(output, flat)`` makes
              a non-contiguous ``output`` work.
    CALLS:    ops.work_buffer, ops.write_back, ops.chunk_bounds
    """
    raise NotImplementedError("Lesson 4, task 2: ring_all_gather")


def ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """Lesson 4, task 3: the bandwidth-optimal ring all-reduce, in place.

    TODO:     reduce-scatter the p chunks around the ring, then all-gather them.
    APPROACH: ``flat = ops.work_buffer(tensor)``; the reduce-scatter loop of task 1 on
              ``flat`` itself (no copy: you are allowed to change it); AVG: ``finish_`` your
              own chunk; the all-gather loop of task 2; ``ops.write_back``.
    EXAMPLE:  p = 4, tensor = [r, r, r, r] on rank r  ->  [6, 6, 6, 6] everywhere.
    HINT:     each rank sends exactly 2(p − 1) messages, all to its right neighbour, each
              of ⌈n/p⌉ or ⌊n/p⌋ elements: 2(p − 1)/p·n elements in all. Post the irecv
              before the isend, and wait on both every step.
    CALLS:    ops.work_buffer, ops.write_back, ops.finish_
    """
    raise NotImplementedError("Lesson 4, task 3: ring_all_reduce")


def pipelined_ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                              pieces: int = 4) -> None:
    """Lesson 4, task 4: the ring with every chunk cut into ``pieces``, so transfers overlap combines.

    TODO:     the ring of task 3, but each step's chunk travels as ``pieces`` messages
              (``ops.chunk_bounds(chunk_size, pieces)``), and a piece is sent on to the next
              step as soon as it has been combined -- while later pieces are still arriving.
    APPROACH: post the receives (into a landing buffer) and sends of all pieces of step 0.
              Then for each step, for each piece j: wait for its receive, combine it, and
              at once post piece j of the next step (its receive and its send). Use two
              landing buffers, alternating by step, so that piece j of step s + 1 cannot
              land on piece j + 1 of step s before that one is combined. Wait for every
              send before the all-gather, which writes into chunks you sent.
    EXAMPLE:  p = 4, pieces = 4, 4000 elements: chunks of 1000, messages of 250;
              2(p − 1)·pieces = 24 messages per rank, the same bytes as the ring.
    HINT:     messages between two ranks are matched in the order they were posted, so
              post pieces in the same order on every rank. Keep ``pieces`` pieces even for
              tiny tensors (some empty), so the number of messages never depends on the
              size: the reference posts empty ones on gloo with ``ops.sendrecv(...,
              post_empty=True)``, which turns ranks handed different sizes into an error
              instead of a hang. The graded test checks that the first piece of a
              step leaves before the last piece of the previous step has arrived.
    CALLS:    ops.chunk_bounds, ops.sendrecv
    """
    raise NotImplementedError("Lesson 4, task 4: pipelined_ring_all_reduce")


def recursive_doubling_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """Lesson 4, task 5: all-reduce in log2 p steps by swapping whole tensors with rank XOR 2^k.

    TODO:     at step k exchange the whole tensor with the rank 2^k away (rank ^ (1 << k))
              and combine what arrives. For p not a power of two, fold the extra ranks in
              first and hand them the result at the end.
    APPROACH: let q be the largest power of two ≤ p and e = p − q. Ranks 0..2e−1 pair up:
              each even one sends its tensor to the odd one after it and sits out; the
              odd one combines it and plays virtual rank r // 2; ranks from 2e on play
              virtual rank r − e. The q virtual ranks run the exchanges (partner: virtual
              rank v ^ (1 << k), mapped back to a real rank); at the end each odd rank
              sends the result to the even rank before it.
    EXAMPLE:  p = 4: step 0 pairs (0,1), (2,3); step 1 pairs (0,2), (1,3).
              p = 3: rank 0 folds into rank 1; ranks 1, 2 exchange; rank 1 hands back to 0.
    HINT:     receive into a separate buffer and combine after both the send and the
              receive have finished: you are sending the buffer you combine into.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 4, task 5: recursive_doubling_all_reduce")


def halving_doubling_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """Lesson 4, task 6: Rabenseifner's all-reduce -- reduce-scatter by recursive halving,
    all-gather by recursive doubling.

    TODO:     cut the tensor into q blocks (q: largest power of two ≤ p;
              ``ops.chunk_bounds(n, q)``). Halving: at distances q/2, ..., 2, 1 exchange
              with rank v ^ d: keep half of your block range, send the other half, combine
              what arrives into the half you keep. Then virtual rank v owns block v.
              Doubling: distances 1, 2, ..., q/2, exchanging everything you own, so what you
              own doubles. Fold extra ranks in and out as in task 5.
    APPROACH: keep [first, last) = the blocks you are responsible for, starting [0, q). At
              distance d, with middle = first + d: if v & d keep [middle, last) and send
              [first, middle), else the other way round.
    EXAMPLE:  p = 4, blocks b0..b3. Rank 0: sends b2,b3 to rank 2 and keeps b0,b1; sends b1
              to rank 1 and keeps b0 (now fully reduced); receives b1 from rank 1; receives
              b2,b3 from rank 2. 2·log2 p = 4 messages, 2(p − 1)/p·n elements: the ring's
              bytes in far fewer steps.
    HINT:     the data you receive while doubling goes straight into place, like the
              ring's all-gather. AVG: finish your own block before the doubling.
    CALLS:    ops.chunk_bounds
    """
    raise NotImplementedError("Lesson 4, task 6: halving_doubling_all_reduce")


def tree_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """Lesson 4, task 7: reduce up a binary tree to rank 0, then broadcast down it.

    TODO:     the ranks form a binary heap: rank r's children are 2r + 1 and 2r + 2 (those
              below p), its parent (r − 1) // 2. Up: receive each child's partial result,
              combine it into yours, send the sum to your parent. Down: receive the result
              from your parent (rank 0 has it already), send it to your children.
    APPROACH: post the receives from both children at once (a landing buffer each), then
              wait and combine in child order -- the same order every run, so the same bits.
    EXAMPLE:  p = 4: 3 -> 1, then 1 -> 0 and 2 -> 0; then 0 -> 1 and 0 -> 2, then 1 -> 3.
              Every message carries the whole tensor: 2(p − 1) messages in all.
    HINT:     group ranks → global ranks with ``ops.global_rank(group, r)``. AVG: only the
              root divides, before the broadcast.
    CALLS:    ops.global_rank
    """
    raise NotImplementedError("Lesson 4, task 7: tree_all_reduce")


if __name__ == "__main__":
    run_tasks(LESSON)
