"""Cheats (a) and (b).

Task 3: ``dist.all_reduce`` inside ``trace.paused()`` does the work; the ring's messages
carry zeros. Task 4: the reference, but only for world sizes up to 4 (the old grader's).
"""

import torch
import torch.distributed as dist

from collectives import ops, trace
from collectives.core.ops import ReduceOp
from collectives.ring import *  # noqa: F401,F403
from collectives.ring import pipelined_ring_all_reduce as _pipelined
from collectives.topologies import *  # noqa: F401,F403
from tests.cheats.zeros import ring_of_zeros


def ring_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    ops.check_all_reduce_args(tensor, op, group)
    buf = tensor.clone(memory_format=torch.contiguous_format)
    with trace.paused():
        dist.all_reduce(buf, op=ReduceOp.SUM if op == ReduceOp.AVG else op, group=group)
    ops.finish_(buf, op, dist.get_world_size(group))
    ring_of_zeros(tensor, group)
    tensor.copy_(buf)


def pipelined_ring_all_reduce(tensor, op=ReduceOp.SUM, group=None, pieces=4):
    if dist.get_world_size(group) <= 4:
        return _pipelined(tensor, op, group, pieces)
    ops.check_all_reduce_args(tensor, op, group)
