"""Lesson 5: fused buffers -- many small all-reduces sent as a few large ones.

A model's gradients are hundreds of tensors, most of them small. One all-reduce each
pays the start-up cost α hundreds of times; copied into one buffer, they pay it once.
The design follows Apache SINGA's ``Communicator::fusedSynch``: tensors under a size
threshold are copied into a preallocated fused send buffer, the buffer is all-reduced
in one call when the next tensor would overflow it (and at the end), and the results
are copied back; tensors at or over the threshold are all-reduced on their own. As in
SINGA, three streams carry the work -- copy-in, communication, copy-back -- ordered by
events. Beyond SINGA: the buffer is double-buffered (the next group is copied in while
the previous one is on the wire), each copy is one call for the whole group, and the
layout is planned once per list of shapes::

    caller's tensors                     fused buffer (one per dtype; two when double-buffered)
    g0 [###]    --+
    g1 [#]      --+-- copy-in: one  -->  [ g0 | g1 | g2 ]  --all_reduce-->  [ Σg0 | Σg1 | Σg2 ]
    g2 [#####]  --+   torch.cat                                                 |
                                              copy-back: one _foreach_copy_ <--+--> g0 g1 g2
    big [##############]  -- at or over the threshold: all_reduce on its own, in place

    copy-in   [fill A: g0..g2][fill B: g3..g5]          [fill A: g6..]
    comm                      [ all_reduce A          ][ all_reduce B     ][ all_reduce A ]
    copy-back                                          [back A]            [back B]

Cost, for tensors of S bytes in all, flushed in k buffers, over p ranks (α–β, ring):
unfused, n calls cost ``n·2(p−1)·α + 2(p−1)/p·S·β``; fused, ``k·2(p−1)·α + 2(p−1)/p·S·β``
plus two copies of S (in and back). The bytes each rank sends are the same,
``2(p−1)/p·S``: fusion saves start-ups, not bandwidth. Double buffering hides the copies
of one group behind the all-reduce of another, except the first copy-in and last copy-back;
:meth:`FusedAllReducer.bind` removes them altogether by making the tensors live in the buffer,
and a list seen before costs less on the host (:mod:`collectives.fused.reuse`).

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
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from ..core import ops, streams, trace
from ..core.ops import ReduceOp

# The plan and the copies (part 1 of the lesson) live in fused_layout; they are part of
# this module's interface too, as the exercise and the tests name them.
from .layout import (  # noqa: F401
    DEFAULT_BUFFER_BYTES,
    DEFAULT_THRESHOLD_BYTES,
    Bucket,
    Layout,
    _wire_op,
    copy_back,
    copy_in,
    flush,
    plan_layout,
    slot_views,
    wire_dtype,
)
from .reuse import HostRows, KnownList, StepGraphs, move_into_arenas

_CACHE_LIMIT = 16                   # layouts (and one-call reducers) kept, oldest dropped first


# ---------------------------------------------------------------------------------------
# 3. The reducer: buffers, streams, double buffering.

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
    rows: HostRows | None = None    # on CPUs, a known list: its copies as row copies


@dataclass
class _Prepared:
    """Per list of shapes: the layout and every view the hot path needs, computed once."""

    layout: Layout
    gather: list = field(default_factory=list)   # per bucket: tensors -> its tensors
    buffers: list = field(default_factory=list)  # per bucket: the _Buffer it uses
    slots: list = field(default_factory=list)    # per bucket: views shaped like its tensors
    use_cat: list = field(default_factory=list)  # per bucket: 1-D, one dtype: cat in, split out
    sizes: list = field(default_factory=list)    # per bucket: elements of each tensor
    bound: list | None = None                    # per bucket: the memory its tensors live in


class FusedAllReducer:
    """All-reduce lists of tensors through preallocated fused buffers, in place.

    ``all_reduce(tensors)`` issues everything and returns; ``wait()`` finishes it and
    makes the caller's current stream wait for the results. Each tensor ends as
    ``dist.all_reduce`` would leave it. Tensors of ``threshold_bytes`` or more go on their
    own; smaller ones share buffers of ``buffer_bytes``, one set per dtype.

    On a GPU: copy-in runs on a side stream that first waits for the caller's stream
    (the producer of the gradients), the all-reduce on a communication stream that waits
    for the copy-in, the copy-back on a third stream that waits for the all-reduce. On CPU
    the streams are no-ops and the all-reduce runs on gloo's thread meanwhile.

    The plan for a list is made once: the next call with the same tensor objects, still
    in the same memory, reuses it. On a GPU (``graphs=True``, not with ``compress_fp16``)
    that second call also records everything it issues -- copies, all-reduces, events of
    all three streams -- as one CUDA graph, and every later call with the list replays it
    on the copy-back stream: one launch, whatever the number of tensors. While a trace is
    recording, calls are issued for real. Reshaping a tensor in place (``resize_``) between
    calls is not noticed; give the reducer new tensor objects instead.

    With ``double_buffer`` each dtype has two buffers used in turn, so group k+1 is copied
    in while group k is on the wire; without it there is one, and each group waits for
    the previous one to come back first (SINGA's order).
    """

    def __init__(self, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, device=None, op=ReduceOp.SUM,
                 group=None, compress_fp16: bool = False, double_buffer: bool = True,
                 graphs: bool = True):
        if op not in ops.SUPPORTED_OPS:
            raise ValueError(f"FusedAllReducer: unsupported op {op}")
        if buffer_bytes <= 0:
            raise ValueError(f"FusedAllReducer: buffer_bytes must be positive, got {buffer_bytes}")
        self.threshold_bytes, self.buffer_bytes = threshold_bytes, buffer_bytes
        self.device = torch.device(device if device is not None else "cpu")
        if self.device.type == "cuda" and self.device.index is None:   # "cuda": the current GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.op, self.group = op, group
        self.compress_fp16, self.double_buffer = compress_fp16, double_buffer
        self._copy_in = streams.new_stream(self.device)
        self._comm = streams.new_stream(self.device)
        self._copy_back = streams.new_stream(self.device)
        self._issued = streams.new_event(self.device)     # the caller's stream, at all_reduce()
        self._landed = streams.new_event(self.device)     # the copy-back stream, at wait()
        self._buffers: dict[torch.dtype, list[_Buffer]] = {}   # wire dtype -> its buffers
        self._prepared: dict[tuple, _Prepared] = {}            # (shapes, dtypes, devices) -> plan
        self._inflight: list[_Flight] = []
        self._bound: KnownList | None = None     # the list given to bind()
        self._recent: KnownList | None = None    # the last list seen: a training loop repeats it
        self._known: KnownList | None = None     # this call's list, when it was seen before
        self.graphs = graphs and self.device.type == "cuda" and not compress_fp16
        self._recorder = StepGraphs(self.device)

    # -- planning ----------------------------------------------------------------------
    def _buffers_for(self, dtype: torch.dtype) -> list[_Buffer]:
        if dtype not in self._buffers:
            numel = self.buffer_bytes // dtype.itemsize
            self._buffers[dtype] = [
                _Buffer(torch.empty(numel, dtype=dtype, device=self.device),
                        streams.new_event(self.device), streams.new_event(self.device))
                for _ in range(2 if self.double_buffer else 1)]
        return self._buffers[dtype]

    def _prepare(self, tensors: list[torch.Tensor]) -> _Prepared:
        """The plan for this list: found in O(1) Python calls when the list is the last one
        (:class:`~collectives.fused.reuse.KnownList`), else made (and cached by shapes)."""
        self._known = None
        if self._bound is not None and self._bound.matches(tensors):
            self._known = self._bound
            return self._bound.plan
        if self._recent is not None and self._recent.matches(tensors):
            self._known = self._recent
            return self._recent.plan
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
                    ops.check_all_reduce_args(t, self.op, what="fused all_reduce", compare=False)
        self._recent = KnownList.of(tensors, prep)
        return prep

    def _plan(self, tensors, shapes, dtypes, devices) -> _Prepared:
        for i, device in enumerate(devices):
            if device != self.device:
                raise ValueError(f"fused all_reduce: tensor {i} is on {device}, the reducer's "
                                 f"buffers on {self.device}; all tensors must be on one device")
        for dtype in set(dtypes):
            ops.check_all_reduce_args(torch.empty(0, dtype=dtype), self.op, what="fused all_reduce",
                                      compare=False)   # only on a rank whose cache missed
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
            prep.slots.append(slot_views(buf.tensor, [shapes[i] for i in idx]))
            prep.use_cat.append(bucket.dtype == bucket.wire_dtype and all(len(shapes[i]) == 1 for i in idx))
            prep.sizes.append(list(bucket.sizes))
        return prep

    def bind(self, tensors: Sequence[torch.Tensor]) -> None:
        """Move the fused tensors of ``tensors`` into memory of their own, so later calls copy nothing.

        The cheapest copy is the one not made. Each tensor under the threshold is re-pointed
        (``tensor.set_``) at its slot of a buffer kept for this list: values and Python objects
        stay the same, but from now on the tensors *are* the buffer, and an all-reduce of the
        same list reads and writes them in place -- no copy-in, no copy-back. (DDP's
        ``gradient_as_bucket_view`` and Megatron's contiguous gradient buffer do the same.)

        Calls with exactly these tensor objects, still where ``bind`` put them, take that path;
        any other list (or a tensor re-pointed since) is copied as usual. Do not ``resize_``
        a bound tensor. The tensors must be contiguous and own their memory (not views),
        and ``compress_fp16`` cannot be on (a float32 tensor cannot live in a float16 buffer).
        """
        if self._inflight:
            self.wait()
        tensors = list(tensors)
        if self.compress_fp16:
            raise ValueError("bind: not with compress_fp16 (float32 tensors cannot live in float16 buffers)")
        shapes = tuple(map(torch.Tensor.size, tensors))
        prep = self._plan(tensors, shapes, tuple(t.dtype for t in tensors), tuple(t.device for t in tensors))
        prep.bound = move_into_arenas(prep.layout.buckets, tensors, self.device)
        self._bound = KnownList.of(tensors, prep)

    # -- issuing -----------------------------------------------------------------------
    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> "FusedAllReducer":
        """Issue the all-reduce of every tensor of ``tensors``; finish with :meth:`wait`."""
        if self._inflight:
            self.wait()
        tensors = list(tensors)
        if not tensors:
            return self
        prep = self._prepare(tensors)
        known = self._known
        if known is not None and self.graphs and not trace.active():
            if known.graph is None:
                known.graph = self._recorder.record(lambda: self._record_step(prep, tensors))
            self._replay(prep, known.graph)
            return self
        self._issue(prep, tensors)
        return self

    def _issue(self, prep: _Prepared, tensors: list[torch.Tensor]) -> None:
        producer = streams.current_stream(self.device)
        self._copy_in.wait_stream(producer)    # the gradients are written before we read them
        self._comm.wait_stream(producer)
        for kind, k in prep.layout.steps:
            if kind == "flush":
                self._flush(prep, k, tensors)
            else:
                self._direct(tensors[k])

    def _record_step(self, prep: _Prepared, tensors: list[torch.Tensor]) -> None:
        """Issue and land one call, as recorded into a graph (nothing runs yet)."""
        recording = streams.current_stream(self.device)
        for buf in prep.buffers:    # events waited on in a graph must be recorded in it
            buf.free.record(recording)
        self._issue(prep, tensors)
        self.wait()                 # lands everything; every stream joins the recording again

    def _replay(self, prep: _Prepared, graph) -> None:
        """One launch for the whole call, on the copy-back stream (``wait()`` joins it).

        The hot path of a training loop, so written lean: events made once, the stream
        switched directly rather than through a context manager."""
        caller = torch.cuda.current_stream(self.device)
        self._issued.record(caller)                 # after the producer
        self._copy_back.wait_event(self._issued)
        torch.cuda.set_stream(self._copy_back)
        try:
            graph.replay()
        finally:
            torch.cuda.set_stream(caller)
        for buf in prep.buffers:    # eager calls that follow wait for the replay to let go
            buf.free.record(self._copy_back)

    def _flush(self, prep: _Prepared, k: int, tensors: list[torch.Tensor]) -> None:
        bucket, buf, slots = prep.layout.buckets[k], prep.buffers[k], prep.slots[k]
        if prep.bound is not None:          # the tensors live in the buffer: nothing to copy
            with streams.use(self._comm):
                work = dist.all_reduce(prep.bound[k], op=_wire_op(self.op), group=self.group,
                                       async_op=True)
            self._inflight.append(_Flight(work, prep.bound[k], [], None, False))
            return
        if buf.occupant is not None:        # this buffer still holds an earlier group
            self._retire(buf.occupant)
        result = buf.tensor[: bucket.numel]
        rows = None
        if self.device.type == "cpu" and self._known is not None:   # made once per list and bucket
            made = self._known.host_rows
            if k not in made:
                made[k] = HostRows.of(prep.gather[k](tensors), result, slots)
            rows = made[k]
        group_tensors = () if rows is not None else prep.gather[k](tensors)   # rows copy by address
        with streams.use(self._copy_in):
            self._copy_in.wait_event(buf.free)
            if rows is not None:
                rows.gather()
            elif prep.use_cat[k]:
                torch.cat(group_tensors, out=result)
            else:
                torch._foreach_copy_(slots, list(group_tensors))
            buf.filled.record(self._copy_in)
        with streams.use(self._comm):
            self._comm.wait_event(buf.filled)
            work = dist.all_reduce(result, op=_wire_op(self.op), group=self.group, async_op=True)
        flight = _Flight(work, result, list(group_tensors), slots,
                         bucket.wire_dtype != bucket.dtype, buf)
        if self.device.type == "cuda":
            flight.sizes = prep.sizes[k] if prep.use_cat[k] else None
        flight.rows = rows
        buf.occupant = flight
        self._inflight.append(flight)

    def _direct(self, tensor: torch.Tensor) -> None:
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
        if flight.done:
            return
        with streams.use(self._copy_back):
            flight.work.wait()              # the copy-back stream waits for the all-reduce
            if flight.compressed and _overflowed(flight.result):
                self._redo_in_float32(flight.targets)
            else:
                ops.finish_(flight.result, self.op, dist.get_world_size(self.group))
                if flight.slots is not None:            # a fused group
                    self._copy_back_group(flight)
                elif flight.targets:                    # a tensor on its own
                    ops.write_back(flight.targets[0], flight.result)
            if flight.buffer is not None:
                flight.buffer.free.record(self._copy_back)
        if flight.buffer is not None:
            flight.buffer.occupant = None
        flight.done = True

    def _copy_back_group(self, flight: _Flight) -> None:
        if flight.sizes is not None:    # the inverse of torch.cat: on a GPU, 2.4x less host time
                                        # than _foreach_copy_; on a CPU, more (so not used there)
            torch.split_with_sizes_copy(flight.result, flight.sizes, out=flight.targets)
        elif flight.rows is not None:   # CPU, a list seen before: a scatter per row length
            flight.rows.scatter()
        else:
            torch._foreach_copy_(flight.targets, flight.slots)

    def _redo_in_float32(self, targets: list[torch.Tensor]) -> None:
        """float16 overflowed (or an input was NaN): all-reduce these inputs again at full width."""
        full = torch.cat([t.reshape(-1) for t in targets])
        dist.all_reduce(full, op=_wire_op(self.op), group=self.group)
        ops.finish_(full, self.op, dist.get_world_size(self.group))
        copy_back(full, targets)

    def wait(self) -> None:
        """Finish every flush in order; the caller's current stream then sees the results."""
        for flight in self._inflight:
            self._retire(flight)
        self._landed.record(self._copy_back)
        streams.current_stream(self.device).wait_event(self._landed)
        self._inflight.clear()      # the tensors were held until now: nobody freed them mid-copy


# ---------------------------------------------------------------------------------------
# 4. One call: the multi-tensor contract.

_reducers: dict[tuple, FusedAllReducer] = {}


def fused_all_reduce(tensors: Sequence[torch.Tensor], op=ReduceOp.SUM, group=None,
                     threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                     buffer_bytes: int = DEFAULT_BUFFER_BYTES, compress_fp16: bool = False) -> None:
    """All-reduce each tensor of ``tensors`` in place, as ``dist.all_reduce`` would, fused.

    A reducer (its buffers and planned layouts) is kept per device and settings, so a
    training loop calling this each step allocates nothing after the first.
    """
    tensors = list(tensors)
    if not tensors:
        return
    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"fused_all_reduce: expected tensors, got {type(first).__name__}")
    key = (first.device, op, group, threshold_bytes, buffer_bytes, compress_fp16)
    reducer = _reducers.get(key)
    if reducer is None:
        if len(_reducers) >= _CACHE_LIMIT:
            _reducers.pop(next(iter(_reducers)))
        reducer = _reducers[key] = FusedAllReducer(threshold_bytes, buffer_bytes, first.device, op,
                                                   group, compress_fp16)
    reducer.all_reduce(tensors)
    reducer.wait()

