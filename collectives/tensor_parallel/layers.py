"""Lesson 13: the two splittings of a linear layer, and the vocabulary split in two.

A linear layer ``y = x·Wᵀ + b`` with ``W`` of shape (out, in) splits two ways over p ranks::

    column-parallel  W = [W₀; W₁; ...] by output rows     row-parallel  W = [W₀ | W₁ | ...] by input columns
        x (whole) ──f──> y_r = x·W_rᵀ + b_r                    x_r (my columns) ──> x_r·W_rᵀ ──g──> Σ_r + b
        each rank: out/p of the outputs                        each rank: a partial sum of every output

They pair: the column layer's output, split by feature, is exactly the row layer's input,
so an MLP (column → activation → row) or an attention (heads by column → per-head attention
→ output projection by row) runs on its shards from entry to exit with one all-reduce
forward (g) and one backward (f's). Under sequence parallelism f becomes an all-gather of
the sequence and g a reduce-scatter (:mod:`collectives.tensor_parallel.comm`).

The vocabulary splits the same way: a vocabulary-parallel embedding looks up only the rows
it owns (zeros elsewhere) and the sum over ranks (g) assembles every token's row; the
language-model head is column-parallel over the vocabulary, and its cross-entropy is
computed without gathering the logits -- one all-reduce of the max, one of the sum of
exponentials together with the target's logit: 3 numbers per token instead of V.

Every layer is built from a whole ``nn.Linear`` / ``nn.Embedding`` (the same on every
rank, from one seed) by cutting out this rank's part; sizes that do not split are refused
before anything is cut.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from collectives.core.ops import ReduceOp

from .comm import TPGroup, copy_to_tp, reduce_from_tp, scatter_seq


def check_split(what: str, n: int, p: int, name: str) -> int:
    """``n // p``, or a ValueError naming what does not split."""
    if p < 1:
        raise ValueError(f"{what}: the group must have at least one rank, got {p}")
    if n % p:
        raise ValueError(f"{what}: {name} = {n} does not split over {p} ranks; "
                         f"tensor parallelism needs {name} divisible by the group's size")
    return n // p


def _mark_sequence_parallel(*params) -> None:
    """Replicated parameters whose gradients, under sequence parallelism, are partial sums
    over the sequence shards: :func:`sync_sequence_parallel_grads` all-reduces them."""
    for q in params:
        if q is not None:
            q.sequence_parallel = True


