"""Lesson 12: all-reduce without messages -- every rank reads its peers' memory.

On one machine the ranks can map one segment (:class:`~collectives.symmetric.workspace.SharedWorkspace`).
Then an all-reduce needs no message at all: each rank writes its input into its own slot,
waits until every peer has written (a barrier of flags in the same memory), and reads::

    one-shot, p = 4: every rank reads every slot and reduces all of it

        slot 0  [a0 a1 a2 a3]  --+
        slot 1  [b0 b1 b2 b3]  --+-- rank r: out = a + b + c + d   (rank 0's slot first, always)
        slot 2  [c0 c1 c2 c3]  --+
        slot 3  [d0 d1 d2 d3]  --+

    two-shot: a reduce-scatter by reading, then an all-gather by reading

        1. rank r reduces chunk r of every slot and writes it back into chunk r of ITS slot
           (no peer reads that chunk of that slot in this phase: it is safe to overwrite)
        2. barrier
        3. rank r copies chunk j out of slot j, for every j

Cost, n bytes on p ranks (σ a barrier, ρ per byte read from a peer, γ per byte combined,
ω per byte written to the own slot)::

    one-shot   n·ω + σ + (p − 1)·n·ρ + (p − 1)·n·γ
    two-shot   n·ω + 2σ + 2(p − 1)/p·n·ρ + (p − 1)/p·n·γ

The one-shot reads p − 1 whole tensors and combines them all, but synchronises once; the
two-shot reads and combines a ring's worth (2(p − 1)/p·n) but synchronises twice. Small
tensors: the one-shot; large ones: the two-shot (:mod:`collectives.symmetric.cost`).

Every rank runs the same reduction over the same slots, so every rank ends with the same
bits -- a floating-point sum depends on its order, and ``dist.all_reduce`` promises equal
results on every rank. Up to four ranks that order is rank order, 0, 1, ..., p − 1; from
five, torch's reduction over the slot axis groups the rows differently (the bits may then
differ from a plain loop's, by a rounding, but never from rank to rank).

The guards (see :mod:`~collectives.symmetric.workspace`): epoch flags, and two buffers used
in turn so that the next call's write never lands on a slot a slow peer still reads.
Memory ordering: the data is written before the flag and read after it; x86-64 keeps
stores in order and loads in order (TSO), so a peer that sees the flag sees the data. A
weaker machine (Arm) needs a release fence before the flag store and an acquire fence
after the flag load, which Python cannot issue: the workspace refuses to be made there
(the GPU version issues them explicitly).

After DeepSpeed's shared-memory CPU all-reduce (each rank copies into a shared buffer,
then reduces from it) and vLLM's and TensorRT-LLM's custom all-reduce on GPUs.
"""

from __future__ import annotations

import os
import time

import torch

from ..core import ops
from ..core.ops import ReduceOp
from .workspace import HOME, SharedWorkspace, workspace

__all__ = ["flag_barrier", "one_shot_all_reduce", "two_shot_all_reduce", "reduce_rows_"]

SPINS = 16          # looks at the flags with a yield in between, before napping
NAP = 5e-6          # the first nap (s); it doubles every 16 naps ...
MAX_NAP = 1e-3      # ... up to 1 ms
DOUBLINGS = 8       # 5 µs · 2 ** 8 > 1 ms: the exponent stops growing here (a float cannot hold 2 ** 1024)


