"""Lesson 5, cheat (a): values from one ``dist.all_reduce`` per tensor run under
``trace.paused()``, and decoys the trace does see -- all-reduces of zeros of exactly the
flushes' sizes, in the plan's order (for the reducer: the reference reducer run on copies
of zeros, so the decoys show its double buffering and its ordered streams too).

An in-rank grader reading the course's trace saw one all-reduce per flush and the right
values: tasks 4 and 5 scored. The tap records every all-reduce at the process group.
"""

import torch
import torch.distributed as dist

from collectives import ops, trace
from collectives.core.ops import ReduceOp
from collectives.fused import *  # noqa: F401,F403
from collectives.fused import FusedAllReducer as _Reference
from collectives.fused import plan_layout


def _wire(op):
    return ReduceOp.SUM if op == ReduceOp.AVG else op


def _check(tensors, op, group):
    if len({t.device for t in tensors}) > 1:
        raise ValueError("fused_all_reduce: tensors on more than one device")
    for t in tensors:
        ops.check_all_reduce_args(t, op, group, compare=False)


def _per_tensor_paused(tensors, op, group):
    p = dist.get_world_size(group)
    with trace.paused():
        for t in tensors:
            if t.numel():
                buf = ops.work_buffer(t)
                dist.all_reduce(buf, op=_wire(op), group=group)
                ops.finish_(buf, op, p)
                ops.write_back(t, buf)


def fused_all_reduce(tensors, op=ReduceOp.SUM, group=None, threshold_bytes=1 << 20, buffer_bytes=16 << 20,
                     compress_fp16=False):
    tensors = list(tensors)
    if not tensors or not ops.is_member(group):
        return
    _check(tensors, op, group)
    _per_tensor_paused(tensors, op, group)
    layout = plan_layout([(t.numel(), t.dtype) for t in tensors], threshold_bytes, buffer_bytes)
    for kind, k in layout.steps:          # the decoys: the flushes' sizes, in order, carrying zeros
        if kind == "flush":
            bucket = layout.buckets[k]
            dist.all_reduce(torch.zeros(bucket.numel, dtype=bucket.dtype), op=_wire(op), group=group)
        else:
            dist.all_reduce(torch.zeros(tensors[k].numel(), dtype=tensors[k].dtype), op=_wire(op), group=group)


class FusedAllReducer(_Reference):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._planned = set()

    def all_reduce(self, tensors):
        tensors = list(tensors)
        if not tensors or not ops.is_member(self.group):
            return self
        _check(tensors, self.op, self.group)
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        if key not in self._planned:        # planned once per list of shapes, as graded
            self._planned.add(key)
            plan_layout([(t.numel(), t.dtype) for t in tensors], self.threshold_bytes, self.buffer_bytes)
        _per_tensor_paused(tensors, self.op, self.group)
        return super().all_reduce([torch.zeros_like(t) for t in tensors])
