"""Lesson 12, cheat: the shared-memory protocol as a costume, ``dist.all_reduce`` inside.

Each all-reduce writes its input into its slot, passes the right number of barriers
(the reference's flag barrier, task 1) and, in the two-shot, leaves the reduced chunk in
its own slot where a peer would gather it -- but the values come from gloo's own
all-reduce, called under ``trace.paused()`` so the course's tracer does not see it. The
judge's tap, on the process group itself, does.
"""

import torch.distributed as dist

from collectives import ops, trace
from collectives.core.ops import ReduceOp
from collectives.symmetric import flag_barrier  # noqa: F401 - task 1, the reference's
from collectives.symmetric.workspace import workspace as group_workspace

LESSON = 12


def _library(flat, op, group, p):
    with trace.paused():
        dist.all_reduce(flat, op=ReduceOp.SUM if op == ReduceOp.AVG else op, group=group)
    ops.finish_(flat, op, p)


def one_shot_all_reduce(tensor, op=ReduceOp.SUM, group=None, *, workspace=None):
    if not ops.check_all_reduce_args(tensor, op, group, what="one_shot_all_reduce"):
        return
    rank, p = ops.group_rank_and_size(group)
    ws = workspace or group_workspace(group, tensor.numel() * tensor.element_size())
    if tensor.numel() == 0:
        return
    flat = ops.work_buffer(tensor)
    buffer = ws.begin(flat.numel() * flat.element_size())
    ws.slot(buffer, rank, flat.dtype, flat.numel()).copy_(flat)
    flag_barrier(ws)
    _library(flat, op, group, p)
    ops.write_back(tensor, flat)


def two_shot_all_reduce(tensor, op=ReduceOp.SUM, group=None, *, workspace=None):
    if not ops.check_all_reduce_args(tensor, op, group, what="two_shot_all_reduce"):
        return
    rank, p = ops.group_rank_and_size(group)
    ws = workspace or group_workspace(group, tensor.numel() * tensor.element_size())
    if tensor.numel() == 0:
        return
    flat = ops.work_buffer(tensor)
    buffer = ws.begin(flat.numel() * flat.element_size())
    slot = ws.slot(buffer, rank, flat.dtype, flat.numel())
    slot.copy_(flat)
    flag_barrier(ws)
    _library(flat, op, group, p)
    lo, hi = ops.chunk_bounds(flat.numel(), p)[rank]
    slot[lo:hi].copy_(flat[lo:hi])
    flag_barrier(ws)
    ops.write_back(tensor, flat)


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
