"""Lesson 12, natural mistakes, one per task: the barrier counts its epochs in the flag and
never in ws.epoch; the one-shot combines its own slot first (every rank a different order,
so float sums differ from rank to rank); the two-shot gathers without the second barrier.

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
    arrived = int(ws.flags[ws.rank]) + 1     # MISTAKE: the barrier counts in the flag, never in ws.epoch
    ws.flags[ws.rank] = arrived
    ws.pause_at("posted")
    started = time.monotonic()
    while min(ws.flags.tolist()) < arrived:
        if time.monotonic() - started > ws.timeout:
            raise ws.timed_out(time.monotonic() - started, arrived)
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
    _reference_barrier(ws)
    ws.pause_at("read")
    order = [rank] + [r for r in range(p) if r != rank]   # MISTAKE: every rank starts from its own slot
    flat.copy_(ws.slot(buffer, order[0], dtype, n))
    for r in order[1:]:
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
    ws.slot(buffer, rank, dtype, n)[lo:hi].copy_(mine)
    # MISTAKE: no second barrier before the gather
    ws.pause_at("gather")
    for peer, (a, b) in enumerate(ops.chunk_bounds(n, p)):
        if peer != rank:
            flat[a:b].copy_(ws.slot(buffer, peer, dtype, n)[a:b])
    ops.write_back(tensor, flat)


def triton_one_shot(handle, numel: int, dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("Lesson 12, task 4: triton_one_shot")


if __name__ == "__main__":
    run_tasks(LESSON)
