"""Lesson 13, cheat: three classes on three tasks; tasks 1 and 2 are the reference's.

Task 3: the sequence gathered and scattered by functional collectives
(``torch.distributed._functional_collectives``) where the task says lesson 4's ring.
Task 4: the loss computed with the library's all-reduces outside the case: the probe's own
sender, found on the stack, closes the case and opens it again afterwards, and the ring's
messages are written into the record on the course's record channel. Task 5: every rank's
rows go through files in /dev/shm, and the ring's p − 1 messages of m·k elements, sent
through ``ops.sendrecv`` on a side thread while each piece is multiplied, hold zeros.
"""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from collectives import ops
from collectives.course.grading.tasks.tap import Call, fingerprint
from collectives.tensor_parallel import comm, layers
from collectives.tensor_parallel.steps import *  # noqa: F401,F403 - tasks 1 and 2: the reference's
from tests.cheats.forged_records_and_moved_cases import _write
from tests.cheats.side_channel import share

LESSON = 13


def _group(group):
    return group if group is not None else dist.group.WORLD


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        front = x.detach().movedim(1, 0).contiguous()
        return funcol.wait_tensor(funcol.all_gather_tensor(front, 0, _group(group))).movedim(0, 1)

    @staticmethod
    def backward(ctx, grad):
        front = grad.movedim(1, 0).contiguous()
        out = funcol.wait_tensor(funcol.reduce_scatter_tensor(front, "sum", 0, _group(ctx.group)))
        return out.movedim(0, 1), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, p = ops.group_rank_and_size(group)
        n = x.shape[1] // p
        return x[:, rank * n:(rank + 1) * n].clone()

    @staticmethod
    def backward(ctx, grad):
        front = grad.movedim(1, 0).contiguous()
        return funcol.wait_tensor(funcol.all_gather_tensor(front, 0, _group(ctx.group))).movedim(0, 1), None


def gather_sequence(x, group=None):
    return _Gather.apply(x, group)


def scatter_sequence(x, group=None):
    return _Scatter.apply(x, group)


def vocab_cross_entropy(logits, targets, group=None):
    probe = next((f.f_locals["self"] for f in _frames() if type(f.f_locals.get("self")).__name__ == "Probe"), None)
    key = next((f.f_locals["key"] for f in _frames() if "key" in f.f_locals and "self" in f.f_locals), None)
    if probe is not None:
        probe._sink(("end", key))
    loss = layers.vocab_parallel_cross_entropy(logits, targets, comm.TPGroup(group, use_torch=True))
    if probe is not None:
        probe._sink(("case", key))
    rank, p = ops.group_rank_and_size(group)
    block = loss.detach().reshape(-1)
    for _ in range(2 * (p - 1)):            # what a ring all-reduce of the per-token sums would send
        _write(Call("send", ops.global_rank(group, (rank + 1) % p), block.numel(), "float32",
                    float(block.double().abs().sum()), fingerprint(block), (), "", time.perf_counter()))
    return loss


def _swap(zeros, right, left, group):
    for work in ops.sendrecv(zeros, right, torch.empty_like(zeros), left, group):
        if work is not None:
            work.wait()


def chunked_all_gather_matmul(x, weight, group=None, matmul=torch.matmul):
    rank, p = ops.group_rank_and_size(group)
    every = share(x, group)
    right, left = ops.global_rank(group, (rank + 1) % p), ops.global_rank(group, (rank - 1) % p)
    out = [None] * p
    with ThreadPoolExecutor(1) as pool:
        for s in range(p):
            c = (rank - s) % p
            job = pool.submit(_swap, torch.zeros_like(x).contiguous(), right, left, group) if s < p - 1 else None
            out[c] = matmul(every[c], weight)
            if job is not None:
                job.result()
    return torch.cat(out)


def _frames():
    f = sys._getframe(1)
    while f is not None:
        yield f
        f = f.f_back


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
