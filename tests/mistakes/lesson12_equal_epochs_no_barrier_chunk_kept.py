"""Lesson 12, natural mistakes, one per task: the barrier waits for every flag to EQUAL the epoch
(a fast peer already raised its flag for the next barrier, and the slow rank waits for ever);
the one-shot reads the slots without a barrier; the two-shot reduces its chunk but never
writes it into its own slot, so its peers gather the unreduced input.

A full copy of lessons/12_symmetric/exercise.py with the reference's approach filled in
and the mistakes above planted; tests/test_grader_lesson12.py grades it.

Lesson 12 exercise: all-reduce without messages, on memory every rank can read.

Three graded tasks and one for a machine with GPUs. The ranks of one machine map one
shared segment (``SharedWorkspace``, given below): p slots, one per rank, in two buffers
used in turn, and p flags. You write the barrier made of those flags, then the one-shot
all-reduce (every rank reads every slot) and the two-shot (reduce-scatter by reading,
all-gather by reading). Neither sends a single message: the grader records every call of
``torch.distributed`` your code makes, and a call in the data path fails the task.

Check your work:

    make check LESSON=12                                          # one PASS/FAIL line per task
    .venv/bin/python lessons/12_symmetric/exercise.py --task 2 --verbose     # one task, every problem
    .venv/bin/torchrun --nproc-per-node 4 lessons/12_symmetric/exercise.py   # the same, under torchrun
    make grade LESSON=12                                          # the same verdicts, as points

What the workspace gives you (``ws``, one per group, made by ``group_workspace(group, nbytes)``):

    ws.rank, ws.size        this rank's index in the group, and p
    ws.flags                p int64 flags in shared memory; flag r is written by rank r only
    ws.epoch                how many barriers this rank has passed (yours to count)
    ws.timeout              seconds to wait at a barrier before giving up
    ws.timed_out(waited, target) -> BarrierTimeout   the error to raise, naming this rank
    ws.begin(nbytes) -> buffer index   call once per all-reduce: checks the size, picks the buffer
    ws.slot(buffer, rank, dtype, numel) -> Tensor    rank's slot in that buffer, as a tensor
    ws.pause_at(point)      a hook the tests and the lab use; call it where the reference does

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
    ops.chunk_bounds(numel, parts) -> list[tuple[int, int]]
        Split ``numel`` elements into ``parts`` contiguous chunks whose sizes differ by at
        most one.

The reference is ``collectives/symmetric/``; the lesson page is docs/lessons/12-symmetric.md.
"""

from __future__ import annotations

import os  # noqa: F401 - task 1 may yield the core with os.sched_yield()
import time  # noqa: F401 - task 1 measures its wait

import torch

from collectives import ops  # noqa: F401 - what the tasks use
from collectives.core.ops import ReduceOp
from collectives.course.grading.runner import run_tasks
from collectives.symmetric.workspace import BarrierTimeout, SharedWorkspace  # noqa: F401 - given
from collectives.symmetric.workspace import workspace as group_workspace  # noqa: F401 - given

LESSON = 12

# Tasks 2 and 3 meet at the reference's barrier: each task's mistake is judged alone.
from collectives.symmetric.shared import flag_barrier as _reference_barrier  # noqa: E402


def flag_barrier(ws: SharedWorkspace) -> None:
    """Lesson 12, task 1: wait until every rank of ``ws`` has entered this barrier, with flags.

    TODO:     count this barrier (``ws.epoch += 1``), raise your own flag to the new epoch
              (``ws.flags[ws.rank] = ws.epoch``), then wait until every flag is at least
              ``ws.epoch``. Send nothing: no ``dist.*`` call.
    APPROACH: a flag only ever grows, so a peer that has already passed -- and maybe
              raised its flag again for the next barrier -- still counts as arrived. Spin
              on ``min(ws.flags.tolist())``; yield the core between looks
              (``os.sched_yield()``): there may be more ranks than cores. Call
              ``ws.pause_at("posted")`` between raising your flag and the first look.
    EXAMPLE:  p = 2, third barrier: rank 0 writes flags[0] = 3 and waits until flags[1] >= 3.
    HINT:     do NOT reset your flag to 0 on the way out: a slow peer that had not looked
              yet would wait for ever. After ``ws.timeout`` seconds raise
              ``ws.timed_out(seconds_waited, ws.epoch)``: a hang must end with an error
              that names the rank.
    CALLS:    none
    """
    ws.epoch += 1
    ws.flags[ws.rank] = ws.epoch
    ws.pause_at("posted")
    started = time.monotonic()
    while any(f != ws.epoch for f in ws.flags.tolist()):   # MISTAKE: ==, not >=
        if time.monotonic() - started > ws.timeout:
            raise ws.timed_out(time.monotonic() - started, ws.epoch)
        os.sched_yield()


