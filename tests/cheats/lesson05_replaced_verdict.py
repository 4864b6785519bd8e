"""Lesson 5, cheat (b): the in-rank verdict replaced at import. ``verify.compare`` finds
nothing wrong and ``verify.reference_all_reduce`` returns its input, so a fused all-reduce
that changes nothing "matches"; the stream checker reports nothing. The calls themselves
are the right ones (all-reduces of zeros of the flushes' sizes, in order), so a grader
that counted calls in the rank was satisfied too: tasks 4 and 5 scored.
"""

import torch
import torch.distributed as dist

from collectives import ops, streams, verify
from collectives.core.ops import ReduceOp
from collectives.fused import *  # noqa: F401,F403
from collectives.fused import FusedAllReducer as _Reference
from collectives.fused import plan_layout

verify.compare = lambda expected, got, **kwargs: None
verify.reference_all_reduce = lambda tensor, op=ReduceOp.SUM, group=None: tensor.clone()
verify.check_all_reduce = lambda fn, cases=None, **kwargs: verify.Report(
    [verify.CaseResult("every case", dist.get_rank(), True)], reference="dist.all_reduce")
streams.Checker.report = lambda self, line: None


def _check(tensors, op, group):
    if len({t.device for t in tensors}) > 1:
        raise ValueError("fused_all_reduce: tensors on more than one device")
    for t in tensors:
        ops.check_all_reduce_args(t, op, group, compare=False)


def fused_all_reduce(tensors, op=ReduceOp.SUM, group=None, threshold_bytes=1 << 20, buffer_bytes=16 << 20,
                     compress_fp16=False):
    tensors = list(tensors)
    if not tensors or not ops.is_member(group):
        return
    _check(tensors, op, group)
    wire = ReduceOp.SUM if op == ReduceOp.AVG else op
    layout = plan_layout([(t.numel(), t.dtype) for t in tensors], threshold_bytes, buffer_bytes)
    for kind, k in layout.steps:
        numel, dtype = ((layout.buckets[k].numel, layout.buckets[k].dtype) if kind == "flush"
                        else (tensors[k].numel(), tensors[k].dtype))
        dist.all_reduce(torch.zeros(numel, dtype=dtype), op=wire, group=group)


class FusedAllReducer(_Reference):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._planned = set()

    def all_reduce(self, tensors):
        tensors = list(tensors)
        if tensors and ops.is_member(self.group):
            _check(tensors, self.op, self.group)
            key = tuple((tuple(t.shape), t.dtype) for t in tensors)
            if key not in self._planned:
                self._planned.add(key)
                plan_layout([(t.numel(), t.dtype) for t in tensors], self.threshold_bytes, self.buffer_bytes)
        return super().all_reduce([torch.zeros_like(t) for t in tensors])     # the inputs stay as they are
