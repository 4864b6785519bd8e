"""Lesson 13: the four conjugate operators that put a layer's collectives into autograd.

After Megatron-LM (Shoeybi et al., 2019): a tensor-parallel region is entered through one
operator and left through its conjugate, and each operator's backward is the other's
forward. With sequence parallelism (Korthikanti et al., 2022) the all-reduce is split into
its two halves, and the region between blocks holds 1/p of the sequence::

    plain TP           forward                     backward
      f  copy_to       identity                    all-reduce the gradient
      g  reduce_from   all-reduce                  identity

    sequence parallel
      ḡ  gather_seq    all-gather the sequence     reduce-scatter the gradient
      ḡ* scatter_seq   reduce-scatter the sequence all-gather the gradient

The collectives are lesson 4's ring by default (``ring_all_reduce``, ``ring_all_gather``,
``ring_reduce_scatter``), and torch's own under ``use_torch`` (the trace tells which).
Activations are ``(batch, sequence, hidden)``; the sequence is dim 1, so a gather or a
scatter on it moves the sequence to the front, where the ring's rank-major pieces are
contiguous, and back.

Cost per call, n bytes of the full activation on p ranks: an all-reduce sends
2(p − 1)/p·n per rank, each half (p − 1)/p·n -- so sequence parallelism sends the same
bytes as plain TP, in twice the collectives of half the size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from collectives.core.ops import ReduceOp
from collectives.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter


@dataclass(frozen=True)
class TPGroup:
    """The ranks a layer is split over: ``group`` (``None``: the world) and which
    collectives carry it (lesson 4's ring, or torch's with ``use_torch``)."""
    group: object = None
    use_torch: bool = False

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def all_reduce(self, x: torch.Tensor, op=ReduceOp.SUM) -> torch.Tensor:
        """A new tensor: ``x`` summed (or ``op``-ed) over the group."""
        out = x.detach().contiguous().clone()
        if self.size == 1:
            return out
        if self.use_torch:
            dist.all_reduce(out, op=op, group=self.group)
        else:
            ring_all_reduce(out, op=op, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` laid end to end on ``dim``, in rank order."""
        p = self.size
        if p == 1:
            return x.detach().clone()
        front = x.detach().movedim(dim, 0).contiguous()
        out = front.new_empty((p * front.shape[0],) + tuple(front.shape[1:]))
        if self.use_torch:
            dist.all_gather_into_tensor(out, front, group=self.group)
        else:
            ring_all_gather(out, front, group=self.group)
        return out.movedim(0, dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's 1/p of ``x`` on ``dim``, summed over the group."""
        p = self.size
        if x.shape[dim] % p:
            raise ValueError(f"reduce_scatter: dimension {dim} of size {x.shape[dim]} does not split "
                             f"into {p} equal pieces")
        if p == 1:
            return x.detach().clone()
        front = x.detach().movedim(dim, 0).contiguous()
        out = front.new_empty((front.shape[0] // p,) + tuple(front.shape[1:]))
        if self.use_torch:
            dist.reduce_scatter_tensor(out, front, group=self.group)
        else:
            ring_reduce_scatter(out, front, group=self.group)
        return out.movedim(0, dim)

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's 1/p of ``x`` on ``dim`` (no message)."""
        p = self.size
        if x.shape[dim] % p:
            raise ValueError(f"split: dimension {dim} of size {x.shape[dim]} does not split into {p} equal pieces")
        return x.chunk(p, dim)[self.rank].contiguous()


def _check(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return tp.all_gather(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.reduce_scatter(grad, ctx.dim), None, None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return tp.reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather(grad, ctx.dim), None, None


class _SplitSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return tp.split(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather(grad, ctx.dim), None, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup | None = None) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward (enters a column layer)."""
    _check(x, "copy_to_tp")
    return _CopyTo.apply(x, tp or TPGroup())


def reduce_from_tp(x: torch.Tensor, tp: TPGroup | None = None) -> torch.Tensor:
    """g: all-reduce forward, identity backward (leaves a row layer)."""
    _check(x, "reduce_from_tp")
    return _ReduceFrom.apply(x, tp or TPGroup())


def gather_seq(x: torch.Tensor, tp: TPGroup | None = None, dim: int = 1) -> torch.Tensor:
    """All-gather the sequence forward, reduce-scatter the gradient backward (enters a
    column layer under sequence parallelism)."""
    _check(x, "gather_seq")
    return _GatherSeq.apply(x, tp or TPGroup(), dim)


def scatter_seq(x: torch.Tensor, tp: TPGroup | None = None, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter the sequence forward, all-gather the gradient backward (leaves a row
    layer under sequence parallelism)."""
    _check(x, "scatter_seq")
    tp = tp or TPGroup()
    if x.shape[dim] % tp.size:
        raise ValueError(f"scatter_seq: a sequence of {x.shape[dim]} does not split over {tp.size} ranks")
    return _ScatterSeq.apply(x, tp, dim)


def split_seq(x: torch.Tensor, tp: TPGroup | None = None, dim: int = 1) -> torch.Tensor:
    """This rank's 1/p of a replicated ``x`` on ``dim`` forward (no message), all-gather of
    the gradient backward: where a replicated activation enters a sequence-parallel region."""
    _check(x, "split_seq")
    tp = tp or TPGroup()
    if x.shape[dim] % tp.size:
        raise ValueError(f"split_seq: a sequence of {x.shape[dim]} does not split over {tp.size} ranks")
    return _SplitSeq.apply(x, tp, dim)
