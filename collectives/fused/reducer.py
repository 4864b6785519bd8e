"""Lesson 5, part 2: the fused all-reducer -- SINGA's design, plainly.

A model's gradients are hundreds of tensors, most of them small. One all-reduce each
pays the start-up cost α hundreds of times; copied into one buffer, they pay it once.
The design follows Apache SINGA's ``Communicator::fusedSynch``: tensors under a size
threshold are copied into a preallocated fused buffer, the buffer is all-reduced in one
call, and the results are copied back; larger tensors are all-reduced on their own. The
copies and the all-reduce run on side streams ordered by events. Beside SINGA: the
buffer is double-buffered (the next group is copied in while the previous one is on the
wire), each copy is one call for the whole group, the layout is planned once per list of
shapes, and copy-back has a stream of its own::

    caller's tensors                     fused buffer (one per dtype; two when double-buffered)
    g0 [###]    --+
    g1 [#]      --+-- copy-in: one  -->  [ g0 | g1 | g2 ]  --all_reduce-->  [ Σg0 | Σg1 | Σg2 ]
    g2 [#####]  --+   torch.cat                                                 |
                                              copy-back: one _foreach_copy_ <--+--> g0 g1 g2
    big [##############]  -- at or over the threshold: all_reduce on its own, in place

    copy-in   [fill A: g0..g2][fill B: g3..g5]          [fill A: g6..]
    comm                      [ all_reduce A          ][ all_reduce B     ][ all_reduce A ]
    copy-back                                          [back A]            [back B]

    events: "A filled" (copy-in -> comm), the all-reduce's work (comm -> copy-back),
            "A free" (copy-back -> the next copy-in into A)

When a group is sent differs from SINGA. SINGA copies each gradient into the buffer as
autograd yields it and sends the buffer *after* adding a gradient, once the elements
gathered exceed the threshold (the same number that sends larger gradients on their
own), so a buffer holds up to the threshold plus one more gradient. Here the whole list
is known before anything is copied: :func:`~collectives.fused.layout.plan_layout` closes a
bucket *before* the tensor that would overflow it, so no flush is larger than
``buffer_bytes``.

Cost, for tensors of S bytes in all, flushed in k buffers, over p ranks (α–β, ring):
unfused, n calls cost ``n·2(p−1)·α + 2(p−1)/p·S·β``; fused, ``k·2(p−1)·α + 2(p−1)/p·S·β``
plus two copies of S (in and back). The bytes each rank sends are the same,
``2(p−1)/p·S``: fusion saves start-ups, not bandwidth. Double buffering hides the copies
of one group behind the all-reduce of another, except the first copy-in and last copy-back.
A training loop, which hands the same tensors every step, can skip more: that second step
is :mod:`collectives.fused.fast`, built on this class.

**float16 on the wire** (``compress_fp16=True``): float32 tensors travel as float16 --
cast in the buffer, all-reduced, cast back -- half the bytes. Each input is rounded once
(relative error at most ``u = 2⁻¹¹``) and each of the at most p−1 partial sums once more,
so for SUM every element satisfies ``|got − exact| ≤ γ_p · Σᵢ|xᵢ| + p·2⁻²⁵`` with
``γ_p = p·u / (1 − p·u)`` (about ``p · 4.9e-4``); the second term covers values in
float16's subnormal range. AVG divides that sum by p in float16: ``γ_{p+1} · Σᵢ|xᵢ| / p
+ p·2⁻²⁵``. MIN and MAX are off by one rounding of the result (``u`` relative). float16
stops at 65504: a flush whose result holds an inf or a NaN -- an overflow, or a NaN
input -- is all-reduced again in float32 from the untouched inputs. Every rank sees the
same result, so every rank takes the same decision and the calls stay matched.
(bfloat16 tensors travel as they are, in buffers of their own.)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from ..core import ops, streams
from ..core.ops import ReduceOp

# The plan and the copies (part 1 of the lesson) live in layout.py; they are part of
# this module's interface too, as the exercise and the tests name them.
from .layout import (DEFAULT_BUFFER_BYTES, DEFAULT_THRESHOLD_BYTES, Bucket,  # noqa: F401
                     Layout, _wire_op, copy_back, copy_in, flush, plan_layout, slot_views,
                     wire_dtype)

_CACHE_LIMIT = 16                   # layouts kept per reducer, oldest dropped first


def _overflowed(half: torch.Tensor) -> bool:
    """True when a float16 tensor holds an inf or a NaN (exponent bits all set)."""
    return bool(((half.view(torch.int16) & 0x7C00) == 0x7C00).any())


@dataclass
class _Buffer:
    tensor: torch.Tensor
    filled: object                  # event: copy-in done (the all-reduce waits on it)
    free: object                    # event: copy-back done (the next copy-in waits on it)
    occupant: "_Flight | None" = None


@dataclass
class _Flight:
    """One all-reduce in flight and what to do when it lands."""

    work: object                    # the async Work handle
    result: torch.Tensor            # what is being reduced (buffer part, or a tensor)
    targets: list[torch.Tensor]     # where the results go
    slots: list[torch.Tensor] | None  # views of ``result`` shaped like ``targets``; None: direct
    compressed: bool                # float16 on the wire: check for overflow before copy-back
    buffer: _Buffer | None = None
    done: bool = False
    sizes: list | None = None       # on GPUs, 1-D targets of the buffer's dtype: one split_with_sizes_copy


@dataclass
class _Prepared:
    """Per list of shapes: the layout and every view the hot path needs, computed once."""

    layout: Layout
    gather: list = field(default_factory=list)   # per bucket: tensors -> its tensors
    buffers: list = field(default_factory=list)  # per bucket: the _Buffer it uses
    slots: list = field(default_factory=list)    # per bucket: views shaped like its tensors
    use_cat: list = field(default_factory=list)  # per bucket: 1-D, one dtype: cat in, split out
    sizes: list = field(default_factory=list)    # per bucket: elements of each tensor


class FusedAllReducer:
    """All-reduce lists of tensors through preallocated fused buffers, in place.

    ``all_reduce(tensors)`` issues everything and returns; ``wait()`` finishes it and
    makes the caller's current stream wait for the results. Each tensor ends as
    ``dist.all_reduce`` would leave it. Tensors of ``threshold_bytes`` or more go on their
    own; smaller ones share buffers of ``buffer_bytes``, one set per dtype.

    On a GPU: copy-in runs on a side stream that first waits for the caller's stream
    (the producer of the gradients), the all-reduce on a communication stream that waits
    for the copy-in, the copy-back on a third stream that waits for the all-reduce. On CPU
    the streams are stand-ins (:mod:`collectives.core.streams`) and the all-reduce runs on
    gloo's thread meanwhile.

    With ``double_buffer`` each dtype has two buffers used in turn, so group k+1 is copied
    in while group k is on the wire; without it there is one, and each group waits for
    the previous one to come back first (SINGA's order). The layout of a list of shapes
    is planned once and kept.
    """

    def __init__(self, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, device=None, op=ReduceOp.SUM,
                 group=None, compress_fp16: bool = False, double_buffer: bool = True):
        if op not in ops.SUPPORTED_OPS:
            raise ValueError(f"FusedAllReducer: unsupported op {op}")
        if buffer_bytes <= 0:
            raise ValueError(f"FusedAllReducer: buffer_bytes must be positive, got {buffer_bytes}")
        self.threshold_bytes, self.buffer_bytes = threshold_bytes, buffer_bytes
        self.device = torch.device(device if device is not None else "cpu")
        if self.device.type == "cuda" and self.device.index is None:   # "cuda": the current GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.op, self.group = op, group
        self._member = ops.is_member(group)    # outside the group: every call does nothing
        self.compress_fp16, self.double_buffer = compress_fp16, double_buffer
        self._copy_in = streams.new_stream(self.device, name="copy-in")      # packs groups into buffers
        self._comm = streams.new_stream(self.device, name="comm")            # runs the all-reduces
        self._copy_back = streams.new_stream(self.device, name="copy-back")  # copies results back
        self._landed = streams.new_event(self.device, name="landed")  # the copy-back stream, at wait()
        self._buffers: dict[torch.dtype, list[_Buffer]] = {}   # wire dtype -> its buffers
        self._prepared: dict[tuple, _Prepared] = {}            # (shapes, dtypes, devices) -> plan
        self._inflight: list[_Flight] = []

    # -- planning ----------------------------------------------------------------------
    def _buffers_for(self, dtype: torch.dtype) -> list[_Buffer]:
        if dtype not in self._buffers:
            numel = self.buffer_bytes // dtype.itemsize
            self._buffers[dtype] = [
                _Buffer(torch.empty(numel, dtype=dtype, device=self.device),
                        streams.new_event(self.device, name=f"{dtype} buffer {i} filled"),
                        streams.new_event(self.device, name=f"{dtype} buffer {i} free"))
                for i in range(2 if self.double_buffer else 1)]
            caller = streams.current_stream(self.device)
            for buf in self._buffers[dtype]:      # a new buffer is free: its first fill waits on this
                buf.free.record(caller)
        return self._buffers[dtype]

    def _prepare(self, tensors: list[torch.Tensor]) -> _Prepared:
        """The plan for this list, looked up by (shapes, dtypes, devices); made on a miss."""
        try:
            shapes = tuple(map(torch.Tensor.size, tensors))
        except TypeError:
            bad = next(i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor))
            raise TypeError(f"fused all_reduce: item {bad} is a {type(tensors[bad]).__name__}, "
                            "not a tensor") from None
        dtypes = tuple(map(operator.attrgetter("dtype"), tensors))
        devices = tuple(map(operator.attrgetter("device"), tensors))
        key = (shapes, dtypes, devices)
        prep = self._prepared.get(key)
        if prep is None:
            prep = self._plan(tensors, shapes, dtypes, devices)
            if len(self._prepared) >= _CACHE_LIMIT:
                self._prepared.pop(next(iter(self._prepared)))
            self._prepared[key] = prep
        if not all(map(torch.Tensor.is_contiguous, tensors)):   # views: rule out expanded ones
            for t in tensors:
                if not t.is_contiguous():
                    ops.check_all_reduce_args(t, self.op, what="fused all_reduce")
        return prep

    def _plan(self, tensors, shapes, dtypes, devices) -> _Prepared:
        """Check the input, plan the layout, give each bucket its buffer and slot views."""
        for i, device in enumerate(devices):
            if device != self.device:
                raise ValueError(f"fused all_reduce: tensor {i} is on {device}, the reducer's "
                                 f"buffers on {self.device}; all tensors must be on one device")
        for dtype in set(dtypes):
            ops.check_all_reduce_args(torch.empty(0, dtype=dtype), self.op, what="fused all_reduce")
        layout = plan_layout([(s.numel(), d) for s, d in zip(shapes, dtypes)],
                             self.threshold_bytes, self.buffer_bytes, self.compress_fp16)
        prep, turns = _Prepared(layout), {}
        for bucket in layout.buckets:
            pool = self._buffers_for(bucket.wire_dtype)
            turn = turns.get(bucket.wire_dtype, 0)          # buffers of a dtype used in turn
            turns[bucket.wire_dtype] = turn + 1
            buf = pool[turn % len(pool)]
            idx = bucket.indices
            prep.gather.append(operator.itemgetter(*idx) if len(idx) > 1
                               else (lambda ts, i=idx[0]: (ts[i],)))
            prep.buffers.append(buf)
            # splitting a buffer into 1000 views costs more than the copy itself: done once
            prep.slots.append(slot_views(buf.tensor, [shapes[i] for i in idx]))
            prep.use_cat.append(bucket.dtype == bucket.wire_dtype and all(len(shapes[i]) == 1 for i in idx))
            prep.sizes.append(list(bucket.sizes))
        return prep

    # -- issuing -----------------------------------------------------------------------
    @torch.no_grad()        # on the tensors' data, as dist.all_reduce: a Parameter is fine
    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> "FusedAllReducer":
        """Issue the all-reduce of every tensor of ``tensors``; finish with :meth:`wait`.

        A rank outside the reducer's group does nothing, as ``dist.all_reduce``."""
        if self._inflight:
            self.wait()
        tensors = list(tensors)
        if not tensors or not self._member:
            return self
        self._issue(self._prepare(tensors), tensors)
        return self

    def _issue(self, prep: _Prepared, tensors: list[torch.Tensor]) -> None:
        """Every step of the plan, in the order every rank issues them."""
        producer = streams.current_stream(self.device)
        self._copy_in.wait_stream(producer)    # the gradients are written before we read them
        self._comm.wait_stream(producer)
        for kind, k in prep.layout.steps:
            if kind == "flush":
                self._flush(prep, k, tensors)
            else:
                self._direct(tensors[k])

    def _flush(self, prep: _Prepared, k: int, tensors: list[torch.Tensor]) -> None:
        """Bucket k: copy in (after its buffer is free), then one all-reduce (after the copy)."""
        bucket, buf = prep.layout.buckets[k], prep.buffers[k]
        if buf.occupant is not None:        # this buffer still holds an earlier group: land it
            self._retire(buf.occupant)
        result = buf.tensor[: bucket.numel]
        with streams.use(self._copy_in):
            self._copy_in.wait_event(buf.free)
            flight = self._pack(prep, k, tensors, result)
            buf.filled.record(self._copy_in)
        with streams.use(self._comm):
            self._comm.wait_event(buf.filled)
            flight.work = dist.all_reduce(result, op=_wire_op(self.op), group=self.group,
                                          async_op=True)
        flight.buffer = buf
        buf.occupant = flight
        self._inflight.append(flight)

    def _pack(self, prep: _Prepared, k: int, tensors: list[torch.Tensor],
              result: torch.Tensor) -> _Flight:
        """Copy bucket k's tensors into ``result`` in one call; return how to copy them back."""
        group_tensors = prep.gather[k](tensors)
        if prep.use_cat[k]:
            torch.cat(group_tensors, out=result)
        else:                               # any shape or strides, and the float16 cast
            torch._foreach_copy_(prep.slots[k], list(group_tensors))
        flight = _Flight(None, result, list(group_tensors), prep.slots[k],
                         prep.layout.buckets[k].wire_dtype != prep.layout.buckets[k].dtype)
        if self.device.type == "cuda" and prep.use_cat[k]:
            flight.sizes = prep.sizes[k]
        return flight

    def _direct(self, tensor: torch.Tensor) -> None:
        """A tensor at or over the threshold: all-reduced on its own, in place."""
        compressed = self.compress_fp16 and tensor.dtype == torch.float32
        with streams.use(self._comm):
            if compressed:
                result = tensor.reshape(-1).to(torch.float16)
            else:
                result = ops.work_buffer(tensor)    # the tensor's memory, or a copy of a view
            work = dist.all_reduce(result, op=_wire_op(self.op), group=self.group, async_op=True)
        if result.data_ptr() != tensor.data_ptr():  # a temporary: keep it alive for copy-back
            streams.record_stream(result, self._copy_back)
        self._inflight.append(_Flight(work, result, [tensor], None, compressed))

    # -- landing -----------------------------------------------------------------------
    def _retire(self, flight: _Flight) -> None:
        """Land one flight on the copy-back stream; then its buffer is free."""
        if flight.done:
            return
        with streams.use(self._copy_back):
            flight.work.wait()              # the copy-back stream waits for the all-reduce
            if flight.compressed and _overflowed(flight.result):
                self._redo_in_float32(flight.targets)
            else:
                ops.finish_(flight.result, self.op, dist.get_world_size(self.group))
                if flight.slots is not None:            # a fused group
                    self._unpack(flight)
                elif flight.targets:                    # a tensor on its own
                    ops.write_back(flight.targets[0], flight.result)
            if flight.buffer is not None:
                flight.buffer.free.record(self._copy_back)
        if flight.buffer is not None:
            flight.buffer.occupant = None
        flight.done = True

    def _unpack(self, flight: _Flight) -> None:
        """Copy a fused group's results back into its tensors, in one call."""
        if flight.sizes is not None:    # the inverse of torch.cat: on a GPU, 2.4x less host time
                                        # than _foreach_copy_; on a CPU, more (so not used there)
            torch.split_with_sizes_copy(flight.result, flight.sizes, out=flight.targets)
        else:
            torch._foreach_copy_(flight.targets, flight.slots)

    def _redo_in_float32(self, targets: list[torch.Tensor]) -> None:
        """float16 overflowed (or an input was NaN): all-reduce these inputs again at full width."""
        full = torch.cat([t.reshape(-1) for t in targets])
        dist.all_reduce(full, op=_wire_op(self.op), group=self.group)
        ops.finish_(full, self.op, dist.get_world_size(self.group))
        copy_back(full, targets)

    @torch.no_grad()
    def wait(self) -> None:
        """Finish every flush in order; the caller's current stream then sees the results."""
        for flight in self._inflight:
            self._retire(flight)
        self._landed.record(self._copy_back)
        streams.current_stream(self.device).wait_event(self._landed)
        self._inflight.clear()      # the tensors were held until now: nobody freed them mid-copy
