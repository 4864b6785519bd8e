"""Lesson 11 exercise, a cheat: every task done with dist.all_to_all_single, the right values
from a library collective instead of messages (and Bruck as the library's too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from collectives import ops
from collectives.course.grading.runner import run_tasks
from tests.mistakes.lesson11_given import blocks  # noqa: F401 - given by the exercise

LESSON = 11


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
