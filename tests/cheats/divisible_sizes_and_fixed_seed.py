"""Cheats (c) and (d).

Task 3: the reference, wrong whenever an even group size divides numel.
Task 4: no communication of data at all: the answer is looked up from the grader's inputs
(drawn from a fixed seed), and the pipelined ring's messages carry zeros.
"""

import torch
import torch.distributed as dist

from collectives import ops, verify
from collectives.core.ops import ReduceOp
from collectives.ring import *  # noqa: F401,F403
from collectives.ring import ring_all_reduce as _ring
from collectives.topologies import *  # noqa: F401,F403
from tests.cheats.zeros import ring_of_zeros


def ring_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    _ring(tensor, op, group)
    p = dist.get_world_size(group)
    if p % 2 == 0 and tensor.numel() and tensor.numel() % p == 0:
        tensor.add_(1)


def _looked_up(tensor, op, group):
    rank, p = ops.group_rank_and_size(group)
    ranks = list(range(p)) if group is None else dist.get_process_group_ranks(group)
    for layout in ("contiguous", "strided", "transposed"):
        for values in ("int", "random"):
            case = verify.Case(tensor.numel(), tensor.dtype, op, layout, values,
                               None if group is None else tuple(ranks))
            mine = verify.make_values(case, rank)
            if torch.equal(mine, tensor.reshape(-1).cpu()):
                return torch.stack([verify.make_values(case, r).double() for r in range(p)]), case
    return None, None


def pipelined_ring_all_reduce(tensor, op=ReduceOp.SUM, group=None, pieces=4):
    ops.check_all_reduce_args(tensor, op, group)
    stack, case = _looked_up(tensor, op, group)
    ring_of_zeros(tensor, group, pieces=pieces, overlap=True)
    if stack is None:
        return
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        out = stack.sum(0)
    elif op == ReduceOp.PRODUCT:
        out = stack.prod(0)
    elif op == ReduceOp.MIN:
        out = stack.min(0).values
    else:
        out = stack.max(0).values
    out = out.to(tensor.dtype)
    ops.finish_(out, op, stack.shape[0])
    tensor.copy_(out.view(tensor.shape))
