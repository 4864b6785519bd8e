"""Lesson 11 exercise, a cheat: every task done with dist.all_to_all_single, the right values
from a library collective instead of messages (and Bruck as the library's too).

Original header follows.

Lesson 11 exercise: all-to-all, uneven splits, and a mixture-of-experts dispatch.

Five functions, five tasks. Every all-to-all has ``dist.all_to_all_single``'s contract:
blocks are cut along dim 0 (equal, or ``*_split_sizes`` rows each), rank r's output block s
is rank s's input block r, any dtype, any world size (graded on 1 to 6 ranks: 3, 5 and 6
are not powers of two), empty blocks allowed.

Check your work:

    make check LESSON=11                                          # one PASS/FAIL line per task
    .venv/bin/python lessons/11_alltoall/exercise.py --task 1 --verbose    # one task, every problem
    .venv/bin/torchrun --nproc-per-node 4 lessons/11_alltoall/exercise.py  # the same, under torchrun
    make grade LESSON=11                                          # the same verdicts, as points

The checks are the grader's own judges, run outside your ranks, on inputs drawn at random
on every run; every message you send is recorded where your code cannot reach it. A
library collective (``dist.all_to_all_single``, ``dist.all_gather``...) does not pass:
build everything from ``send``/``recv``.

Course functions you may call (the sheet is checked against the code):

    ops.group_rank_and_size(group=None) -> tuple[int, int]
        This rank's index in ``group`` and the group's size (the world when ``group`` is
        None).
    ops.global_rank(group, group_rank) -> int
        The global rank of ``group_rank`` in ``group``: what ``send``/``recv`` take.
    ops.sendrecv(send_buf, dst, recv_buf, src, group=None, *, post_empty=False)
        Post a receive of ``recv_buf`` from ``src`` and a send of ``send_buf`` to ``dst``;
        return the ``(receive, send)`` handles. ``dst``/``src`` are global ranks.
    ops.rank_device() -> torch.device
        The device this rank's tensors belong on: its GPU under NCCL, else the CPU.

The reference is ``collectives/alltoall/``; the lesson page is docs/lessons/11-alltoall.md.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from collectives import ops
from collectives.course.grading.runner import run_tasks

LESSON = 11


def blocks(tensor: torch.Tensor, split_sizes, p: int) -> list[torch.Tensor]:
    """Given: ``tensor`` (contiguous) cut along dim 0 into p blocks -- ``split_sizes[i]`` rows
    each, or equal blocks when ``split_sizes`` is None -- each block a flat, contiguous view."""
    rows = [tensor.shape[0] // p] * p if split_sizes is None else list(split_sizes)
    row = math.prod(tensor.shape[1:])
    flat, out, at = tensor.reshape(-1), [], 0
    for r in rows:
        out.append(flat[at * row:(at + r) * row])
        at += r
    return out


def pairwise_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
    result = torch.empty(output.shape, dtype=output.dtype)
    dist.all_to_all_single(result, input.contiguous(), output_split_sizes, input_split_sizes, group=group)
    output.copy_(result)


def bruck_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
    pairwise_all_to_all(output, input, output_split_sizes, input_split_sizes, group)


def exchange_splits(input_split_sizes, group=None):
    recv = torch.empty(len(input_split_sizes), dtype=torch.int64)
    dist.all_to_all_single(recv, torch.tensor(input_split_sizes, dtype=torch.int64), group=group)
    return recv.tolist()


def all_to_all_uneven(input, input_split_sizes, group=None):
    sizes = exchange_splits(input_split_sizes, group)
    output = torch.empty((sum(sizes), *input.shape[1:]), dtype=input.dtype)
    pairwise_all_to_all(output, input, sizes, list(input_split_sizes), group)
    return output, sizes


def moe_dispatch_combine(x, expert_of, num_experts, expert_fn, group=None):
    rank, p = ops.group_rank_and_size(group)
    local = num_experts // p
    order = torch.argsort(expert_of, stable=True)
    counts = torch.bincount(expert_of, minlength=num_experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(p, local)
    send_splits = counts.view(p, local).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    received = torch.empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(received, x.index_select(0, order), recv_splits, send_splits, group=group)
    pieces = received.split(recv_counts.reshape(-1).tolist())
    back = [None] * (p * local)
    for e in range(local):
        y = expert_fn(rank * local + e, torch.cat([pieces[s * local + e] for s in range(p)]))
        for s, part in enumerate(y.split(recv_counts[:, e].tolist())):
            back[s * local + e] = part
    returned = torch.empty_like(x)
    dist.all_to_all_single(returned, torch.cat(back), send_splits, recv_splits, group=group)
    return returned.index_select(0, torch.argsort(order))


if __name__ == "__main__":
    run_tasks(LESSON)
