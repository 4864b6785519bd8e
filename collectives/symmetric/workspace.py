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

Setting the segment up is the only part with messages: group rank 0 creates the file and
removes its name at once, keeping it open; it broadcasts where its open file can be reached
(``/proc/<pid>/fd/<fd>``, with the file's device and inode, so a peer knows it opened the
same file); every rank opens it and all-gathers what it asked for; if they agree, every
rank maps it. The name lives for a few microseconds of rank 0's own code, so nothing is
left in ``/dev/shm`` however the world ends, a rank killed included. (Where a rank cannot
reach another process's ``/proc``, the rendezvous is made again with the name kept until
every rank has opened the file; every error on the way removes it, a kill may not.) Every
all-reduce after that moves its data through the mapping alone.

Each rank's flag line has room for more than its flag: before each call a rank writes
there what it passes (bytes, dtype, op), and after the first barrier every rank compares
them (:meth:`SharedWorkspace.agree`), so ranks that disagree all raise instead of reducing
garbage. The CPU barrier's correctness rests on x86-64's store order (see
:mod:`.shared`): a workspace refuses to be made on any other processor.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import threading
import zlib
from typing import Callable

import torch
import torch.distributed as dist

from ..core import ops, trace

__all__ = ["SharedWorkspace", "BarrierTimeout", "workspace", "FLAG_LINE", "DEFAULT_CAPACITY", "HOME", "TSO_MACHINES"]

