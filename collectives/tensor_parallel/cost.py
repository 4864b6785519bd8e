"""Lesson 13: what a transformer block sends per rank, and what it keeps for the backward.

**Communication**, one block, activations of b·s·h elements of ``nbytes`` each, p ranks,
every collective lesson 4's ring. Plain TP: 2 all-reduces forward (after attention and
after the MLP: g) and 2 backward (f's), each sending 2(p − 1)/p·bsh elements per rank.
Sequence parallelism: 2 all-gathers and 2 reduce-scatters forward, as many backward, each
(p − 1)/p·bsh -- the same bytes in twice the collectives -- plus, as Megatron does, the
column layers' input gathered once more in the backward instead of kept (2 all-gathers)::

    per rank, forward + backward       plain TP: 4 · 2(p − 1)/p · bsh     SP: 10 · (p − 1)/p · bsh

**Activation memory**, per rank, what the backward keeps of one block (after Korthikanti
et al.'s count for Megatron's block, here for this lesson's :class:`~.model.TPBlock` in fp32 and
without dropout, read off autograd's saved tensors): the regions split over heads or
the MLP's width keep 1/p on every rank in both schemes; the LayerNorm and residual
regions keep the whole sequence in plain TP and 1/p of it under SP.
"""

from __future__ import annotations


def comm_bytes_per_layer(b: int, s: int, h: int, p: int, *, sp: bool, nbytes: int = 4,
                         backward: bool = True) -> dict:
    """Bytes one rank sends for one block: ``{"collectives": n, "bytes": n}`` (see the module)."""
    if p < 1:
        raise ValueError(f"comm_bytes_per_layer: p must be at least 1, got {p}")
    passes = 2 if backward else 1
    if p == 1:
        return dict(collectives=0, bytes=0)
    act = b * s * h * nbytes
    if sp:
        n = 4 + (6 if backward else 0)              # backward: 2 RS, 2 AG, and 2 AG again
        return dict(collectives=n, bytes=n * (p - 1) * act // p)
    return dict(collectives=2 * passes, bytes=2 * passes * 2 * (p - 1) * act // p)


def activation_bytes(b: int, s: int, h: int, heads: int, ffn: int, p: int, *, sp: bool,
                     nbytes: int = 4) -> dict:
    """Bytes of activations one block keeps for its backward on one rank, by region:
    ``{"replicated": ..., "split": ..., "total": ...}`` (see :func:`_saved`)."""
    return _saved(b, s, h, heads, ffn, p, sp, nbytes)


def _saved(b, s, h, heads, ffn, p, sp, nbytes) -> dict:
    """Elements kept, by who keeps them (autograd's saved tensors of :class:`~.model.TPBlock`):

    * LayerNorm and residual region: the block's input x and the first LayerNorm's output,
      the residual h and the second LayerNorm's output (4·bsh), and both LayerNorms' mean
      and 1/σ (4·bs) -- whole on every rank in plain TP, 1/p of the sequence under SP (the
      column layers keep the shard and gather it again in the backward);
    * heads and MLP width, 1/p on every rank in both: q, k, v and the attention's output
      (4·bsh), the attention's log-sum-exp (b·heads·s), the MLP's w1 output and GELU output
      (2·bs·ffn)."""
    replicated = 4 * b * s * h + 4 * b * s
    split = 4 * b * s * h + b * heads * s + 2 * b * s * ffn
    rep = replicated // p if sp else replicated
    return dict(replicated=rep * nbytes, split=split // p * nbytes, total=(rep + split // p) * nbytes)


def saved_activation_bytes(fn, *args, exclude=()) -> int:
    """Bytes of the distinct tensors autograd saves while ``fn(*args)`` runs, leaving out the
    storages of the tensors in ``exclude`` (a module's parameters: weights, not activations)."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())
