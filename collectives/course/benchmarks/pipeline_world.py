"""What both of ``bench-pp``'s suites run in their ranks: the micro-batches, and a step timed
across every rank."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def data(m: int, rows: int, width: int) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(7)
    return ([torch.randn(rows, width, generator=gen) for _ in range(m)],
            [torch.randn(rows, width, generator=gen) for _ in range(m)])


def timed(fn) -> tuple[float, float]:
    """Run ``fn`` on every rank at once; (first start, last end) over the ranks (one host's clock)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    ends = torch.tensor([-t0, t1], dtype=torch.float64)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX)
    return -float(ends[0]), float(ends[1])
