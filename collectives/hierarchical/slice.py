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

Two buffers beside the slice, both Fairring's:

* **staging** -- the collect stage receives M rows ([d, m, :] from each machine) before
  adding them. With D > 1 it needs no memory: after the reduce-scatter, rank d no longer
  needs block [(d + 1) mod D] (its partial sum belongs to rank d + 1 now), and the
  all-gather will overwrite it. With D = 1 every block is needed, so a slot of a
  bounded pool is borrowed.
* **padding** -- when D·M does not divide n, the first ⌊n/(D·M)⌋·D·M elements are viewed
  as the block and the tail (fewer than D·M elements) is copied into a padding slot of
  D·M elements that travels the same five stages beside it, one element per block.
  What sits in the rest of the slot does not matter: it is reduced and thrown away.

Each stage function issues its operation(s) with ``async_op=True`` on the stage's own
group and returns the handles: the pipeline (:mod:`.pipeline`) decides when to wait.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..core import ops, streams, trace
from ..core.ops import ReduceOp

from .layout import StageGroups

# torch 2.13 renames these two (reduce_scatter_single, all_gather_single); the old names
# are the ones every torch the course supports has, and the ones the trace records.
warnings.filterwarnings("ignore", message=r".*`torch\.distributed\.(reduce_scatter_tensor|"
                        r"all_gather_into_tensor)` is deprecated", category=FutureWarning)

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
        need = numel * torch.empty((), dtype=dtype).element_size()
        buf = self.buffers[slot]
        if buf is None or buf.numel() < need or buf.device != torch.device(device):
            if self.events[slot] is not None:
                self.events[slot].synchronize()      # the old buffer may still be in use
            buf = torch.zeros(max(need, 64), dtype=torch.uint8, device=device)
            self.buffers[slot] = buf
        return slot, buf[:need].view(dtype)

    def release(self, slot: int, stream, device) -> None:
        if self.events[slot] is None:
            self.events[slot] = streams.new_event(device)
        self.events[slot].record(stream)


class Slice:
    """One slice of the flat tensor on its way through the five stages, on one rank."""

    def __init__(self, flat: torch.Tensor, groups: StageGroups, op, group_size: int, pools,
                 stage_streams, index: int = 0):
        D, M = groups.layout.D, groups.layout.M
        self.flat, self.groups, self.op, self.p = flat, groups, op, group_size
        self.d, self.m, self.D, self.M = groups.d, groups.m, D, M
        self.index, self.streams, self.pools = index, stage_streams, pools
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

    def _parts(self):
        """(block, staging) for the main part and for the padding, skipping empty ones."""
        parts = []
        if self.block.numel():
            parts.append((self.block, self.staging))
        if self.padding is not None:
            parts.append((self.padding, self.pad_staging))
        return parts

    def _label(self, stage: str):
        return trace.label(f"slice {self.index}: {stage}")

    # ---- stage 1: reduce-scatter inside the machine --------------------------------------
    def reduce_scatter(self) -> list:
        if self.padding is not None:        # the tail goes into the padding slot first
            self.padding.view(-1)[: self.tail.numel()].copy_(self.tail)
        if self.D == 1:
            return []
        op = ReduceOp.SUM if self.op == ReduceOp.AVG else self.op
        works = []
        with self._label("reduce-scatter"):
            for blocks, _ in self._parts():   # rank d keeps [d, :, :], summed over the machine
                works.append(dist.reduce_scatter_tensor(blocks[self.d].view(-1), blocks.view(-1), op=op,
                                                        group=self.groups.reduce_scatter, async_op=True))
        return works

    # ---- stage 2: collect on the rail (all-to-all) -----------------------------------------
    def collect(self) -> list:
        if self.M == 1:
            return []
        works = []
        with self._label("collect"):
            for blocks, staging in self._parts():   # row m of [d, :, :] goes to machine m
                works.append(dist.all_to_all_single(staging.view(-1), blocks[self.d].reshape(-1),
                                                    group=self.groups.collect, async_op=True))
        return works

    # ---- stage 3: add the M rows into the block this rank owns -----------------------------
    def add(self) -> None:
        for blocks, staging in self._parts():
            mine = blocks[self.d, self.m]
            if self.M > 1:
                mine.copy_(staging[0])
                for row in range(1, self.M):
                    ops.combine_(mine, staging[row], self.op)
            ops.finish_(mine, self.op, self.p)       # AVG: the one division, on n/(D·M) elements
        if self.staging_slot is not None:
            self.pools["staging"].release(self.staging_slot, self.streams[2], self.flat.device)

    # ---- stage 4: diffuse on the rail (all-gather) -----------------------------------------
    def diffuse(self) -> list:
        if self.M == 1:
            return []
        works = []
        with self._label("diffuse"):
            for blocks, _ in self._parts():   # [d, m, :] from every machine -> [d, :, :]
                works.append(dist.all_gather_into_tensor(blocks[self.d].view(-1), blocks[self.d, self.m],
                                                         group=self.groups.diffuse, async_op=True))
        return works

    # ---- stage 5: all-gather inside the machine --------------------------------------------
    def all_gather(self) -> list:
        if self.D == 1:
            return []
        works = []
        with self._label("all-gather"):
            for blocks, _ in self._parts():   # [d, :, :] from every local rank -> [:, :, :]
                works.append(dist.all_gather_into_tensor(blocks.view(-1), blocks[self.d].view(-1),
                                                         group=self.groups.all_gather, async_op=True))
        return works

    # ---- after the last stage: the tail comes back from the padding slot ------------------
    def finish(self) -> None:
        if self.padding is not None:
            self.tail.copy_(self.padding.view(-1)[: self.tail.numel()])
            self.pools["padding"].release(self.pad_slot, self.streams[4], self.flat.device)
