"""Lesson 10, natural mistakes (one per task): the exercise solved as the reference solves
it, with one slip a student makes planted in each task's own function. Every task must
FAIL, its message naming the slip (tests/test_grader_lesson10.py):

1. ``shard_rows`` checks ``rank > p`` -- off by one: rank p is let through;
2. ``zero1_step`` packs parameter by parameter (each one's p shards together) instead of
   rank by rank, so the reduce-scatter hands each rank the wrong rows;
3. ``free_layer`` points ``.data`` at an empty tensor (and ``gather_layer`` at a new full
   one): nothing autograd saved is freed;
4. ``forward_prefetch`` prefetches while ``alive <= max_alive``: one layer too many;
5. ``reduce_scatter_grads`` sums where it should average;
6. ``zero3_train`` never zeroes ``grad_piece``: step 2 steps with step 1's gradient too.

Where a task builds on another task's function it calls the reference's, so each task
shows its own slip only.
"""

from __future__ import annotations

import concurrent.futures

import torch
import torch.distributed as dist
from torch import nn

from collectives.core.ops import ReduceOp
from collectives.course.grading.runner import run_tasks
from collectives.ring import ring_all_gather, ring_reduce_scatter
from collectives.sharded import ShardGroup, ShardSpec
from collectives.sharded import steps as _ref
from collectives.sharded import zero3_steps as _ref3

LESSON = 10


def shard_rows(full, rank, p):
    if not 0 <= rank <= p:                              # the slip: rank == p passes
        raise ValueError(f"shard_rows: rank must be in [0, {p}), got {rank}")
    rows = full.shape[0] if full.dim() else 1
    flat = full.reshape(rows, -1)
    c = -(-rows // p)
    out = full.new_zeros(c * flat.shape[1])
    lo, hi = min(rank * c, rows), min((rank + 1) * c, rows)
    out[:(hi - lo) * flat.shape[1]] = flat[lo:hi].reshape(-1)
    return out


def unshard_rows(gathered, shape, p):
    return _ref.unshard_rows(gathered, shape, p)


def zero1_step(params, shards, optimizer, group=None):
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    g = ShardGroup([q.shape for q in params], p)
    # the slip: every parameter's p shards one after the other, not block r = rank r's rows of all
    packed = torch.cat([torch.cat(ShardGroup([q.shape], p).shard([q.grad], r)) for q in params for r in range(p)])
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


def gather_layer(params, shapes, piece, group=None):
    p = dist.get_world_size(group)
    g = ShardGroup(shapes, p)
    gathered = piece.new_empty(p * g.shard_numel)
    ring_all_gather(gathered, piece, group=group)
    for q, full in zip(params, g.unpack(gathered)):
        q.data = full.clone()                            # the slip's other half: a new tensor


def free_layer(params):
    for q in params:
        q.data = torch.empty(0, dtype=q.dtype, device=q.device)     # the slip


def forward_prefetch(layers, shapes, pieces, x, max_alive=2, group=None):
    if max_alive < 1:
        raise ValueError(f"forward_prefetch: max_alive must be at least 1, got {max_alive}")
    params = [list(layer.parameters()) for layer in layers]
    with concurrent.futures.ThreadPoolExecutor(1) as comm:
        pending, alive, h = {}, 0, x
        for i, layer in enumerate(layers):
            if i not in pending:
                alive += 1
                pending[i] = comm.submit(_ref.gather_layer, params[i], shapes[i], pieces[i], group)
            if i + 1 < len(layers) and alive <= max_alive:          # the slip: <= for <
                alive += 1
                pending[i + 1] = comm.submit(_ref.gather_layer, params[i + 1], shapes[i + 1], pieces[i + 1], group)
            pending.pop(i).result()
            h = layer(h)
            _ref.free_layer(params[i])
            alive -= 1
    return h


def reduce_scatter_grads(params, shapes, grad_piece, group=None, reduce_dtype=None):
    p = dist.get_world_size(group)
    g = ShardGroup(shapes, p)
    packed = g.pack([q.grad for q in params], dtype=reduce_dtype or params[0].grad.dtype)
    for q in params:
        q.grad = None
    mine = packed.new_empty(g.shard_numel)
    ring_reduce_scatter(mine, packed, op=ReduceOp.SUM, group=group)       # the slip: SUM
    grad_piece.add_(mine.to(grad_piece.dtype))


def zero3_layer(layer, shapes, piece, grad_piece, group=None, reduce_dtype=None):
    params = list(layer.parameters())
    state = {"ready": 0}

    def gather():
        if any(q.untyped_storage().nbytes() == 0 for q in params):
            _ref.gather_layer(params, shapes, piece.to(params[0].dtype), group)

    def before_backward(grad):
        gather()
        return grad

    def post_forward(module, args, output):
        _ref.free_layer(params)
        if output.requires_grad:
            output.register_hook(before_backward)

    def grad_ready(param):
        state["ready"] += 1
        if state["ready"] == len(params):
            state["ready"] = 0
            reduce_scatter_grads(params, shapes, grad_piece, group, reduce_dtype)
            _ref.free_layer(params)

    handles = [layer.register_forward_pre_hook(lambda m, a: gather()), layer.register_forward_hook(post_forward)]
    return handles + [q.register_post_accumulate_grad_hook(grad_ready) for q in params]


def zero3_train(model, batches, lr=1e-2, group=None, param_dtype=None, reduce_dtype=None):
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    units = [m for m in model.children() if any(True for _ in m.parameters())]
    pieces, grads, rows, handles = [], [], [], []
    for m in units:
        shapes = [tuple(q.shape) for q in m.parameters()]
        g = ShardGroup(shapes, p)
        piece = torch.cat(g.shard([q.detach().float() for q in m.parameters()], rank))
        grad_piece = torch.zeros_like(piece)
        if param_dtype is not None:
            m.to(param_dtype)
        _ref.free_layer(list(m.parameters()))
        handles += _ref3.zero3_layer(m, shapes, piece, grad_piece, group, reduce_dtype)
        for view, spec in zip(g.shard_views(piece), g.specs):
            rows.append((nn.Parameter(spec.unpad(view, rank)), spec))
        pieces.append(piece)
        grads.append((g, grad_piece))
    opt = torch.optim.Adam([r for r, _ in rows], lr=lr, foreach=False)
    losses = []
    for x in batches:
        loss = model(x.to(param_dtype) if param_dtype is not None else x).float().square().mean()
        loss.backward()
        k = 0
        for g, grad_piece in grads:
            for view in g.shard_views(grad_piece):
                shard, spec = rows[k]
                shard.grad = spec.unpad(view, rank).clone()
                k += 1
            # the slip: grad_piece is not zeroed here
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    for h in handles:
        h.remove()
    return losses, [piece.clone() for piece in pieces]


_unused = ShardSpec


if __name__ == "__main__":
    run_tasks(LESSON)
