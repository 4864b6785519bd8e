"""Forged call records and a moved case window (lesson 4, tasks 1 and 2).

Task 1: the data goes through files in /dev/shm; no message is sent, and the ring's
messages are written into the record instead -- p − 1 sends to the right neighbour of the
right sizes, each with the fingerprint of the very block the ring would carry -- on the
course's record channel: its public sender where there is one, else every pipe the rank
holds. Task 2: the window of the case is moved: the probe's own sender, found on the stack,
closes the case, ``dist.all_gather_into_tensor`` does the work outside it, and the case is
opened again; inside it, the ring's p − 1 messages of the right sizes hold zeros.
"""

import gc
import pickle
import sys
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from collectives.core import channels
from collectives.core.ops import ReduceOp, chunk_bounds
from collectives.course.grading.tasks.tap import Call, fingerprint
from collectives.ring import *  # noqa: F401,F403
from collectives.topologies import *  # noqa: F401,F403
from tests.cheats.side_channel import decoys, reduce_scatter_by_files


def _write(record) -> None:
    send = getattr(channels, "send", None)
    if send is not None:
        send(record)
        return
    if not _PIPES:
        result = next((f.f_locals.get("conn") for f in _frames() if f.f_code.co_name == "_worker"), None)
        _PIPES.extend(obj for obj in gc.get_objects()       # every pipe but the one the result goes back on
                      if isinstance(obj, Connection) and obj is not result and obj.writable and not obj.closed)
    for pipe in _PIPES:
        try:
            pipe.send_bytes(pickle.dumps(record))
        except OSError:
            pass


_PIPES: list = []


def ring_reduce_scatter(output, input, op=ReduceOp.SUM, group=None):
    ranks, me, steps = reduce_scatter_by_files(output, input, op, group)
    p = len(ranks)
    for block, recv_n in steps:
        _write(Call("send", ranks[(me + 1) % p], block.numel(), str(input.dtype)[6:], float(block.double().abs().sum()),
                    fingerprint(block), tuple(ranks), "", time.perf_counter()))
        _write(Call("recv", ranks[(me - 1) % p], block.numel(), str(input.dtype)[6:], 0.0, 0.0, tuple(ranks), "",
                    time.perf_counter()))


def ring_all_gather(output, input, group=None):
    p = dist.get_world_size(group)
    probe = next((f.f_locals["self"] for f in _frames() if type(f.f_locals.get("self")).__name__ == "Probe"), None)
    key = next((f.f_locals["key"] for f in _frames() if "key" in f.f_locals and "self" in f.f_locals), None)
    if probe is not None:
        probe._sink(("end", key))
    size = [hi - lo for lo, hi in chunk_bounds(output.numel(), p)]
    padded = torch.zeros(max(size), dtype=input.dtype)
    padded[:input.numel()] = input.reshape(-1)
    every = torch.empty(p * max(size), dtype=input.dtype)
    dist.all_gather_into_tensor(every, padded, group=group)
    if probe is not None:
        probe._sink(("case", key))
    output.copy_(torch.cat([every[r * max(size):r * max(size) + n] for r, n in enumerate(size)]).view(output.shape))
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(p))
    me = ranks.index(dist.get_rank())
    if p > 1:
        decoys([(size[(me - s) % p], size[(me - s - 1) % p]) for s in range(p - 1)], ranks[(me + 1) % p],
               input.dtype, group)


def _frames():
    f = sys._getframe(1)
    while f is not None:
        yield f
        f = f.f_back
