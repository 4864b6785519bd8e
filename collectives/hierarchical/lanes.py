"""The machinery of the in-flight reducer (:mod:`.inflight`): lanes and the staging ring.

* A **lane** runs one stage's work for one slice after another, in order -- Fairring's stream
  per stage. :class:`StreamLane` is a CUDA stream (on a CPU, a stand-in stream whose work
  runs when given: what :func:`collectives.core.streams.checking` verifies);
  :class:`ThreadLane` is a thread, the CPU's stream, which blocks where a GPU stream would
  wait. Both have ``submit(work)``, ``mark()`` (an event set when the lane gets there) and
  ``wait_for(event)`` (later work waits for it).
* The **staging ring** (:class:`StagingRing`) is Fairring's total-memory budget: one arena,
  handed out to the slices in order, each slice told which earlier slice last held its bytes.
"""

from __future__ import annotations

import collections
import queue
import threading

import torch

from ..core import nccl_memory, streams

ALIGN = 64                      # each staging buffer starts on a 64-byte boundary


class StreamLane:
    """A stage's lane on a GPU: a CUDA stream. Work given to it is issued at once, under the
    stream; ``wait_for(event)`` makes the stream (not the host) wait. On a CPU the same
    lane is a stand-in stream (:mod:`collectives.core.streams`): work runs when given, which
    :func:`streams.checking` uses to verify the event chain without a GPU."""

    def __init__(self, device, name: str):
        self.device, self.stream = device, streams.new_stream(device, name=f"the {name} lane")

    def submit(self, work) -> None:
        with streams.use(self.stream):
            work()

    def mark(self):
        event = streams.new_event(self.device)
        event.record(self.stream)
        return event

    def wait_for(self, event) -> None:
        if event is not None:
            self.stream.wait_event(event)


class ThreadLane:
    """A stage's lane on a CPU: a thread that runs the work given to it, in order, and
    blocks where a GPU stream would wait. ``mark()`` is an event the thread sets when it
    gets there; ``wait_for(event)`` holds the lane's later work until it is set."""

    def __init__(self, engine, name: str):
        """``engine``: who to tell when a work raises (``engine.fail``) and whether it has
        (``engine.error``)."""
        self.engine, self.queue = engine, queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"collectives {name} lane", daemon=True)
        self.thread.start()

    def submit(self, work) -> None:
        self.queue.put(work)

    def mark(self) -> threading.Event:
        event = threading.Event()
        self.queue.put(_Set(event))
        return event

    def wait_for(self, event) -> None:
        if event is not None:
            self.queue.put(lambda: self._wait(event))

    def _wait(self, event: threading.Event) -> None:
        while not event.wait(0.5):
            if self.engine.error is not None:
                return                          # a failed engine: its lanes drain without waiting

    def _run(self) -> None:
        while True:
            work = self.queue.get()
            if work is None:
                return
            if isinstance(work, _Set):
                work.event.set()
                continue
            if self.engine.error is not None:
                continue                        # after a failure only the events are still set
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - handed to every handle still waiting
                self.engine.fail(exc)

    def close(self) -> None:
        self.queue.put(None)


class _Set:
    """A lane's mark: set the event when the lane gets here."""

    def __init__(self, event: threading.Event):
        self.event = event


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class StagingRing:
    """Fairring's total-memory budget: one arena of ``capacity`` bytes handed out as a ring.

    ``reserve(i, nbytes)`` gives slice i the ``nbytes`` after the previous slice's (from the
    start again when they do not fit before the end) and says which earlier slice last used
    any of them -- slice i must wait for that one to finish. Slices finish in the order they
    were reserved, so the latest one overlapped is the only one to wait for. Reserving is
    bookkeeping on the host: the waiting is done by the lanes.
    """

    def __init__(self, capacity: int, device):
        self.capacity, self.device = capacity, device
        self.arena: torch.Tensor | None = None        # allocated on first use
        self.head = 0
        self.live: collections.deque = collections.deque()   # (slice, start, end), oldest first
        self.peak = 0                                  # most bytes reserved at once

    def reserve(self, index: int, nbytes: int) -> tuple[torch.Tensor, int | None]:
        if nbytes > self.capacity:
            raise ValueError(f"a slice needs {nbytes} bytes of staging; the budget is {self.capacity}")
        if self.arena is None:
            self.arena = nccl_memory.temporary(max(self.capacity, ALIGN), torch.uint8, self.device)
        if nbytes == 0:
            return self.arena[:0], None
        start = self.head if self.head + nbytes <= self.capacity else 0
        end, reused = start + nbytes, None
        while self.live:                   # the oldest regions lie just after the head
            j, lo, hi = self.live[0]
            skipped = start < self.head and lo >= self.head          # in the tail left behind by the wrap
            if not (skipped or (lo < end and start < hi)):
                break
            reused = j
            self.live.popleft()
        self.head = end
        self.live.append((index, start, end))
        self.peak = max(self.peak, sum(hi - lo for _, lo, hi in self.live))
        return self.arena[start:end], reused


class OwnSlot:
    """One slice's own staging buffer, in the shape of a :class:`~.slice.SlotPool`: the
    reducer has already waited for the slot's previous slice, so acquiring waits for nothing."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer

    def acquire(self, numel: int, dtype: torch.dtype, device, stream):
        need = numel * torch.empty((), dtype=dtype).element_size()
        if need > self.buffer.numel():
            raise RuntimeError(f"a slice asked for {need} bytes of staging, {self.buffer.numel()} were reserved")
        return 0, self.buffer[:need].view(dtype)

    def release(self, slot: int, stream, device) -> None:
        pass
