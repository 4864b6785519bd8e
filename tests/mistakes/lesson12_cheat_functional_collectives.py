"""Lesson 12, cheats: the all-reduces computed by a library, out of the tap's sight, dressed up.

The one-shot calls ``torch.ops._c10d_functional.all_reduce``, which goes under the process
group's Python methods; the two-shot calls the tap's original ``dist.all_reduce``, taken from
the wrapper (``__wrapped__``). No recorded call shows either; the cheat also writes its input
into its slot, counts a call on the workspace and passes the right number of the reference's
barriers, and writes the reduced chunk into its slot. The values, the counts and the slot all look right:
the fence gives it away -- the functional collective finds no backend under the graded world's
group and says so, and the original ``dist.all_reduce`` ends in the fence, recorded in the case.
"""

import torch
import torch.distributed as dist

from collectives import ops
from collectives.symmetric.shared import flag_barrier  # noqa: F401 - task 1: the reference's
from collectives.symmetric.workspace import workspace as group_workspace

LESSON = 12


def _dressed(tensor, op, group, workspace, barriers):
    if not ops.check_all_reduce_args(tensor, op, group):
        return
    rank, p = ops.group_rank_and_size(group)
    nbytes = tensor.numel() * tensor.element_size()
    ws = workspace if workspace is not None else group_workspace(group, nbytes)
    if tensor.numel() == 0:
        return
    flat = ops.work_buffer(tensor)
    buffer = ws.begin(nbytes)
    ws.slot(buffer, rank, flat.dtype, flat.numel()).copy_(flat)
    if barriers == 1:
        name = (group or dist.group.WORLD).group_name
        reduced = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(flat.clone(), "sum" if op != dist.ReduceOp.MAX else "max", name))
        flat.copy_(reduced)
    else:
        original = getattr(dist.all_reduce, "__wrapped__", dist.all_reduce)     # the tap's original
        original(flat, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=group)
    ops.finish_(flat, op, p)
    lo, hi = ops.chunk_bounds(flat.numel(), p)[rank]
    ws.slot(buffer, rank, flat.dtype, flat.numel())[lo:hi].copy_(flat[lo:hi])
    for _ in range(barriers):
        flag_barrier(ws)
    ops.write_back(tensor, flat)


def one_shot_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, *, workspace=None):
    _dressed(tensor, op, group, workspace, 1)


def two_shot_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, *, workspace=None):
    _dressed(tensor, op, group, workspace, 2)
