"""Lesson 5, part 3: the mechanics of the fast path -- what a training loop's second call need not do again.

A training loop hands the fused all-reducer the same tensors every step. On a GPU that
matters more than the bytes: for 1000 small tensors, planning the list, a ``torch.cat`` and
a ``_foreach_copy_`` each cost the host about as long as the flat all-reduce of the same
bytes takes (``tools/gpu_fused_profile.py`` times each piece). The work is per tensor, on
the host; the GPU moves the bytes in microseconds. Ways to stop paying it every step, used
by :class:`collectives.fused.fast.FastFusedAllReducer`:

* :class:`KnownList` -- recognise a list seen before (same tensor objects, same memory)
  in two C-level passes, and reuse its plan;
* :class:`StepGraphs` -- record everything one call of that list issues (copy-in on one
  stream, the all-reduces on another, copy-back on a third, and the events between them)
  once as a CUDA graph, and replay it: one launch per step, whatever the number of
  tensors. NCCL collectives can be captured like any kernel (Megatron-LM and vLLM run
  theirs that way); the streams and events become the graph's edges, so the order SINGA's
  three streams give is kept;
* :class:`HostRows` -- on a CPU, where copying 1000 small tensors costs per tensor, not
  per byte: read the tensors' memory as rows of one array and copy each row length in one
  gather (in) and one scatter (back), at ``memcpy`` speed rather than a call per tensor;
* :func:`move_into_arenas` -- make the copies unnecessary: the tensors are re-pointed into
  the fused buffer itself (``FastFusedAllReducer.bind``), as DDP's ``gradient_as_bucket_view``
  and Megatron-LM's contiguous gradient buffer do.
"""

from __future__ import annotations

import bisect
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .layout import Bucket, slot_views


class KnownList:
    """A list of tensors recognised in O(1) Python calls, with what was made for it.

    A list seen in passing (the last one a training loop handed over) is held by weak
    reference: a loop's old gradients are freed when the loop drops them, and a list with a
    freed tensor matches nothing again. A bound list (``hold=True``: tensors that live in
    the reducer's own buffers) is held as it is -- holding it costs no memory -- which makes
    its identity pass the cheapest there is.
    """

    def __init__(self, tensors: list[torch.Tensor], plan, hold: bool = False):
        self.plan = plan                # the reducer's prepared plan for this list
        self.graph: Any = None          # its recorded step (a CUDA graph), once there is one
        self.host_rows: dict = {}       # CPU: bucket -> HostRows.of(), or None
        self.arenas: list | None = None  # bound lists: per bucket, the memory its tensors live in
        self.handle: tuple | None = None  # bound lists: the object bind() returned (recognised by identity)
        self.listed: list | None = None   # bound lists: the tensors as the list a call indexes
        self.data_ptrs = list(map(torch.Tensor.data_ptr, tensors))
        self._held = list(tensors) if hold else None
        alive = self._alive = [True]    # cleared when any tensor of a weakly held list is freed

        def freed(_ref, alive=alive):
            alive[0] = False
        self._refs = None if hold else [weakref.ref(t, freed) for t in tensors]
        self.ids = list(map(id, tensors))

    @classmethod
    def of(cls, tensors: list[torch.Tensor], plan, hold: bool = False) -> "KnownList":
        return cls(tensors, plan, hold)

    @property
    def tensors(self) -> list[torch.Tensor | None]:
        """The tensors, where still alive (None for a freed one)."""
        return list(self._held) if self._held is not None else [ref() for ref in self._refs]

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        """The same tensor objects, in the same order, still in the same memory.

        Same objects: held, by identity (``is``, one C-level pass); held weakly, every tensor
        of the list is still alive and the ids are the same (two live objects never share an
        id). A tensor given new memory (``t.data = ...``, ``set_``) no longer matches; one
        reshaped in place (``resize_``) to the same address would, so the reducer asks
        callers not to. Both passes are one C call per tensor: for 1000 tensors tens of
        microseconds of host time per call, which the bound list's handle
        (:class:`~collectives.fused.fast.BoundList`) does without.
        """
        if len(tensors) != len(self.ids):
            return False
        if self._held is not None:
            same = all(map(operator.is_, tensors, self._held))
        else:
            same = self._alive[0] and list(map(id, tensors)) == self.ids
        return same and list(map(torch.Tensor.data_ptr, tensors)) == self.data_ptrs


