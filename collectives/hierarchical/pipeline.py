"""Pipelined slices: stage k of slice i + 1 runs while stage k + 1 of slice i does.

The tensor is cut into slices (a multiple of D·M elements each, so only the last one
needs the padding slot). Every stage has a stream of its own and a process group of its
own; slice i's stage k starts when its stage k − 1 is done, whatever the other slices
are doing::

    time ─►        t0      t1        t2        t3         t4         t5        t6
    reduce-scatter  s0      s1        s2
    collect                 s0        s1        s2
    add                               s0        s1         s2
    diffuse                                     s0         s1         s2
    all-gather                                             s0         s1        s2

Inside a machine the links are fast and across machines slow, so the inside stages of
one slice hide under the slow stages of its neighbours: at best the time of the
across-machine stages alone. Fairring chains the stages with CUDA events; here it is the
same code on every device: each stage is issued with ``async_op=True`` under its stream
(:mod:`collectives.streams`), and the next stage of the same slice first calls ``wait()``
on its handles *under its own stream*. On NCCL that makes that stream wait -- the host
moves on at once; on gloo (CPU) it blocks the host until the operation is done, and only
there: the operations of other slices, on other groups, keep running on gloo's threads.

The schedule is a wavefront, the same on every rank: at tick t, stage k works on slice
t − k, the last stage first, so that a slot is released before the next slice asks for it.
Every rank therefore issues the same operations on each group in the same order.

**Several communicators in flight, on NCCL.** NCCL's guide warns that operations in
flight on several communicators at once can deadlock: an NCCL kernel spins on the GPU
until its peers' data arrives, so if rank A launches communicator 1's kernel before
communicator 2's and rank B the other way round, each GPU can sit in (or behind) the
kernel its peer has not started. NCCL's rule is to submit them in the same order on every
rank. The wavefront is that order: a function of the slice count alone, identical on
every rank, issued from one thread; a stream waits only for an *earlier* operation of the
same order, so the oldest unfinished operation can always run everywhere. What NCCL cannot
promise is that four communicators' kernels fit on the GPU together (it might take more
blocks per operation one day); Fairring makes the same bet. On gloo there is no such
hazard -- each group has its own connections and threads -- and only the order *within*
each group must agree (:mod:`.inflight` relies on that).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from ..core import ops, streams
from ..core.ops import ReduceOp
from . import cost
from .layout import Layout, checked_layout, stage_groups
from .slice import NUM_SLOTS, Slice, SlotPool

_state: dict[tuple, dict] = {}     # per (groups, device): the stage streams and the slot pools


def slice_resources(groups, device) -> dict:
    """The stage streams and the slot pools of ``groups`` on ``device``, made on first use
    (and again inside and after a :func:`streams.checking` block, whose streams keep count)."""
    key = (id(groups), str(device))
    if key not in _state or _state[key]["checker"] is not streams.active_checker():
        _state[key] = {
            "checker": streams.active_checker(),
            "streams": [streams.new_stream(device, name=f"the {stage} stream")
                        for stage in ("reduce-scatter", "collect", "add", "diffuse", "all-gather")],
            "pools": {"staging": SlotPool(NUM_SLOTS), "padding": SlotPool(NUM_SLOTS),
                      "partials": SlotPool(NUM_SLOTS)},
            # one mark per stage, recorded again for every slice (see hierarchical_all_reduce)
            "marks": [streams.new_event(device) for _ in range(6)],
        }
    return _state[key]


def default_tiers(device) -> cost.Tiers:
    """The tiers to plan with for tensors on ``device`` in this world: NCCL over NVLink is
    not gloo over loopback, and NCCL's GPUs on one host (no ``LOCAL_WORLD_SIZE`` below the
    world's size) are NVLink on both tiers (:func:`cost.tiers_for`)."""
    backend = dist.get_backend() if dist.is_initialized() else None
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    one_host = not local.isdigit() or (dist.is_initialized() and int(local) >= dist.get_world_size())
    return cost.tiers_for(backend, torch.device(device).type, one_host)


def default_slice_numel(numel: int, element_size: int, layout: Layout,
                        tiers: cost.Tiers | None = None) -> int:
    """The slice size the tier-aware cost model finds fastest, from :func:`cost.slice_plan`:
    computed once per (elements, dtype size, layout, tiers), then looked up."""
    return cost.slice_plan(numel, element_size, layout.D, layout.M, tiers or cost.DEFAULT_TIERS)


def inside_mode(device, inside: str | None = None) -> str:
    """How stages 1 and 5 go: ``"collectives"`` (NCCL's in-place reduce-scatter and
    all-gather) on a GPU, ``"messages"`` on gloo (see :mod:`.slice`)."""
    if inside is None:
        return "collectives" if streams.is_cuda(device) else "messages"
    if inside not in ("collectives", "messages"):
        raise ValueError(f"inside must be 'collectives' or 'messages', got {inside!r}")
    return inside


