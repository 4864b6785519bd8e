"""One slice through the five stages, after Fairring's ``allReduceOneSlice``.

A slice of n elements is viewed as a D × M × n/(D·M) block, ``slice3d[d, m, :]``. The
local rank d of machine m owns block [d, m] at the end of stage 3; the stages move blocks
so that every rank ends with all of them::

    start          after 1 (reduce-scatter   after 2 (collect on       after 3 (add)
                   inside the machine)       the rail, all-to-all)
    rank (d, m)    rank (d, m) holds         rank (d, m) holds         rank (d, m) holds
    holds its own  [d, :, :] summed over     in its staging rows       [d, m, :] summed over
    [:, :, :]      machine m's D ranks       [d, m, :] of every        every rank
                                             machine's partial sum
    then 4 (diffuse: all-gather on the rail -> [d, :, :] final) and
         5 (all-gather inside the machine  -> [:, :, :] final, everywhere).

    per rank, n elements:   inside the machine 2(D − 1)/D · n     (stages 1 and 5)
                            across machines    2(M − 1)/M · n/D   (stages 2 and 4)

Three buffers beside the slice, the first two Fairring's:

* **staging** -- the collect stage receives M rows ([d, m, :] from each machine) before
  adding them. With D > 1 it needs no memory: after the reduce-scatter, rank d no longer
  needs block [(d + 1) mod D] (its partial sum belongs to rank d + 1 now), and the
  all-gather will overwrite it. With D = 1 every block is needed, so a slot of a
  bounded pool is borrowed.
* **padding** -- when D·M does not divide n, the first ⌊n/(D·M)⌋·D·M elements are viewed
  as the block and the tail (fewer than D·M elements) is copied into a padding slot of
  D·M elements that travels the same five stages beside it, one element per block.
  What sits in the rest of the slot does not matter: it is reduced and thrown away.
* **partials** -- the reduce-scatter's incoming partial sums of block [d] (D − 1 of them)
  land in a slot: not in the slice, whose other blocks are leaving at the same time.
  Fairring's ``ncclReduceScatter`` keeps that buffer inside NCCL.

On gloo the collect and the diffuse are a few messages on the stage's own group, every
receive posted before any send (:func:`collectives.core.ops.post_exchange`). Every stage
goes one of two ways (``inside=``), each where it is the faster:

* ``"collectives"`` (on NCCL, the default there): NCCL's own reduce-scatter and
  all-gather, *in place* -- block [d] is where NCCL's in-place reduce-scatter puts rank
  d's part of [D, M, −1], so the slice is both input and output and no partials slot is
  needed. This is what Fairring calls (``ncclReduceScatter``/``ncclAllGather``): NCCL's
  kernels reduce as the data streams in, which a batch of point-to-point messages and a
  separate add cannot match on a GPU. The collect is then one ``all_to_all_single`` on the
  rail and the diffuse one in-place ``all_gather_into_tensor`` there: one call each, where a
  batch of 2(M − 1) messages costs the host far more (the same bytes).
* ``"messages"`` (on gloo, the default there): D − 1 messages each way, receives first.
  gloo's ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` moved the same bytes
  4× slower over loopback (171 and 140 ms against 40 and 33 ms for 64 MiB; the engineering
  notes of lesson 7 have the runs): gloo builds them from generic steps and copies.

A stage function posts its operations and returns the handles: the pipeline
(:mod:`.pipeline`) decides when to wait.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..core import nccl_memory, ops, streams, trace
from .layout import StageGroups

_NO_LABEL = contextlib.nullcontext()
NUM_SLOTS = 2   # staging and padding slots in each pool: slices in flight may outnumber them


class SlotPool:
    """A few reusable buffers, each with an event saying when its last user is done.

    ``acquire(numel, stream)`` hands out slot i mod size; the stream that will write it
    first waits for the slot's event, so a slice never overwrites a slot that an earlier
    slice is still reading on another stream. ``release(slot, stream)`` records the event.
    On CPU the events are no-ops: there the pipeline has waited for the last user already.
    """

    def __init__(self, size: int = NUM_SLOTS):
        self.size = size
        self.buffers: list[torch.Tensor | None] = [None] * size
        self.events = [None] * size
        self.next = 0

    def acquire(self, numel: int, dtype: torch.dtype, device, stream) -> tuple[int, torch.Tensor]:
        slot = self.next % self.size
        self.next += 1
        if self.events[slot] is not None:
            stream.wait_event(self.events[slot])
        need = numel * dtype.itemsize
        buf = self.buffers[slot]
        if buf is None or buf.numel() < need or buf.device != torch.device(device):
            if self.events[slot] is not None:
                self.events[slot].synchronize()      # the old buffer may still be in use
            buf = nccl_memory.temporary(max(need, 64), torch.uint8, device)
            self.buffers[slot] = buf
        return slot, buf[:need].view(dtype)

    def restart(self, stream) -> None:
        """Record every slot's event again on ``stream``: where a CUDA graph begins (a graph
        may wait only on events recorded inside it, and the last ones were recorded before)."""
        for event in self.events:
            if event is not None:
                event.record(stream)

    def release(self, slot: int, stream, device) -> None:
        if self.events[slot] is None:
            self.events[slot] = streams.new_event(device)
        self.events[slot].record(stream)


class Slice:
    """One slice of the flat tensor on its way through the five stages, on one rank."""

    def __init__(self, flat: torch.Tensor, groups: StageGroups, op, group_size: int, pools,
                 stage_streams, index: int = 0, inside: str = "messages", labels: bool = True):
        D, M = groups.layout.D, groups.layout.M
        self.flat, self.groups, self.op, self.p = flat, groups, op, group_size
        self.d, self.m, self.D, self.M = groups.d, groups.m, D, M
        self.index, self.streams, self.pools = index, stage_streams, pools
        self.collectives_inside = inside == "collectives"
        self.labels = labels            # trace labels (off where stages run on threads of their own)
        self.partials_slot = None
        device = flat.device
        main = flat.numel() // (D * M) * (D * M)
        self.block = flat[:main].view(D, M, -1)            # slice3d[d, m, :]
        self.tail = flat[main:]
        self.padding = self.pad_slot = None
        if self.tail.numel():
            self.pad_slot, pad = pools["padding"].acquire(D * M, flat.dtype, device, stage_streams[0])
            self.padding = pad.view(D, M, 1)                 # one element per block
        self.staging = self.pad_staging = self.staging_slot = None
        if M > 1:
            if D > 1:   # Fairring's trick: block [(d + 1) mod D] is free after the reduce-scatter
                self.staging = self.block[(self.d + 1) % D]
                if self.padding is not None:
                    self.pad_staging = self.padding[(self.d + 1) % D]
            else:       # D = 1: every block is ours to keep; borrow a slot
                k = self.block.shape[2]
                self.staging_slot, buf = pools["staging"].acquire(M * (k + 1), flat.dtype, device,
                                                                  stage_streams[1])
                self.staging = buf[:M * k].view(M, k)
                self.pad_staging = buf[M * k:].view(M, 1)

    def parts(self):
        """(block, staging) for the main part and for the padding, skipping empty ones."""
        parts = []
        if self.block.numel():
            parts.append((self.block, self.staging))
        if self.padding is not None:
            parts.append((self.padding, self.pad_staging))
        return parts

    def _label(self, stage: str):
        return trace.label(f"slice {self.index}: {stage}") if self.labels else _NO_LABEL

    # ---- stage 1: reduce-scatter inside the machine (as messages) --------------------------
    def reduce_scatter(self) -> list:
        if self.padding is not None:        # the tail goes into the padding slot first
            self.padding.view(-1)[: self.tail.numel()].copy_(self.tail)
        if self.D == 1:
            return []
        if self.collectives_inside:      # NCCL's in-place reduce-scatter: block [d] is rank d's part
            base = ops.ReduceOp.SUM if self.op == ops.ReduceOp.AVG else self.op
            with self._label("reduce-scatter"):
                return [dist.reduce_scatter_tensor(blocks[self.d].view(-1), blocks.view(-1), op=base,
                                                   group=self.groups.reduce_scatter, async_op=True)
                        for blocks, _ in self.parts()]
        inside, d = self.groups.inside_ranks(), self.d
        others = [j for j in range(self.D) if j != d]
        # What the D − 1 other local ranks send for block [d] lands in a slot of the pool: it
        # cannot land in the slice, whose other blocks are leaving at the same time.
        sizes = [blocks[d].numel() for blocks, _ in self.parts()]
        self.partials_slot, buf = self.pools["partials"].acquire((self.D - 1) * sum(sizes), self.flat.dtype,
                                                                 self.flat.device, self.streams[0])
        self.partials, works, at = [], [], 0
        with self._label("reduce-scatter"):
            for (blocks, _), size in zip(self.parts(), sizes):   # block [j, :, :] goes to local rank j
                incoming = buf[at:at + (self.D - 1) * size].view(self.D - 1, *blocks[d].shape)
                at += incoming.numel()
                self.partials.append(incoming)
                works += ops.post_exchange(recvs=[(incoming[i], inside[j]) for i, j in enumerate(others)],
                                           sends=[(blocks[j], inside[j]) for j in others],
                                           group=self.groups.reduce_scatter)
        return works

    def sum_partials(self) -> None:
        """The end of stage 1, once its messages are in: add the other local ranks' partial
        sums of block [d] into this rank's own. Now [d, :, :] is machine m's sum."""
        if self.D == 1 or self.partials_slot is None:     # one rank inside, or NCCL summed them
            return
        for (blocks, _), incoming in zip(self.parts(), self.partials):
            for row in incoming:
                ops.combine_(blocks[self.d], row, self.op)
        self.pools["partials"].release(self.partials_slot, self.streams[1], self.flat.device)
        self.partials, self.partials_slot = [], None

    # ---- stage 2: collect on the rail (all-to-all, as messages) ---------------------------
    def collect(self) -> list:
        self.sum_partials()
        if self.M == 1:
            return []
        rail, d, m = self.groups.rail_ranks(), self.d, self.m
        others = [j for j in range(self.M) if j != m]
        works = []
        if self.collectives_inside:      # one all-to-all on the rail: row j of [d, :, :] to machine j
            with self._label("collect"):
                return [dist.all_to_all_single(staging.view(-1), blocks[d].view(-1), group=self.groups.collect,
                                               async_op=True) for blocks, staging in self.parts()]
        with self._label("collect"):
            for blocks, staging in self.parts():   # row j of [d, :, :] goes to machine j
                works += ops.post_exchange(recvs=[(staging[j], rail[j]) for j in others],
                                           sends=[(blocks[d, j], rail[j]) for j in others],
                                           group=self.groups.collect)
        return works

    # ---- stage 3: add the rows that arrived into the block this rank owns ------------------
    def add(self) -> None:
        for blocks, staging in self.parts():
            mine = blocks[self.d, self.m]            # this machine's partial sum, already in place
            for row in range(self.M):
                if row != self.m:
                    ops.combine_(mine, staging[row], self.op)
            ops.finish_(mine, self.op, self.p)       # AVG: the one division, on n/(D·M) elements
        if self.staging_slot is not None:
            self.pools["staging"].release(self.staging_slot, self.streams[2], self.flat.device)

    # ---- stage 4: diffuse on the rail (all-gather, as messages) ---------------------------
    def diffuse(self) -> list:
        if self.M == 1:
            return []
        rail, d, m = self.groups.rail_ranks(), self.d, self.m
        others = [j for j in range(self.M) if j != m]
        works = []
        if self.collectives_inside:      # one in-place all-gather on the rail: [d, m, :] -> [d, :, :]
            with self._label("diffuse"):
                return [dist.all_gather_into_tensor(blocks[d].view(-1), blocks[d, m].view(-1),
                                                    group=self.groups.diffuse, async_op=True)
                        for blocks, _ in self.parts()]
        with self._label("diffuse"):
            for blocks, _ in self.parts():   # [d, m, :] to every machine; [d, j, :] from each
                works += ops.post_exchange(recvs=[(blocks[d, j], rail[j]) for j in others],
                                           sends=[(blocks[d, m], rail[j]) for j in others],
                                           group=self.groups.diffuse)
        return works

    # ---- stage 5: all-gather inside the machine (as messages) -----------------------------
    def all_gather(self) -> list:
        if self.D == 1:
            return []
        if self.collectives_inside:      # NCCL's in-place all-gather: [d] -> [:, :, :]
            with self._label("all-gather"):
                return [dist.all_gather_into_tensor(blocks.view(-1), blocks[self.d].view(-1),
                                                    group=self.groups.all_gather, async_op=True)
                        for blocks, _ in self.parts()]
        inside, d = self.groups.inside_ranks(), self.d
        others = [j for j in range(self.D) if j != d]
        works = []
        with self._label("all-gather"):
            for blocks, _ in self.parts():   # [d, :, :] to every local rank; [j, :, :] from each
                works += ops.post_exchange(recvs=[(blocks[j], inside[j]) for j in others],
                                           sends=[(blocks[d], inside[j]) for j in others],
                                           group=self.groups.all_gather)
        return works

    # ---- after the last stage: the tail comes back from the padding slot ------------------
    def finish(self) -> None:
        if self.padding is not None:
            self.tail.copy_(self.padding.view(-1)[: self.tail.numel()])
            self.pools["padding"].release(self.pad_slot, self.streams[4], self.flat.device)
