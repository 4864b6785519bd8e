"""What both of ``bench-pp``'s suites run in their ranks: the micro-batches, and a step timed
across every rank."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def data(m: int, rows: int, width: int, device=None) -> tuple[list, list]:
    """``m`` micro-batches and their targets, the same on every rank (drawn on the CPU)."""
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(rows, width, generator=gen) for _ in range(m)]
    ts = [torch.randn(rows, width, generator=gen) for _ in range(m)]
    return [x.to(device) for x in xs], [t.to(device) for t in ts]


def timed(fn, device=None) -> tuple[float, float]:
    """Run ``fn`` on every rank at once; (first start, last end) over the ranks (one host's
    clock), a GPU's work waited for."""
    cuda = device is not None and torch.device(device).type == "cuda"
    dist.barrier()
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    ends = torch.tensor([-t0, t1], dtype=torch.float64, device=device)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX)
    return -float(ends[0]), float(ends[1])
