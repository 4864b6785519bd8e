"""``sparse_all_reduce``: selection, error feedback and a transport, behind one contract.

The function every other part of the lesson is for: it adds the residual, selects (see
:mod:`.select`), keeps the rest as the new residual, picks a transport with the cost model
(:mod:`.allgather`, :mod:`.split`, or the dense ring on the kept values) and leaves the sum
in the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..core import cost, ops, trace
from .allgather import allgather_sum_, exchange_counts
from .select import MAX_NUMEL, keep_count, threshold_indices, topk_indices
from .split import SplitInfo, split_sum_

ReduceOp = dist.ReduceOp
VARIANTS = ("auto",) + cost.SPARSE_VARIANTS


@dataclass
class SparseInfo:
    """What one call did on this rank."""

    variant: str                       # "dense" (everything kept), "allgather", "split", "local"
    kept: int                          # pairs this rank sent
    counts: list[int] | None = None    # every rank's count (threshold mode), else None
    split: SplitInfo | None = None     # the split variant's exchange sizes
    extra: dict = field(default_factory=dict)


def _check(tensor, residual, density, threshold, method, op, group):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"sparse_all_reduce: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.numel() > MAX_NUMEL:
        raise ValueError(f"sparse_all_reduce: {tensor.numel()} elements is 2^31 or more; indices "
                         "travel as int32. Split the tensor (e.g. into buckets) below 2^31 elements.")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"sparse_all_reduce: op must be SUM or AVG, got {ops.op_name(op)}: a sum of "
                         "what each rank sent is what error feedback makes sense of")
    ops.check_all_reduce_args(tensor, op, group, what="sparse_all_reduce")
    if (density is None) == (threshold is None):
        raise ValueError("sparse_all_reduce: give exactly one of density= (top-k mode) and "
                         "threshold= (threshold mode)")
    if threshold is not None and not threshold >= 0:
        raise ValueError(f"sparse_all_reduce: threshold must be >= 0, got {threshold}")
    if density is not None and not 0.0 < density <= 1.0:
        raise ValueError(f"sparse_all_reduce: density must be in (0, 1], got {density}")
    if method not in VARIANTS:
        raise ValueError(f"sparse_all_reduce: method must be one of {', '.join(VARIANTS)}, got {method!r}")
    if residual is not None:
        if residual.shape != tensor.shape or residual.dtype != tensor.dtype or residual.device != tensor.device:
            raise ValueError("sparse_all_reduce: the residual must match the tensor's shape, dtype and "
                             f"device; got {tuple(residual.shape)} {residual.dtype} {residual.device} for "
                             f"{tuple(tensor.shape)} {tensor.dtype} {tensor.device}")
        if not residual.is_contiguous():
            raise ValueError("sparse_all_reduce: the residual must be contiguous (it is state you keep)")


def select_to_send(x: torch.Tensor, *, density=None, threshold=None, selection="auto",
                   state: dict | None = None) -> torch.Tensor:
    """Indices (int64) of the elements of the 1-D tensor ``x`` this rank sends."""
    if threshold is not None:
        return threshold_indices(x, threshold)
    return topk_indices(x, keep_count(x.numel(), density), selection, state)


def sparse_all_reduce(tensor: torch.Tensor, residual: torch.Tensor | None = None, *,
                      density: float | None = None, threshold: float | None = None,
                      method: str = "auto", selection: str = "auto", op=ReduceOp.SUM,
                      group=None, link: cost.AlphaBeta | None = None,
                      state: dict | None = None) -> SparseInfo:
    """Sum (or average) over ranks of what each rank chose to send; in place.

    The contract, on every rank of ``group``:

    * **what is sent** -- ``x = tensor + residual`` (just ``tensor`` without a residual).
      Top-k mode (``density=d``): the k = ⌈d·n⌉ elements of largest ``|x|``. Threshold mode
      (``threshold=t``): every element with ``|x| ≥ t``. NaN counts as the largest magnitude,
      so NaN and inf are sent and propagate as they would through a dense all-reduce.
    * **the result** -- ``tensor`` ends equal to ``dist.all_reduce`` of what each rank sent
      (each rank's sent elements at their places, zeros elsewhere), SUM or AVG.
    * **error feedback** -- what was not sent is left in ``residual``:
      ``tensor_in + residual_in == sent + residual_out`` exactly (every element is in one or
      the other). Without a residual the unsent part is dropped.
    * **everything kept** -- ``threshold=0`` or ``density=1`` *is* ``dist.all_reduce``
      (of ``tensor + residual``), bit for bit; the residual becomes zero.

    Args:
        tensor: any shape and layout (a non-contiguous view is reduced through a copy),
            fewer than 2^31 elements; float32/64, float16, bfloat16 or an integer dtype.
        residual: error-feedback state of the same shape/dtype/device, contiguous; updated
            in place. Start it at zeros and keep one per tensor.
        density / threshold: exactly one -- the mode.
        method: the transport, ``"allgather"`` (SINGA's), ``"split"`` (SparCML's), ``"dense"``
            (the kept values in a zeroed tensor, dense all-reduce) or ``"auto"``: the one
            :func:`collectives.cost.choose_sparse_variant` predicts fastest for ``link``.
        selection: how top-k finds the k largest (:data:`METHODS`); ignored by threshold mode.
            Every method finds the same k (up to ties); they differ in speed. The default,
            ``"auto"``, is the fastest measured on the device: ``"topk"`` on a GPU, ``"sample"``
            (a threshold estimated from a sample, one filtering pass) on a CPU.
        op: ``ReduceOp.SUM`` or ``ReduceOp.AVG``.
        group: a process group (default: the world).
        link: α and β for ``method="auto"`` (default :data:`collectives.cost.GIGABIT`).
        state: a dict kept per tensor by the caller, for ``selection="reuse"``.

    Host synchronisation: top-k with ``torch.topk`` (the GPU default) and the all-gather or
    dense transport needs none; the filtering selections (``sample``, ``reuse``) read their
    threshold and their candidates' count, threshold mode reads every rank's count (one
    small all-gather), and the split transport reads its two small exchanges.

    Returns:
        :class:`SparseInfo`: the transport used and what this rank sent.
    """
    _check(tensor, residual, density, threshold, method, op, group)
    p = dist.get_world_size(group)
    if tensor.numel() == 0:
        return SparseInfo("dense", 0)
    flat = ops.work_buffer(tensor)                   # the tensor's memory when contiguous
    keep_all = threshold == 0 or density == 1
    if keep_all:
        # Everything is sent: the dense all-reduce itself, so the result is bit for bit its own.
        if residual is not None:
            flat.add_(residual.view(-1))
            residual.zero_()
        with trace.label("sparse: everything kept, dense all-reduce"):
            dist.all_reduce(flat, group=group)
        ops.finish_(flat, op, p)
        ops.write_back(tensor, flat)
        return SparseInfo("dense", flat.numel())

    # x = tensor + residual, computed in the residual's memory: after the selection, what is
    # left there (x with the sent elements zeroed) *is* the next residual -- no copy of x.
    x = flat if residual is None else residual.view(-1).add_(flat)
    indices = select_to_send(x, density=density, threshold=threshold, selection=selection, state=state)
    values = x.index_select(0, indices)              # what this rank sends (a copy)
    if residual is not None:
        x.index_fill_(0, indices, 0)                 # the rest waits for the next call
    counts = None
    n, kept = flat.numel(), indices.numel()
    if threshold is not None and p > 1:
        counts = exchange_counts(kept, group, flat.device)    # everyone must agree on widths
    widest = kept if counts is None else max(counts)
    variant = method
    if p == 1:
        variant = "local"
    elif method == "auto":
        variant = cost.choose_sparse_variant(n, widest, p, link or cost.GIGABIT, flat.element_size(),
                                             counts=False)
    info = SparseInfo(variant, kept, counts)
    if variant == "local":
        flat.zero_().index_copy_(0, indices, values)
    elif variant == "allgather":
        allgather_sum_(flat, indices, values, counts=counts, group=group)
    elif variant == "split":
        info.split = split_sum_(flat, indices, values, group=group)
    else:                                            # "dense": sent values in zeros, ring it
        flat.zero_().index_copy_(0, indices, values)
        with trace.label("sparse: dense all-reduce of the kept values"):
            dist.all_reduce(flat, group=group)
    ops.finish_(flat, op, p)
    ops.write_back(tensor, flat)
    return info
