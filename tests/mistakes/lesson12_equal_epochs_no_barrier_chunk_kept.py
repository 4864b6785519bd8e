"""Lesson 12, natural mistakes, one per task: the barrier waits for every flag to EQUAL the epoch
(a fast peer already raised its flag for the next barrier, and the slow rank waits for ever);
the one-shot reads the slots without a barrier; the two-shot reduces its chunk but never
writes it into its own slot, so its peers gather the unreduced input.

The exercise's functions with the reference's approach filled in and the mistakes above
planted (its docstrings left out); tests/test_grader_lesson12.py grades it.
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
    raise NotImplementedError("Lesson 12, task 4: triton_one_shot")


if __name__ == "__main__":
    run_tasks(LESSON)