def hierarchical_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, layout=None,
                            slice_numel: int | None = None, initial_event=None, *,
                            inside: str | None = None, _what: str = "hierarchical_all_reduce") -> None:
    """All-reduce ``tensor`` in place, hierarchically: five stages per slice, slices pipelined.

    Args:
        tensor: any tensor; a non-contiguous one is reduced through a contiguous copy.
        op: SUM, PRODUCT, MIN, MAX or AVG (SUM, then one division of the owned block).
        group: the process group (the world by default).
        layout: ``(D, M)`` ranks per machine and machines, two integers; default from the
            environment (``LOCAL_WORLD_SIZE``). It must match the group's size.
        slice_numel: elements per slice (rounded down to a multiple of D·M); default from
            the cost model's plan, computed once per (elements, dtype, layout, tiers) and
            remembered; ``slice_numel >= tensor.numel()`` runs one slice.
        initial_event: an event (``collectives.streams``) the first stage waits for, so
            that writes the caller queued before it are seen; default: the caller's stream.
        inside: ``"collectives"`` or ``"messages"`` for stages 1 and 5; default
            collectives on a GPU (NCCL's own), messages on a CPU (gloo).

    Cost, n bytes, one slice: inside 2(D − 1)·α_in + 2(D − 1)/D·n·β_in, across
    2(M − 1)·α_x + 2(M − 1)/M·n/D·β_x per rank (:func:`cost.tiered`: every message its α);
    pipelined over S slices, about the across-machine stages alone plus one slice of the others.
    """
    shape = checked_layout(tensor, op, group, layout, _what, slice_numel=slice_numel)
    if shape is None:
        return                         # not in the group: nothing to do, as dist.all_reduce
    p = dist.get_world_size(group)
    if tensor.numel() == 0:
        return
    if p == 1:
        return              # one rank: SUM, MIN, MAX, PRODUCT and AVG leave it as it is
    if slice_numel is not None and slice_numel < 1:
        raise ValueError(f"{_what}: slice_numel must be positive, got {slice_numel}")
    groups = stage_groups(shape, group)
    flat = ops.work_buffer(tensor.detach())
    device = flat.device
    state = slice_resources(groups, device)
    stage_streams, pools, marks = state["streams"], state["pools"], state["marks"]
    mode = inside_mode(device, inside)
    DM = shape.D * shape.M
    if slice_numel is None:
        slice_numel = default_slice_numel(flat.numel(), flat.element_size(), shape, default_tiers(device))
    step = max(DM, slice_numel // DM * DM)
    bounds = [(lo, min(lo + step, flat.numel())) for lo in range(0, flat.numel(), step)]

    caller = streams.current_stream(device)
    if initial_event is not None:
        stage_streams[0].wait_event(initial_event)
    else:
        stage_streams[0].wait_stream(caller)
    # Recorded into a CUDA graph (one capture of many buckets issues them all with one launch):
    # the graph may wait only on events recorded inside it, and must end with every stream it
    # forked joined again.
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing:
        for pool in pools.values():
            pool.restart(stage_streams[0])

    slices: list[Slice | None] = [None] * len(bounds)
    pending: dict[int, list] = {}      # slice -> handles its next stage must wait for

    def run_stage(k: int, i: int) -> None:
        stream = stage_streams[min(k, 4)]
        with streams.use(stream):
            for work in pending.pop(i, []):
                work.wait()                           # NCCL: this stream waits; gloo: the host
            works = []
            if k == 0:
                lo, hi = bounds[i]
                slices[i] = Slice(flat[lo:hi], groups, op, p, pools, stage_streams, index=i, inside=mode)
                works = slices[i].reduce_scatter()
            elif k == 1:
                works = slices[i].collect()
            elif k == 2:
                slices[i].add()
            elif k == 3:
                works = slices[i].diffuse()
            elif k == 4:
                works = slices[i].all_gather()
            else:
                slices[i].finish()
                slices[i] = None                      # its views are no longer needed
                return
            # This stream's own work (copies, the add) and everything it waited for: the next
            # stage waits for this mark too, so a skipped stage (D or M = 1) still orders them.
            # One event per stage serves every slice: stage k + 1 waits for slice i's mark at the
            # next tick, before stage k records it again for slice i + 1 (the last stage goes
            # first), and a stream's wait takes the event as it stands when the wait is issued.
            mark = marks[k]
            mark.record(stream)
            pending[i] = works + [mark]

    stages = 6   # the five stages, and the copy back of the padding
    for tick in range(len(bounds) + stages - 1):
        for k in reversed(range(stages)):
            i = tick - k
            if 0 <= i < len(bounds):
                run_stage(k, i)

    for stream in stage_streams if capturing else stage_streams[4:]:
        caller.wait_stream(stream)
    ops.write_back(tensor.detach(), flat)


def one_slice_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, layout=None) -> None:
    """:func:`hierarchical_all_reduce` with the whole tensor as one slice: no pipelining."""
    numel = tensor.numel() if isinstance(tensor, torch.Tensor) else 1   # not a tensor: the check says so
    hierarchical_all_reduce(tensor, op, group, layout, slice_numel=max(1, numel), _what="one_slice_all_reduce")


def slices_of(numel: int, layout: Layout, slice_numel: int) -> int:
    """How many slices :func:`hierarchical_all_reduce` cuts ``numel`` elements into."""
    step = max(layout.size, slice_numel // layout.size * layout.size)
    return math.ceil(numel / step) if numel else 0
