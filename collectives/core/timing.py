"""Timing collectives fairly: warm up, align the ranks, time each run, take the median.

A collective is as slow as its slowest rank, so every run's time is the maximum over
ranks. On GPUs the time comes from CUDA events on the current stream; on CPU from
``perf_counter``. Used by the tour and every benchmark.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from . import trace
from .ops import rank_device


def measure(fn: Callable[[], object], *, warmup: int = 2, iters: int = 5, group=None,
            device: torch.device | None = None) -> list[float]:
    """Seconds for each of ``iters`` runs of ``fn()`` (after ``warmup`` runs), max over ranks.

    Each run starts after a barrier so that no rank's time includes waiting for a late peer.
    Not traced: the barriers and the max-reduction are the harness's, not the algorithm's.
    ``device`` defaults to the rank's own (its GPU under NCCL): a GPU's work is timed with
    CUDA events, never with the host's clock, which sees only the launches.
    """
    device = device if device is not None else rank_device()
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    with trace.paused():
        for _ in range(iters):
            dist.barrier(group=group)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(device)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        slowest = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest.cpu().tolist()


def measure_back_to_back(fn: Callable[[], object], *, iters: int = 100, group=None,
                         device: torch.device) -> float:
    """Seconds per run of ``fn()`` issued ``iters`` times in a row, max over ranks.

    :func:`measure` waits for each run to finish before the next starts, so on a GPU a
    run's host time -- launching, checking, planning -- adds to its time. A training loop
    does not wait: the host issues step k+1 while the GPU still works on step k, and host
    time shows only where it exceeds the GPU's. This times that: one barrier, then every
    run issued back to back between two CUDA events. On CPU, where nothing is queued, it is
    the mean time of a run with no barrier between runs.
    """
    cuda = device.type == "cuda"
    fn()
    with trace.paused():
        dist.barrier(group=group)
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / iters
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            seconds = (time.perf_counter() - t0) / iters
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest.item()


# NCCL registers the buffers of point-to-point calls it sees captured in a CUDA graph
# (NCCL_GRAPH_REGISTER, on by default). With torch's caching allocator handing freed memory
# back out, a captured ring replayed wrong, and its next replay never ended, once an earlier
# capture's memory had been given back to CUDA (tools/gpu_probe.py graph, 2x H200,
# docs/data/gpu/graph-probe-register-on-2x-h200.json); with it off every capture was exact.
GRAPH_ENV = {"NCCL_GRAPH_REGISTER": "0"}


def graph_env() -> dict[str, str]:
    """The environment for ranks that capture NCCL point-to-point calls with
    :func:`capture_graph`: :data:`GRAPH_ENV`, unless the caller's environment sets it
    otherwise. It must be in place before NCCL starts."""
    return {k: os.environ.get(k, v) for k, v in GRAPH_ENV.items()}


def capture_graph(fn: Callable[[], object], *, warm: int = 1, device: torch.device | None = None):
    """``fn`` recorded once in a CUDA graph and returned (``graph.replay()`` issues all its
    kernels at once: the GPU's own time, with no launch from Python). ``warm`` runs come
    first on a side stream, where libraries compile, allocate and bind outside the capture;
    the course's trace is paused while it records. Ranks that capture NCCL point-to-point
    calls start with :func:`graph_env`."""
    device = device if device is not None else rank_device()
    here, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(here)
    with torch.cuda.stream(side):
        for _ in range(warm):
            fn()
    here.wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with trace.paused(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    torch.cuda.synchronize(device)
    return graph


def kernel_times(fn: Callable[[], object], *, runs: int = 5, device: torch.device | None = None) -> dict:
    """Mean µs per call of each GPU kernel (and copy or set) that ``fn()`` puts on the GPU, by
    name (cut to 80 characters), from torch's profiler, with their ``"sum"``; longest first.
    CUPTI sees the kernels of a replayed CUDA graph too: where a replay's time goes."""
    from torch.profiler import ProfilerActivity, profile

    device = device if device is not None else rank_device()
    fn()
    torch.cuda.synchronize(device)
    with trace.paused(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize(device)
    out: dict[str, float] = {}
    for event in prof.events():
        if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
            out[event.name[:80]] = out.get(event.name[:80], 0.0) + event.time_range.elapsed_us() / runs
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]))
    out["sum"] = sum(out.values())
    return out


def measure_issue(fn: Callable[[], object], *, iters: int = 20, device: torch.device | None = None,
                  barrier: bool = False, group=None) -> float:
    """Median seconds this host takes to *issue* ``fn()``: the device is synchronised before
    each run, not after, so on a GPU this is the launching, checking and planning alone --
    what sets the pace wherever it exceeds the GPU's own time. ``barrier``: each run starts
    together with the other ranks' (for work that waits for its peers on the host). This
    rank's own median: not reduced over ranks."""
    device = device if device is not None else rank_device()
    cuda = device.type == "cuda"
    seconds = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize(device)
        if barrier:
            with trace.paused():
                dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize(device)
    return statistics.median(seconds)


def max_over_ranks(value: float, group=None) -> float:
    """The largest ``value`` of any rank (a host number, reduced on the rank's own device)."""
    box = torch.tensor([float(value)], dtype=torch.float64, device=rank_device())
    with trace.paused():
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    return box.item()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth, bytes/s: the tensor's size over the time."""
    return nbytes / seconds if seconds > 0 else float("nan")


def busbw(nbytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth, bytes/s: algbw times 2(p-1)/p, the share of the data each link must
    carry in a bandwidth-optimal all-reduce -- comparable across world sizes (nccl-tests).

    A link rate only for bandwidth-optimal algorithms (the ring, halving-doubling, NCCL's
    own): for one that sends more (the naive ring, recursive doubling, a tree) it is a
    normalised speed, not what its links carried."""
    if world_size <= 1:
        return algbw(nbytes, seconds)
    return algbw(nbytes, seconds) * 2 * (world_size - 1) / world_size


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864, ``"1K"`` -> 1024, ``"4096"`` -> 4096 (bytes)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in scale:
        return int(float(text[:-1]) * scale[text[-1]])
    return int(text)


def parse_sizes(text: str) -> list[int]:
    """``"1K..64M"`` -> powers of 4 from 1 KiB to 64 MiB; ``"1K,1M"`` -> those two."""
    if ".." in text:
        lo, hi = (parse_size(t) for t in text.split(".."))
        sizes, s = [], lo
        while s <= hi:
            sizes.append(s)
            s *= 4
        if sizes[-1] != hi:
            sizes.append(hi)
        return sizes
    return [parse_size(t) for t in text.split(",") if t]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"


def human_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"
