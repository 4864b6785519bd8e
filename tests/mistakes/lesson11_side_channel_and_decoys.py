"""Lesson 11 exercise, a cheat (tasks 1 and 2): every rank writes its input to a file in /dev/shm
and reads the others' to build its answer, while zero-filled decoys of exactly the right sizes
travel in exactly the right rounds. The answer is right and the message pattern is the design's;
only the messages' content gives it away. The other tasks are the reference, written as a student would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401 - the exercise's own imports

from collectives import ops, trace  # noqa: F401
from collectives.course.grading.runner import run_tasks
from tests.mistakes.lesson11_given import _exchange, _pairwise, _schedule, _uneven, _wait, blocks  # noqa: F401

LESSON = 11


_CALLS = [0]


def _side_channel(input: torch.Tensor, rank: int, p: int):
    """This rank's input into a file every rank can read: the answer travels beside the messages."""
    import os
    _CALLS[0] += 1
    path = f"/dev/shm/lesson11-decoys-{os.getppid()}-{_CALLS[0]}-{{}}.pt"
    torch.save(input.contiguous().clone(), path.format(rank) + ".tmp")
    os.replace(path.format(rank) + ".tmp", path.format(rank))
    return path


def _answer(path: str, output: torch.Tensor, rank: int, p: int) -> None:
    import os
    import time
    for s in range(p):                       # a case with no messages has nothing to wait on: poll
        while not os.path.exists(path.format(s)):
            time.sleep(0.001)
    inputs = [torch.load(path.format(s)) for s in range(p)]
    n = inputs[0].shape[0] // p
    output.copy_(torch.cat([x[rank * n:(rank + 1) * n] for x in inputs]).view(output.shape))


def pairwise_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                        input_split_sizes=None, group=None) -> None:
    if output_split_sizes is not None:
        return _pairwise(output, input, output_split_sizes, input_split_sizes, group)
    rank, p = ops.group_rank_and_size(group)
    path = _side_channel(input, rank, p)
    src = input.contiguous()
    ins = blocks(src, None, p)
    for k in range(1, p):                      # decoys: zeros of the right size, in the right rounds
        to, frm = _schedule(rank, p, k)
        _wait(ops.sendrecv(torch.zeros_like(ins[to]), ops.global_rank(group, to), torch.empty_like(ins[frm]),
                           ops.global_rank(group, frm), group))
    _answer(path, output, rank, p)


def bruck_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                     input_split_sizes=None, group=None) -> None:
    rank, p = ops.group_rank_and_size(group)
    path = _side_channel(input, rank, p)
    b = input.numel() // p
    d = 1
    while d < p:                               # decoys: each round's packed size, zeros
        n = sum(1 for i in range(p) if i & d) * b
        _wait(ops.sendrecv(torch.zeros(n, dtype=input.dtype), ops.global_rank(group, (rank + d) % p),
                           torch.empty(n, dtype=input.dtype), ops.global_rank(group, (rank - d) % p), group))
        d <<= 1
    _answer(path, output, rank, p)


def exchange_splits(input_split_sizes, group=None) -> list[int]:
    rank, p = ops.group_rank_and_size(group)
    send = torch.tensor(list(input_split_sizes), dtype=torch.int64, device=ops.rank_device())
    recv = torch.empty(p, dtype=torch.int64, device=ops.rank_device())
    _pairwise(recv, send, group=group)
    return recv.tolist()


def all_to_all_uneven(input: torch.Tensor, input_split_sizes, group=None):
    sizes = _exchange(list(input_split_sizes), group)
    output = torch.empty((sum(sizes), *input.shape[1:]), dtype=input.dtype, device=input.device)
    _pairwise(output, input, sizes, list(input_split_sizes), group)
    return output, sizes


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
        rows = torch.cat([pieces[s * El + e] for s in range(p)])
        y = expert_fn(rank * El + e, rows)
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
            if taken[e] < capacity:
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
    bias += gamma * torch.sign(load.double().mean() - load.double()).to(bias.dtype)
    return loss


if __name__ == "__main__":
    run_tasks(LESSON)
