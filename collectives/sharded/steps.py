"""Lesson 10's exercise, solved: the four moves sharded training is made of, one function each.

The classes (:class:`~collectives.sharded.zero.ZeRO`, :class:`~collectives.sharded.fsdp.FSDP`)
do these same moves with hooks and bookkeeping around them; here each stands alone.

1. :func:`shard_rows` / :func:`unshard_rows` -- a tensor's rank-``r`` rows, padded, and back;
2. :func:`zero1_step` -- ZeRO-1's step: reduce-scatter, Adam on my rows, all-gather;
3. :func:`gather_layer` / :func:`free_layer` -- a layer's weights whole just while needed;
4. :func:`forward_prefetch` -- a forward that gathers layer i+1 while layer i computes.

ZeRO-3's whole step, built on these, is :mod:`collectives.sharded.zero3_steps`.
"""

from __future__ import annotations

import concurrent.futures

import torch

from collectives.core.ops import ReduceOp
from collectives.ring import ring_all_gather, ring_reduce_scatter

from .shard import ShardGroup, ShardSpec


def shard_rows(full: torch.Tensor, rank: int, p: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``full`` cut on dim 0 into ``p`` shards of ``ceil(rows/p)``
    rows, flat and padded with zeros to ``ceil(rows/p) · row_numel`` elements."""
    if not 0 <= rank < p:
        raise ValueError(f"shard_rows: rank must be in [0, {p}), got {rank}")
    return ShardSpec(tuple(full.shape), p).shard(full, rank)


def unshard_rows(gathered: torch.Tensor, shape, p: int) -> torch.Tensor:
    """The tensor of ``shape`` rebuilt from ``p`` padded shards laid end to end."""
    group = ShardGroup([tuple(shape)], p)
    return group.unpack(gathered.reshape(-1))[0].clone()


def zero1_step(params, shards, optimizer, group=None) -> None:
    """ZeRO-1's step. ``params[i].grad`` holds this rank's full gradient; ``shards[i]`` is
    this rank's rows of ``params[i]`` (a view of it) and ``optimizer`` steps ``shards``.

    Reduce-scatter the mean gradient (lesson 4's ring) so each shard gets its rows' grad,
    step, then all-gather every rank's updated rows back into ``params``."""
    p = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    g = ShardGroup([q.shape for q in params], p)
    packed = g.pack([q.grad for q in params])
    piece = packed.new_empty(g.shard_numel)
    ring_reduce_scatter(piece, packed, op=ReduceOp.AVG, group=group)
    for shard, view, spec in zip(shards, g.shard_views(piece), g.specs):
        shard.grad = spec.unpad(view, rank).clone()
    optimizer.step()
    with torch.no_grad():
        mine = torch.cat(g.shard([q.detach() for q in params], rank))
        gathered = mine.new_empty(p * g.shard_numel)
        ring_all_gather(gathered, mine, group=group)
        for q, full in zip(params, g.unpack(gathered)):
            q.copy_(full)


def gather_layer(params, shapes, piece: torch.Tensor, group=None) -> None:
    """Make each freed parameter of a layer whole: all-gather every rank's ``piece`` (its
    padded rows of each parameter, in order), grow each parameter's storage back to its
    full size and copy tensor i into it -- in place, so every tensor that shares the storage
    (what autograd saved of it in a forward) sees the weights again."""
    p = torch.distributed.get_world_size(group)
    g = ShardGroup(shapes, p)
    gathered = piece.new_empty(p * g.shard_numel)
    ring_all_gather(gathered, piece, group=group)
    for q, full in zip(params, g.unpack(gathered)):
        storage = q.untyped_storage()
        if storage.nbytes() < q.numel() * q.element_size():
            storage.resize_(q.numel() * q.element_size())
        q.data.copy_(full)        # through .data: autograd's saved copy stays valid (no version bump)


def free_layer(params) -> None:
    """Drop the full parameters: shrink each one's storage to nothing (FSDP2's way). The
    Parameter keeps its shape; every tensor sharing its storage -- the weight a forward saved
    for backward -- holds no memory either, until :func:`gather_layer` grows it back."""
    for q in params:
        q.untyped_storage().resize_(0)


def forward_prefetch(layers, shapes, pieces, x: torch.Tensor, max_alive: int = 2, group=None) -> torch.Tensor:
    """``x`` through ``layers`` in order, each gathered just before it runs and freed after;
    layer i+1's all-gather runs on a thread of its own while layer i computes, as long as
    no more than ``max_alive`` layers are gathered (or being gathered) at once."""
    if max_alive < 1:
        raise ValueError(f"forward_prefetch: max_alive must be at least 1, got {max_alive}")
    params = [list(layer.parameters()) for layer in layers]
    with concurrent.futures.ThreadPoolExecutor(1) as comm:       # one thread: the same order on every rank
        pending: dict[int, concurrent.futures.Future] = {}
        alive = 0
        h = x
        for i, layer in enumerate(layers):
            if i not in pending:
                alive += 1
                pending[i] = comm.submit(gather_layer, params[i], shapes[i], pieces[i], group)
            if i + 1 < len(layers) and alive < max_alive:
                alive += 1
                pending[i + 1] = comm.submit(gather_layer, params[i + 1], shapes[i + 1], pieces[i + 1], group)
            pending.pop(i).result()
            h = layer(h)
            free_layer(params[i])
            alive -= 1
    return h
