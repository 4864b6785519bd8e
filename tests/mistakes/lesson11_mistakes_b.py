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
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401 - the exercise's own imports

from collectives import ops, trace  # noqa: F401
from collectives.course.grading.runner import run_tasks
from tests.mistakes.lesson11_given import _exchange, _pairwise, _schedule, _uneven, _wait, blocks  # noqa: F401

LESSON = 11


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
