"""Lesson 5, part 3: the fast path -- what a training loop's next call need not do again.

:class:`~collectives.fused.reducer.FusedAllReducer` plans a list of shapes once, but every
call still looks the plan up (one pass per attribute over the list) and copies tensor by
tensor. A training loop hands it the same tensors every step; :class:`FastFusedAllReducer`
is the same reducer with the per-tensor host work of a repeated list taken out, using the
mechanics of :mod:`collectives.fused.reuse`:

1. **a list seen before** (:class:`~collectives.fused.reuse.KnownList`: the same tensors,
   still in the same memory) reuses its plan, recognised in two C-level passes;
2. **on a GPU, one graph**: the second call with that list is recorded as one CUDA graph
   (copy-in, all-reduces, copy-back and the events between the three streams) and every
   later call replays it: one launch, whatever the number of tensors;
3. **on a CPU, row copies**: copy-in and copy-back of a known list as one gather and one
   scatter per tensor length (:class:`~collectives.fused.reuse.HostRows`);
4. **no copies at all**: :meth:`~FastFusedAllReducer.bind` moves the tensors into the
   buffers, and :meth:`~FastFusedAllReducer.bind_grads` keeps a model's gradients there
   whatever ``optimizer.zero_grad()`` does. Both return a :class:`BoundList`: passed back
   to ``all_reduce`` it is recognised by identity alone, one comparison whatever the
   number of tensors (a tuple: nothing can be put in or taken out of it).

A known list holds its tensors by weak reference: the reducer keeps no gradient alive.
A gradient freed by ``zero_grad()`` (``set_to_none=True``, the default) comes back next
step as a new tensor in new memory, which is not the list seen before; a loop that
wants steps 1-3 either binds the gradients (``bind_grads``, which also makes the copies
unnecessary) or keeps them (``zero_grad(set_to_none=False)``).
"""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from ..core import checkmode, ops, streams, trace
from ..core.ops import ReduceOp
from .layout import DEFAULT_BUFFER_BYTES, DEFAULT_THRESHOLD_BYTES, _wire_op
from .reducer import _CACHE_LIMIT, FusedAllReducer, _Flight, _Prepared
from .reuse import HostRows, KnownList, StepGraphs, move_into_arenas


class BoundList(tuple):
    """The tensors :meth:`FastFusedAllReducer.bind` moved into the reducer's buffers, as
    one immutable list. ``reducer.all_reduce(bound)`` with the object ``bind`` returned is
    recognised in O(1): the reducer compares the object, not its 1000 tensors. A later
    ``bind`` makes a new one; an old one is then an ordinary list (checked tensor by tensor).
    A bound tensor must stay where ``bind`` put it (no ``t.data = ...``, ``set_`` or
    ``resize_``): with ``COLLECTIVES_CHECK=1`` every call checks that it did."""