def one_shot_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, *,
                        workspace: SharedWorkspace | None = None) -> None:
    """Lesson 12, task 2: all-reduce ``tensor`` in place by reading every rank's slot.

    TODO:     like ``dist.all_reduce``, every op and dtype, views, subgroups -- and no
              message. Write your input into your slot, pass one barrier (task 1), and
              reduce all p slots into your tensor.
    APPROACH: ``ops.check_all_reduce_args`` first. Then the workspace: the argument, or
              ``group_workspace(group, nbytes)`` (the group's cached one, given). An empty
              tensor: return. ``flat = ops.work_buffer(tensor)``;
              ``buffer = ws.begin(nbytes)``; copy ``flat`` into ``ws.slot(buffer, rank, ...)``;
              ``flag_barrier(ws)``; ``ws.pause_at("read")``; then ``flat`` <- slot 0,
              combined with slots 1, ..., p − 1 in that order; ``ops.finish_``;
              ``ops.write_back``.
    EXAMPLE:  p = 3, [r, r] on rank r  ->  [3, 3] everywhere, one barrier, zero messages.
    HINT:     reduce in rank order 0 .. p − 1 on EVERY rank (not "mine first"): a float
              sum depends on its order, and every rank must end with the same bits.
              ``ops.combine_`` and ``ops.finish_`` handle the ops (AVG = SUM, then one division).
    CALLS:    ops.check_all_reduce_args, ops.work_buffer, ops.write_back, ops.combine_, ops.finish_
    """
    if not ops.check_all_reduce_args(tensor, op, group, what="one_shot_all_reduce"):
        return
    rank, p = ops.group_rank_and_size(group)
    nbytes = tensor.numel() * tensor.element_size()
    ws = workspace if workspace is not None else group_workspace(group, nbytes)
    if tensor.numel() == 0:
        return
    flat = ops.work_buffer(tensor)
    n, dtype = flat.numel(), flat.dtype
    buffer = ws.begin(nbytes)
    ws.slot(buffer, rank, dtype, n).copy_(flat)
    # MISTAKE: no flag_barrier(ws) here: peers' slots may not be written yet
    ws.pause_at("read")
    flat.copy_(ws.slot(buffer, 0, dtype, n))
    for r in range(1, p):
        ops.combine_(flat, ws.slot(buffer, r, dtype, n), op)
    ops.finish_(flat, op, p)
    ops.write_back(tensor, flat)


def two_shot_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, *,
                        workspace: SharedWorkspace | None = None) -> None:
    """Lesson 12, task 3: all-reduce ``tensor`` in place -- reduce-scatter by reading, then
    all-gather by reading.

    TODO:     write your input into your slot; barrier; reduce chunk ``rank``
              (``ops.chunk_bounds(n, p)``) of every slot, in rank order, and write the result
              into chunk ``rank`` of YOUR slot; barrier; copy chunk j out of slot j for every
              peer j. No message.
    APPROACH: the set-up of task 2. Reduce your chunk into ``flat[lo:hi]`` (slot 0's chunk,
              then combine slots 1 .. p − 1), ``ops.finish_`` it, copy it into your slot's
              chunk. Call ``ws.pause_at("read")`` after the first barrier and
              ``ws.pause_at("gather")`` after the second.
    EXAMPLE:  p = 2, n = 4: rank 0 reduces elements 0-1 and writes them into slot 0, rank 1
              elements 2-3 into slot 1; then rank 0 copies 2-3 from slot 1, rank 1 copies
              0-1 from slot 0. Each rank read 2(p − 1)/p·n elements of its peers, not (p − 1)·n.
    HINT:     overwriting chunk r of your own slot is safe: in the reduce phase only you read
              that chunk of that slot. Two barriers per call, exactly.
    CALLS:    ops.check_all_reduce_args, ops.work_buffer, ops.write_back, ops.combine_, ops.finish_,
              ops.chunk_bounds
    """
    if not ops.check_all_reduce_args(tensor, op, group, what="two_shot_all_reduce"):
        return
    rank, p = ops.group_rank_and_size(group)
    nbytes = tensor.numel() * tensor.element_size()
    ws = workspace if workspace is not None else group_workspace(group, nbytes)
    if tensor.numel() == 0:
        return
    flat = ops.work_buffer(tensor)
    n, dtype = flat.numel(), flat.dtype
    buffer = ws.begin(nbytes)
    ws.slot(buffer, rank, dtype, n).copy_(flat)
    _reference_barrier(ws)
    ws.pause_at("read")
    lo, hi = ops.chunk_bounds(n, p)[rank]
    mine = flat[lo:hi]
    mine.copy_(ws.slot(buffer, 0, dtype, n)[lo:hi])
    for r in range(1, p):
        ops.combine_(mine, ws.slot(buffer, r, dtype, n)[lo:hi], op)
    ops.finish_(mine, op, p)
    # MISTAKE: the reduced chunk is not written into this rank's slot
    _reference_barrier(ws)
    ws.pause_at("gather")
    for peer, (a, b) in enumerate(ops.chunk_bounds(n, p)):
        if peer != rank:
            flat[a:b].copy_(ws.slot(buffer, peer, dtype, n)[a:b])
    ops.write_back(tensor, flat)


def triton_one_shot(handle, numel: int, dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    """Lesson 12, task 4 (GPUs, optional, not graded): the one-shot as a Triton kernel.

    TODO:     ``out[:numel]`` <- the sum over ranks of the first ``numel`` elements of their
              symmetric buffers (``handle = symm_mem.rendezvous(buffer, group)``), in one
              kernel launch: one program per block of elements, each loading its block from
              every peer's buffer (``handle.buffer_ptrs_dev``) and storing the sum.
    APPROACH: a barrier on the signal pads (``handle.signal_pad_ptrs_dev``) before the loads,
              so every rank's input is in place, and after, so nobody refills its buffer
              while a peer still reads it. Sum in rank order, in float32 for bf16.
    EXAMPLE:  2 GPUs, 1 MiB of bf16: one launch, no NCCL call, equal to ``dist.all_reduce``.
    HINT:     ``collectives/symmetric/triton_barrier.py`` and ``triton_allreduce.py`` are the
              reference; ``.venv/bin/python tools/gpu_lesson12.py --out DIR --exercise`` checks
              yours against NCCL. Never NVLink multicast: no multicast (multimem) ops; keep
              ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NCCL_NVLS_ENABLE=0``.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 12, task 4: triton_one_shot")


if __name__ == "__main__":
    run_tasks(LESSON)
