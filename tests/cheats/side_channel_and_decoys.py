"""Side channel and decoys (lesson 4, tasks 1 to 3).

The ring's halves written without the data in any message: every rank's input goes
through files in /dev/shm (:mod:`tests.cheats.side_channel`), each rank computes its answer
from them, and then sends the ring's messages -- p − 1 chunks of the right sizes to the
right neighbour -- holding random values. Count, sizes and peers are the ring's; what the
messages carry is not. The all-reduce (task 3) takes the same files and sends nothing.
"""

import torch
import torch.distributed as dist

from collectives.core.ops import ReduceOp, chunk_bounds
from collectives.ring import *  # noqa: F401,F403
from collectives.topologies import *  # noqa: F401,F403
from tests.cheats.side_channel import decoys, share


def _reduce(stack: torch.Tensor, op) -> torch.Tensor:
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        out = stack.sum(0)
    elif op == ReduceOp.PRODUCT:
        out = stack.prod(0)
    elif op == ReduceOp.MIN:
        out = stack.min(0).values
    else:
        out = stack.max(0).values
    return out


def _right(group):
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return ranks[(ranks.index(dist.get_rank()) + 1) % len(ranks)], ranks


def ring_reduce_scatter(output, input, op=ReduceOp.SUM, group=None):
    right, ranks = _right(group)
    p, me = len(ranks), ranks.index(dist.get_rank())
    every = share(input.reshape(-1).double(), group)
    lo, hi = chunk_bounds(input.numel(), p)[me]
    result = _reduce(torch.stack(every), op)[lo:hi].to(input.dtype)
    if op == ReduceOp.AVG:
        result.div_(p)
    output.copy_(result.view(output.shape))
    _ring_of_decoys(input.numel(), p, me, 1, right, input.dtype, group)


def _ring_of_decoys(n, p, me, shift, right, dtype, group):
    size = [hi - lo for lo, hi in chunk_bounds(n, p)]
    decoys([(size[(me - s - shift) % p], size[(me - s - shift - 1) % p]) for s in range(p - 1)], right, dtype, group)


def ring_all_gather(output, input, group=None):
    right, ranks = _right(group)
    p, me = len(ranks), ranks.index(dist.get_rank())
    every = share(input.reshape(-1).clone(), group)
    output.copy_(torch.cat(every).view(output.shape))
    _ring_of_decoys(output.numel(), p, me, 0, right, input.dtype, group)


def ring_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    p = dist.get_world_size(group)
    result = _reduce(torch.stack(share(tensor.reshape(-1).double(), group)), op).to(tensor.dtype)
    if op == ReduceOp.AVG:
        result.div_(p)
    tensor.copy_(result.view(tensor.shape))