class FastFusedAllReducer(FusedAllReducer):
    """:class:`FusedAllReducer` with the fast path for lists seen before (module docstring).

    The results are those of :class:`FusedAllReducer`, bit for bit; only the host work
    differs. On a GPU (``graphs=True``, not with ``compress_fp16``) the second call with a
    known list records a CUDA graph and later calls replay it on the copy-back stream.
    While a trace is recording, calls are issued for real. Reshaping a tensor in place
    (``resize_``) between calls is not noticed; give the reducer new tensor objects instead.
    """

    def __init__(self, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, device=None, op=ReduceOp.SUM,
                 group=None, compress_fp16: bool = False, double_buffer: bool = True,
                 graphs: bool = True):
        super().__init__(threshold_bytes, buffer_bytes, device, op, group, compress_fp16,
                         double_buffer)
        self._bound: KnownList | None = None     # the list given to bind()
        self._recent: KnownList | None = None    # the last list seen: a training loop repeats it
        self._known: KnownList | None = None     # this call's list, when it was seen before
        self.graphs = graphs and self.device.type == "cuda" and not compress_fp16
        self._recorder = StepGraphs(self.device)
        self._issued = streams.new_event(self.device)   # the caller's stream, before a replay
        self._grad_hooks: list = []

    # -- 1. recognising a list ---------------------------------------------------------
    @torch.no_grad()
    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> "FastFusedAllReducer":
        """:meth:`FusedAllReducer.all_reduce`; the :class:`BoundList` that :meth:`bind`
        returned is recognised by identity, without looking at its tensors."""
        bound = self._bound
        if bound is None or tensors is not bound.handle or not self._member:
            return super().all_reduce(tensors)
        if self._inflight:
            self.wait()
        if checkmode.enabled() and not bound.matches(bound.handle):
            moved = [i for i, (t, ptr) in enumerate(zip(bound.handle, bound.data_ptrs)) if t.data_ptr() != ptr]
            raise ValueError(f"fused all_reduce: bound tensor(s) {moved[:8]} no longer live where bind() put "
                             "them (t.data = ..., set_ or resize_); bind the list again")
        self._known = bound
        self._issue(bound.plan, bound.listed)
        return self

    def _prepare(self, tensors: list[torch.Tensor]) -> _Prepared:
        """Found in O(1) Python calls when the list is the bound one or the last one seen."""
        self._known = None
        if self._bound is not None and self._bound.matches(tensors):
            self._known = self._bound
            return self._bound.plan
        if self._recent is not None and self._recent.matches(tensors):
            self._known = self._recent
            return self._recent.plan
        prep = super()._prepare(tensors)
        self._recent = KnownList.of(tensors, prep)
        return prep

    # -- 2. one graph per step, on a GPU -----------------------------------------------
    def _issue(self, prep: _Prepared, tensors: list[torch.Tensor]) -> None:
        known = self._known
        if known is None or not self.graphs or trace.active():
            super()._issue(prep, tensors)
            return
        if known.graph is None:
            known.graph = self._recorder.record(lambda: self._record_step(prep, tensors))
        self._replay(prep, known.graph)

    def _record_step(self, prep: _Prepared, tensors: list[torch.Tensor]) -> None:
        """Issue and land one call, as recorded into a graph (nothing runs yet)."""
        recording = streams.current_stream(self.device)
        for buf in prep.buffers:    # events waited on in a graph must be recorded in it
            buf.free.record(recording)
        super()._issue(prep, tensors)
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

    # -- 3. row copies, on a CPU -------------------------------------------------------
    def _pack(self, prep: _Prepared, k: int, tensors: list[torch.Tensor],
              result: torch.Tensor) -> _Flight:
        known = self._known
        if known is None or self.device.type != "cpu":
            return super()._pack(prep, k, tensors, result)
        made = known.host_rows                      # made once per list and bucket
        if k not in made:
            made[k] = HostRows.of(prep.gather[k](tensors), result, prep.slots[k])
        rows = made[k]
        if rows is None:                            # not a plain byte copy: the ordinary way
            return super()._pack(prep, k, tensors, result)
        rows.gather()
        flight = _Flight(None, result, [], prep.slots[k], False)   # rows copy by address
        flight.rows = rows
        return flight

    def _unpack(self, flight: _Flight) -> None:
        rows = getattr(flight, "rows", None)
        if rows is not None:        # CPU, a list seen before: a scatter per row length
            rows.scatter()
        else:
            super()._unpack(flight)

    # -- 4. no copies: tensors that live in the buffer ---------------------------------
    def _flush(self, prep: _Prepared, k: int, tensors: list[torch.Tensor]) -> None:
        known = self._known
        if known is None or known.arenas is None:
            super()._flush(prep, k, tensors)
            return
        arena = known.arenas[k]             # the tensors live in it: nothing to copy
        with streams.use(self._comm):
            work = dist.all_reduce(arena, op=_wire_op(self.op), group=self.group, async_op=True)
        self._inflight.append(_Flight(work, arena, [], None, False))

    def bind(self, tensors: Sequence[torch.Tensor]) -> BoundList:
        """Move the fused tensors of ``tensors`` into memory of their own, so later calls copy nothing.

        The cheapest copy is the one not made. Each tensor under the threshold is re-pointed
        (``tensor.set_``) at its slot of a buffer kept for this list: values and Python objects
        stay the same, but from now on the tensors *are* the buffer, and an all-reduce of the
        same list reads and writes them in place -- no copy-in, no copy-back. (DDP's
        ``gradient_as_bucket_view`` and Megatron's contiguous gradient buffer do the same.)

        Returns the tensors as a :class:`BoundList`: ``all_reduce`` of that very object is
        recognised in O(1). Calls with another list of exactly these tensor objects, still
        where ``bind`` put them, take the same path after a check of every tensor; any other
        list (or a tensor re-pointed since) is copied as usual. Do not ``resize_``
        a bound tensor. The tensors must be contiguous and own their memory (not views),
        and ``compress_fp16`` cannot be on (a float32 tensor cannot live in a float16 buffer).
        The reducer holds the buffers, not the tensors: a bound tensor that is freed leaves
        its slot unused.
        """
        if self._inflight:
            self.wait()
        tensors = list(tensors)
        if self.compress_fp16:
            raise ValueError("bind: not with compress_fp16 (float32 tensors cannot live in float16 buffers)")
        shapes = tuple(map(torch.Tensor.size, tensors))
        prep = self._plan(tensors, shapes, tuple(t.dtype for t in tensors), tuple(t.device for t in tensors))
        arenas = move_into_arenas(prep.layout.buckets, tensors, self.device)
        self._bound = KnownList.of(tensors, prep, hold=True)
        self._bound.arenas = arenas
        self._bound.handle = BoundList(tensors)
        self._bound.listed = tensors               # the list _issue indexes, made once
        return self._bound.handle

    def bind_grads(self, parameters: Iterable[torch.Tensor]) -> BoundList:
        """Keep the gradients of ``parameters`` in the reducer's buffers, step after step.

        A standard training loop frees its gradients every step (``optimizer.zero_grad()``
        sets them to None) and autograd makes new ones, in new memory: not a list seen
        before. This gives each parameter a gradient bound into the buffers (:meth:`bind`)
        and registers a hook that runs when autograd has accumulated a gradient: when the
        parameter's ``.grad`` is a new tensor, its values are copied into the bound one and
        ``.grad`` points at it again -- SINGA's copy as autograd yields a gradient, and
        DDP's ``gradient_as_bucket_view``. Then ``all_reduce([p.grad for p in parameters])``
        is the bound list on every step: recognised, reduced in place, nothing copied, and
        the gradient autograd made is freed at once. Returns the bound gradients.

        Parameters that do not require a gradient are left out. As with DDP without
        ``find_unused_parameters``, each bound parameter must get a gradient every step:
        after ``zero_grad()`` one that backward did not reach has ``.grad`` None, which
        ``all_reduce`` refuses. Returns the bound gradients as a :class:`BoundList`: pass
        it to ``all_reduce`` every step and the list is recognised in O(1).
        """
        params = [p for p in parameters if p.requires_grad]
        grads = []
        for p in params:
            grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if p.grad is not None:
                grad.copy_(p.grad)
            grads.append(grad)
        bound = self.bind(grads)
        for p, grad in zip(params, grads):
            p.grad = grad
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(
                functools.partial(_keep_grad_in, grad)))
        return bound


