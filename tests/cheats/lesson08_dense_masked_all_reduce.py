"""Lesson 8, cheat (a): every sparse transport, and the hook, as ONE dense all-reduce of the
masked tensor. The selection and the residual are honest (the reference's), so the values
and the residual identity are right; but nothing travels as (index, value) pairs -- the
all-gather, split and the asynchronous all-reduce each send all n elements. An in-rank
grader that compared values scored tasks 3, 4 and 5 (11 and 5/5 points). The tap sees
the all-reduce where one all-gather of the packed pairs (or split's messages to owners)
must be.
"""

import torch
import torch.distributed as dist

from collectives.sparse import *  # noqa: F401,F403
from collectives.sparse import SparseHookState as _ReferenceState
from collectives.sparse.all_reduce import SparseInfo, SparseWork, _begin, _completed, _finish

LESSON = 8


def allgather_sum_(out, indices, values, *, counts=None, group=None):
    out.zero_().index_copy_(0, indices, values)
    dist.all_reduce(out, group=group)
    return out


def split_sum_(out, indices, values, *, group=None, densify=True):
    allgather_sum_(out, indices, values, group=group)
    return None


def _start(tensor, residual, kwargs, async_op):
    begun = _begin(tensor, residual, kwargs.get("density"), kwargs.get("threshold"),
                   kwargs.get("transport", "allgather"), kwargs.get("selection", "auto"),
                   kwargs.get("op", dist.ReduceOp.SUM), kwargs.get("group"), kwargs.get("state"),
                   kwargs.get("segments"), kwargs.get("profile"))
    if begun is None:
        return SparseInfo("none", 0), None
    flat, values, info = begun
    if values is not None:
        flat.zero_().index_copy_(0, info.indices, values)
    p = dist.get_world_size(kwargs.get("group"))
    if p == 1:
        return info, _completed(_finish(tensor, flat, kwargs.get("op", dist.ReduceOp.SUM), p))
    work = dist.all_reduce(flat, group=kwargs.get("group"), async_op=True)
    return info, work.get_future().then(lambda _: _finish(tensor, flat, kwargs.get("op", dist.ReduceOp.SUM), p))


def sparse_all_reduce(tensor, residual=None, **kwargs):
    info, future = _start(tensor, residual, kwargs, True)
    if future is not None:
        future.wait()
    return info


def sparse_all_reduce_async(tensor, residual=None, **kwargs):
    info, future = _start(tensor, residual, kwargs, True)
    return SparseWork(info, future if future is not None else _completed(tensor))


class SparseHookState(_ReferenceState):
    def start_(self, params, flat: torch.Tensor):
        work = sparse_all_reduce_async(flat, self.residual_for(params, flat), **self._arguments(params, flat))
        self.sent, self.elements = self.sent + work.info.kept, self.elements + flat.numel()
        return work
