"""Lesson 13: a small transformer, whole on one process and split over a tensor-parallel group.

:class:`TinyGPT` is the one-process model: a token embedding, blocks of (LayerNorm →
causal attention → dropout → residual, LayerNorm → MLP → dropout → residual), a final
LayerNorm and a head over the vocabulary. Its modules are named as TorchTitan's Llama
(``attention.wq``, ``feed_forward.w1``, ...), so torch's own tensor-parallel plan applies
to it unchanged, and its attention reads the number of heads from the projection's width,
so it runs on a rank's heads as well as on all of them.

:class:`TPGPT` cuts a :class:`TinyGPT` for this rank (Megatron-LM's layout)::

    plain TP (every activation between blocks whole on every rank)
      embedding   vocabulary rows          → g (all-reduce)
      attention   f → wq wk wv by heads → attention on my heads → wo by rows → g
      MLP         f → w1 by columns → GELU → w2 by rows → g
      head        f → output by vocabulary → cross-entropy, logits never gathered

    sequence parallel: every g becomes a reduce-scatter on the sequence and every f an
    all-gather, so LayerNorm, dropout and the residual stream hold 1/p of the sequence.

Any group whose size divides the heads, the MLP's width and the vocabulary (and, with
sequence parallelism, the sequence) works; any other is refused before anything is cut.

Dropout draws the whole activation's mask from the global generator (the same seed on
every rank) and keeps this rank's part of it: in a replicated region every rank drops the
same elements, in a sequence-parallel one each keeps its slice -- so the split model drops
exactly what the one-process model drops (Megatron instead draws each shard from a
generator of its own: cheaper, and not equal to one process).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .comm import TPGroup, copy_to_tp
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _mark_sequence_parallel,
    check_split,
    gather_linear,
    vocab_parallel_cross_entropy,
)


@dataclass(frozen=True)
class Config:
    vocab: int = 32
    hidden: int = 16
    heads: int = 4
    ffn: int = 32
    layers: int = 2
    dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class Dropout(nn.Module):
    """Dropout whose mask is drawn for the whole activation (``full`` shape) from the global
    generator, this rank's ``part`` of it kept (see the module)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor, part=None, full=None) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.rand(full or x.shape) >= self.p
        if part is not None:
            keep = part(keep)
        return x * keep.to(x.dtype) / (1.0 - self.p)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq, self.wk, self.wv = (nn.Linear(cfg.hidden, cfg.hidden) for _ in range(3))
        self.wo = nn.Linear(cfg.hidden, cfg.hidden)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``x`` (b, s, hidden) on the heads its projections hold."""
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, s, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.heads(x))


class FeedForward(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1, self.w2 = nn.Linear(cfg.hidden, cfg.ffn), nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.attention, self.feed_forward = Attention(cfg), FeedForward(cfg)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.dropout(self.attention(self.attention_norm(x)))
        return h + self.dropout(self.feed_forward(self.ffn_norm(h)))


class TinyGPT(nn.Module):
    """The one-process model (see the module)."""

    def __init__(self, cfg: Config, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for block in self.layers:
            h = block(h)
        return self.output(self.norm(h))

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class TPBlock(nn.Module):
    """One :class:`Block` cut for this rank: heads and the MLP's width split, 4 collectives
    forward (2 all-reduces, or under ``sp`` 2 all-gathers and 2 reduce-scatters)."""

    def __init__(self, block: Block, tp: TPGroup, sp: bool):
        super().__init__()
        self.tp, self.sp = tp, sp
        self.attention_norm, self.ffn_norm = copy.deepcopy(block.attention_norm), copy.deepcopy(block.ffn_norm)
        att = block.attention
        self.head_dim = att.head_dim
        self.wq, self.wk, self.wv = (ColumnParallelLinear(w, tp, sp=sp, enter=False)
                                     for w in (att.wq, att.wk, att.wv))
        self.wo = RowParallelLinear(att.wo, tp, sp=sp)
        self.w1 = ColumnParallelLinear(block.feed_forward.w1, tp, sp=sp)
        self.w2 = RowParallelLinear(block.feed_forward.w2, tp, sp=sp)
        self.dropout = block.dropout
        if sp:
            _mark_sequence_parallel(*self.attention_norm.parameters(), *self.ffn_norm.parameters())

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sp:
            return self.dropout(x)
        p, r = self.tp.size, self.tp.rank
        full = (x.shape[0], x.shape[1] * p) + tuple(x.shape[2:])
        return self.dropout(x, part=lambda m: m.chunk(p, 1)[r], full=full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attention_norm(x)
        if self.sp:                                   # one gather for q, k and v
            qkv = gather_linear(a, (self.wq, self.wk, self.wv), self.tp)
        else:                                         # one f for q, k and v
            a = copy_to_tp(a, self.tp)
            qkv = [w(a) for w in (self.wq, self.wk, self.wv)]
        b, s = qkv[0].shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in qkv)
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        h = x + self._drop(self.wo(heads))
        return h + self._drop(self.w2(F.gelu(self.w1(self.ffn_norm(h)))))


def check_config(cfg: Config, p: int, seq: int | None = None, sp: bool = False) -> None:
    """Refuse a group of ``p`` ranks the model cannot be split over, naming the size."""
    check_split("TPGPT", cfg.heads, p, "heads")
    check_split("TPGPT", cfg.ffn, p, "ffn")
    check_split("TPGPT", cfg.vocab, p, "vocab")
    if sp and seq is not None:
        check_split("TPGPT (sequence parallel)", seq, p, "sequence length")


class TPGPT(nn.Module):
    """This rank's part of ``model`` (a :class:`TinyGPT`) over ``tp``; ``sp`` for sequence
    parallelism. :meth:`loss` is the mean cross-entropy, equal on every rank."""

    def __init__(self, model: TinyGPT, tp: TPGroup | None = None, *, sp: bool = False):
        super().__init__()
        self.tp, self.sp, self.cfg = tp or TPGroup(), sp, model.cfg
        check_config(model.cfg, self.tp.size)
        self.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, self.tp, sp=sp)
        self.layers = nn.ModuleList(TPBlock(b, self.tp, sp) for b in model.layers)
        self.norm = copy.deepcopy(model.norm)
        self.output = ColumnParallelLinear(model.output, self.tp, sp=sp)
        if sp:
            _mark_sequence_parallel(*self.norm.parameters())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the vocabulary's logits, for the whole sequence."""
        if self.sp:
            check_split("TPGPT (sequence parallel)", ids.shape[1], self.tp.size, "sequence length")
        h = self.tok_embeddings(ids)
        for block in self.layers:
            h = block(h)
        return self.output(self.norm(h))

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self(ids), targets, self.tp).mean()
