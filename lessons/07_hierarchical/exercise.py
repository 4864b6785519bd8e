"""Lesson 7 exercise: hierarchical all-reduce, after Fairring.

Six tasks: the two simple hierarchies first, then Fairring's five stages on one slice,
then the slices pipelined, then the call made asynchronous -- buckets in flight -- and a
DDP communication hook on it. Tasks 1-5 have ``dist.all_reduce``'s contract -- in place,
every op and dtype, views -- plus ``layout=(D, M)``: D ranks per machine, M machines,
ranks machine-major (rank r is local rank r % D of machine r // D), two integers. Without
``layout`` it comes from the launcher's environment (``LOCAL_WORLD_SIZE``).

Given: :func:`stage_groups_for` -- the layout and a process group per stage (from
``collectives.hierarchical.layout``, the same groups the reference uses). You write the
communication.

Check your work:

    .venv/bin/python lessons/07_hierarchical/exercise.py                         # PASS/FAIL per task
    .venv/bin/torchrun --nproc-per-node 4 lessons/07_hierarchical/exercise.py    # the same, under torchrun
    make check LESSON=07                                                         # the same, from make
    make grade LESSON=07                                                         # the points

Each task is judged outside your process, on inputs drawn from secrets and on every
message and collective your ranks make, read where they reach the process group: bytes
across machines per rank must be 2(M − 1)/M · n/D (root-based: 2(M − 1)/M · n from each
machine's root only), inside 2(D − 1)/D · n, on the rail, with no collective over ranks of
several machines; tasks 3-5 build the stages (no all-reduce on the rail). A flat
all-reduce gives the right numbers and the wrong pattern: no points. Time yours against
the flat ring on the simulated cluster: ``.venv/bin/python -m collectives bench-hier
--impl exercise --quick``.

Course functions you may call (the sheet is checked against the code):

    ops.work_buffer(tensor) -> torch.Tensor
        A flat, contiguous buffer holding ``tensor``'s elements: the tensor's own memory
        when it is contiguous, else a copy (to be written back with :func:`write_back`).
    ops.write_back(tensor, flat) -> None
        Copy ``flat`` into ``tensor`` (its data, detached) unless it already is ``tensor``'s
        memory.
    ops.finish_(tensor, op, group_size) -> torch.Tensor
        Apply what remains after the combining: for AVG, one division by the group size.
    ops.combine_(acc, incoming, op) -> torch.Tensor
        ``acc <- acc (op) incoming``, in place. AVG accumulates as SUM (see
        :func:`finish_`).
    ops.post_exchange(recvs, sends, group=None) -> list
        Post every receive ``(buffer, src)``, then every send ``(buffer, dst)`` (global
        ranks); return the handles, each with ``wait()``. Empty buffers are not posted.
    collectives.hierarchical.layout.resolve(layout=None, group=None) -> Layout
        The layout of ``group`` (the world by default): ``layout`` if given, else the
        environment.
    collectives.hierarchical.layout.stage_groups(layout, group=None, *, ranks=None, name='') ->
                                                 StageGroups | None
        This rank's :class:`StageGroups` for ``layout`` over ``group``, created on first
        use.

The reference is ``collectives/hierarchical/``; the lesson page is docs/lessons/07-hierarchical.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist  # noqa: F401 - what the tasks use

from collectives import ops  # noqa: F401 - what the tasks use
from collectives.core.ops import ReduceOp
from collectives.course.grading.runner import run_tasks
from collectives.hierarchical.layout import StageGroups, resolve, stage_groups

LESSON = 7


def stage_groups_for(group=None, layout=None) -> StageGroups:
    """Given: this rank's :class:`StageGroups` -- ``.layout`` (``.D``, ``.M``), ``.d`` (local
    rank), ``.m`` (machine), and one process group per stage: ``.reduce_scatter`` and
    ``.all_gather`` (inside this machine), ``.collect`` and ``.diffuse`` (this rank's rail).
    A stage whose tier has one rank (D = 1 or M = 1) has ``None``: skip it."""
    return stage_groups(resolve(layout, group), group)


def root_based_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, layout=None) -> None:
    """Lesson 7, task 1: Horovod's first hierarchy: reduce to a root, all-reduce the roots, broadcast.

    TODO:     inside each machine reduce the tensor to local rank 0; all-reduce between
              the M roots; broadcast from local rank 0 inside each machine.
    APPROACH: ``g = stage_groups_for(group, layout)``; the root is ``g.inside_ranks()[0]``
              (a global rank). ``dist.reduce`` on ``g.reduce_scatter``, ``dist.all_reduce`` on
              ``g.collect`` (only where ``g.d == 0``), ``dist.broadcast`` on ``g.all_gather``.
    EXAMPLE:  layout (2, 2), tensor = [r] on rank r -> [6] everywhere; only ranks 0 and 2
              send across machines, the whole tensor.
    HINT:     work on ``ops.work_buffer(tensor.detach())`` and ``ops.write_back`` at the end;
              AVG: reduce with SUM, then ``ops.finish_`` once, on the root, before the broadcast.
              Return early for an empty tensor or a group of one rank.
    CALLS:    ops.work_buffer, ops.write_back, ops.finish_
    """
    raise NotImplementedError("Lesson 7, task 1: root_based_all_reduce")


def rail_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, layout=None) -> None:
    """Lesson 7, task 2: reduce-scatter inside, all-reduce on the rail, all-gather inside.

    TODO:     split the tensor into D parts; after a reduce-scatter inside the machine,
              local rank d holds part d summed over its machine; all-reduce part d with the
              ranks of rail d (the same d on every machine); all-gather inside the machine.
    APPROACH: copy the tensor into a zero-padded flat buffer of D·⌈n/D⌉ elements viewed
              [D, ⌈n/D⌉]; ``dist.reduce_scatter_tensor(parts[d], padded, op, group=g.reduce_scatter)``,
              ``dist.all_reduce(parts[d], op, group=g.collect)``,
              ``dist.all_gather_into_tensor(padded, parts[d], group=g.all_gather)``.
    EXAMPLE:  layout (2, 2), n = 8: each rank sends 4·(1/2) = 4 elements inside in each of
              the two inside stages, and 2·(1/2)·4 = 4 elements across.
    HINT:     skip a stage whose group is None. AVG: SUM, then ``ops.finish_(parts[d], op, p)``
              before the all-gather. Copy ``padded[:n]`` back into the tensor.
    CALLS:    ops.work_buffer, ops.write_back, ops.finish_
    """
    raise NotImplementedError("Lesson 7, task 2: rail_all_reduce")


def one_slice_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, layout=None) -> None:
    """Lesson 7, task 3: Fairring's five stages on one slice viewed [D, M, −1].

    TODO:     with ``blocks = flat[:main].view(D, M, -1)`` (``main`` = n rounded down to a
              multiple of D·M), rank (d, m):
              1. reduce-scatter inside: ``blocks[d]`` <- [d, :, :] summed over the machine;
              2. collect on the rail: all-to-all ``blocks[d]`` (row m' goes to machine m')
                 into a staging buffer [M, −1];
              3. add: ``blocks[d, m]`` <- the M staging rows combined with ``op``;
              4. diffuse on the rail: all-gather ``blocks[d, m]`` into ``blocks[d]``;
              5. all-gather inside: ``blocks[d]`` into ``blocks``.
              The tail (n mod D·M elements) goes through a padding buffer of D·M elements
              viewed [D, M, 1] that takes the same five stages.
    APPROACH: ``dist.reduce_scatter_tensor``, ``dist.all_to_all_single``,
              ``dist.all_gather_into_tensor`` on flat views (``.view(-1)``), each on its
              stage's group. Staging: with D > 1 use ``blocks[(d + 1) % D]`` -- after stage 1
              this rank no longer needs it, and stage 5 overwrites it; with D = 1 allocate it.
    EXAMPLE:  layout (2, 2), n = 8, rank (d=0, m=1) = rank 2: after stage 1 it holds
              elements 0-3 summed over ranks 2 and 3; after stage 3 it owns elements 2-3
              summed over all four ranks.
    HINT:     AVG: SUM everywhere, ``ops.finish_`` on ``blocks[d, m]`` after stage 3 -- one
              division. Skip the main part when it is empty (n < D·M), and a stage whose
              group is None. ``ops.combine_(acc, row, op)`` does one step of the add.
              The library's collectives are the plain way, and pass. The reference posts
              the same bytes as messages, receives first (``ops.post_exchange``), as
              Fairring does with ncclSend/ncclRecv (the page says why it does so on gloo).
              Try it once yours passes, and time both with ``bench-hier --impl exercise``.
    CALLS:    ops.work_buffer, ops.write_back, ops.finish_, ops.combine_, ops.post_exchange
    """
    raise NotImplementedError("Lesson 7, task 3: one_slice_all_reduce")


def hierarchical_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, layout=None,
                            slice_numel: int | None = None) -> None:
    """Lesson 7, task 4: slices pipelined, each stage on its own group, waiting only where needed.

    TODO:     cut the flat tensor into slices of ``slice_numel`` elements (rounded down to a
              multiple of D·M; ``None``: 4 slices). Run the five stages of task 3 on every
              slice, issuing each with ``async_op=True``, so that stage k of slice i + 1
              runs while stage k + 1 of slice i does.
    APPROACH: a wavefront: at tick t, for k from the last stage down to the first, run
              stage k of slice t − k: first ``wait()`` the handles of that slice's stage
              k − 1, then issue stage k and keep its handles. After the last tick, wait for
              the all-gathers and copy each padding back.
    EXAMPLE:  layout (1, 4), 3 slices: the collect of slice 1 is issued before the diffuse
              of slice 0 has finished -- two operations in flight on different groups.
    HINT:     every rank must issue the same operations on each group in the same order:
              the wavefront does that. With D = 1 each slice in flight needs its own staging
              buffer -- or reuse a few, once the slice that used one has finished its add.
    CALLS:    ops.work_buffer, ops.write_back, ops.finish_, ops.combine_, ops.post_exchange
    """
    raise NotImplementedError("Lesson 7, task 4: hierarchical_all_reduce")


def hierarchical_all_reduce_async(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, layout=None, *,
                                  memory_bytes: int = 64 << 20):
    """Lesson 7, task 5: the asynchronous call -- a handle at once, buckets in flight in bounded memory.

    TODO:     return at once a handle with ``wait()`` (returns ``tensor``, reduced in place)
              and ``get_future()`` (a ``torch.futures.Future`` whose value is ``tensor``),
              while the reduction goes on in the background. Many calls (buckets) may be in
              flight together; they complete in the order they were made, and the staging
              the slices in flight hold together never exceeds ``memory_bytes``.
    APPROACH: an engine per (group, layout), made on the first call, with process groups
              of its own: ``stage_groups(resolve(layout, group), group, name="in flight")``
              (your threads must never share a group with the caller's calls). On a CPU a
              stage's stream is a *thread*: one per stage, each running its stage's work for
              one slice after another, from a queue. Slice i's stage k waits for its stage
              k − 1 (a ``threading.Event``), ``wait()``s that stage's handles, then posts its
              own (task 3's stages). Every rank hands the slices over in the same order, and
              each group matches its messages in order, so any interleaving of the threads
              is correct. Memory: a slice reserves its staging (task 3's partial sums,
              staging rows, padding) from the budget before its first stage and gives it
              back after its last; when the budget is spent, the next slice waits.
    EXAMPLE:  layout (2, 2): ``h = [hierarchical_all_reduce_async(b, layout=(2, 2)) for b in
              buckets]`` returns before any other rank has called; ``[x.wait() for x in h]``
              leaves every bucket equal to ``dist.all_reduce``'s, bucket 0 done first.
    HINT:     check the arguments on the caller's thread, before anything is queued (a
              list, a float layout: the same error on every rank). The first call makes
              process groups: every rank must make it, so it may wait for the others. An
              empty tensor or a group of one: a handle that completes after the buckets
              before it. ``future.set_result(tensor)`` from your last stage's thread
              completes a bucket; ``future.set_exception(...)`` reports a failure.
    CALLS:    collectives.hierarchical.layout.resolve, collectives.hierarchical.layout.stage_groups,
              ops.work_buffer, ops.write_back, ops.finish_, ops.combine_
    """
    raise NotImplementedError("Lesson 7, task 5: hierarchical_all_reduce_async")


@dataclass
class HierarchicalHookState:
    """Given: what :func:`hierarchical_hook` keeps between buckets (``register_comm_hook``'s
    first argument): the group, the layout, the staging budget, and a count of buckets."""

    group: object = None
    layout: tuple | None = None
    memory_bytes: int = 64 << 20
    buckets: int = 0


def hierarchical_hook(state: HierarchicalHookState, bucket):
    """Lesson 7, task 6: a DDP communication hook that keeps buckets in flight.

    TODO:     average the bucket's gradients over the ranks with task 5's call and return
              the bucket's future *without waiting*: DDP goes on with backward, hands over
              the next bucket, and waits for every future at the end of backward.
    APPROACH: ``flat = bucket.buffer()``; divide it by the world size first, as DDP's own
              ``allreduce_hook`` does (``flat.div_(p)``: then a SUM), so that on
              integer-valued gradients your parameters equal dense DDP's bit for bit;
              ``return hierarchical_all_reduce_async(flat, ...).get_future()``.
    EXAMPLE:  ``ddp = DistributedDataParallel(model, bucket_cap_mb=4)``;
              ``ddp.register_comm_hook(HierarchicalHookState(layout=(2, 2)), hierarchical_hook)``;
              train: after each step, the parameters equal those of DDP without the hook.
    HINT:     no ``wait()`` in the hook. DDP calls it in bucket order on every rank, which
              is the order task 5 needs. Leave ``bucket`` and the return unannotated: DDP
              compares the annotations it finds with its own types.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 7, task 6: hierarchical_hook")


if __name__ == "__main__":
    run_tasks(LESSON)
