"""One memory segment that every rank of a group maps: the stage of lesson 12.

Ranks on one machine can share memory. A file in ``/dev/shm`` (RAM, never a disk) mapped
by every rank with ``torch.from_file(path, shared=True)`` is the same physical pages in
each process: what rank 1 writes there, rank 3 reads a moment later, with no message in
between. That is the CPU twin of a GPU's symmetric memory, where each GPU's buffer is
mapped into its peers' address space over NVLink.

The segment, for a group of p ranks and slots of ``capacity`` bytes::

    | flag 0 | flag 1 | ... | flag p-1 |     one 64-byte line each (no false sharing)
    | buffer 0: slot 0 | slot 1 | ... | slot p-1 |
    | buffer 1: slot 0 | slot 1 | ... | slot p-1 |
    | homes:    home 0 | home 1 | ... | home p-1 |     (only with home=True)

Rank r writes only its own flag and, in a call, its own slot; it reads everyone's.
Two buffers, used in turn by successive calls, are the guard against the first hazard of
the lesson (a slot overwritten while a slow peer still reads it); the flags hold epochs,
the guard against the second (a flag reset before a slow peer saw it set). Both guards
can be switched off, for the tests and the lab that show what goes wrong without them.

A home is a tensor that lives in the segment from the start (:meth:`SharedWorkspace.home`),
as torch's ``symm_mem.empty`` hands out GPU memory its peers can map: an all-reduce of it
has no input to copy in. The price is a third guard: the call must not return while a peer
may still read it, since the caller will write its next input there (``closing``).

Setting the segment up is the only part with messages: group rank 0 creates the file
and broadcasts its name, every rank maps it, a gloo barrier, and rank 0 unlinks the
name (the pages live on while mapped; nothing is left in ``/dev/shm`` however the world
ends). Every all-reduce after that moves its data through the mapping alone.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable

import torch
import torch.distributed as dist

from ..core import ops, trace

__all__ = ["SharedWorkspace", "BarrierTimeout", "workspace", "FLAG_LINE", "DEFAULT_CAPACITY", "HOME"]

HOME = 2                          # the row of homes, after buffers 0 and 1 (slot(HOME, r, ...))
FLAG_LINE = 64                    # bytes per flag: one cache line, written by one rank only
DEFAULT_CAPACITY = 1 << 16        # the smallest slot the cache makes (64 KiB)
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()   # Linux: memory, never a disk


class BarrierTimeout(TimeoutError):
    """A rank waited too long at a shared-memory barrier; the message names it and its peers."""


class SharedWorkspace:
    """Two buffers of p slots and p epoch flags in one segment every rank of ``group`` maps.

    Collective: every rank of the group constructs it with the same arguments.

    Args:
        group: the ranks that share the segment (``None``: the world). They must be on one
            machine: a mapping of ``/dev/shm`` does not cross to another host.
        capacity: bytes per slot, the largest tensor an all-reduce on it may take.
        epochs: the flags hold a count that only grows (the guard); ``False``: a flag is
            set to 1 on arrival and reset to 0 on the way out (the hazard).
        two_buffers: successive calls use the two buffers in turn (the guard); ``False``:
            every call uses buffer 0 (the hazard).
        timeout: seconds a rank waits at a barrier before :class:`BarrierTimeout`.
        home: also give every rank a home of ``capacity`` bytes (:meth:`home`).
        closing: an all-reduce of a home ends with a barrier, so that no peer still reads it
            when the caller writes there again (the guard); ``False``: it does not (the hazard).
    """

    def __init__(self, group=None, capacity: int = DEFAULT_CAPACITY, *, epochs: bool = True,
                 two_buffers: bool = True, timeout: float = 30.0, home: bool = False, closing: bool = True):
        if capacity < 0:
            raise ValueError(f"SharedWorkspace: capacity must be at least 0 bytes, got {capacity}")
        self.group = group
        self.rank, self.size = ops.group_rank_and_size(group)
        self.capacity = -(-capacity // FLAG_LINE) * FLAG_LINE     # slots stay 64-byte aligned
        self.epochs, self.two_buffers, self.timeout, self.closing = epochs, two_buffers, timeout, closing
        self.epoch = 0          # barriers this rank has passed: the same count on every rank
        self.calls = 0          # all-reduces begun on this workspace: picks the buffer
        self.pause: Callable[[str, "SharedWorkspace"], None] | None = None   # tests and lab only
        flags_bytes = self.size * FLAG_LINE
        total = flags_bytes + (3 if home else 2) * self.size * self.capacity
        with trace.label("shared memory rendezvous"):
            self.path = self._create_and_share(total)
            self.segment = torch.from_file(self.path, shared=True, size=total, dtype=torch.uint8)
            dist.barrier(group=group)           # every rank has mapped it: the name may go
        if self.rank == 0:
            os.unlink(self.path)
        # flag r is the first int64 of line r: ``flags[r]`` below
        self.flags = self.segment[:flags_bytes].view(torch.int64).view(self.size, FLAG_LINE // 8)[:, 0]
        # buffers 0 and 1, and with homes a third row of slots: buffer HOME (never begin()'s)
        self.buffers = self.segment[flags_bytes:].view(3 if home else 2, self.size, self.capacity)
        self.homes = self.buffers[HOME] if home else None

    def _create_and_share(self, total: int) -> str:
        """Group rank 0 makes the file (zeroed: every flag starts at 0); all learn its name."""
        name = torch.zeros(256, dtype=torch.uint8)
        if self.rank == 0:
            fd, path = tempfile.mkstemp(prefix="collectives-shm-", dir=SHM_DIR)
            os.ftruncate(fd, total)
            os.close(fd)
            name[:len(path)] = torch.tensor(list(path.encode()), dtype=torch.uint8)
        name = name.to(ops.rank_device())       # under NCCL (the tour on GPUs) a broadcast takes a GPU tensor
        dist.broadcast(name, ops.global_rank(self.group, 0), group=self.group)
        name = name.cpu()
        return bytes(name[name != 0].tolist()).decode()

    # ---- what an all-reduce uses ---------------------------------------------------------

    def begin(self, nbytes: int) -> int:
        """Start one all-reduce of ``nbytes`` per rank: the buffer index this call uses."""
        if nbytes > self.capacity:
            raise ValueError(f"rank {self.rank}: a tensor of {nbytes} bytes does not fit this workspace's "
                             f"slots of {self.capacity} bytes; make one with a larger capacity")
        buffer = self.calls % 2 if self.two_buffers else 0
        self.calls += 1
        return buffer

    def slot(self, buffer: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Group rank ``rank``'s slot in ``buffer``, as ``numel`` elements of ``dtype``."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        return self.buffers[buffer, rank, :nbytes].view(dtype)

    def rows(self, buffer: int, dtype: torch.dtype, lo: int, hi: int) -> torch.Tensor:
        """Elements ``lo:hi`` of every slot in ``buffer``, as a ``[p, hi - lo]`` view: row r is slot r."""
        size = torch.empty(0, dtype=dtype).element_size()
        return self.buffers[buffer, :, lo * size:hi * size].view(dtype)

    # ---- homes: tensors that live in the segment --------------------------------------------

    def home(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This rank's home as a tensor of ``numel`` elements: write the input there, all-reduce
        it with this workspace (``two_shot_all_reduce(t, workspace=ws)``), read the result there.

        Every rank takes its home with the same ``numel`` and ``dtype``, and passes it whole."""
        if self.homes is None:
            raise ValueError(f"rank {self.rank}: this workspace has no homes; make it with home=True")
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if numel < 0 or nbytes > self.capacity:
            raise ValueError(f"rank {self.rank}: a home of {numel} elements of {dtype} does not fit this "
                             f"workspace's homes of {self.capacity} bytes")
        return self.homes[self.rank, :nbytes].view(dtype)

    def holds(self, flat: torch.Tensor) -> bool:
        """``flat`` is this rank's home from its first byte, contiguous: its peers can read it."""
        return (self.homes is not None and flat.device.type == "cpu" and flat.is_contiguous()
                and flat.numel() * flat.element_size() <= self.capacity
                and flat.data_ptr() == self.homes[self.rank].data_ptr())

    def pause_at(self, point: str) -> None:
        """Let a test or the lab hold this rank at ``point`` ("posted": its flag is up and it
        has not looked at the others'; "read": past the barrier, before reading peers;
        "gather": the two-shot past its second barrier, before copying the peers' chunks)."""
        if self.pause is not None:
            self.pause(point, self)

    def missing(self, target: int) -> list[int]:
        """Group ranks whose flag has not reached ``target``."""
        return [r for r, f in enumerate(self.flags.tolist()) if f < target]

    def timed_out(self, waited: float, target: int) -> BarrierTimeout:
        return BarrierTimeout(f"rank {self.rank} waited {waited:.1f} s at a shared-memory barrier (epoch "
                              f"{self.epoch}) and gave up: group rank(s) {self.missing(target)} never arrived")

    def __repr__(self) -> str:
        return (f"SharedWorkspace(rank {self.rank} of {self.size}, slots of {self.capacity} bytes, "
                f"epochs={self.epochs}, two_buffers={self.two_buffers}, home={self.homes is not None})")


_CACHE: dict[int, tuple[object, SharedWorkspace]] = {}   # id(group) -> (group, its workspace)


def workspace(group=None, nbytes: int = 0) -> SharedWorkspace:
    """This group's cached workspace, made (collectively) when there is none whose slots
    hold ``nbytes``: slots of the next power of two, at least :data:`DEFAULT_CAPACITY`.

    Every rank of the group passes the same ``nbytes`` (an all-reduce's tensors agree), so
    every rank makes a new one in the same call. Make it ahead of time, at the largest
    size you will reduce, and no all-reduce ever sends a message.
    """
    held = _CACHE.get(id(group))
    if held is not None and held[0] is group and held[1].capacity >= nbytes:
        return held[1]
    capacity = max(DEFAULT_CAPACITY, 1 << max(nbytes - 1, 0).bit_length())
    made = SharedWorkspace(group, capacity)
    _CACHE[id(group)] = (group, made)
    return made
