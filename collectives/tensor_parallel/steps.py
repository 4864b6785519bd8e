"""Lesson 13's exercise, solved: the moves tensor parallelism is made of, one function each.

The layers of :mod:`~collectives.tensor_parallel.layers` and the model do these same moves
with a :class:`~collectives.tensor_parallel.comm.TPGroup` around them; here each stands
alone on a process group, on lesson 4's ring.

1. :func:`copy_to_parallel` / :func:`reduce_from_parallel` -- f and g, as autograd functions;
2. :func:`column_parallel_linear` / :func:`row_parallel_linear` -- the two splittings;
3. :func:`gather_sequence` / :func:`scatter_sequence` -- sequence parallelism's pair;
4. :func:`vocab_cross_entropy` -- the loss without gathering the logits;
5. :func:`chunked_all_gather_matmul` -- async TP's all-gather → matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import async_tp, comm, layers


def _tp(group) -> comm.TPGroup:
    return comm.TPGroup(group)


def copy_to_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: ``x`` unchanged forward; the gradient summed over the group backward."""
    return comm.copy_to_tp(x, _tp(group))


def reduce_from_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: ``x`` summed over the group forward; the gradient unchanged backward."""
    return comm.reduce_from_tp(x, _tp(group))


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group=None) -> torch.Tensor:
    """``x`` (whole) through f, then this rank's output rows ``weight`` (out/p, in) and ``bias``."""
    return F.linear(copy_to_parallel(x, group), weight, bias)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        group=None) -> torch.Tensor:
    """``x`` (this rank's in/p features) times this rank's input columns ``weight``
    (out, in/p), summed over the group by g, then the whole ``bias``."""
    y = reduce_from_parallel(F.linear(x, weight), group)
    return y + bias if bias is not None else y


def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather on dim 1 forward, reduce-scatter of the gradient on dim 1 backward."""
    return comm.gather_seq(x, _tp(group), 1)


def scatter_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter on dim 1 forward, all-gather of the gradient on dim 1 backward."""
    return comm.scatter_seq(x, _tp(group), 1)


def vocab_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token cross-entropy, ``logits`` this rank's slice of the vocabulary."""
    return layers.vocab_parallel_cross_entropy(logits, targets, _tp(group))


def chunked_all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, group=None,
                              matmul=torch.matmul) -> torch.Tensor:
    """``all_gather(x) @ weight`` in p pieces, each transfer under the matmul before it."""
    return async_tp.all_gather_matmul(x, weight, _tp(group), matmul=matmul)