class StepGraphs:
    """Record what a function issues on the GPU as one CUDA graph, for a known list to replay.

    A recorded graph keeps the addresses it was recorded with, which is why it belongs to
    a :class:`KnownList`: the same tensors in the same memory, checked on every call.
    Recording runs nothing: the caller replays the graph to do the work.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = None         # the side stream graphs are recorded on

    def record(self, issue: Callable[[], object]) -> "torch.cuda.CUDAGraph":
        """Capture every kernel, copy, collective and cross-stream event ``issue()`` makes.

        Streams forked inside ``issue`` (waiting on the recording stream) must join it again
        before it returns: a graph has one beginning and one end.
        """
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(stream)
        with torch.cuda.stream(self._stream):
            # thread_local: NCCL's watchdog thread may query its events meanwhile; that is fine
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                issue()
            finally:
                graph.capture_end()
        stream.wait_stream(self._stream)
        return graph


class HostRows:
    """On a CPU, a bucket's copies -- tensors into the buffer, and back -- as a few row copies.

    Copying 1000 tensors of 4000 bytes one by one costs about 0.5 ms of host time either way
    (``torch.cat`` in, a loop of NumPy ``a[...] = b`` back), where one ``memcpy`` of the same
    4 MB takes 0.13 ms: the cost is per tensor, not per byte. The tensors of a known list stay
    where they are, so their memory can be read as *rows* of one array: for each row length
    ``L``, a view of the address range the tensors lie in whose row ``i`` starts at byte ``i``
    (``as_strided``, stride 1 both ways, nothing allocated or touched). Then one
    ``torch.index_select`` gathers every tensor of that length into the buffer, and one NumPy
    fancy assignment ``window[offsets] = rows`` scatters them back: a C loop each, near
    ``memcpy`` speed (0.18 and 0.20 ms for the 1000 tensors).

    Only the tensors' own bytes are read or written; the view merely spans the rest. That is
    why it is kept with a :class:`KnownList`, which checks each call that every tensor is
    still the same object in the same memory. Tensors whose slots in the buffer are not
    consecutive (a list of mixed sizes) go through ``scratch`` in two steps. Built by
    :meth:`of`, which returns None when a copy would need more than moving bytes (a cast, a
    strided view, a conjugate or negative view).
    """

    def __init__(self, parts: list["_RowPart"]):
        self._parts = parts

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], region: torch.Tensor,
           slots: Sequence[torch.Tensor]) -> "HostRows | None":
        """Row copies between ``tensors`` and their ``slots``, views of ``region`` (a contiguous
        CPU tensor), or None when some tensor cannot be copied as plain bytes."""
        if region.device.type != "cpu" or not region.is_contiguous():
            return None
        base = region.data_ptr()
        groups: dict[int, list[tuple[int, int]]] = {}    # row bytes -> [(address, slot offset)]
        for t, slot in zip(tensors, slots):
            if (t.device.type != "cpu" or t.dtype != region.dtype or not t.is_contiguous()
                    or t.is_conj() or t.is_neg()):
                return None
            if t.nbytes:
                groups.setdefault(t.nbytes, []).append((t.data_ptr(), slot.data_ptr() - base))
        region_bytes = region.view(torch.uint8)
        pieces = [(row, m) for row, g in groups.items() for m in _clusters(g, row)]
        scattered = [len(m) * row for row, m in pieces if not _consecutive(m, row)]
        scratch = torch.empty(max(scattered), dtype=torch.uint8) if scattered else None
        parts = []
        for row, members in pieces:
            addresses = np.array([a for a, _ in members], dtype=np.int64)
            lo = int(addresses.min())
            tensors_t, tensors_np = _rows_at(lo, int(addresses.max()) - lo + 1, row)
            part = _RowPart(tensors_t, tensors_np, torch.from_numpy(addresses - lo), addresses - lo)
            n = len(members)
            if _consecutive(members, row):   # slots one after another: the region's bytes are the rows
                first = members[0][1]
                part.rows = region_bytes[first: first + n * row].view(n, row)
            else:                            # slots apart: the rows go through scratch
                part.rows = scratch[: n * row].view(n, row)
                part.slot_offsets = np.array([s for _, s in members], dtype=np.int64)
                part.slot_offsets_t = torch.from_numpy(part.slot_offsets)
                part.slots_t, part.slots_np = _rows_at(base, region.nbytes - row + 1, row)
            part.rows_np = part.rows.numpy()
            parts.append(part)
        return cls(parts)

    def gather(self) -> None:
        """Copy the tensors into their slots: one gather per row length (two via scratch)."""
        for p in self._parts:
            torch.index_select(p.tensors_t, 0, p.offsets_t, out=p.rows)
            if p.slot_offsets is not None:
                p.slots_np[p.slot_offsets] = p.rows_np

    def scatter(self) -> None:
        """Copy the slots back into their tensors: one scatter per row length (two via scratch)."""
        for p in self._parts:
            if p.slot_offsets is not None:
                torch.index_select(p.slots_t, 0, p.slot_offsets_t, out=p.rows)
            p.tensors_np[p.offsets_np] = p.rows_np


@dataclass
class _RowPart:
    """The tensors of one row length, and where their bytes go in the buffer."""

    tensors_t: torch.Tensor            # rows starting at every byte of the tensors' range
    tensors_np: np.ndarray             # the same rows, for NumPy's scatter
    offsets_t: torch.Tensor            # each tensor's row in those
    offsets_np: np.ndarray
    rows: torch.Tensor | None = None   # (tensors, row bytes): the slots themselves, or scratch
    rows_np: np.ndarray | None = None
    slot_offsets: np.ndarray | None = None   # via scratch: each slot's byte offset in the region
    slot_offsets_t: torch.Tensor | None = None
    slots_t: torch.Tensor | None = None      # and the region as rows starting at every byte
    slots_np: np.ndarray | None = None


_SPAN_LIMIT = 1 << 60     # a rows view of ``count × row`` bytes must stay countable


def _clusters(members: list[tuple[int, int]], row: int) -> list[list[tuple[int, int]]]:
    """``members`` split by address so that each one's rows view stays under _SPAN_LIMIT bytes
    (small tensors on the heap and large ones mapped elsewhere can be terabytes apart).
    Each keeps the list's order; almost always there is just one."""
    cuts, lo = [], None
    for address in sorted(a for a, _ in members):
        if lo is None or (address - lo + 1) * row > _SPAN_LIMIT:
            cuts.append(address)
            lo = address
    if len(cuts) == 1:
        return [members]
    found = [[] for _ in cuts]
    for m in members:
        found[bisect.bisect_right(cuts, m[0]) - 1].append(m)
    return found


