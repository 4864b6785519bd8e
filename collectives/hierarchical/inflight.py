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

    lanes            slices of bucket 0 | bucket 1 | bucket 2 ...
    reduce-scatter   0a 0b 0c 1a 1b 2a 2b 2c
    collect             0a 0b 0c 1a 1b 2a 2b 2c             (a lane runs its stages for
    add, diffuse           0a 0b 0c 1a 1b 2a ...             one slice after another, in
    all-gather                0a 0b 0c 1a 1b ...  -> bucket 0 done, then 1, then 2    order)

**Lanes.** Each communication stage has a *lane* that runs its work in order -- Fairring's
stream per stage; the add sends nothing and the diffuse cannot start before it, so the two
share one (four lanes). On a GPU a lane is a CUDA stream: the host issues every stage of a
bucket at once (Fairring's order, slice by slice), and events make each stage's stream wait
for the one before; NCCL progresses on its own. A tier of one rank has no stage to run on
its lanes, and they are left out: on one machine (M = 1) the reduce-scatter's lane hands
straight to the all-gather's, with one rank per machine (D = 1) the collect's lane starts
the slice. On a CPU (gloo) the host cannot issue a stage before the previous one's messages
have arrived (its sum must be added first), so a lane is a *thread*, the CPU's stream: it
takes its stage's work in order and blocks on the waits a GPU stream would make, while the
caller's thread goes on (computing backward, handing over the next bucket).
An event is a ``threading.Event`` set when the lane gets there.

**The host's work, once.** A bucket tensor handed over again (DDP's buckets, step after
step) reuses the slices prepared on its first call (:mod:`.program`: every view and
message worked out once); the plan of a size is looked up, not recomputed; a hand-off
between lanes is one event, and a stream lane reuses its own. On a GPU this is what the
host pays per bucket besides NCCL's calls (``bench-hier host-cost`` measures it).

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

import itertools
import threading

import torch
import torch.distributed as dist

from ..core import ops, streams
from ..core.ops import ReduceOp
from .issue import Issuing
from .lanes import StagingRing, StreamLane, ThreadLane, aligned
from .layout import check_layout, checked_layout, resolve, stage_groups
from .pipeline import default_slice_numel, default_tiers, inside_mode

STAGES = ("reduce-scatter", "collect", "add", "diffuse", "all-gather")
LANES = ("reduce-scatter", "collect", "add and diffuse", "all-gather")   # the add runs just before the diffuse
DEFAULT_MEMORY = 64 << 20       # bytes of staging, all slices in flight together


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


class HierarchicalAllReducer(Issuing):
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
        progress: ``"threads"`` (a lane is a thread: the default on a CPU) or
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
        # the lanes a slice passes through: a tier of one rank leaves its stages' lanes out
        self._used = (self.lanes if D > 1 and M > 1 else [self.lanes[0], self.lanes[3]] if M == 1
                      else self.lanes[1:]) if self.lanes else []
        self._entry = streams.new_event(self.device) if self.progress == "streams" else None
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
            first = self._used[0]            # the lane that starts every slice
            if self.device.type == "cuda":   # the bucket's writes, queued on the caller's stream, come first
                self._entry.record(streams.current_stream(self.device))
                first.stream.wait_event(self._entry)
                for lane in self._used:      # the host lets go of it before the lanes are done with it
                    streams.record_stream(flat, lane.stream)
            elif first.use is streams.use:   # stand-ins that keep count (streams.checking): the same
                first.stream.wait_stream(streams.current_stream(self.device))
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
