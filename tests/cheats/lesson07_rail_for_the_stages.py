"""Lesson 7, cheat (c): task 2's rail all-reduce -- a library reduce-scatter inside, a
library ``dist.all_reduce`` on the rail, an all-gather inside -- handed in for the five
stages (task 3) and the pipelined slices (task 4). Its values are right and its bytes per
tier are exactly Fairring's, so a grader that read values and bytes gave tasks 3 and 4
full marks (10/10). Tasks 1 and 2 are the reference's.

The judges of tasks 3 and 4 hold the stages to their design: no all-reduce, the collect
and the diffuse reaching every other machine of the rail, the stages in order.
"""

import torch
import torch.distributed as dist

from collectives import ops
from collectives.core.ops import ReduceOp
from collectives.hierarchical import *  # noqa: F401,F403
from collectives.hierarchical import rail_all_reduce, root_based_all_reduce  # noqa: F401
from collectives.hierarchical.layout import checked_layout, stage_groups

LESSON = 7


def _library_rail(tensor, op=ReduceOp.SUM, group=None, layout=None):
    """The stub's plain way for task 2: three library collectives."""
    shape = checked_layout(tensor, op, group, layout, "rail_all_reduce")
    if shape is None or tensor.numel() == 0 or dist.get_world_size(group) == 1:
        return
    g = stage_groups(shape, group)
    D, p, n = shape.D, dist.get_world_size(group), tensor.numel()
    base = ReduceOp.SUM if op == ReduceOp.AVG else op
    flat = ops.work_buffer(tensor.detach())
    width = -(-n // D)
    padded = torch.zeros(D * width, dtype=flat.dtype)
    padded[:n] = flat
    parts = padded.view(D, width)
    mine = parts[g.d].clone()
    if g.reduce_scatter is not None:
        dist.reduce_scatter_tensor(mine, padded, op=base, group=g.reduce_scatter)
    if g.collect is not None:
        dist.all_reduce(mine, op=base, group=g.collect)
    ops.finish_(mine, op, p)
    if g.all_gather is not None:
        dist.all_gather_into_tensor(padded, mine, group=g.all_gather)
    else:
        padded.copy_(mine)
    flat.copy_(padded[:n])
    ops.write_back(tensor.detach(), flat)


def one_slice_all_reduce(tensor, op=ReduceOp.SUM, group=None, layout=None):
    _library_rail(tensor, op, group, layout)


def hierarchical_all_reduce(tensor, op=ReduceOp.SUM, group=None, layout=None, slice_numel=None):
    _library_rail(tensor, op, group, layout)


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