def _keep_grad_in(bound: torch.Tensor, param: torch.Tensor) -> None:
    """After autograd accumulated ``param``'s gradient: make sure it lives in ``bound``."""
    if param.grad is not bound:
        with torch.no_grad():
            bound.copy_(param.grad)
        param.grad = bound


# ---------------------------------------------------------------------------------------
# One call: the multi-tensor contract.

_reducers: dict[tuple, FastFusedAllReducer] = {}


def fused_all_reduce(tensors: Sequence[torch.Tensor], op=ReduceOp.SUM, group=None,
                     threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                     buffer_bytes: int = DEFAULT_BUFFER_BYTES, compress_fp16: bool = False) -> None:
    """All-reduce each tensor of ``tensors`` in place, as ``dist.all_reduce`` would, fused.

    A reducer (its buffers and planned layouts) is kept per device and settings, so a
    training loop calling this each step allocates nothing after the first; it is the
    fast one, so a list passed again is recognised.
    """
    tensors = list(tensors)
    if not tensors:
        return
    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"fused_all_reduce: expected tensors, got {type(first).__name__}")
    if not ops.is_member(group):
        return                              # outside the group: nothing to do, as dist.all_reduce
    key = (first.device, op, group, threshold_bytes, buffer_bytes, compress_fp16)
    reducer = _reducers.get(key)
    if reducer is None:
        if len(_reducers) >= _CACHE_LIMIT:
            _reducers.pop(next(iter(_reducers)))
        reducer = _reducers[key] = FastFusedAllReducer(threshold_bytes, buffer_bytes, first.device,
                                                       op, group, compress_fp16)
    reducer.all_reduce(tensors)
    reducer.wait()
