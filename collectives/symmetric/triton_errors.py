"""How lesson 12's Triton kernels give up on a peer that never comes, and how the host hears it.

Each spin of :mod:`.triton_barrier` counts its tries. Past ``spin_limit`` (a kernel argument:
:data:`SPIN_LIMIT` unless the caller asks for another) it stops waiting, writes a *record*
of where it gave up into a small error buffer, and the kernel returns at once. The records
live in pinned host memory that the GPU writes through its mapping (with unified addressing,
CUDA maps every pinned allocation into every device's address space, at the same address),
so the host reads them with a plain load of its own memory -- no stream synchronisation, no
copy, no CUDA call::

    int32 words   0 .. 15          the header: word 0 is 1 once any record is written
    record k      16·(k+1) ..      program b's record for peer q is k = b·p + q:
                                     valid, rank, barrier, peer, phase, expected, seen, program

A record is written field by field, then ``valid`` and the header word with a release at
system scope, so a host that sees the header set sees whole records. The fast path pays a
count and a compare per try in the kernel, and one read of the header word per call on the
host (:meth:`ErrorBuffer.check`, before every launch; a call replayed from a CUDA graph
runs no Python, so there the host reads it in :func:`wait` or by calling ``check``). A set
header raises :class:`SpinTimeout`, naming the rank, the barrier and the peer; from then on
every call on that handle raises: the signal pads' words are in a state no barrier can start
from.

:func:`wait` is the host's deadline: it waits for what the current stream has queued while
reading the header, and names the peer when a record appears or the deadline passes.
No Triton here: the host side imports anywhere.
"""

from __future__ import annotations

import time

import torch

__all__ = ["SPIN_LIMIT", "RECORD_WORDS", "FIELDS", "BARRIERS", "SpinTimeout", "ErrorBuffer", "for_handle",
           "wait"]

SPIN_LIMIT = 1 << 24      # tries of one handshake before giving up: each a system-scope atomic round trip
RECORD_WORDS = 16         # int32 words per record (64 bytes, one line), the header one record long
FIELDS = ("valid", "rank", "barrier", "peer", "phase", "expected", "seen", "program")
# Which barrier of which kernel: the kernels pass these numbers as their BARRIER constexpr.
BARRIERS = {10: "the one-shot's first barrier (every input in place)",
            11: "the one-shot's last barrier (nobody reads any more)",
            20: "the two-shot's first barrier (every input in place)",
            21: "the two-shot's middle barrier (every chunk reduced)",
            22: "the two-shot's last barrier (nobody reads any more)",
            30: "the store two-shot's first barrier (every input in place)",
            31: "the store two-shot's last barrier (every sum has landed)",
            0: "a barrier of a test kernel"}
PHASES = ("arrive", "consume")


class SpinTimeout(RuntimeError):
    """A kernel of lesson 12 gave up waiting for a peer; the message names the rank, the
    peer and the barrier."""


class ErrorBuffer:
    """The error records of one rank's kernels on one group's signal pads, in pinned host
    memory the GPU writes (plain memory where there is no CUDA: tests write it themselves).

    ``records``: how many (program, peer) records fit -- the signal pad's words, as every
    program's row of p words fits in the pad.
    """

    def __init__(self, records: int, rank: int):
        pin = torch.cuda.is_available()
        self.tensor = torch.zeros((records + 1) * RECORD_WORDS, dtype=torch.int32, pin_memory=pin)
        self.words = self.tensor.numpy()      # the same memory: reading it is a CPU load, nothing else
        self.address = self.tensor.data_ptr()  # the GPU's address of it too (unified addressing)
        self.records, self.rank = records, rank
        self.failed: str | None = None        # the first error raised: every later call is refused

    def check(self) -> None:
        """Raise :class:`SpinTimeout` if a kernel has written a record, or one was raised before."""
        if self.failed is not None:
            raise SpinTimeout(f"rank {self.rank} refuses this call: an earlier call's kernel gave up ({self.failed});"
                              " the signal pads are in an unknown state, so no later barrier can be trusted -- "
                              "end this world and start a new one")
        if self.words[0]:
            self.failed = self.describe()
            raise SpinTimeout(self.failed)

    def found(self) -> list[dict]:
        """Every valid record, as a dict of :data:`FIELDS`, in program then peer order."""
        rows = self.words[RECORD_WORDS:].reshape(self.records, RECORD_WORDS)[:, :len(FIELDS)]
        return [dict(zip(FIELDS, map(int, row))) for row in rows if row[0]]

    def describe(self) -> str:
        records = self.found()
        if not records:
            return f"rank {self.rank}: a kernel gave up waiting at a barrier (its record is not readable yet)"
        first = records[0]
        where = BARRIERS.get(first["barrier"], f"barrier {first['barrier']}")
        if first["phase"] == 0:
            what = (f"it could not arrive at peer {first['peer']}: the word in peer {first['peer']}'s signal pad "
                    f"held {first['seen']} where {first['expected']} was expected (its previous arrival never "
                    f"consumed: peer {first['peer']} is behind or gone)")
        else:
            what = (f"peer {first['peer']} never arrived: the word in rank {first['rank']}'s signal pad held "
                    f"{first['seen']} where {first['expected']} was expected")
        peers = sorted({r["peer"] for r in records})
        return (f"rank {first['rank']} gave up at {where}, program {first['program']}: {what}; "
                f"{len(records)} record(s), peers waited for: {peers}")


_BUFFERS: dict = {}       # (pads' and buffers' address arrays, rank, world, device) -> ErrorBuffer


def for_handle(handle, device: int, records: int) -> ErrorBuffer:
    """The error buffer of ``handle``'s signal pads on ``device``, made on first use. Keyed,
    as the launch plans are, by the handle's pointers, rank and world size: a handle made
    later at exactly the same addresses counts as the same one (and is refused if it was)."""
    key = (handle.signal_pad_ptrs_dev, handle.buffer_ptrs_dev, handle.rank, handle.world_size, device)
    if key not in _BUFFERS:             # a buffer is never replaced: its failed state stays with it
        _BUFFERS[key] = ErrorBuffer(records, handle.rank)
    return _BUFFERS[key]


def wait(errors: ErrorBuffer, timeout: float, nap: float = 1e-3) -> None:
    """Wait, at most ``timeout`` seconds, for the work queued so far on the current CUDA
    stream, reading ``errors`` meanwhile: :class:`SpinTimeout` naming the peer if a kernel
    gave up (before or at the deadline), :class:`TimeoutError` if the deadline passed with
    no record (a kernel still spinning, or something else stuck)."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + timeout
    while not done.query():
        errors.check()
        if time.monotonic() > deadline:
            errors.check()
            raise TimeoutError(f"rank {errors.rank}: the stream did not finish within {timeout} s and no kernel "
                               "of lesson 12 has given up yet")
        time.sleep(nap)
    errors.check()
