"""Not a cheat, a slip: an AVG that divides the whole tensor at the end instead of the own
chunk before the all-gather. The values are the same; the division costs n, not n/p."""

import torch.distributed as dist

from collectives.core.ops import ReduceOp
from collectives.ring import *  # noqa: F401,F403
from collectives.ring import ring_all_reduce as _ring
from collectives.topologies import *  # noqa: F401,F403


def ring_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    if op == ReduceOp.AVG:
        _ring(tensor, ReduceOp.SUM, group)
        tensor /= dist.get_world_size(group)
    else:
        _ring(tensor, op, group)
