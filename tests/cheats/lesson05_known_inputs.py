"""Lesson 5, cheat (c): outputs for inputs known in advance. ``plan_layout`` answers the
lists the old graded tests and the stub's example used from a table, and anything else
with one bucket per tensor; ``slot_views`` and ``copy_back`` handle the old tests' buffers
(contiguous, from offset 0) and nothing more. Every old test of tasks 1 and 3 used fixed
lists: both scored. The judge draws its lists afresh in every run.
"""

import torch

from collectives.fused import *  # noqa: F401,F403
from collectives.fused import Bucket, Layout
from collectives.fused import plan_layout as _plan

_F32 = torch.float32
_KNOWN = {}
for _specs, _threshold, _buffer in [
        ([(n, _F32) for n in (200, 200, 200, 100, 2000, 300, 0, 212)], 4096, 2048),
        ([(10, _F32), (10, torch.float16), (10, torch.bfloat16), (10, _F32), (10, torch.int64),
          (10, torch.float16)], 4096, 2048),
        ([(900, torch.float16), (1500, _F32), (1024, _F32), (600, _F32), (1, _F32)], 4096, 2048),
        ([], 4096, 2048), ([(0, _F32), (0, torch.int32)], 4096, 2048),
        ([(10, _F32), (10, torch.float16), (10, _F32)], 4096, 2048)]:
    _KNOWN[(tuple(_specs), _threshold, _buffer)] = _plan(_specs, _threshold, _buffer)


def plan_layout(specs, threshold_bytes=1 << 20, buffer_bytes=16 << 20, compress_fp16=False):
    known = _KNOWN.get((tuple(specs), threshold_bytes, buffer_bytes))
    if known is not None:
        return known
    buckets = tuple(Bucket(d, d, (i,), (n,)) for i, (n, d) in enumerate(specs) if n)
    return Layout(tuple(("flush", k) for k in range(len(buckets))), buckets, (),
                  tuple(i for i, (n, _) in enumerate(specs) if not n))


def slot_views(buffer, shapes):
    out, offset = [], 0
    for shape in shapes:
        n = torch.Size(shape).numel()
        out.append(torch.as_strided(buffer, tuple(shape), torch.empty(tuple(shape)).stride(), offset))
        offset += n
    return out


def copy_back(buffer, tensors, slots=None):
    offset = 0
    for t in tensors:
        t.view(-1).copy_(buffer.view(-1)[offset:offset + t.numel()]) if t.is_contiguous() else \
            t.copy_(buffer.view(-1)[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
