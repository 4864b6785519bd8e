"""How the in-flight reducer (:mod:`.inflight`) issues one slice: on streams or on threads.

:class:`Issuing` holds the part of :class:`~.inflight.HierarchicalAllReducer` that runs for
every slice, where the host's time goes:

* ``_prepared`` -- a bucket tensor's slices prepared once (:mod:`.program`) and looked up
  on every later call while the tensor lives;
* ``_issue_streams`` -- the GPU's path: the five stages issued at once on four streams, each
  waiting (as a stream, not the host) for the previous lane's event and handles;
* ``_issue_threads`` -- the CPU's path: one queue entry per lane thread, and no hand-off
  where a tier of one rank leaves nothing to wait for.
"""

from __future__ import annotations

import functools
import time
import weakref

import torch

from ..core import streams
from .lanes import OwnSlot, aligned
from .program import PreparedSlice
from .slice import Slice

MAX_PREPARED = 4096             # bucket tensors whose prepared slices a reducer keeps at most


class Issuing:
    """The per-slice work of :class:`~.inflight.HierarchicalAllReducer` (a base class: it
    reads the reducer's lanes, ring, groups and layout)."""

    def _prepared(self, tensor: torch.Tensor, flat: torch.Tensor, bounds: list) -> list | None:
        """The prepared slices of ``tensor`` (:mod:`.program`), made on its first call and
        kept while the tensor object lives: None for a slice with a padding tail, or when
        ``flat`` is a copy (a non-contiguous tensor)."""
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            return None
        key, what = id(tensor), (flat.data_ptr(), flat.numel(), flat.dtype, len(bounds))
        entry = self._programs.get(key)
        if entry is not None and entry[0]() is tensor and entry[1] == what:
            return entry[2]
        DM = self.layout.D * self.layout.M
        slices = [PreparedSlice(flat[lo:hi], self.groups, self.p, self.inside) if (hi - lo) % DM == 0 else None
                  for lo, hi in bounds]
        if len(self._programs) >= MAX_PREPARED:
            self._programs.clear()
        programs = self._programs

        def forget(_, key=key):
            if programs.get(key) is entry:
                programs.pop(key, None)
        entry = (weakref.ref(tensor, forget), what, slices)
        programs[key] = entry
        return slices

    def _pools(self, need) -> tuple[dict, object]:
        """This slice's own staging, carved from its region of the ring; and the event of the
        slice that last used those bytes (None: nothing to wait for)."""
        kinds, nbytes = need
        region, after = self.ring.reserve(nbytes)
        pools, at = {"region": region}, 0
        for kind, size in kinds.items():
            pools[kind] = OwnSlot(region[at:at + size])
            at += aligned(size)
        return pools, after

    def _note(self, bucket: int, k: int, i: int, stage: str, t0: float) -> None:
        self.timeline.append(dict(bucket=bucket, slice=k, index=i, stage=stage, issued=t0, done=time.perf_counter()))

    def _issue_streams(self, piece, need, op, bucket: int, k: int, finish) -> object:
        """The five stages of one slice, issued at once on the lanes' streams (the add runs on
        the diffuse's lane, just before it); each lane's stream waits for the previous lane's
        event and for the previous stage's handles -- the host waits for nothing. A tier of
        one rank leaves its lanes out: with M = 1 the reduce-scatter's lane hands straight to
        the all-gather's, with D = 1 the collect's lane starts the slice (each hand-off is an
        event recorded and waited for, host time on every slice).
        Returns the event a bucket's handle waits for: on a GPU None (the bucket's future
        carries it), on stand-in streams one recorded after the bucket's last slice."""
        i = self._slices
        self._slices += 1
        if isinstance(piece, PreparedSlice):
            region, after = self.ring.reserve(need[1])
            one = piece.bind(op, region, need[0], i)
        else:
            pools, after = self._pools(need)
            one = Slice(piece, self.groups, op, self.p, pools, self._streams, index=i, inside=self.inside)
        rs, collect, diffuse, gather = self.lanes
        record, D, M = self.record, self.layout.D, self.layout.M
        t0 = time.perf_counter()

        def all_gather():
            for w in one.all_gather():
                w.wait()
            one.finish()
            if finish is not None:
                self._complete(bucket, *finish)

        def note(*stages) -> None:          # the timeline: when each stage's issuing began and ended
            nonlocal t0
            if record:
                for stage in stages:
                    self._note(bucket, k, i, stage, t0)
                t0 = time.perf_counter()

        if M == 1:      # one machine: no collect or diffuse to wait for
            works = _on(rs, after, (), one.reduce_scatter)
            self.ring.waited(after)
            note("reduce-scatter")
            _on(gather, rs.event, works, one.collect, one.add, one.diffuse, all_gather)
            note("collect", "add", "diffuse", "all-gather")
        else:
            if D == 1:  # one rank per machine: no reduce-scatter to wait for
                works = _on(collect, after, (), one.reduce_scatter, one.collect)
                note("reduce-scatter", "collect")
            else:
                works = _on(rs, after, (), one.reduce_scatter)
                note("reduce-scatter")
                works = _on(collect, rs.event, works, one.collect)
                note("collect")
            self.ring.waited(after)
            works = _on(diffuse, collect.event, works, one.add, one.diffuse)
            note("add", "diffuse")
            _on(gather, diffuse.event, works, all_gather)
            note("all-gather")
        if need[1]:                          # a later slice will reuse these bytes: it waits for this
            self.ring.finished(gather.finish_event())
        if finish is None or gather.cuda or gather.use is not streams.use:
            return None      # not the last slice; a GPU's future waits on its own events; plain stand-ins
        done = streams.new_event(self.device)       # stand-ins that keep count: the handle waits for it
        done.record(gather.stream)
        return done

    def _issue_threads(self, piece: torch.Tensor, need, op, bucket: int, k: int, finish) -> object:
        """The five stages of one slice handed to the four lanes' threads, one queue entry per
        lane: each lane waits for the previous lane's event, then for the previous stage's
        messages, then posts its own. A tier of one rank has no messages to wait for: with
        D = 1 the collect's lane starts the slice, with M = 1 the all-gather's lane does the
        sum and the add (two hand-offs, not four). Returns the event set when the slice is done."""
        i = self._slices
        self._slices += 1
        pools, after = self._pools(need)
        rs, collect, diffuse, gather = self.lanes
        record, state = self.record, {}
        ready = piece.bind(op, pools["region"], need[0], i) if isinstance(piece, PreparedSlice) else None

        def reduce_scatter():
            state["t"] = time.perf_counter()
            one = state["slice"] = ready or Slice(piece, self.groups, op, self.p, pools, self._streams,
                                                  index=i, inside=self.inside, labels=False)
            state["works"] = one.reduce_scatter()

        def wait(stage: str) -> None:
            for w in state.pop("works"):
                w.wait()
            if record:
                self._note(bucket, k, i, stage, state["t"])
            state["t"] = time.perf_counter()

        def collect_():
            wait("reduce-scatter")
            state["works"] = state["slice"].collect()

        def add_and_diffuse():
            wait("collect")
            state["slice"].add()
            if record:
                self._note(bucket, k, i, "add", state["t"])
            state["t"] = time.perf_counter()
            state["works"] = state["slice"].diffuse()

        def all_gather():
            wait("diffuse")
            for w in state["slice"].all_gather():
                w.wait()
            state.pop("slice").finish()
            if record:
                self._note(bucket, k, i, "all-gather", state["t"])
            if finish is not None:
                self._complete(bucket, *finish)

        steps = [(rs, [reduce_scatter]), (collect, [collect_]), (diffuse, [add_and_diffuse]), (gather, [all_gather])]
        D, M = self.layout.D, self.layout.M
        if D == 1:      # no reduce-scatter to wait for: the collect's lane starts the slice
            steps[1][1].insert(0, reduce_scatter)
            del steps[0]
        if M == 1:      # no collect or diffuse in flight: the all-gather's lane sums, adds and posts
            steps[-1][1][:0] = collect_, add_and_diffuse
            del steps[-3:-1]
        event = after
        for lane, works in steps:      # one hand-off per lane that has something to wait for
            event = lane.submit(works[0] if len(works) == 1 else functools.partial(_each, works), event)
        if need[1]:
            self.ring.finished(event)
        return event


def _on(lane, event, works, *stages):
    """Issue ``stages`` on ``lane``'s stream after ``event`` and the previous stage's handles
    (as the stream: NCCL's ``wait()`` makes the current stream wait); record the lane's
    event after them. Returns the handles of the last stage."""
    stream = lane.stream
    if event is not None:
        stream.wait_event(event)
    if lane.cuda:
        with torch.cuda.stream(stream):
            out = _run(works, stages)
    elif lane.use is streams.use:        # a stand-in stream that keeps count (streams.checking)
        with streams.use(stream):
            out = _run(works, stages)
    else:                                # a plain stand-in: the work runs as it is given
        for w in works:
            w.wait()
        for stage in stages:
            out = stage()
    lane.event.record(stream)
    return out or ()


def _each(works) -> None:
    for work in works:
        work()


def _run(works, stages):
    for w in works:
        w.wait()
    for stage in stages:
        out = stage()
    return out
