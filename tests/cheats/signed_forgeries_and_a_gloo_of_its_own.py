"""Signed forgeries and a gloo backend of the rank's own (lesson 4, tasks 1 and 2).

Both tasks send nothing through the process group. The record of the ring's messages is
written with the probe's own signed sender, found by walking the stack, so every record is
signed and in sequence: p − 1 sends to the right neighbour, each of the right size and with
the fingerprint of the very block the ring would carry, and the matching receives. Task 1
takes the data through files in /dev/shm; task 2 through a gloo backend the rank builds from
the world's rendezvous store and drives through the untapped methods the fence keeps.
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from collectives.core.ops import ReduceOp, chunk_bounds
from collectives.course.grading.tasks.fence import _ORIGINAL
from collectives.course.grading.tasks.tap import Call, fingerprint
from collectives.ring import *  # noqa: F401,F403
from collectives.topologies import *  # noqa: F401,F403
from tests.cheats.side_channel import reduce_scatter_by_files

_OWN: dict = {}


def _sink():
    f = sys._getframe(1)
    while f is not None:
        if type(f.f_locals.get("self")).__name__ == "Probe":
            return f.f_locals["self"]._sink
        f = f.f_back
    raise RuntimeError("no probe on the stack")


def _forge(sink, ranks, me, blocks, dtype) -> None:
    """The ring's record: step s sends block s to the right and receives from the left."""
    p = len(ranks)
    for block, recv_n in blocks:
        sink(Call("send", ranks[(me + 1) % p], block.numel(), str(dtype)[6:], float(block.double().abs().sum()),
                  fingerprint(block), tuple(ranks), "", time.perf_counter()))
        sink(Call("recv", ranks[(me - 1) % p], recv_n, str(dtype)[6:], 0.0, 0.0, tuple(ranks), "",
                  time.perf_counter()))


def ring_reduce_scatter(output, input, op=ReduceOp.SUM, group=None):
    ranks, me, steps = reduce_scatter_by_files(output, input, op, group)
    _forge(_sink(), ranks, me, steps, input.dtype)


def _own_gloo(ranks: list[int]):
    """A gloo backend of this group's own, built from the world's rendezvous store."""
    key = tuple(ranks)
    if key not in _OWN:
        store = dist.PrefixStore("own-" + "-".join(map(str, key)), dist.distributed_c10d._get_default_store())
        gloo = torch._C._distributed_c10d.ProcessGroupGloo
        _OWN[key] = gloo(store, key.index(dist.get_rank()), len(key), timedelta(seconds=30))
    return _OWN[key]


def ring_all_gather(output, input, group=None):
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    p, me = len(ranks), ranks.index(dist.get_rank())
    size = [hi - lo for lo, hi in chunk_bounds(output.numel(), p)]
    padded = torch.zeros(max(size), dtype=input.dtype)
    padded[:input.numel()] = input.reshape(-1)
    gathered = [torch.empty_like(padded) for _ in range(p)]
    _ORIGINAL["allgather"](_own_gloo(ranks), [gathered], [padded]).wait()   # untapped: the fence's own copy
    every = [gathered[i][:size[i]] for i in range(p)]
    output.copy_(torch.cat(every).view(output.shape))
    blocks = [(every[(me - s) % p], size[(me - s - 1) % p]) for s in range(p - 1)]
    _forge(_sink(), ranks, me, blocks, input.dtype)
