"""Lesson 10, cheat: ZeRO-1's step done as DDP's (one all-reduce of every gradient, then
the step on the shards given), and a forward that gathers every layer up front. The
parameters after the step and the forward's output are right, so a grader that compared
only values gave tasks 2 and 4 full marks. Tasks 1 and 3 are the reference's.

The judge reads the messages: ZeRO-1 sends no all-reduce; and the probe's layers count how
many of them are whole as they run: more than ``max_alive``.
"""

import torch
import torch.distributed as dist

from collectives.sharded import *  # noqa: F401,F403
from collectives.sharded import free_layer, gather_layer

LESSON = 10


def zero1_step(params, shards, optimizer, group=None):
    p = dist.get_world_size(group)
    for q in params:
        dist.all_reduce(q.grad, group=group)
        q.grad.div_(p)
    rank = dist.get_rank(group)
    for q, s in zip(params, shards):
        c = -(-q.shape[0] // p)
        s.grad = q.grad[rank * c:rank * c + s.shape[0]].clone()
    optimizer.step()
    # every rank stepped only its rows: fetch the rest with one more all-reduce of the deltas
    with torch.no_grad():
        for q, s in zip(params, shards):
            c = -(-q.shape[0] // p)
            mine = torch.zeros_like(q)
            mine[rank * c:rank * c + s.shape[0]] = q[rank * c:rank * c + s.shape[0]]
            dist.all_reduce(mine, group=group)
            q.copy_(mine)


def forward_prefetch(layers, shapes, pieces, x, max_alive=2, group=None):
    params = [list(m.parameters()) for m in layers]
    for ps, s, piece in zip(params, shapes, pieces):
        gather_layer(ps, s, piece, group)
    for m, ps in zip(layers, params):
        x = m(x)
    for ps in params:
        free_layer(ps)
    return x


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
