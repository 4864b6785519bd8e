"""Lesson 10, natural mistakes (one per task), a second set: the exercise solved as the
reference solves it, with one slip planted in each task's own function. Every task must
FAIL, its message naming the slip (tests/test_grader_lesson10.py):

1. ``shard_rows`` takes ``rows // p`` rows a shard (floor, not ceiling): pieces too small;
2. ``zero1_step`` all-gathers the weights with ``dist.all_gather_into_tensor``, not the ring;
3. ``gather_layer`` points ``.data`` at the gathered tensor instead of growing the freed
   storage back and copying into it: what autograd saved stays empty;
4. ``forward_prefetch`` starts layer i+1's gather only after layer i has computed;
5. ``zero3_layer`` never frees a layer after its reduce-scatter;
6. ``zero3_train`` casts the model to bf16 before cutting the masters: bf16 masters.

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
    if not 0 <= rank < p:
        raise ValueError(f"shard_rows: rank must be in [0, {p}), got {rank}")
    rows = full.shape[0] if full.dim() else 1
    flat = full.reshape(rows, -1)
    c = max(1, rows // p)                               # the slip: floor
    out = full.new_zeros(c * flat.shape[1])
    lo, hi = min(rank * c, rows), min((rank + 1) * c, rows)
    out[:(hi - lo) * flat.shape[1]] = flat[lo:hi].reshape(-1)
    return out


def unshard_rows(gathered, shape, p):
    return _ref.unshard_rows(gathered, shape, p)


def zero1_step(params, shards, optimizer, group=None):
    p, rank = dist.get_world_size(group), dist.get_rank(group)
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
        dist.all_gather_into_tensor(gathered, mine, group=group)      # the slip: the library's
        for q, full in zip(params, g.unpack(gathered)):
            q.copy_(full)


def gather_layer(params, shapes, piece, group=None):
    p = dist.get_world_size(group)
    g = ShardGroup(shapes, p)
    gathered = piece.new_empty(p * g.shard_numel)
    ring_all_gather(gathered, piece, group=group)
    for q, full in zip(params, g.unpack(gathered)):
        q.data = full.clone()                            # the slip: a new tensor, the storage stays empty


def free_layer(params):
    for q in params:
        q.untyped_storage().resize_(0)


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
            pending.pop(i).result()
            h = layer(h)
            _ref.free_layer(params[i])
            alive -= 1
            if i + 1 < len(layers) and alive < max_alive:           # the slip: after the compute
                alive += 1
                pending[i + 1] = comm.submit(_ref.gather_layer, params[i + 1], shapes[i + 1], pieces[i + 1], group)
    return h


def reduce_scatter_grads(params, shapes, grad_piece, group=None, reduce_dtype=None):
    p = dist.get_world_size(group)
    g = ShardGroup(shapes, p)
    packed = g.pack([q.grad for q in params], dtype=reduce_dtype or params[0].grad.dtype)
    for q in params:
        q.grad = None
    mine = packed.new_empty(g.shard_numel)
    ring_reduce_scatter(mine, packed, op=ReduceOp.AVG, group=group)
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
            _ref3.reduce_scatter_grads(params, shapes, grad_piece, group, reduce_dtype)
            # the slip: the layer is not freed here (only after its next forward)

    handles = [layer.register_forward_pre_hook(lambda m, a: gather()), layer.register_forward_hook(post_forward)]
    return handles + [q.register_post_accumulate_grad_hook(grad_ready) for q in params]


def zero3_train(model, batches, lr=1e-2, group=None, param_dtype=None, reduce_dtype=None):
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    units = [m for m in model.children() if any(True for _ in m.parameters())]
    pieces, grads, rows, handles = [], [], [], []
    for m in units:
        shapes = [tuple(q.shape) for q in m.parameters()]
        g = ShardGroup(shapes, p)
        if param_dtype is not None:
            m.to(param_dtype)                                # the slip: cast before the masters are cut
        piece = torch.cat(g.shard([q.detach() for q in m.parameters()], rank))
        grad_piece = torch.zeros_like(piece)
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
            grad_piece.zero_()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    for h in handles:
        h.remove()
    return losses, [piece.clone() for piece in pieces]


_unused = ShardSpec


if __name__ == "__main__":
    run_tasks(LESSON)
