"""Routes round the record (lesson 4, tasks 1 and 2), each with the ring's p − 1 messages of
the right sizes sent beside it.

Task 1: the functional collectives (``torch.ops._c10d_functional.reduce_scatter_tensor``),
which never call the process group's Python methods. Task 2: the recorder's own wrapper
round ``ProcessGroup._allgather_base`` opened up (``__closure__``, ``__wrapped__``) and its
original called on the world's group directly.
"""

import torch
import torch.distributed as dist

from collectives.core.ops import ReduceOp, chunk_bounds
from collectives.ring import *  # noqa: F401,F403
from collectives.topologies import *  # noqa: F401,F403
from tests.cheats.side_channel import decoys


def _layout(numel, group):
    p = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(p))
    return p, ranks, ranks.index(dist.get_rank()), [hi - lo for lo, hi in chunk_bounds(numel, p)]


def ring_reduce_scatter(output, input, op=ReduceOp.SUM, group=None):
    p, ranks, me, size = _layout(input.numel(), group)
    padded = torch.zeros(p * max(size), dtype=input.dtype)
    for r, (lo, hi) in enumerate(chunk_bounds(input.numel(), p)):
        padded[r * max(size):r * max(size) + hi - lo] = input.reshape(-1)[lo:hi]
    name = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.PRODUCT: "product", ReduceOp.MIN: "min",
            ReduceOp.MAX: "max"}[op]
    group_name = (group or dist.group.WORLD).group_name
    mine = torch.ops._c10d_functional.reduce_scatter_tensor(padded, name, p, group_name)
    mine = torch.ops._c10d_functional.wait_tensor(mine)
    output.copy_(mine[:size[me]].view(output.shape))
    if p > 1:
        decoys([(size[(me - s - 1) % p], size[(me - s - 2) % p]) for s in range(p - 1)], ranks[(me + 1) % p],
               input.dtype, group)


def _original(fn):
    seen = [fn]
    while seen:
        f = seen.pop()
        inner = getattr(f, "__wrapped__", None)
        if inner is not None:
            seen.append(inner)
        for cell in getattr(f, "__closure__", None) or ():
            value = cell.cell_contents
            if callable(value) and getattr(value, "__name__", "") == fn.__name__ and value is not fn:
                if getattr(value, "__closure__", None) is None:
                    return value
                seen.append(value)
    return fn


def ring_all_gather(output, input, group=None):
    p, ranks, me, size = _layout(output.numel(), group)
    padded = torch.zeros(max(size), dtype=input.dtype)
    padded[:input.numel()] = input.reshape(-1)
    every = torch.empty(p * max(size), dtype=input.dtype)
    gather = _original(dist.ProcessGroup._allgather_base)
    gather(group or dist.group.WORLD, every, padded).wait()
    output.copy_(torch.cat([every[r * max(size):r * max(size) + n] for r, n in enumerate(size)]).view(output.shape))
    if p > 1:
        decoys([(size[(me - s) % p], size[(me - s - 1) % p]) for s in range(p - 1)], ranks[(me + 1) % p],
               input.dtype, group)
