"""Lesson 10's exercise, solved: ZeRO-3's whole step from the four moves of :mod:`.steps`.

5. :func:`zero3_layer` -- one layer under ZeRO-3: gathered before its forward and freed after,
   gathered again before its backward, its gradients reduce-scattered (the mean, lesson 4's
   ring) as soon as they have all accumulated, added to this rank's gradient rows, dropped,
   and the layer freed -- all from hooks, so it happens during backward, layer by layer;
6. :func:`zero3_train` -- a model trained for some steps with it: fp32 masters (this rank's
   rows), the layers computing in ``param_dtype`` (bf16: mixed precision, as FSDP2's
   ``MixedPrecisionPolicy``), Adam on the masters' rows.

:class:`collectives.sharded.FSDP` is the same algorithm with prefetch, a side stream and the
bookkeeping a library needs; these two are the algorithm alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from collectives.core.ops import ReduceOp
from collectives.ring import ring_reduce_scatter

from .shard import ShardGroup
from .steps import free_layer, gather_layer


def reduce_scatter_grads(params, shapes, grad_piece: torch.Tensor, group=None, reduce_dtype=None) -> None:
    """Add this rank's rows of the mean over the ranks of ``params``' gradients to
    ``grad_piece`` (padded, laid out as a piece): pack, ring reduce-scatter (AVG) in
    ``reduce_dtype`` (default the gradients'), then drop the full gradients."""
    p = dist.get_world_size(group)
    g = ShardGroup(shapes, p)
    packed = g.pack([q.grad for q in params], dtype=reduce_dtype or params[0].grad.dtype)
    for q in params:
        q.grad = None
    mine = packed.new_empty(g.shard_numel)
    ring_reduce_scatter(mine, packed, op=ReduceOp.AVG, group=group)
    grad_piece.add_(mine.to(grad_piece.dtype))


def zero3_layer(layer: nn.Module, shapes, piece: torch.Tensor, grad_piece: torch.Tensor, group=None,
                reduce_dtype=None) -> list:
    """ZeRO-3 for ``layer``, whose parameters are freed (:func:`free_layer`); returns the hooks'
    handles. ``piece``: this rank's fp32 rows of them (the masters, read at every gather and
    cast to the parameters' dtype before the all-gather); ``grad_piece``: where this rank's
    rows of the mean gradient are added, in backward."""
    params = list(layer.parameters())
    state = {"ready": 0}

    def gather():
        if any(q.untyped_storage().nbytes() == 0 for q in params):
            gather_layer(params, shapes, piece.to(params[0].dtype), group)

    def before_backward(grad):
        gather()                              # freed after forward: the backward needs it again
        return grad

    def pre_forward(module, args):
        gather()

    def post_forward(module, args, output):
        free_layer(params)
        outs = output if isinstance(output, (tuple, list)) else (output,)
        for t in outs:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(before_backward)

    def grad_ready(param):
        state["ready"] += 1
        if state["ready"] == len(params):     # the layer's last gradient: reduce, drop, free
            state["ready"] = 0
            reduce_scatter_grads(params, shapes, grad_piece, group, reduce_dtype)
            free_layer(params)

    handles = [layer.register_forward_pre_hook(pre_forward), layer.register_forward_hook(post_forward)]
    handles += [q.register_post_accumulate_grad_hook(grad_ready) for q in params]
    return handles


def zero3_train(model: nn.Module, batches, lr: float = 1e-2, group=None, param_dtype=None,
                reduce_dtype=None) -> tuple[list[float], list[torch.Tensor]]:
    """Train ``model`` (its children with parameters are the units) one step per batch of
    ``batches`` (this rank's) under ZeRO-3: loss ``model(x).float().square().mean()``, Adam
    (``lr``, ``foreach=False``) on this rank's fp32 rows. Returns this rank's losses and its
    fp32 pieces of every unit (padded rows, as :func:`shard_rows` makes them) after training."""
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    units = [m for m in model.children() if any(True for _ in m.parameters())]
    pieces, grads, rows, handles = [], [], [], []
    for m in units:
        params = list(m.parameters())
        shapes = [tuple(q.shape) for q in params]
        g = ShardGroup(shapes, p)
        piece = torch.cat(g.shard([q.detach().float() for q in params], rank))
        grad_piece = torch.zeros_like(piece)
        if param_dtype is not None:
            m.to(param_dtype)                 # the layer computes in param_dtype; the masters stay fp32
        free_layer(list(m.parameters()))
        handles += zero3_layer(m, shapes, piece, grad_piece, group, reduce_dtype)
        for view, spec in zip(g.shard_views(piece), g.specs):
            rows.append((nn.Parameter(spec.unpad(view, rank)), spec))
        pieces.append(piece)
        grads.append((g, grad_piece))
    opt = torch.optim.Adam([r for r, _ in rows], lr=lr, foreach=False)
    losses = []
    try:
        for x in batches:
            loss = model(x.to(param_dtype) if param_dtype is not None else x).float().square().mean()
            loss.backward()
            k = 0
            for g, grad_piece in grads:
                for view in g.shard_views(grad_piece):
                    shard, spec = rows[k]
                    shard.grad = spec.unpad(view, rank).clone()
                    k += 1
                grad_piece.zero_()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    finally:
        for h in handles:
            h.remove()
    return losses, [piece.clone() for piece in pieces]
