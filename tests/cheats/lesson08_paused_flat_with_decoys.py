"""Lesson 8, cheat (b): the values from a flat ``dist.all_reduce`` run under
``trace.paused()``, behind decoys of the right sizes: the all-gather of ``p·width`` packed
pairs the all-gather transport would make (carrying zeros), so a grader reading the
course's trace saw the right collectives and bytes. The tap records the paused all-reduce
at the process group, beside the decoy: tasks 2 to 5 score nothing.
"""

import torch
import torch.distributed as dist

from collectives import trace
from collectives.sparse import *  # noqa: F401,F403
from collectives.sparse import SparseHookState as _ReferenceState
from collectives.sparse.all_reduce import SparseInfo, SparseWork, _begin, _completed, _finish

LESSON = 8


def _decoy(width, value_bytes, group):
    p = dist.get_world_size(group)
    send = torch.zeros(width * (4 + value_bytes), dtype=torch.uint8)
    every = torch.empty(p * send.numel(), dtype=torch.uint8)
    if width:
        dist.all_gather(list(every.chunk(p)), send, group=group)


def allgather_sum_(out, indices, values, *, counts=None, group=None):
    _decoy(indices.numel() if counts is None else max(counts), out.element_size(), group)
    out.zero_().index_copy_(0, indices, values)
    with trace.paused():
        dist.all_reduce(out, group=group)
    return out


def split_sum_(out, indices, values, *, group=None, densify=True):
    allgather_sum_(out, indices, values, group=group)
    return None


def sparse_all_reduce(tensor, residual=None, *, density=None, threshold=None, transport="allgather",
                      selection="auto", op=dist.ReduceOp.SUM, group=None, state=None, segments=None, profile=None):
    begun = _begin(tensor, residual, density, threshold, transport, selection, op, group, state, segments, profile)
    if begun is None:
        return SparseInfo("none", 0)
    flat, values, info = begun
    p = dist.get_world_size(group)
    if values is not None:
        if p > 1:
            _decoy(info.kept if info.counts is None else max(info.counts), flat.element_size(), group)
        flat.zero_().index_copy_(0, info.indices, values)
    if p > 1:
        with trace.paused():
            dist.all_reduce(flat, group=group)
    _finish(tensor, flat, op, p)
    return info


def sparse_all_reduce_async(tensor, residual=None, **kwargs):
    info = sparse_all_reduce(tensor, residual, **kwargs)
    return SparseWork(info, _completed(tensor))


class SparseHookState(_ReferenceState):
    def start_(self, params, flat: torch.Tensor):
        work = sparse_all_reduce_async(flat, self.residual_for(params, flat), **self._arguments(params, flat))
        self.sent, self.elements = self.sent + work.info.kept, self.elements + flat.numel()
        return work
