"""Buckets in flight: an asynchronous hierarchical all-reduce, after Fairring's ``allReduce``.

:func:`~collectives.hierarchical.hierarchical_all_reduce` blocks its caller until the
tensor is reduced. In training that wastes what Fairring is built for: DDP hands over a
bucket of gradients while backward is still computing the next one, and NCCL runs one
process group's all-reduces one after the other. Here a call returns a :class:`Handle` at
once; the slices of every bucket handed over flow through the same five stages, so bucket
b + 1's reduce-scatter runs while bucket b is still crossing machines::

    reducer = HierarchicalAllReducer(layout=(2, 2), memory_bytes=64 << 20)
    handles = [reducer.all_reduce(bucket) for bucket in buckets]   # returns at once
    for h in handles:
        h.wait()                     # or h.get_future(): a torch.futures.Future of the tensor

    stage lanes      slices of bucket 0 | bucket 1 | bucket 2 ...
    reduce-scatter   0a 0b 0c 1a 1b 2a 2b 2c
    collect             0a 0b 0c 1a 1b 2a 2b 2c             (one lane per stage; a lane
    add                    0a 0b 0c 1a 1b 2a ...             runs its stage for one slice
    diffuse                   0a 0b 0c 1a 1b ...             after another, in order)
    all-gather                   0a 0b 0c 1a ...  -> bucket 0 done, then 1, then 2

**Lanes.** Each stage has a *lane* that runs its work in order -- Fairring's stream per
stage. On a GPU a lane is a CUDA stream: the host issues every stage of a bucket at once
(Fairring's order, slice by slice), and events make each stage's stream wait for the one
before; NCCL progresses on its own. On a CPU (gloo) the host cannot issue a stage before
the previous one's messages have arrived (its sum must be added first), so a lane is a
*thread*, the CPU's stream: it takes its stage's work in order and blocks on the waits a
GPU stream would make, while the caller's thread goes on (computing backward, handing over
the next bucket). An event is a ``threading.Event`` set when the lane gets there.

**Why any interleaving is correct.** Each stage has its own process groups (a set made for
each reducer alone: ``stage_groups(..., name="in flight <n>")``) and each lane issues its
stage for the slices in the order they were handed over -- the same on every rank. Messages
on one group match in the order they are posted, so stage k of slice i meets stage k of
slice i on every peer, however the lanes' threads interleave. Nothing waits in a cycle: a lane waits
only for an earlier stage of the same slice, or (for memory) for an earlier slice to finish.

**Bounded memory.** Fairring gives its staging a total budget. A slice needs staging
beside it -- the reduce-scatter's incoming partial sums (on gloo), the collect's rows when
D = 1, the padding tail -- and takes it from one arena of ``memory_bytes``, handed out as a
ring: slice i gets the bytes after slice i − 1's, wrapping to the start, and its first stage
waits until the last slice whose bytes it reuses has finished (slices finish in order, so
that one is enough). Buckets in flight are then as many as fit -- never more memory than
the budget::

    arena   [ s5 s6 | s2 s3 s4 ]      head after s6; s7 reuses s2's bytes: it waits for s2
             ^ wrapped

Buckets complete in the order they were handed over (the last lane finishes slices in
order), and every rank must hand over the same buckets in the same order (DDP does).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import weakref

import torch
import torch.distributed as dist

from ..core import ops, streams
from ..core.ops import ReduceOp
from .lanes import OwnSlot, StagingRing, StreamLane, ThreadLane, aligned
from .layout import check_layout, checked_layout, resolve, stage_groups
from .pipeline import default_slice_numel, default_tiers, inside_mode
from .program import PreparedSlice
from .slice import Slice

STAGES = ("reduce-scatter", "collect", "add", "diffuse", "all-gather")
LANES = ("reduce-scatter", "collect", "add and diffuse", "all-gather")   # the add runs just before the diffuse
DEFAULT_MEMORY = 64 << 20       # bytes of staging, all slices in flight together
MAX_PREPARED = 4096             # bucket tensors whose prepared slices a reducer keeps at most


class Handle:
    """What :meth:`HierarchicalAllReducer.all_reduce` returns at once.

    ``wait()`` returns the reduced tensor once it is (on a GPU: makes the current stream
    wait for it, as a ``Work`` of NCCL does); ``get_future()`` is a ``torch.futures.Future``
    whose value is the tensor (what a DDP communication hook returns); ``is_completed()``
    asks without waiting. An error on any rank's stages is raised by ``wait()``.
    """

    def __init__(self, tensor: torch.Tensor, future: torch.futures.Future, bucket: int, done=None):
        self.tensor, self.bucket = tensor, bucket
        self._future, self._done = future, done      # _done: the last lane's event (streams)

    def wait(self) -> torch.Tensor:
        if self._done is not None:
            streams.current_stream(self.tensor.device).wait_event(self._done)
        return self._future.wait()

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


def _finished(tensor: torch.Tensor, bucket: int = -1) -> Handle:
    future = torch.futures.Future()
    future.set_result(tensor)
    return Handle(tensor, future, bucket)


_WHAT = "HierarchicalAllReducer.all_reduce"
_serial = itertools.count()     # reducers made in this process: every rank makes them in the same order


class HierarchicalAllReducer:
    """Asynchronous hierarchical all-reduce with buckets in flight in bounded staging memory.

    Construct it on every rank at the same point (it creates its process groups, a
    collective over the world); then ``all_reduce(tensor, op)`` returns a :class:`Handle`.

    Args:
        group: the process group (the world by default); a subgroup spanning both tiers
            needs its groups made by every rank first (:func:`~.layout.stage_groups`).
        layout: ``(D, M)``; default from the environment (``LOCAL_WORLD_SIZE``).
        memory_bytes: Fairring's total staging budget: the slices in flight never hold more.
        slice_bytes: the largest slice (default ``memory_bytes // 4``, so at least four slices
            fit); each bucket is cut as the cost model's plan says, never into larger slices.
        progress: ``"threads"`` (a lane per stage is a thread: the default on a CPU) or
            ``"streams"`` (a lane is a stream: the default on a GPU; on a CPU the work runs
            when issued, synchronously).
        inside: stages 1 and 5 as ``"collectives"`` or ``"messages"`` (default: NCCL's own
            collectives on a GPU, messages on gloo).
        record: keep :attr:`timeline`, one row per stage of each slice (issued, done).
    """

    def __init__(self, group=None, layout=None, *, memory_bytes: int = DEFAULT_MEMORY,
                 slice_bytes: int | None = None, progress: str | None = None, inside: str | None = None,
                 device=None, record: bool = False):
        if memory_bytes < 1:
            raise ValueError(f"memory_bytes must be positive, got {memory_bytes}")
        self.group = group
        self.member = ops.is_member(group)
        self.layout = resolve(layout, group) if self.member else None
        self.device = torch.device(device) if device is not None else ops.rank_device()
        if progress is None:
            progress = "streams" if self.device.type == "cuda" else "threads"
        if progress not in ("threads", "streams"):
            raise ValueError(f"progress must be 'threads' or 'streams', got {progress!r}")
        self.progress, self.inside = progress, inside_mode(self.device, inside)
        self.memory_bytes = memory_bytes
        self.slice_bytes = max(slice_bytes or memory_bytes // 4, 64)
        self.record, self.timeline = record, []
        self.error: BaseException | None = None
        self.p = dist.get_world_size(group) if self.member else 0
        self.groups = None
        if self.member and ops.check_mode():     # before any group is made: made from the layout
            ops.compare_across_ranks("HierarchicalAllReducer", torch.empty(0, device=self.device), ReduceOp.SUM,
                                     group, {"layout": (self.layout.D, self.layout.M), "memory_bytes": memory_bytes,
                                             "progress": progress, "inside": self.inside})
        if self.member and self.p > 1:      # groups of its own: two reducers' lanes must not share one
            self.groups = stage_groups(self.layout, group, name=f"in flight {next(_serial)}")
        D, M = (self.layout.D, self.layout.M) if self.layout else (1, 1)
        self.slice_bytes = max(self.slice_bytes, 8 * D * M)   # a slice holds at least one element per block
        largest = self._staging_need(self.slice_bytes // 8 + 1, 8, D, M)      # the worst case: 8-byte elements
        if sum(aligned(b) for b in largest.values()) > memory_bytes:
            raise ValueError(f"memory_bytes={memory_bytes} cannot hold the staging of one slice of "
                             f"{self.slice_bytes} bytes; give more memory or smaller slices")
        self.lanes = self._make_lanes() if self.groups is not None else []
        self.ring = StagingRing(memory_bytes, self.device, recycle=self.lanes[-1].recycle if self.lanes else None)
        # the stream of each of the five stages (the add's is the diffuse's; stand-ins for threads)
        lane_streams = [getattr(lane, "stream", streams.NullStream()) for lane in self.lanes]
        self._streams = lane_streams[:3] + lane_streams[2:]
        self._plans: dict[tuple, tuple] = {}      # (elements, element size, D, M) -> slices and their staging
        self._programs: dict[int, tuple] = {}     # id(tensor) -> (weak reference, what, its prepared slices)
        self._slices = 0                          # slices handed over so far
        self._buckets = 0
        self._pending: dict[int, torch.futures.Future] = {}
        self._followers: dict[int, list] = {}     # bucket -> empty buckets to complete right after it
        self._lock = threading.Lock()
        self.peak_in_flight = 0                   # most buckets handed over and not yet done

    # ---- set-up -----------------------------------------------------------------------

    def _staging_need(self, numel: int, element_size: int, D: int, M: int) -> dict[str, int]:
        """Bytes of staging a slice of ``numel`` elements needs, by kind: the padding tail, one
        element per block; the reduce-scatter's incoming partial sums, (D − 1)/D of the slice
        and its tail (messages only: NCCL keeps them inside); the collect's M rows when D = 1
        (with D > 1 they land in the slice itself, Fairring's trick)."""
        k = numel // (D * M)
        tail = numel % (D * M)
        need = {"padding": D * M * element_size if tail else 0,
                "partials": (D - 1) * M * (k + 1) * element_size if self.inside == "messages" and D > 1 else 0,
                "staging": M * (k + 1) * element_size if D == 1 and M > 1 else 0}
        return need

    def _make_lanes(self) -> list:
        if self.progress == "streams":
            return [StreamLane(self.device, lane) for lane in LANES]
        return [ThreadLane(self, lane) for lane in LANES]

    @property
    def staging_bytes(self) -> int:
        """The most staging the slices in flight ever held at once (≤ ``memory_bytes``)."""
        return self.ring.peak

    # ---- the call ---------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM) -> Handle:
        """Start all-reducing ``tensor`` in place; return its :class:`Handle` at once.

        Checked before anything is issued (a tensor, an op it supports, on this engine's
        device; in check mode the ranks compare it, layout included). The tensor must not be
        touched until the handle completes."""
        what = _WHAT
        if ops.check_mode():             # the ranks compare the call, layout included
            shape = checked_layout(tensor, op, self.group, self.layout, what, engine="in flight",
                                   memory_bytes=self.memory_bytes, slice_bytes=self.slice_bytes)
        else:                            # the layout was resolved and checked when the reducer was made
            shape = self.layout if ops.check_all_reduce_args(tensor, op, self.group, what=what, compare=False) else None
        if shape is None or tensor.numel() == 0 or self.p == 1:
            return self._nothing_to_send(tensor)
        if tensor.device != self.device:
            raise ValueError(f"{what}: the tensor is on {tensor.device}, this reducer on {self.device}")
        if self.error is not None:
            raise RuntimeError(f"{what}: an earlier bucket failed on this rank: {self.error!r}")
        flat = ops.work_buffer(tensor)
        bounds, needs = self._plan(flat.numel(), flat.element_size(), shape)
        bucket = self._buckets
        self._buckets += 1
        future = torch.futures.Future(devices=[self.device]) if self.device.type == "cuda" else torch.futures.Future()
        with self._lock:
            self._pending[bucket] = future
            self.peak_in_flight = max(self.peak_in_flight, len(self._pending))
        done = None
        if self.progress == "streams":
            if self.device.type == "cuda":   # the bucket's writes, queued on the caller's stream, come first
                self.lanes[0].stream.wait_stream(streams.current_stream(self.device))
                for lane in self.lanes:      # the host lets go of it before the lanes are done with it
                    streams.record_stream(flat, lane.stream)
            elif self.lanes[0].use is streams.use:   # stand-ins that keep count (streams.checking): the same
                self.lanes[0].stream.wait_stream(streams.current_stream(self.device))
            issue = self._issue_streams
        else:
            issue = self._issue_threads
        last = len(bounds) - 1
        prepared = self._prepared(tensor, flat, bounds)
        for k, (lo, hi) in enumerate(bounds):
            ready = prepared[k] if prepared is not None and prepared[k] is not None and not prepared[k].busy else None
            done = issue(ready or flat[lo:hi], needs[k == last], op, bucket, k,
                         (tensor, flat, future) if k == last else None)
        return Handle(tensor, future, bucket, done if self.progress == "streams" else None)

    def _plan(self, numel: int, element_size: int, shape) -> tuple[list, dict]:
        """The slices of a bucket of ``numel`` elements and each slice's staging, computed once
        per (elements, element size, layout) and looked up after: ``(bounds, {last?: need})``."""
        key = (numel, element_size, shape.D, shape.M)
        plan = self._plans.get(key)
        if plan is None:
            D, M = shape.D, shape.M
            best = default_slice_numel(numel, element_size, shape, default_tiers(self.device))
            step = max(D * M, min(best, self.slice_bytes // element_size) // (D * M) * (D * M))
            bounds = [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]
            needs = {}
            for last in (False, True):
                lo, hi = bounds[-1] if last else bounds[0]
                kinds = self._staging_need(hi - lo, element_size, D, M)
                needs[last] = (kinds, sum(aligned(b) for b in kinds.values()))
            plan = self._plans[key] = (bounds, needs)
        return plan

    def _nothing_to_send(self, tensor: torch.Tensor) -> Handle:
        """An empty tensor, or a group of one: done as soon as the buckets before it are
        (buckets complete in order, this one too)."""
        with self._lock:
            if self._pending:
                future = torch.futures.Future()
                self._followers.setdefault(max(self._pending), []).append((future, tensor))
                return Handle(tensor, future, -1)
        return _finished(tensor)

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
        """The five stages of one slice, issued at once on the four lanes' streams (the add
        runs on the diffuse's lane, just before it); each lane's stream waits for the previous
        lane's event and for the previous stage's handles -- the host waits for nothing.
        Returns the event recorded after the last stage of a bucket's last slice."""
        i = self._slices
        self._slices += 1
        if isinstance(piece, PreparedSlice):
            region, after = self.ring.reserve(need[1])
            one = piece.bind(op, region, need[0], i)
        else:
            pools, after = self._pools(need)
            one = Slice(piece, self.groups, op, self.p, pools, self._streams, index=i, inside=self.inside)
        rs, collect, diffuse, gather = self.lanes
        record = self.record
        t0 = time.perf_counter()
        works = _on(rs, after, (), one.reduce_scatter)
        self.ring.waited(after)
        if record:
            self._note(bucket, k, i, "reduce-scatter", t0)
            t0 = time.perf_counter()
        works = _on(collect, rs.event, works, one.collect)
        if record:
            self._note(bucket, k, i, "collect", t0)
            t0 = time.perf_counter()
        works = _on(diffuse, collect.event, works, one.add, one.diffuse)
        if record:
            self._note(bucket, k, i, "add", t0)
            self._note(bucket, k, i, "diffuse", t0)
            t0 = time.perf_counter()
        stream = gather.stream
        with gather.use(stream):
            stream.wait_event(diffuse.event)
            for w in works:
                w.wait()
            for w in one.all_gather():
                w.wait()
            one.finish()
            if finish is not None:
                self._complete(bucket, *finish)
        if record:
            self._note(bucket, k, i, "all-gather", t0)
        if need[1]:                          # a later slice will reuse these bytes: it waits for this
            self.ring.finished(gather.finish_event())
        if finish is None or not (gather.cuda or gather.use is streams.use):
            return None                             # not the last slice, or plain stand-ins: nothing to wait for
        done = streams.new_event(self.device)       # the bucket's own: its handle waits for it
        done.record(stream)
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

    def _complete(self, bucket: int, tensor: torch.Tensor, flat: torch.Tensor, future) -> None:
        ops.write_back(tensor.detach(), flat)
        future.set_result(tensor)            # on a GPU: under the last lane's stream, recorded there
        with self._lock:                     # only now: an empty bucket handed over meanwhile follows it
            self._pending.pop(bucket, None)
            followers = self._followers.pop(bucket, [])
        for follower, empty in followers:
            follower.set_result(empty)

    def fail(self, exc: BaseException) -> None:
        """A stage raised on this rank: every bucket still in flight fails with it."""
        with self._lock:
            if self.error is None:
                self.error = exc
            pending, self._pending = list(self._pending.values()), {}
            followers = [f for waiting in self._followers.values() for f, _ in waiting]
            self._followers = {}
        pending += followers
        rank = dist.get_rank() if dist.is_initialized() else -1
        for future in pending:
            if not future.done():
                future.set_exception(RuntimeError(f"hierarchical all-reduce in flight failed on rank {rank}: "
                                                  f"{type(exc).__name__}: {exc}"))

    # ---- the end ----------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for every bucket handed over so far."""
        with self._lock:
            pending = list(self._pending.values())
        for future in pending:
            future.wait()

    def close(self) -> None:
        """Wait for what is in flight, then stop the lanes' threads."""
        try:
            if self.error is None:
                self.synchronize()
        finally:
            for lane in self.lanes:
                if isinstance(lane, ThreadLane):
                    lane.close()
            self.lanes = []


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
    else:
        out = _run(works, stages)
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


_reducers: dict[tuple, HierarchicalAllReducer] = {}


def hierarchical_all_reduce_async(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, layout=None, *,
                                  memory_bytes: int = DEFAULT_MEMORY) -> Handle:
    """:meth:`HierarchicalAllReducer.all_reduce` on a reducer made on first use for
    (group, layout, device, memory), the same on every rank. Returns a :class:`Handle` at once."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"hierarchical_all_reduce_async: expected a torch.Tensor, got {type(tensor).__name__}")
    shape = None if layout is None else check_layout(layout)
    key = (id(dist.distributed_c10d._get_default_group()), id(group), shape, str(tensor.device), memory_bytes)
    if key not in _reducers:
        _reducers[key] = HierarchicalAllReducer(group, layout, memory_bytes=memory_bytes, device=tensor.device)
    return _reducers[key].all_reduce(tensor, op)
