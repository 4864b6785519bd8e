"""The machinery of the in-flight reducer (:mod:`.inflight`): lanes and the staging ring.

* A **lane** runs one stage's work for one slice after another, in order -- Fairring's stream
  per stage. :class:`StreamLane` is a CUDA stream (on a CPU, a stand-in stream whose work
  runs when given: what :func:`collectives.core.streams.checking` verifies);
  :class:`ThreadLane` is a thread, the CPU's stream, which blocks where a GPU stream would
  wait. Both have ``submit(work, after)``: wait for ``after`` (the previous lane's event),
  run ``work``, and return the event that says the lane got past it -- one hand-off.
* The **staging ring** (:class:`StagingRing`) is Fairring's total-memory budget: one arena,
  handed out to the slices in order, each slice told which earlier slice last held its bytes.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading

import torch

from ..core import nccl_memory, streams

ALIGN = 64                      # each staging buffer starts on a 64-byte boundary


class StreamLane:
    """A stage's lane on a GPU: a CUDA stream. ``submit(work, after)`` makes the stream (not
    the host) wait for ``after``, issues ``work`` under the stream at once, and returns the
    lane's event recorded after it. The lane keeps *one* event and records it again for the
    next slice: a CUDA stream's ``wait_event`` takes the event as it stands when the wait is
    issued, and the next lane's wait is issued before the host moves on. (An event that must
    outlive the next slice -- the staging ring's -- is :meth:`finish_event`'s.) On a CPU the
    same lane is a stand-in stream (:mod:`collectives.core.streams`): work runs when given,
    which :func:`streams.checking` uses to verify the event chain without a GPU."""

    def __init__(self, device, name: str):
        self.device, self.stream = device, streams.new_stream(device, name=f"the {name} lane")
        self.event = streams.new_event(device)
        # ``with lane.use(lane.stream)``: the stream's context, or nothing for a CPU stand-in
        self.use = _no_context if type(self.stream) is streams.NullStream else streams.use
        self.cuda = isinstance(self.stream, torch.cuda.Stream)
        self._spare: list = []                   # finish events handed back by the staging ring

    def submit(self, work, after=None):
        stream = self.stream
        with self.use(stream):
            if after is not None:
                stream.wait_event(after)
            work()
        self.event.record(stream)
        return self.event

    def finish_event(self):
        """An event of its own, recorded now on this lane: kept until the staging ring hands it back."""
        event = self._spare.pop() if self._spare else streams.new_event(self.device)
        event.record(self.stream)
        return event

    def recycle(self, event) -> None:
        self._spare.append(event)


class ThreadLane:
    """A stage's lane on a CPU: a thread that runs the work given to it, in order, and
    blocks where a GPU stream would wait. ``submit(work, after)`` queues one item -- wait for
    ``after``, run ``work``, set the returned event -- so a hand-off between two lanes is one
    queue entry and one ``threading.Event``."""

    def __init__(self, engine, name: str):
        """``engine``: who to tell when a work raises (``engine.fail``) and whether it has
        (``engine.error``)."""
        self.engine, self.queue = engine, queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"collectives {name} lane", daemon=True)
        self.thread.start()

    def submit(self, work, after=None) -> threading.Event:
        done = threading.Event()
        self.queue.put((after, work, done))
        return done

    def finish_event(self):
        return None                             # the last submit's event is the slice's own

    def recycle(self, event) -> None:
        pass

    def _wait(self, event: threading.Event) -> None:
        while not event.wait(0.5):
            if self.engine.error is not None:
                return                          # a failed engine: its lanes drain without waiting

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            after, work, done = item
            if after is not None and not after.is_set():
                self._wait(after)
            if self.engine.error is None:       # after a failure only the events are still set
                try:
                    work()
                except BaseException as exc:  # noqa: BLE001 - handed to every handle still waiting
                    self.engine.fail(exc)
            done.set()

    def close(self) -> None:
        self.queue.put(None)


_NOTHING = contextlib.nullcontext()


def _no_context(stream):
    return _NOTHING


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class StagingRing:
    """Fairring's total-memory budget: one arena of ``capacity`` bytes handed out as a ring.

    ``reserve(nbytes)`` gives the next slice the ``nbytes`` after the previous slice's (from
    the start again when they do not fit before the end) and returns the "finished" event
    of the latest earlier slice that used any of them -- the new slice must wait for it.
    Slices finish in the order they were reserved, so the latest one overlapped is the only
    one to wait for. ``finished(event)`` then attaches the new slice's own event. Reserving
    is bookkeeping on the host, constant work per slice: the waiting is done by the lanes.
    """

    def __init__(self, capacity: int, device, recycle=None):
        self.capacity, self.device = capacity, device
        self.arena: torch.Tensor | None = None        # allocated on first use
        self.head = 0
        self.live: collections.deque = collections.deque()   # [start, end, event], oldest first
        self.held = 0                                  # bytes reserved now
        self.peak = 0                                  # most bytes reserved at once
        self._recycle = recycle                        # events no slice will wait for again

    def reserve(self, nbytes: int) -> tuple[torch.Tensor, object]:
        if nbytes > self.capacity:
            raise ValueError(f"a slice needs {nbytes} bytes of staging; the budget is {self.capacity}")
        if self.arena is None:
            self.arena = nccl_memory.temporary(max(self.capacity, ALIGN), torch.uint8, self.device)
        if nbytes == 0:
            return self.arena[:0], None
        start = self.head if self.head + nbytes <= self.capacity else 0
        end, after = start + nbytes, None
        while self.live:                   # the oldest regions lie just after the head
            lo, hi, event = self.live[0]
            skipped = start < self.head and lo >= self.head          # in the tail left behind by the wrap
            if not (skipped or (lo < end and start < hi)):
                break
            if after is not None and self._recycle is not None:
                self._recycle(after)       # an older one: the newer region's wait covers it
            after = event
            self.held -= hi - lo
            self.live.popleft()
        self.head = end
        self.live.append([start, end, None])
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        return self.arena[start:end], after

    def finished(self, event) -> None:
        """The event set when the slice last reserved is done (with bytes only)."""
        if self.live and self.live[-1][2] is None:
            self.live[-1][2] = event

    def waited(self, event) -> None:
        """``event`` was waited for (by the next slice's first lane): it may be recorded again."""
        if event is not None and self._recycle is not None:
            self._recycle(event)


class OwnSlot:
    """One slice's own staging buffer, in the shape of a :class:`~.slice.SlotPool`: the
    reducer has already waited for the slot's previous slice, so acquiring waits for nothing."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer

    def acquire(self, numel: int, dtype: torch.dtype, device, stream):
        need = numel * dtype.itemsize
        if need > self.buffer.numel():
            raise RuntimeError(f"a slice asked for {need} bytes of staging, {self.buffer.numel()} were reserved")
        return 0, self.buffer[:need].view(dtype)

    def release(self, slot: int, stream, device) -> None:
        pass
