"""Lesson 5, part 1: the plan and the copies of a fused all-reduce.

:func:`plan_layout` decides, once per list of (numel, dtype), which tensors travel on their
own (at or over the threshold) and which share a fused buffer -- one buffer per wire dtype,
closed when the next tensor would overflow it. :func:`copy_in` and :func:`copy_back` move a
whole group in one call each (``torch.cat`` in, ``torch._foreach_copy_`` out), and
:func:`flush` is the whole unfused-to-fused round trip without streams.
:mod:`collectives.fused.reducer` builds the streamed, double-buffered all-reducer on these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..core.ops import ReduceOp

DEFAULT_THRESHOLD_BYTES = 1 << 20   # tensors this big or bigger are all-reduced on their own
DEFAULT_BUFFER_BYTES = 16 << 20     # one fused buffer; 1000 tensors of 16 KiB fill one exactly


def _wire_op(op):
    return ReduceOp.SUM if op == ReduceOp.AVG else op  # AVG: SUM, then one division


# ---------------------------------------------------------------------------------------
# 1. The layout: which tensor goes where, decided from (numel, dtype) alone.

@dataclass(frozen=True)
class Bucket:
    """One flush: consecutive tensors of one dtype, packed end to end in a buffer."""

    dtype: torch.dtype        # dtype of the tensors in it (never mixed)
    wire_dtype: torch.dtype   # dtype of the buffer: float16 when float32 is compressed
    indices: tuple[int, ...]  # positions in the caller's list, in buffer order
    sizes: tuple[int, ...]    # elements of each, same order

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.numel * self.wire_dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """The plan of one call: ``steps`` in the order every rank issues them."""

    steps: tuple[tuple[str, int], ...]  # ("direct", tensor index) or ("flush", bucket index)
    buckets: tuple[Bucket, ...]
    direct: tuple[int, ...]             # tensors all-reduced on their own
    skipped: tuple[int, ...]            # empty tensors: nothing to send

    @property
    def flushes(self) -> int:
        return len(self.buckets)


def wire_dtype(dtype: torch.dtype, compress_fp16: bool = False) -> torch.dtype:
    """The dtype a tensor travels in: float16 for float32 under compression, else its own."""
    return torch.float16 if compress_fp16 and dtype == torch.float32 else dtype


def plan_layout(specs: Sequence[tuple[int, torch.dtype]], threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                buffer_bytes: int = DEFAULT_BUFFER_BYTES, compress_fp16: bool = False) -> Layout:
    """Plan the flushes for tensors described by ``(numel, dtype)``, in list order.

    * an empty tensor is skipped;
    * a tensor of ``threshold_bytes`` or more (or one that alone overflows a buffer) is
      all-reduced directly, at its place in the order;
    * every other tensor joins the open bucket of its dtype; when it would overflow that
      bucket, the bucket is flushed first and a new one opened;
    * at the end, the open buckets are flushed in the order they were opened.

    SINGA's rule differs: it sees one gradient at a time, copies it into the buffer as
    autograd yields it, and sends the buffer *after* adding it, once the elements gathered
    exceed its threshold (which also sends larger gradients on their own). Planning the whole
    list first closes a bucket *before* the tensor that would overflow it instead, so no
    flush is larger than ``buffer_bytes``.

    Every rank plans from the same shapes, so every rank issues the same all-reduces in
    the same order -- what keeps the collectives matched.
    """
    steps, buckets, direct, skipped = [], [], [], []
    open_buckets: dict[torch.dtype, list[tuple[int, int]]] = {}  # dtype -> [(index, numel)]

    def flush(dtype):
        members = open_buckets.pop(dtype)
        buckets.append(Bucket(dtype, wire_dtype(dtype, compress_fp16),
                              tuple(i for i, _ in members), tuple(n for _, n in members)))
        steps.append(("flush", len(buckets) - 1))

    for index, (numel, dtype) in enumerate(specs):
        if numel == 0:
            skipped.append(index)
            continue
        on_wire = numel * wire_dtype(dtype, compress_fp16).itemsize
        if numel * dtype.itemsize >= threshold_bytes or on_wire > buffer_bytes:
            steps.append(("direct", index))
            direct.append(index)
            continue
        members = open_buckets.get(dtype, [])
        filled = sum(n for _, n in members) * wire_dtype(dtype, compress_fp16).itemsize
        if members and filled + on_wire > buffer_bytes:
            flush(dtype)
        open_buckets.setdefault(dtype, []).append((index, numel))
    for dtype in sorted(open_buckets, key=lambda d: open_buckets[d][0][0]):
        flush(dtype)
    return Layout(tuple(steps), tuple(buckets), tuple(direct), tuple(skipped))


# ---------------------------------------------------------------------------------------
# 2. The copies: one call each way, whatever the number of tensors.

def slot_views(buffer: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of ``buffer``'s first elements, one per shape, end to end: where each tensor lives."""
    sizes = [s.numel() for s in map(torch.Size, shapes)]
    flat = buffer.view(-1)[: sum(sizes)]
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


def copy_in(tensors: Sequence[torch.Tensor], buffer: torch.Tensor,
            slots: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Pack ``tensors`` end to end into ``buffer``; return the filled part.

    One call for the whole group: ``torch.cat(..., out=)`` when every tensor is 1-D and of
    the buffer's dtype (one kernel on a GPU), else ``torch._foreach_copy_`` into the slots,
    which takes any shape, any strides, and casts (float32 into a float16 buffer).
    Never a Python loop of one copy per tensor: on a GPU that is one launch per tensor.
    """
    numel = sum(t.numel() for t in tensors)
    filled = buffer.view(-1)[:numel]
    if slots is None and all(t.dim() == 1 and t.dtype == buffer.dtype for t in tensors):
        torch.cat(tensors, out=filled)
    else:
        torch._foreach_copy_(slots or slot_views(buffer, [t.shape for t in tensors]), list(tensors))
    return filled


def copy_back(buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
              slots: list[torch.Tensor] | None = None) -> None:
    """Copy each tensor's slot of ``buffer`` back into it, in one ``_foreach_copy_``.

    The slots are shaped like the tensors, so a transposed or strided view is written
    element for element, and nothing between its elements is touched.
    """
    if tensors:
        torch._foreach_copy_(list(tensors), slots or slot_views(buffer, [t.shape for t in tensors]))


def flush(tensors: Sequence[torch.Tensor], buffer: torch.Tensor, op=ReduceOp.SUM, group=None):
    """The fused step, plainly: copy ``tensors`` into ``buffer``, start one all-reduce of the
    filled part. Returns ``(work, filled)``: ``work.wait()``, divide for AVG
    (:func:`collectives.core.ops.finish_`), then :func:`copy_back`. AVG travels as SUM."""
    filled = copy_in(tensors, buffer)
    work = dist.all_reduce(filled, op=_wire_op(op), group=group, async_op=True)
    return work, filled
