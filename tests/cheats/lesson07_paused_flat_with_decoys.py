"""Lesson 7, cheat (a): every hierarchy's values from one flat ``dist.all_reduce`` run under
``trace.paused()``; the trace sees only decoys -- messages of zeros of exactly the bytes
each tier should carry (2(D − 1)/D·n to the machine's ranks, 2(M − 1)/M·n/D to the
rail's), so a grader that counted bytes by tier in the rank's trace gave tasks 2-5 full
marks (lesson 7: 15/15 under the in-rank grader). Task 1 is the reference's.

The tap records the flat all-reduce at the process group, over ranks of several machines.
"""

import torch
import torch.distributed as dist

from collectives import trace
from collectives.core.ops import ReduceOp
from collectives.hierarchical import *  # noqa: F401,F403
from collectives.hierarchical import Handle as _Handle
from collectives.hierarchical import resolve as _resolve
from collectives.hierarchical import root_based_all_reduce  # noqa: F401 - task 1: the reference's

LESSON = 7


def _decoys(n: int, layout, group=None):
    shape = _resolve(layout, group)
    D, M, rank = shape.D, shape.M, dist.get_rank()
    d, m = rank % D, rank // D
    inside = [m * D + k for k in range(D) if k != d]
    rail = [d + D * k for k in range(M) if k != m]
    sends, recvs = [], []
    for peers, size in ((inside, -(-n // D)), (rail, -(-n // (D * M)))):
        for peer in peers:
            for _ in range(2):
                sends.append(dist.isend(torch.zeros(size), peer))
                recvs.append(dist.irecv(torch.zeros(size), peer))
    for w in sends + recvs:
        w.wait()


def _flat(tensor, op, group, layout):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("expected a tensor")
    if isinstance(layout, tuple) and any(not isinstance(v, int) for v in layout):
        raise TypeError("layout must be two integers")
    _resolve(layout, group)                      # a layout that does not fit: its ValueError
    flat = tensor.detach().contiguous().clone()
    with trace.paused():
        dist.all_reduce(flat, ReduceOp.SUM if op == ReduceOp.AVG else op, group=group)
    if op == ReduceOp.AVG:
        flat.div_(dist.get_world_size(group))
    tensor.detach().copy_(flat)
    _decoys(tensor.numel(), layout, group)


def rail_all_reduce(tensor, op=ReduceOp.SUM, group=None, layout=None):
    _flat(tensor, op, group, layout)


def one_slice_all_reduce(tensor, op=ReduceOp.SUM, group=None, layout=None):
    _flat(tensor, op, group, layout)


def hierarchical_all_reduce(tensor, op=ReduceOp.SUM, group=None, layout=None, slice_numel=None):
    _flat(tensor, op, group, layout)


def hierarchical_all_reduce_async(tensor, op=ReduceOp.SUM, group=None, layout=None, *, memory_bytes=64 << 20):
    _flat(tensor, op, group, layout)
    future = torch.futures.Future()
    future.set_result(tensor)

    class Done(_Handle):
        def __init__(self):
            self.future = future

        def wait(self):
            return tensor

        def get_future(self):
            return future

        def is_completed(self):
            return True
    return Done()


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