def _consecutive(members: list[tuple[int, int]], row: int) -> bool:
    """Whether the slots follow one another in the buffer, in the list's order."""
    first = members[0][1]
    return all(s == first + i * row for i, (_, s) in enumerate(members))


def _rows_at(lo: int, count: int, row: int) -> tuple[torch.Tensor, np.ndarray]:
    """``count`` rows of ``row`` bytes, row ``i`` starting at address ``lo + i``, as a torch
    tensor and a NumPy array. Nothing is allocated, read or written: they only span memory."""
    span = np.asarray(_Memory(lo, count - 1 + row))
    rows_np = np.lib.stride_tricks.as_strided(span, (count, row), (1, 1), writeable=True)
    return torch.from_numpy(span).as_strided((count, row), (1, 1)), rows_np


class _Memory:
    """``nbytes`` bytes at ``address``, as NumPy sees an array (its array interface)."""

    def __init__(self, address: int, nbytes: int):
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}


def move_into_arenas(buckets: Sequence[Bucket], tensors: Sequence[torch.Tensor],
                     device: torch.device) -> list[torch.Tensor]:
    """Re-point each bucket's tensors at their slots of one new buffer per bucket; return the buffers.

    Values and Python objects stay the same (``tensor.set_``); from now on an all-reduce of a
    buffer reads and writes the tensors in place. The tensors must own their memory and be
    contiguous: a view's base would keep the old memory, and its other views would not follow.
    """
    arenas = []
    for bucket in buckets:
        members = [tensors[i] for i in bucket.indices]
        for i, t in zip(bucket.indices, members):
            if not t.is_contiguous() or t._base is not None:
                raise ValueError(f"bind: tensor {i} is a view or not contiguous; bind needs "
                                 "tensors that own their memory")
        arena = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        slots = slot_views(arena, [t.shape for t in members])
        torch._foreach_copy_(slots, members)
        with torch.no_grad():
            for t, slot in zip(members, slots):
                t.set_(arena.untyped_storage(), slot.storage_offset(), slot.size(), slot.stride())
        arenas.append(arena)
    return arenas
