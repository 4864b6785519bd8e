"""Lesson 11 exercise, natural mistakes (set B): the reference written as a student would,
with one mistake planted in each task, each of which the grader must fail with a message
that points at it:

    task 1: the own block never copied
    task 2: each round sends to rank − d and receives from rank + d
    task 3: every rank's whole count list sent to every rank (an all-gather: p times the counts)
    task 4: the input's split sizes returned as the output's
    task 5: each expert called once per source rank, not once on all its rows
    task 6: an off-by-one capacity (`<=`): one row too many per full expert
    task 7: the bias moved the wrong way (busy experts up)

Original header follows.

Lesson 11 exercise: all-to-all, uneven splits, and a mixture-of-experts dispatch.

Seven functions, seven tasks. Every all-to-all has ``dist.all_to_all_single``'s contract:
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
import torch.distributed as dist  # noqa: F401 - the exercise's own imports

from collectives import ops, trace  # noqa: F401
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


def _wait(handles) -> None:
    for handle in handles:
        handle.wait()


def _schedule(rank: int, p: int, k: int) -> tuple[int, int]:
    if p & (p - 1) == 0:
        return rank ^ k, rank ^ k
    return (rank + k) % p, (rank - k) % p


def _pairwise(output, input, output_split_sizes=None, input_split_sizes=None, group=None) -> None:
    """A correct pairwise all-to-all, for the tasks built on task 1."""
    rank, p = ops.group_rank_and_size(group)
    src = input.contiguous()
    dst = output if output.is_contiguous() else torch.empty(output.shape, dtype=output.dtype)
    ins, outs = blocks(src, input_split_sizes, p), blocks(dst, output_split_sizes, p)
    outs[rank].copy_(ins[rank])
    for k in range(1, p):
        to, frm = _schedule(rank, p, k)
        _wait(ops.sendrecv(ins[to], ops.global_rank(group, to), outs[frm], ops.global_rank(group, frm), group))
    if dst is not output:
        output.copy_(dst)


def _exchange(counts: list[int], group=None) -> list[int]:
    rank, p = ops.group_rank_and_size(group)
    send = torch.tensor(counts, dtype=torch.int64, device=ops.rank_device())
    recv = torch.empty(p, dtype=torch.int64, device=ops.rank_device())
    _pairwise(recv, send, group=group)
    return recv.tolist()


def _uneven(input, input_split_sizes, group=None):
    sizes = _exchange(list(input_split_sizes), group)
    output = torch.empty((sum(sizes), *input.shape[1:]), dtype=input.dtype, device=input.device)
    _pairwise(output, input, sizes, list(input_split_sizes), group)
    return output, sizes


def pairwise_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                        input_split_sizes=None, group=None) -> None:
    rank, p = ops.group_rank_and_size(group)
    src = input.contiguous()
    dst = output if output.is_contiguous() else torch.empty(output.shape, dtype=output.dtype)
    ins, outs = blocks(src, input_split_sizes, p), blocks(dst, output_split_sizes, p)
    for k in range(1, p):
        to, frm = _schedule(rank, p, k)
        _wait(ops.sendrecv(ins[to], ops.global_rank(group, to), outs[frm], ops.global_rank(group, frm), group))
    if dst is not output:
        output.copy_(dst)


def bruck_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                     input_split_sizes=None, group=None) -> None:
    rank, p = ops.group_rank_and_size(group)
    src = input.contiguous()
    b = src.numel() // p
    slots = [t.clone() for t in blocks(src, None, p)]
    slots = [slots[(rank + i) % p] for i in range(p)]
    d = 1
    while d < p:
        moving = [i for i in range(p) if i & d]
        to, frm = (rank - d) % p, (rank + d) % p
        packed = torch.cat([slots[i] for i in moving])
        landing = torch.empty_like(packed)
        _wait(ops.sendrecv(packed, ops.global_rank(group, to), landing, ops.global_rank(group, frm), group))
        for i, piece in zip(moving, landing.split(b)):
            slots[i] = piece
        d <<= 1
    result = torch.cat([slots[(rank - s) % p] for s in range(p)])
    output.copy_(result.view(output.shape))


def exchange_splits(input_split_sizes, group=None) -> list[int]:
    rank, p = ops.group_rank_and_size(group)
    send = torch.tensor(list(input_split_sizes) * p, dtype=torch.int64, device=ops.rank_device())
    everyone = torch.empty(p * p, dtype=torch.int64, device=ops.rank_device())
    _pairwise(everyone, send, group=group)
    return everyone.view(p, p)[:, rank].tolist()


def all_to_all_uneven(input: torch.Tensor, input_split_sizes, group=None):
    sizes = _exchange(list(input_split_sizes), group)
    output = torch.empty((sum(sizes), *input.shape[1:]), dtype=input.dtype, device=input.device)
    _pairwise(output, input, sizes, list(input_split_sizes), group)
    return output, list(input_split_sizes)


def moe_dispatch_combine(x: torch.Tensor, expert_of: torch.Tensor, num_experts: int, expert_fn,
                         group=None) -> torch.Tensor:
    rank, p = ops.group_rank_and_size(group)
    El = num_experts // p
    order = torch.argsort(expert_of, stable=True)
    counts = torch.bincount(expert_of, minlength=num_experts).tolist()
    send_counts = torch.tensor(counts, dtype=torch.int64)
    recv_counts = torch.empty(num_experts, dtype=torch.int64)
    _pairwise(recv_counts, send_counts, group=group)
    recv_counts = recv_counts.view(p, El)
    send = [sum(counts[q * El:(q + 1) * El]) for q in range(p)]
    recv = recv_counts.sum(1).tolist()
    received = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype)
    _pairwise(received, x.index_select(0, order).contiguous(), recv, send, group)
    pieces = received.split(recv_counts.reshape(-1).tolist())
    back = [None] * (p * El)
    for e in range(El):
        y = torch.cat([expert_fn(rank * El + e, pieces[s * El + e]) for s in range(p)])
        for s, part in enumerate(y.split(recv_counts[:, e].tolist())):
            back[s * El + e] = part
    returned = torch.empty_like(x)
    _pairwise(returned, torch.cat(back).contiguous() if back else x, send, recv, group)
    return returned.index_select(0, torch.argsort(order))


def topk_dispatch_combine(x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor, num_experts: int,
                          capacity: int, expert_fn, group=None):
    rank, p = ops.group_rank_and_size(group)
    El = num_experts // p
    T, k = experts.shape
    slot = torch.full((T, k), -1, dtype=torch.int64)
    taken = [0] * num_experts
    for j in range(k):
        for t in range(T):
            e = int(experts[t, j])
            if taken[e] <= capacity:
                slot[t, j] = taken[e]
            taken[e] += 1
    dropped = int((slot < 0).sum())
    flat = [(int(experts[t, j]), int(slot[t, j]), t, j) for t in range(T) for j in range(k) if slot[t, j] >= 0]
    flat.sort()
    counts = [0] * num_experts
    for e, _, _, _ in flat:
        counts[e] += 1
    recv_counts = torch.empty(num_experts, dtype=torch.int64)
    _pairwise(recv_counts, torch.tensor(counts, dtype=torch.int64), group=group)
    recv_counts = recv_counts.view(p, El)
    send = [sum(counts[q * El:(q + 1) * El]) for q in range(p)]
    recv = recv_counts.sum(1).tolist()
    rows = x[[t for _, _, t, _ in flat]] if flat else x[:0]
    received = torch.empty((sum(recv), x.shape[1]), dtype=x.dtype)
    _pairwise(received, rows.contiguous(), recv, send, group)
    pieces = received.split(recv_counts.reshape(-1).tolist())
    back = [None] * (p * El)
    for e in range(El):
        y = expert_fn(rank * El + e, torch.cat([pieces[s * El + e] for s in range(p)]))
        for s, part in enumerate(y.split(recv_counts[:, e].tolist())):
            back[s * El + e] = part
    returned = torch.empty((len(flat), x.shape[1]), dtype=x.dtype)
    _pairwise(returned, torch.cat(back).contiguous() if back else x[:0], send, recv, group)
    out = torch.zeros_like(x)
    for (e, _, t, j), y in zip(flat, returned):
        out[t] += gates[t, j] * y
    return out, dropped


def balance_experts(bias: torch.Tensor, expert: torch.Tensor, probs: torch.Tensor, gamma: float,
                    group=None) -> torch.Tensor:
    rank, p = ops.group_rank_and_size(group)
    E = probs.shape[1]
    mine = torch.bincount(expert.reshape(-1), minlength=E)
    f = mine.to(probs.dtype) / expert.numel()
    loss = E * (f * probs.mean(0)).sum()
    everyone = torch.empty(p * E, dtype=torch.int64)
    _pairwise(everyone, mine.repeat(p), group=group)
    load = everyone.view(p, E).sum(0)
    bias += gamma * torch.sign(load.double() - load.double().mean()).to(bias.dtype)
    return loss


if __name__ == "__main__":
    run_tasks(LESSON)