def flag_barrier(ws: SharedWorkspace) -> None:
    """Wait until every rank of the workspace has called this as often as this rank has.

    Epoch flags: the k-th barrier raises this rank's flag to k; a rank passes when every
    flag is at least k. A flag only grows, so a fast rank that has passed (and maybe
    started the next barrier, k + 1) never hides its arrival from a slow one::

        rank 0:  flag 0 = 5 ... all >= 5? yes, go ...  flag 0 = 6 ... all >= 6? wait
        rank 1:  flag 1 = 5 ............ all >= 5?  yes (flag 0 is 6 >= 5), go

    ``ws.epochs = False`` is the naive barrier, for the lesson's hazard: set the flag to 1,
    wait for all ones, reset to 0 -- a fast rank's reset can come before a slow rank has
    looked, and the slow rank then waits for a 1 that never comes.
    """
    me, flags = ws.rank, ws.flags
    ws.epoch += 1
    target = ws.epoch if ws.epochs else 1
    flags[me] = target                     # after our slot's data: TSO keeps the order
    ws.pause_at("posted")
    started = time.monotonic()
    spins = 0
    while min(flags.tolist()) < target:
        spins += 1
        if spins < SPINS:
            os.sched_yield()               # a peer is probably a moment away: look again soon
        else:                              # more ranks than cores: give the core to the ones working
            time.sleep(min(NAP * 2 ** min((spins - SPINS) // 16, DOUBLINGS), MAX_NAP))
        if spins % 64 == 0 and time.monotonic() - started > ws.timeout:
            raise ws.timed_out(time.monotonic() - started, target)
    if not ws.epochs:
        flags[me] = 0                      # the hazard: a slow peer may not have seen our 1


def reduce_rows_(out: torch.Tensor, rows: torch.Tensor, op) -> torch.Tensor:
    """``out`` <- row 0 (op) row 1 (op) ... (op) row p − 1 of ``rows`` (one row per slot).

    The plain loop -- ``out.copy_(rows[0])``, then ``ops.combine_(out, rows[j], op)`` for
    j = 1 .. p − 1 -- reads the running result back p − 1 times; torch's reduction over the
    slot axis reads each slot once and writes ``out`` once. Up to four rows it adds them in
    row order (float32 and float64: the loop's bits); from five rows it groups them
    otherwise, and a float sum may differ from the loop's by a rounding. bfloat16 and
    float16 are accumulated in float32 and rounded once. Every rank runs the same reduction
    on the same slots, so every rank ends with the same bits, whatever p.
    AVG is summed here and divided by :func:`ops.finish_`.
    """
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return torch.sum(rows, 0, dtype=out.dtype, out=out)
    if op == ReduceOp.PRODUCT:
        return torch.prod(rows, 0, dtype=out.dtype, out=out)
    if op == ReduceOp.MIN:
        return torch.amin(rows, 0, out=out)
    if op == ReduceOp.MAX:
        return torch.amax(rows, 0, out=out)
    raise ValueError(f"unsupported op {op}")


def _prepare(tensor: torch.Tensor, op, group, ws: SharedWorkspace | None, what: str):
    """Checks, the flat buffer, and the workspace; None when there is nothing to do."""
    if not ops.check_all_reduce_args(tensor, op, group, what=what):
        return None                        # not in the group: nothing to do, as dist.*
    rank, p = ops.group_rank_and_size(group)
    nbytes = tensor.numel() * tensor.element_size()
    if ws is None:
        ws = workspace(group, nbytes)
    elif ws.size != p or ws.rank != rank:
        raise ValueError(f"{what}: the workspace is rank {ws.rank} of {ws.size}, "
                         f"this rank is {rank} of {p} in the group")
    if tensor.numel() == 0:
        return None
    flat = ops.work_buffer(tensor)
    # a GPU tensor goes through the host's shared memory and back: correct, not fast (the
    # GPU version of the lesson is collectives.symmetric.gpu); this keeps the tour whole
    return rank, p, flat if flat.device.type == "cpu" else flat.cpu(), ws


def _finish(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Write the result back: into the tensor's device when it was staged, then into a view."""
    if flat.device != tensor.device:
        tensor.detach().copy_(flat.view(tensor.shape))
    else:
        ops.write_back(tensor, flat)


def one_shot_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, *,
                        workspace: SharedWorkspace | None = None) -> None:
    """All-reduce ``tensor`` in place by reading every peer's slot: one barrier, no message.

    ``workspace``: the segment to use (default: the group's cached one, made on first use
    or when the tensor outgrows it -- the only time a message is sent).
    """
    ready = _prepare(tensor, op, group, workspace, "one_shot_all_reduce")
    if ready is None:
        return
    rank, p, flat, ws = ready
    with ws.lock:                                     # one call at a time on this rank's workspace
        n, dtype = flat.numel(), flat.dtype
        buffer = ws.begin(n * flat.element_size(), dtype, op, "one_shot_all_reduce")
        ws.slot(buffer, rank, dtype, n).copy_(flat)   # 1. publish our input
        flag_barrier(ws)                              # 2. every slot is written
        ws.agree("one_shot_all_reduce", dtype, op)    #    (every rank passed the same: else all raise)
        ws.pause_at("read")
        reduce_rows_(flat, ws.rows(buffer, dtype, 0, n), op)   # 3. reduce slots 0 .. p-1
        ops.finish_(flat, op, p)
    _finish(tensor, flat)


def two_shot_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, *,
                        workspace: SharedWorkspace | None = None) -> None:
    """All-reduce ``tensor`` in place: reduce-scatter by reading, then all-gather by reading.

    Rank r reduces chunk r (``ops.chunk_bounds``) of every slot (the same reduction on
    every rank) and writes the result into chunk r of its own slot; after a second
    barrier every rank copies chunk j out of slot j. Two barriers, no message.

    A tensor that is this rank's home in ``workspace`` (:meth:`SharedWorkspace.home`, on
    every rank) is reduced where it lives: no copy in, and a third barrier before returning.
    """
    ready = _prepare(tensor, op, group, workspace, "two_shot_all_reduce")
    if ready is None:
        return
    rank, p, flat, ws = ready
    with ws.lock:                                     # one call at a time on this rank's workspace
        if ws.holds(flat):
            _two_shot_at_home(flat, op, rank, p, ws)
        else:
            _two_shot(flat, op, rank, p, ws)
    _finish(tensor, flat)


def _two_shot(flat: torch.Tensor, op, rank: int, p: int, ws: SharedWorkspace) -> None:
    n, dtype = flat.numel(), flat.dtype
    buffer = ws.begin(n * flat.element_size(), dtype, op, "two_shot_all_reduce")
    slots = [ws.slot(buffer, r, dtype, n) for r in range(p)]
    slots[rank].copy_(flat)                           # 1. publish our input
    flag_barrier(ws)                                  # 2. every slot is written
    ws.agree("two_shot_all_reduce", dtype, op)
    ws.pause_at("read")
    bounds = ops.chunk_bounds(n, p)
    lo, hi = bounds[rank]
    mine = flat[lo:hi]                                # 3. reduce chunk r of slots 0 .. p-1
    reduce_rows_(mine, ws.rows(buffer, dtype, lo, hi), op)
    ops.finish_(mine, op, p)
    slots[rank][lo:hi].copy_(mine)                    # only this rank reads this chunk of this slot
    flag_barrier(ws)                                  # 4. every chunk is reduced
    ws.pause_at("gather")
    for peer, (a, b) in enumerate(bounds):            # 5. gather the others' chunks
        if peer != rank:
            flat[a:b].copy_(slots[peer][a:b])


def _two_shot_at_home(home: torch.Tensor, op, rank: int, p: int, ws: SharedWorkspace) -> None:
    """The two-shot on inputs that already live in the segment, each rank's in its home.

    The same reads as above without the copy-in; but the home is the caller's tensor, and
    the caller writes its next input there as soon as this returns. A slow peer may still
    be copying our chunk out of it then, so the call ends with a third barrier: after it,
    nobody reads our home until our next call's first barrier (``ws.closing``, the guard).
    """
    n, dtype = home.numel(), home.dtype
    ws.begin(n * home.element_size(), dtype, op, "two_shot_all_reduce")   # what it passes, for agree()
    flag_barrier(ws)                                  # 1. every home holds its rank's input
    ws.agree("two_shot_all_reduce", dtype, op)
    ws.pause_at("read")
    bounds = ops.chunk_bounds(n, p)
    lo, hi = bounds[rank]
    mine = torch.empty(hi - lo, dtype=dtype)          # not into the home: its chunk is one of the rows
    reduce_rows_(mine, ws.rows(HOME, dtype, lo, hi), op)
    ops.finish_(mine, op, p)
    home[lo:hi].copy_(mine)                           # only this rank reads this chunk of this home
    flag_barrier(ws)                                  # 2. every chunk is reduced
    ws.pause_at("gather")
    for peer, (a, b) in enumerate(bounds):            # 3. gather the others' chunks from their homes
        if peer != rank:
            home[a:b].copy_(ws.slot(HOME, peer, dtype, n)[a:b])
    if ws.closing:
        flag_barrier(ws)                              # 4. nobody reads our home any more