class ColumnParallelLinear(nn.Module):
    """This rank's output rows of ``linear``. ``enter`` applies f (or, under ``sp``, the
    sequence all-gather) to the input first; a layer sharing an input already entered
    (the k and v projections beside q) passes ``enter=False``."""

    def __init__(self, linear: nn.Linear, tp: TPGroup | None = None, *, sp: bool = False, enter: bool = True):
        super().__init__()
        self.tp, self.sp, self.enter = tp or TPGroup(), sp, enter
        p, r = self.tp.size, self.tp.rank
        n = check_split("ColumnParallelLinear", linear.out_features, p, "out_features")
        self.weight = nn.Parameter(linear.weight.detach()[r * n:(r + 1) * n].clone())
        self.bias = nn.Parameter(linear.bias.detach()[r * n:(r + 1) * n].clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter and self.sp:
            return gather_linear(x, [self], self.tp)[0]
        if self.enter:
            x = copy_to_tp(x, self.tp)
        return F.linear(x, self.weight, self.bias)


class _GatherLinear(torch.autograd.Function):
    """All-gather the sequence, then several column layers on it, keeping only the shard:
    the backward gathers it again for the weights' gradients (Korthikanti et al.)."""

    @staticmethod
    def forward(ctx, x, tp, dim, *weights_and_biases):
        ctx.tp, ctx.dim, ctx.n = tp, dim, len(weights_and_biases) // 2
        full = tp.all_gather(x, dim)
        ctx.save_for_backward(x, *weights_and_biases)
        return tuple(F.linear(full, w, b) for w, b in zip(weights_and_biases[0::2], weights_and_biases[1::2]))

    @staticmethod
    def backward(ctx, *grads):
        x, *wb = ctx.saved_tensors
        full = ctx.tp.all_gather(x, ctx.dim)                      # gathered again, not kept
        grad_in = None
        out = []
        for g, w, b in zip(grads, wb[0::2], wb[1::2]):
            if g is None:                                         # an output nobody used
                out += [None, None]
                continue
            part = g @ w
            grad_in = part if grad_in is None else grad_in.add_(part)
            out += [g.flatten(0, -2).t() @ full.flatten(0, -2), g.flatten(0, -2).sum(0) if b is not None else None]
        grad_x = ctx.tp.reduce_scatter(grad_in, ctx.dim) if grad_in is not None else None
        return (grad_x, None, None, *out)


def gather_linear(x: torch.Tensor, layers, tp: TPGroup | None = None, dim: int = 1) -> list[torch.Tensor]:
    """Sequence parallelism's entry into column layers: ``x`` (this rank's part of the
    sequence) all-gathered and fed to every layer of ``layers`` (column-parallel, sharing
    the one gather), only the shard kept for the backward, which gathers it again."""
    tp = tp or TPGroup()
    wb = [t for layer in layers for t in (layer.weight, layer.bias)]
    return list(_GatherLinear.apply(x, tp, dim, *wb))


class RowParallelLinear(nn.Module):
    """This rank's input columns of ``linear``: a partial product, summed over the group by
    g (or, under ``sp``, reduce-scattered on the sequence), then the whole bias added."""

    def __init__(self, linear: nn.Linear, tp: TPGroup | None = None, *, sp: bool = False):
        super().__init__()
        self.tp, self.sp = tp or TPGroup(), sp
        p, r = self.tp.size, self.tp.rank
        n = check_split("RowParallelLinear", linear.in_features, p, "in_features")
        self.weight = nn.Parameter(linear.weight.detach()[:, r * n:(r + 1) * n].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        if sp:
            _mark_sequence_parallel(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = scatter_seq(y, self.tp) if self.sp else reduce_from_tp(y, self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[lo, hi)`` of ``embedding``: tokens it does not own look up
    zeros, and g sums every rank's lookup (under ``sp``: reduce-scattered on the sequence)."""

    def __init__(self, embedding: nn.Embedding, tp: TPGroup | None = None, *, sp: bool = False):
        super().__init__()
        self.tp, self.sp = tp or TPGroup(), sp
        p, r = self.tp.size, self.tp.rank
        n = check_split("VocabParallelEmbedding", embedding.num_embeddings, p, "vocabulary")
        self.lo, self.hi = r * n, (r + 1) * n
        self.weight = nn.Parameter(embedding.weight.detach()[self.lo:self.hi].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.lo) | (ids >= self.hi)
        local = (ids - self.lo).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return scatter_seq(rows, self.tp) if self.sp else reduce_from_tp(rows, self.tp)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, tp):
        n = logits.shape[-1]
        lo = tp.rank * n
        peak = tp.all_reduce(logits.detach().amax(-1), op=ReduceOp.MAX)      # message 1: N numbers
        z = logits.detach() - peak.unsqueeze(-1)
        e = z.exp()
        mine = (targets >= lo) & (targets < lo + n)
        local = (targets - lo).masked_fill(~mine, 0)
        target_z = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = tp.all_reduce(torch.stack([e.sum(-1), target_z]))              # message 2: 2N numbers
        ctx.save_for_backward(e / sums[0].unsqueeze(-1), local, mine)
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        hit = g.gather(-1, local.unsqueeze(-1)) - mine.unsqueeze(-1).to(g.dtype)
        g.scatter_(-1, local.unsqueeze(-1), hit)
        return g * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 tp: TPGroup | None = None) -> torch.Tensor:
    """The cross-entropy of every token, ``logits`` holding this rank's slice of the
    vocabulary (rank r: classes ``[r·n, (r+1)·n)``, n the last dimension). The logits are
    never gathered: the max, then the sum of exponentials and the target's logit, are
    all-reduced -- 3 numbers per token. Returns the per-token losses (shape of ``targets``),
    equal on every rank; the gradient of the logits is local, no message."""
    tp = tp or TPGroup()
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError("vocab_parallel_cross_entropy: logits and targets must be tensors")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} do not match "
                         f"targets {tuple(targets.shape)} (logits are targets' shape + this rank's vocabulary)")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"vocab_parallel_cross_entropy: targets must be integer class ids, got {targets.dtype}")
    vocab = logits.shape[-1] * tp.size
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"vocab_parallel_cross_entropy: a target lies outside the vocabulary [0, {vocab})")
    return _VocabParallelCE.apply(logits, targets, tp)


def sync_sequence_parallel_grads(module, tp: TPGroup | None = None) -> int:
    """Sum over the group the gradients of the replicated parameters that saw only this
    rank's piece of the sequence (LayerNorms, a row layer's bias); returns how many.
    One all-reduce of them all packed together.

    ``module`` may also be lesson 10's :class:`~collectives.sharded.FSDP` around a split
    model (2-D: FSDP across, TP inside): then the gradients summed are those of this rank's
    rows of each such parameter -- the sum over the TP group and FSDP's average over the
    data-parallel group are both linear, so their order does not matter."""
    tp = tp or TPGroup()
    units = getattr(module, "units", None)
    if units is not None and not isinstance(module, nn.Module):           # lesson 10's FSDP
        pairs = [(q, s) for u in units for q, s in zip(u.params, u.shards)]
        params = [s for q, s in pairs if getattr(q, "sequence_parallel", False) and s.grad is not None]
    else:
        params = [q for q in module.parameters() if getattr(q, "sequence_parallel", False) and q.grad is not None]
    if params and tp.size > 1:
        flat = tp.all_reduce(torch.cat([q.grad.reshape(-1) for q in params]))
        offset = 0
        for q in params:
            q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
            offset += q.numel()
    return len(params)
