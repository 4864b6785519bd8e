"""Lesson 3 exercise: the naive ring all-reduce.

Build ``naive_ring_all_reduce`` -- the ring of the PyTorch distributed tutorial, made into
a real ``all_reduce``: in place, every op, every dtype, views and subgroups. One function,
graded in three tasks that ask progressively more of it.

Check your work:

    .venv/bin/python lessons/03_naive_ring/exercise.py                        # PASS/FAIL per task
    .venv/bin/torchrun --nproc-per-node 4 lessons/03_naive_ring/exercise.py   # the same, under torchrun
    make check LESSON=03                                                       # the same, from make
    make grade LESSON=03                                                       # the points

Each task runs your function on worlds of 1 to 4 ranks, on inputs only the checker knows,
and records every message it makes where your code cannot reach: p − 1 messages of the
whole tensor to the right neighbour, each carrying a rank's input, unchanged.

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

The reference is ``collectives/naive_ring.py``; the lesson page is docs/lessons/03-naive-ring.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from collectives import ops  # noqa: F401  (for your solution)
from collectives.core.ops import ReduceOp
from collectives.course.grading.runner import run_tasks

LESSON = 3


def naive_ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """Lesson 3, tasks 1-3: all-reduce ``tensor`` in place by passing whole tensors round a ring.

    TODO:     p − 1 times: send a whole tensor to the right neighbour, receive one from the
              left, combine the arrival into ``tensor``. The first tensor you send is your
              own input; after that, forward what just arrived, unchanged.
    APPROACH: task 1 -- the loop, for SUM on contiguous tensors. Two receive buffers that
              alternate: the one that arrived last step is being sent while the next one
              lands in the other. Wait for the send before you reuse its buffer.
              task 2 -- every op: ``ops.combine_(acc, incoming, op)`` and, for AVG, one
              ``ops.finish_(acc, op, p)`` at the end.
              task 3 -- the rest of ``dist.all_reduce``'s contract: ``ops.check_all_reduce_args``
              first (bad op, AVG on ints, complex MIN/MAX, expanded tensors; it returns
              False on a rank outside ``group``: return at once); views through
              ``flat = ops.work_buffer(tensor)`` ... ``ops.write_back(tensor, flat)``;
              groups through ``ops.group_rank_and_size(group)`` and ``ops.global_rank(group, r)``
              (send/recv take global ranks); nothing to do when p == 1 or the tensor is empty.
    EXAMPLE:  p = 4, rank r holds [r, r]  ->  every rank holds [6, 6]. Rank 1 receives, in
              order, rank 0's input, rank 3's, rank 2's.
    HINT:     post ``dist.irecv`` from the left and ``dist.isend`` to the right, then wait on
              both, every step: if every rank did a blocking send first, the ring would
              deadlock -- on gloo at every message size, one element included. Each rank
              sends exactly p − 1 messages of n elements.
    CALLS:    ops.check_all_reduce_args, ops.work_buffer, ops.write_back, ops.combine_, ops.finish_,
              ops.group_rank_and_size, ops.global_rank
    """
    raise NotImplementedError("Lesson 3, tasks 1-3: naive_ring_all_reduce")


if __name__ == "__main__":
    run_tasks(LESSON)
