"""``sparse_all_reduce``: selection, error feedback and a transport, behind one contract.

The function every other part of the lesson is for: it adds the residual, selects (see
:mod:`.select`), keeps the rest as the new residual, moves the pairs with the transport
asked for (:mod:`.allgather`, :mod:`.split`, or the dense ring on the kept values; ``"auto"``
asks the cost model, :mod:`.cost`, with the group's measured link and processor) and leaves
the sum in the tensor.

:func:`sparse_all_reduce_async` is the second step: the same work, with the transport's
collective left in flight and a future to chain on -- what a DDP communication hook returns
so that communication overlaps backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real

import torch
import torch.distributed as dist

from ..core import ops, trace
from .allgather import allgather_sum_, allgather_sum_async, exchange_counts
from .cost import TRANSPORTS, SparseProfile, choose_transport
from .profile import profile_for
from .select import (
    MAX_NUMEL,
    SELECTIONS,
    keep_count,
    threshold_indices,
    topk_indices,
    topk_per_segment,
    validate_selection,
)
from .split import SplitInfo, split_sum_

ReduceOp = dist.ReduceOp
TRANSPORT_CHOICES = ("auto",) + TRANSPORTS
SELECTION_CHOICES = ("auto",) + SELECTIONS


@dataclass
class SparseInfo:
    """What one call did on this rank."""

    transport: str                     # "allgather", "split", "dense", "local" (one rank), "none" (not a member)
    kept: int                          # elements this rank sent
    counts: list[int] | None = None    # every rank's count (threshold mode), else None
    split: SplitInfo | None = None     # the split transport's exchange sizes
    indices: torch.Tensor | None = None    # the indices sent (int64, of the flattened tensor); None: all


def _check(tensor, residual, density, threshold, transport, selection, op, group, state, segments) -> bool:
    """Every argument, before anything is touched; then the group's check (and check mode's
    comparison across ranks). Returns whether this rank is in the group."""
    what = "sparse_all_reduce"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise ValueError(f"{what}: {tensor.dtype} has no magnitude to rank by; use a real floating or "
                         "integer dtype")
    if tensor.numel() > MAX_NUMEL:
        raise ValueError(f"{what}: {tensor.numel()} elements is 2^31 or more; indices travel as int32. "
                         "Split the tensor (e.g. into buckets) below 2^31 elements.")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"{what}: op must be SUM or AVG, got {ops.op_name(op)}: a sum of what each rank "
                         "sent is what error feedback makes sense of")
    if (density is None) == (threshold is None):
        raise ValueError(f"{what}: give exactly one of density= (top-k mode) and threshold= (threshold mode)")
    for name, value in (("density", density), ("threshold", threshold)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, Real)):
            raise TypeError(f"{what}: {name} must be a number, got {type(value).__name__}")
    if threshold is not None and not threshold >= 0:
        raise ValueError(f"{what}: threshold must be >= 0, got {threshold}")
    if density is not None and not 0.0 < density <= 1.0:
        raise ValueError(f"{what}: density must be in (0, 1], got {density}")
    if transport not in TRANSPORT_CHOICES:
        raise ValueError(f"{what}: transport must be one of {', '.join(TRANSPORT_CHOICES)}, got {transport!r}")
    if state is not None and not isinstance(state, dict):
        raise TypeError(f"{what}: state must be a dict kept per tensor, got {type(state).__name__}")
    validate_selection(selection, state if density is not None else {})   # threshold mode selects no top-k
    if segments is not None:
        if density is None:
            raise ValueError(f"{what}: segments= chooses top-k per segment; threshold mode has no k")
        if any(not isinstance(s, int) or s < 0 for s in segments) or sum(segments) != tensor.numel():
            raise ValueError(f"{what}: segments must be sizes >= 0 adding up to the tensor's "
                             f"{tensor.numel()} elements, got {list(segments)[:8]}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{what}: residual must be a tensor, got {type(residual).__name__}")
        if residual.shape != tensor.shape or residual.dtype != tensor.dtype or residual.device != tensor.device:
            raise ValueError(f"{what}: the residual must match the tensor's shape, dtype and device; got "
                             f"{tuple(residual.shape)} {residual.dtype} {residual.device} for "
                             f"{tuple(tensor.shape)} {tensor.dtype} {tensor.device}")
        if not residual.is_contiguous():
            raise ValueError(f"{what}: the residual must be contiguous (it is state you keep)")
        if residual.numel() and residual.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            raise ValueError(f"{what}: the residual shares memory with the tensor; keep it in a tensor of its own")
    agree = {"transport": transport, "density": density, "threshold": threshold, "selection": selection,
             "segments": None if segments is None else tuple(segments)}
    return ops.check_all_reduce_args(tensor, op, group, what=what, agree=agree)


def select_to_send(x: torch.Tensor, *, density=None, threshold=None, selection="auto",
                   state: dict | None = None, segments=None) -> torch.Tensor:
    """Indices (int64) of the elements of the 1-D tensor ``x`` this rank sends: the threshold's,
    the top-k of the whole, or -- with ``segments`` (sizes of consecutive pieces, a model's
    parameters in a bucket) -- the top-k of each piece, ⌈density·size⌉ from each."""
    if threshold is not None:
        return threshold_indices(x, threshold)
    if segments is None:
        return topk_indices(x, keep_count(x.numel(), density), selection, state)
    return topk_per_segment(x, segments, density, selection, state)


def _begin(tensor, residual, density, threshold, transport, selection, op, group, state, segments, profile):
    """The local half of a call: checks, ``x = tensor + residual``, selection, the rest kept.

    Returns ``(flat, values, info)``, ``info.transport`` already decided on every rank the
    same way; ``None`` when this rank is not in the group (nothing touched)."""
    if not _check(tensor, residual, density, threshold, transport, selection, op, group, state, segments):
        return None
    p, n = dist.get_world_size(group), tensor.numel()
    flat = ops.work_buffer(tensor)                   # the tensor's memory when contiguous
    if n == 0 or threshold == 0 or density == 1:
        # Everything is sent: the dense all-reduce itself, so the result is bit for bit its own.
        if residual is not None:
            flat.add_(residual.view(-1))
            residual.zero_()
        return flat, None, SparseInfo("dense", n)
    # x = tensor + residual, computed in the residual's memory: after the selection, what is
    # left there (x with the sent elements zeroed) *is* the next residual -- no copy of x.
    x = flat if residual is None else residual.view(-1).add_(flat)
    indices = select_to_send(x, density=density, threshold=threshold, selection=selection, state=state,
                             segments=segments)
    values = x.index_select(0, indices)              # what this rank sends (a copy)
    if residual is not None:
        x.index_fill_(0, indices, 0)                 # the rest waits for the next call
    counts = None
    if threshold is not None and p > 1:
        counts = exchange_counts(indices.numel(), group, flat.device)    # everyone must agree on widths
    widest = indices.numel() if counts is None else max(counts)
    if p == 1:
        chosen = "local"
    elif transport == "auto":
        # Every rank holds the same profile and the same widest count: the same choice.
        prof = profile or profile_for(group, flat.device)
        chosen = choose_transport(n, widest, p, prof.link, flat.element_size(), counts=counts is not None,
                                  compute=prof.compute)
    else:
        chosen = transport
    return flat, values, SparseInfo(chosen, indices.numel(), counts, indices=indices)


def _finish(tensor: torch.Tensor, flat: torch.Tensor, op, p: int) -> torch.Tensor:
    ops.finish_(flat, op, p)
    ops.write_back(tensor, flat)
    return tensor


def sparse_all_reduce(tensor: torch.Tensor, residual: torch.Tensor | None = None, *,
                      density: float | None = None, threshold: float | None = None,
                      transport: str = "allgather", selection: str = "auto", op=ReduceOp.SUM,
                      group=None, state: dict | None = None, segments=None,
                      profile: SparseProfile | None = None) -> SparseInfo:
    """Sum (or average) over ranks of what each rank chose to send; in place.

    The contract, on every rank of ``group``:

    * **what is sent** -- ``x = tensor + residual`` (just ``tensor`` without a residual).
      Top-k mode (``density=d``): the k = ⌈d·n⌉ elements of largest ``|x|`` (with
      ``segments``, ⌈d·size⌉ of each segment). Threshold mode (``threshold=t``): every
      element with ``|x| ≥ t``, compared exactly in the tensor's dtype. NaN counts as the
      largest magnitude, so NaN and inf are sent and propagate as through a dense all-reduce.
    * **the result** -- ``tensor`` ends equal to ``dist.all_reduce`` of what each rank sent
      (each rank's sent elements at their places, zeros elsewhere), SUM or AVG.
    * **error feedback** -- what was not sent is left in ``residual``:
      ``tensor_in + residual_in == sent + residual_out`` exactly (every element is in one or
      the other). Without a residual the unsent part is dropped.
    * **everything kept** -- ``threshold=0`` or ``density=1`` *is* ``dist.all_reduce``
      (of ``tensor + residual``), bit for bit; the residual becomes zero.
    * **refusals first** -- a bad argument raises before the tensor or the residual changes;
      a rank outside ``group`` returns at once, touching nothing (as ``dist.all_reduce``).

    Args:
        tensor: any shape and layout (a non-contiguous view is reduced through a copy),
            fewer than 2^31 elements; a real floating or integer dtype.
        residual: error-feedback state of the same shape/dtype/device, contiguous, in memory
            of its own; updated in place. Start it at zeros and keep one per tensor.
        density / threshold: exactly one -- the mode.
        transport: how the pairs travel: ``"allgather"`` (SINGA's, the default),
            ``"split"`` (SparCML's), ``"dense"`` (the kept values in a zeroed tensor, dense
            all-reduce) or ``"auto"``: the one :func:`~collectives.sparse.cost.choose_transport`
            predicts fastest from the group's link and processor (``profile``, or measured
            once per group on first use: :func:`collectives.sparse.profile.profile_for`).
        selection: how top-k finds the k largest (:data:`~collectives.sparse.select.SELECTIONS`);
            ignored by threshold mode. Every selection finds the same k (up to ties); they
            differ in speed. ``"auto"``: ``"topk"`` on a GPU, ``"sample"`` on a CPU (the
            fastest measured on each). ``"reuse"`` needs ``state``.
        op: ``ReduceOp.SUM`` or ``ReduceOp.AVG``.
        group: a process group (default: the world).
        state: a dict kept per tensor by the caller, for ``selection="reuse"``.
        segments: sizes of consecutive pieces selected separately (top-k mode; DGC's
            selection per layer).
        profile: the link and processor ``transport="auto"`` prices (default: the group's).

    In check mode (``COLLECTIVES_CHECK=1``) the ranks also compare ``transport``,
    ``density``/``threshold``, ``selection`` and ``segments`` before anything moves: ranks
    that disagree would otherwise meet in mismatched collectives.

    Host synchronisation: top-k with ``torch.topk`` (the GPU default) and the all-gather or
    dense transport needs none; the filtering selections (``sample``, ``reuse``) read their
    threshold and their candidates' count, threshold mode reads every rank's count (one
    small all-gather), and the split transport reads its two small exchanges.

    Returns:
        :class:`SparseInfo`: the transport used and what this rank sent.
    """
    begun = _begin(tensor, residual, density, threshold, transport, selection, op, group, state, segments,
                   profile)
    if begun is None:
        return SparseInfo("none", 0)
    flat, values, info = begun
    p = dist.get_world_size(group)
    if values is None:                               # everything kept
        if flat.numel():
            with trace.label("sparse: everything kept, dense all-reduce"):
                dist.all_reduce(flat, group=group)
    elif info.transport == "local":
        flat.zero_().index_copy_(0, info.indices, values)
    elif info.transport == "allgather":
        allgather_sum_(flat, info.indices, values, counts=info.counts, group=group)
    elif info.transport == "split":
        info.split = split_sum_(flat, info.indices, values, group=group)
    else:                                            # "dense": sent values in zeros, ring it
        flat.zero_().index_copy_(0, info.indices, values)
        with trace.label("sparse: dense all-reduce of the kept values"):
            dist.all_reduce(flat, group=group)
    _finish(tensor, flat, op, p)
    return info


# ---- the second step: the transport left in flight ----------------------------------------------

class SparseWork:
    """A sparse all-reduce in flight: ``info`` at once (the selection is done), the sum once
    the future completes. ``get_future()`` holds the tensor, as a DDP hook must return."""

    def __init__(self, info: SparseInfo, future: torch.futures.Future):
        self.info, self._future = info, future

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self) -> SparseInfo:
        self._future.wait()
        return self.info


def _completed(value) -> torch.futures.Future:
    done = torch.futures.Future()
    done.set_result(value)
    return done


def sparse_all_reduce_async(tensor: torch.Tensor, residual: torch.Tensor | None = None, *,
                            density: float | None = None, threshold: float | None = None,
                            transport: str = "allgather", selection: str = "auto", op=ReduceOp.SUM,
                            group=None, state: dict | None = None, segments=None,
                            profile: SparseProfile | None = None) -> SparseWork:
    """:func:`sparse_all_reduce`, returning while the pairs travel.

    The selection and the residual's update happen now (they are this rank's own work, and
    the caller may reuse its gradient memory once this returns); the collective is started
    with ``async_op=True`` and the adding of what arrives is chained to its future with
    ``.then``. Same arguments, same contract, same bits as the plain call. The all-gather,
    the dense transport and the everything-kept all-reduce are left in flight; the split
    transport needs the host between its rounds and runs to the end before this returns
    (its future is complete), as does a world of one.
    """
    begun = _begin(tensor, residual, density, threshold, transport, selection, op, group, state, segments,
                   profile)
    if begun is None:
        return SparseWork(SparseInfo("none", 0), _completed(tensor))
    flat, values, info = begun
    p = dist.get_world_size(group)

    def finish(_):
        return _finish(tensor, flat, op, p)

    if values is None and not flat.numel():
        return SparseWork(info, _completed(tensor))
    if values is None:
        with trace.label("sparse: everything kept, dense all-reduce"):
            future = dist.all_reduce(flat, group=group, async_op=True).get_future()
    elif info.transport == "allgather":
        future = allgather_sum_async(flat, info.indices, values, counts=info.counts, group=group)
    elif info.transport == "dense":
        flat.zero_().index_copy_(0, info.indices, values)
        with trace.label("sparse: dense all-reduce of the kept values"):
            future = dist.all_reduce(flat, group=group, async_op=True).get_future()
    else:                                            # "split" and "local": done here
        if info.transport == "split":
            info.split = split_sum_(flat, info.indices, values, group=group)
        else:
            flat.zero_().index_copy_(0, info.indices, values)
        return SparseWork(info, _completed(finish(None)))
    return SparseWork(info, future.then(finish))