HOME = 2                          # the row of homes, after buffers 0 and 1 (slot(HOME, r, ...))
FLAG_LINE = 64                    # bytes per flag: one cache line, written by one rank only
DEFAULT_CAPACITY = 1 << 16        # the smallest slot the cache makes (64 KiB)
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()   # Linux: memory, never a disk
TSO_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")   # processors that keep stores in order (TSO)
CALL_WORDS = 3                    # a call's description in its rank's flag line: bytes, dtype, op


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
        machine = platform.machine()
        if machine.lower() not in TSO_MACHINES:
            raise RuntimeError(f"SharedWorkspace: this processor ({machine}) may reorder stores; lesson 12's CPU "
                               "barrier relies on x86-64 keeping them in order (TSO) and Python has no fences. "
                               "Run the lesson on an x86-64 machine")
        self.group = group
        self.rank, self.size = ops.group_rank_and_size(group)
        self.capacity = -(-capacity // FLAG_LINE) * FLAG_LINE     # slots stay 64-byte aligned
        self.epochs, self.two_buffers, self.timeout, self.closing = epochs, two_buffers, timeout, closing
        self.epoch = 0          # barriers this rank has passed: the same count on every rank
        self.calls = 0          # all-reduces begun on this workspace: picks the buffer
        self.pause: Callable[[str, "SharedWorkspace"], None] | None = None   # tests and lab only
        # One call at a time per rank: two threads would share ``epoch`` and ``calls`` and tear
        # each other's results. Calls of two threads are taken in turn, and pair across ranks
        # in the order each rank takes them, as two threads' calls of ``dist.*`` do.
        self.lock = threading.Lock()
        flags_bytes = self.size * FLAG_LINE
        total = flags_bytes + (3 if home else 2) * self.size * self.capacity
        with trace.label("shared memory rendezvous"):
            self.segment = self._rendezvous(total, home)
        lines = self.segment[:flags_bytes].view(torch.int64).view(self.size, FLAG_LINE // 8)
        self.flags = lines[:, 0]              # flag r is the first int64 of line r: ``flags[r]``
        # what each rank passed to its last two calls (numpy: a write costs the call a microsecond)
        self.said = lines[:, 1:1 + 2 * CALL_WORDS].numpy().reshape(self.size, 2, CALL_WORDS)
        # buffers 0 and 1, and with homes a third row of slots: buffer HOME (never begin()'s)
        self.buffers = self.segment[flags_bytes:].view(3 if home else 2, self.size, self.capacity)
        self.homes = self.buffers[HOME] if home else None

    def _rendezvous(self, total: int, home: bool) -> torch.Tensor:
        """Group rank 0 makes the file (zeroed: every flag starts at 0); every rank opens it,
        they agree on its layout, and every rank maps it. First through ``/proc`` (the name
        removed at once); where a peer cannot open that, again with the name kept until every
        rank has opened the file, and removed on every way out."""
        segment = self._attempt(total, home, named=not os.path.isdir("/proc/self/fd"))
        return segment if segment is not None else self._attempt(total, home, named=True)

    def _attempt(self, total: int, home: bool, named: bool) -> torch.Tensor | None:
        """One rendezvous; None (on every rank) where a rank could not open ``/proc``'s path."""
        fd, own = -1, None
        where = torch.zeros(512, dtype=torch.uint8)
        try:
            if self.rank == 0:
                fd, path = tempfile.mkstemp(prefix="collectives-shm-", dir=SHM_DIR)
                own = path                           # the name lives until every rank has opened the file ...
                if not named:
                    os.unlink(path)                  # ... or not at all: reachable while we hold fd
                    path, own = f"/proc/{os.getpid()}/fd/{fd}", None
                os.ftruncate(fd, total)
                stat = os.fstat(fd)
                text = json.dumps([path, stat.st_dev, stat.st_ino]).encode()
                where[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
            where = where.to(ops.rank_device())      # under NCCL (the tour on GPUs) a message takes a GPU tensor
            dist.broadcast(where, ops.global_rank(self.group, 0), group=self.group)
            where = where.cpu()
            path, device, inode = json.loads(bytes(where[where != 0].tolist()).decode())
            mine = self._open(path, device, inode)
            try:
                asked = torch.zeros(self.size, 2, dtype=torch.int64)
                asked[self.rank] = torch.tensor([self.capacity if mine >= 0 else -1, int(home)])
                asked = asked.to(ops.rank_device())
                dist.all_reduce(asked, group=self.group)     # an all-gather: each rank filled its own row
                asked = asked.cpu().tolist()
                if not named and any(cap < 0 for cap, _ in asked):
                    return None                      # a peer cannot reach our /proc: by name, then
                self._agree_on_layout(asked)
                return torch.from_file(f"/proc/self/fd/{mine}" if os.path.isdir("/proc/self/fd") else path,
                                       shared=True, size=total, dtype=torch.uint8)
            finally:
                if mine >= 0:
                    os.close(mine)
        finally:
            if fd >= 0:
                os.close(fd)
            if own is not None and os.path.exists(own):
                os.unlink(own)

    @staticmethod
    def _open(path: str, device: int, inode: int) -> int:
        """Open rank 0's file, checking it is that file (another process's /proc is another
        file); -1 where it cannot be opened."""
        try:
            mine = os.open(path, os.O_RDWR)
        except OSError:
            return -1
        stat = os.fstat(mine)
        if (stat.st_dev, stat.st_ino) != (device, inode):
            os.close(mine)
            return -1
        return mine

    def _agree_on_layout(self, asked: list) -> None:
        """Every rank raises the same error when any rank could not open the file or asked for
        other slots than rank 0: a mapping of another layout would reduce garbage."""
        wrong = [r for r, (cap, home) in enumerate(asked) if (cap, home) != tuple(asked[0])]
        if not wrong:
            return
        said = ", ".join(f"rank {r}: " + ("could not open rank 0's file (not on its machine?)" if cap < 0 else
                                          f"slots of {cap} bytes" + (" with homes" if home else ""))
                         for r, (cap, home) in enumerate(asked))
        raise ValueError(f"SharedWorkspace on rank {self.rank}: every rank must make it with the same capacity "
                         f"and home, on one machine ({said})")

    # ---- what an all-reduce uses ---------------------------------------------------------

    def begin(self, nbytes: int, dtype: torch.dtype | None = None, op=None, what: str | None = None) -> int:
        """Start one all-reduce of ``nbytes`` per rank: the buffer index this call uses.

        What the call passes (``nbytes``, and ``dtype``, ``op`` and the algorithm ``what``
        where given) is written into this rank's flag line, for :meth:`agree` after the
        first barrier."""
        if nbytes > self.capacity:
            raise ValueError(f"rank {self.rank}: a tensor of {nbytes} bytes does not fit this workspace's "
                             f"slots of {self.capacity} bytes; make one with a larger capacity")
        self.said[self.rank, self.calls % 2] = (nbytes, _code(dtype), _code((op, what)))
        buffer = self.calls % 2 if self.two_buffers else 0
        self.calls += 1
        return buffer

    def agree(self, what: str, dtype: torch.dtype | None = None, op=None) -> None:
        """After the call's first barrier: every rank passed the same bytes, dtype and op, or
        every rank raises (each reads the same lines). Written before the flag, so TSO makes
        them visible with it; the next call writes the other half of the line, and no rank
        can be two calls ahead of a peer."""
        said = self.said[:, (self.calls - 1) % 2].tolist()
        if all(s == said[0] for s in said):
            return
        names = {_code(dtype): str(dtype), _code((op, what)): f"{op} in {what}"}
        parts = ", ".join(f"rank {r}: {n} bytes of {names.get(d, 'another dtype')} "
                          f"({names.get(o, 'another op or algorithm')})" for r, (n, d, o) in enumerate(said))
        raise ValueError(f"{what} on rank {self.rank}: the ranks passed different tensors or ops ({parts}); "
                         "every rank must call the same algorithm with the same size, dtype and op")

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
        """The error of a rank that waited ``waited`` s for every flag to reach ``target``:
        who never arrived, and the epoch each rank's flag holds (a rank one epoch behind sits
        in the previous barrier; one that holds 0 never entered a barrier at all)."""
        seen = ", ".join(f"rank {r}: {f}" for r, f in enumerate(self.flags.tolist()))
        return BarrierTimeout(f"rank {self.rank} waited {waited:.1f} s at a shared-memory barrier (epoch "
                              f"{self.epoch}) and gave up: group rank(s) {self.missing(target)} never arrived "
                              f"(the epochs the flags hold: {seen})")

    def __repr__(self) -> str:
        return (f"SharedWorkspace(rank {self.rank} of {self.size}, slots of {self.capacity} bytes, "
                f"epochs={self.epochs}, two_buffers={self.two_buffers}, home={self.homes is not None})")


def _code(value) -> int:
    """A number naming a dtype or an op, the same in every process (0: not given)."""
    if value is None:
        return 0
    code = _CODES.get(value)
    if code is None:
        code = _CODES[value] = zlib.crc32(str(value).encode()) or 1
    return code


_CODES: dict = {}
_CACHE: dict[int, tuple[object, SharedWorkspace]] = {}   # id(group) -> (group, its workspace)
_MAKING = threading.Lock()                                # two threads' first calls make one workspace
_WORLD: list = [None]                                     # the world the cached workspaces belong to


def workspace(group=None, nbytes: int = 0) -> SharedWorkspace:
    """This group's cached workspace, made (collectively) when there is none whose slots
    hold ``nbytes``: slots of the next power of two, at least :data:`DEFAULT_CAPACITY`.

    Every rank of the group passes the same ``nbytes`` (an all-reduce's tensors agree), so
    every rank makes a new one in the same call. Make it ahead of time, at the largest
    size you will reduce, and no all-reduce ever sends a message. A new world (after
    ``destroy_process_group`` and a new ``init_process_group``) starts a new cache.
    """
    world = dist.group.WORLD
    if _WORLD[0] is not world:
        _CACHE.clear()                        # the old world's segments: their peers are gone
        _WORLD[0] = world
    key = world if group is None else group
    held = _CACHE.get(id(key))
    if held is not None and held[0] is key and held[1].capacity >= nbytes:
        return held[1]
    with _MAKING:
        held = _CACHE.get(id(key))
        if held is not None and held[0] is key and held[1].capacity >= nbytes:
            return held[1]
        capacity = max(DEFAULT_CAPACITY, 1 << max(nbytes - 1, 0).bit_length())
        made = SharedWorkspace(group, capacity)
        _CACHE[id(key)] = (key, made)
        return made
