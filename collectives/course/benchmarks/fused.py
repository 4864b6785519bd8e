"""``.venv/bin/python -m collectives bench-fused``: the fused all-reducer against its alternatives.

Many tensors of one size (1000 float32 tensors of 1000 elements by default), all-reduced
in one world, every way this lesson discusses:

* ``separate calls``   -- one ``dist.all_reduce`` per tensor (timed over fewer runs: slow);
* ``flat all_reduce``  -- one ``dist.all_reduce`` of a buffer that already holds the same
  bytes: the floor, since fusion cannot send less or in fewer calls (the baseline);
* ``flat + 2 copies``  -- the same call between two contiguous copies of its bytes (in from
  one tensor, back to it): the floor for copying in and back around one call;
* ``cat + copy_ loop`` -- ``torch.cat`` into a new tensor, all-reduce, a Python loop of
  ``copy_`` back: fusion as first written;
* ``fused``            -- :class:`~collectives.fused.FastFusedAllReducer` (the lesson's
  reducer with the training-loop fast path: the same list every run) with one buffer that
  holds everything; then buffers of ``--split`` bytes, with and without double buffering;
* ``fused, bound``     -- the same after ``bind()``: the tensors live in the buffer, no copies.

The fast cases are timed in interleaved rounds (a change of load falls on all alike), each
run waited for before the next. The flat, copy-floor, fused and bound cases are then timed
again issued back to back. Prints a table with each case's ratio to the flat all-reduce and
writes ``bench-fused.json`` and ``bench-fused.png`` to ``--out``. ``--figures DIR`` draws the
lesson page's figure. ``--impl exercise`` adds ``fused (exercise)``: the ``fused_all_reduce``
of your ``lessons/05_fused/exercise.py``, checked against ``dist.all_reduce`` on
integer-valued data and timed beside the others (a stub is listed as not written yet).

``--backend nccl`` runs one GPU per rank (``--numel 4096``: 1000 tensors of 16 KiB, the
page's case) under the course's rule for GPU comparisons: ``--launch eager|graph``, every
case launched the same way, NCCL called directly, nothing traced, CUDA events over
interleaved rounds (:mod:`collectives.course.benchmarks.fused_gpu`). The record names the
launch, each case's inputs and what was skipped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ...core import cost, launch, ops, timing, trace
from ...core.ops import ReduceOp
from ...fused import FastFusedAllReducer, fused_all_reduce
from .. import verify
from ..site.claims import commit, host
from .fused_gpu import EXERCISE_CASE, exercise_case  # the GPU path shares the exercise case


def _cases(count: int, numel: int, split_bytes: int):
    """(name, detail, setup) triples; setup(tensors, flat) returns the function to time."""
    total = count * numel * 4

    def separate(ts, flat):
        return lambda: [dist.all_reduce(t) for t in ts]

    def flat_ar(ts, flat):
        return lambda: dist.all_reduce(flat)

    def flat_copies(ts, flat):    # what copying in and back costs at memcpy speed
        source = flat.clone()
        def run():
            flat.copy_(source)
            dist.all_reduce(flat)
            source.copy_(flat)
        return run

    def cat_loop(ts, flat):
        def run():
            joined = torch.cat(ts)
            dist.all_reduce(joined)
            for t, piece in zip(ts, joined.split([t.numel() for t in ts])):
                t.copy_(piece)
        return run

    def fused(buffer_bytes, double, bind=False):
        def setup(ts, flat):
            reducer = FastFusedAllReducer(threshold_bytes=total + 1, buffer_bytes=buffer_bytes,
                                          device=ts[0].device, double_buffer=double)
            if bind:
                ts = [t.clone() for t in ts]   # bind re-points them: keep the others' tensors apart
                ts = reducer.bind(ts)          # its handle: recognised in O(1), not tensor by tensor
            return lambda: (reducer.all_reduce(ts), reducer.wait())
        return setup

    flushes = -(-total // split_bytes)
    cases = [
        ("separate calls", f"{count} dist.all_reduce", separate),
        ("flat all_reduce", "one call, bytes already flat", flat_ar),
        ("flat + 2 copies", "one contiguous copy in, the flat call, one back: the floor of "
         "copying around one call", flat_copies),
        ("cat + copy_ loop", "torch.cat, all_reduce, Python copy_ loop", cat_loop),
        ("fused", "one buffer, 1 flush", fused(total, True)),
        ("fused, double buffer", f"{timing.human_bytes(split_bytes)} buffers, {flushes} flushes",
         fused(split_bytes, True)),
        ("fused, one buffer", f"{timing.human_bytes(split_bytes)} buffer, {flushes} flushes (SINGA order)",
         fused(split_bytes, False)),
        ("fused, bound", "bind(): tensors live in the buffer, no copies", fused(total, True, True)),
    ]
    return cases      # on GPUs: fused_gpu's cases, launched under the rule


# Also timed issued back to back (timing.measure_back_to_back): on GPUs the host runs ahead.
BACK_TO_BACK = ("flat all_reduce", "flat + 2 copies", "fused", "fused, bound")


def bench(count: int, numel: int, split_bytes: int, iters: int, separate_iters: int,
          rounds: int = 4, impl: str = "reference") -> list[dict]:
    """Runs on every rank, on CPUs (gloo); returns one row per case (times are the max over ranks).

    The fast cases are measured in ``rounds`` interleaved rounds, so that a change in the
    machine's load while the benchmark runs falls on every case alike."""
    device = torch.device("cpu")
    tensors = [torch.randn(numel, device=device) for _ in range(count)]
    flat = torch.randn(count * numel, device=device)
    cases = _cases(count, numel, split_bytes)
    exercise = None
    if impl == "exercise":
        case, exercise = exercise_case(tensors)
        if case is not None:
            cases.append(case)
    fns = {name: setup(tensors, flat) for name, _, setup in cases}
    times: dict[str, list[float]] = {name: [] for name in fns}
    cpu = dict.fromkeys(fns, 0.0)         # this process's CPU seconds (gloo's threads included)

    def timed(name, n):
        start = time.process_time()
        times[name] += timing.measure(fns[name], warmup=0, iters=n, device=device)
        cpu[name] += time.process_time() - start

    for t in tensors[: max(1, count // 10)]:   # warm-up of the slow case: a tenth of it
        dist.all_reduce(t)
    timed("separate calls", separate_iters)
    for name in fns:                      # warm-up: buffers, layouts, first-touch of memory
        if name != "separate calls":
            timing.measure(fns[name], warmup=2, iters=1, device=device)
    per_round = max(1, iters // rounds)
    ahead = {name: [] for name in BACK_TO_BACK}   # the same runs issued back to back
    for _ in range(rounds):
        for name in fns:
            if name != "separate calls":
                timed(name, per_round)
        for name in BACK_TO_BACK:
            ahead[name].append(timing.measure_back_to_back(fns[name], iters=per_round, device=device))
    rows = [dict(case=name, detail=detail, seconds=timing.median(times[name]), best=min(times[name]),
                 iters=len(times[name]), cpu_per_rank=cpu[name] / len(times[name]))
            for name, detail, _ in cases]
    for r in rows:
        if r["case"] in ahead:
            r["back_to_back"] = timing.median(ahead[r["case"]])
    flat_b = next(r["back_to_back"] for r in rows if r["case"] == "flat all_reduce")
    for r in rows:
        if "back_to_back" in r:
            r["back_to_back_vs_flat"] = r["back_to_back"] / flat_b
    flat_s = next(r["seconds"] for r in rows if r["case"] == "flat all_reduce")
    cpu_all = torch.tensor([r["cpu_per_rank"] for r in rows], dtype=torch.float64, device=device)
    dist.all_reduce(cpu_all)              # mean over ranks (CPU time is per process)
    for r, c in zip(rows, (cpu_all / dist.get_world_size()).tolist()):
        r["vs_flat"] = r["seconds"] / flat_s
        r["cpu_per_rank"] = c
    if exercise is not None:
        if "missing" in exercise:
            rows.append(exercise)
        else:
            next(r for r in rows if r["case"] == EXERCISE_CASE)["wrong"] = exercise["wrong"]
    return rows


def render(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("case", "detail", "time (median)", "best", "runs", "× flat all_reduce", "CPU / rank"):
        table.add_column(col, justify="left" if col in ("case", "detail") else "right")
    for r in rows:
        if "missing" in r:
            table.add_row(r["case"], f"{r['detail']}: {r['missing']}", "-", "-", "-", "-", "-")
            continue
        wrong = f" ({r['wrong']} wrong elements)" if r.get("wrong") else ""
        cpu = "-" if r.get("cpu_per_rank") is None else timing.human_seconds(r["cpu_per_rank"])
        table.add_row(r["case"], r["detail"] + wrong, timing.human_seconds(r["seconds"]),
                      timing.human_seconds(r["best"]), str(r["iters"]), f"{r['vs_flat']:.2f}×", cpu)
    console = Console(width=max(Console().width, 110))
    console.print(table)
    ahead = [r for r in rows if "back_to_back" in r]
    if ahead:
        console.print("issued back to back, no wait between runs (on GPUs the host runs ahead of the "
                      "GPU, as in training): " + "; ".join(
            f"{r['case']} {timing.human_seconds(r['back_to_back'])} ({r['back_to_back_vs_flat']:.2f}×)"
            for r in ahead))
    if any("launched" in r for r in rows):
        console.print("time: slowest rank, median of the rounds, each round runs issued back to back between "
                      "CUDA events (best: the fastest round); runs: per round; launched: "
                      + ", ".join(sorted({r["launched"] for r in rows if "launched" in r})) + ".")
    else:
        console.print("time: slowest rank, median of the runs; CPU / rank: CPU time of one rank's process "
                      "per run (gloo's threads included), mean over ranks.")
    sep = next((r for r in rows if r["case"] == "separate calls"), None)
    fused = next((r for r in rows if r["case"] == "fused"), None)
    if sep and fused:
        console.print(f"fused is {sep['seconds'] / fused['seconds']:.0f}× faster than separate calls "
                      f"and {fused['vs_flat']:.2f}× the time of one flat all_reduce of the same bytes.")


def plot(rows: list[dict], title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "missing" not in r]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r["case"] for r in rows][::-1]
    ax.barh(names, [r["seconds"] * 1e3 for r in rows][::-1], color="#3f51b5")
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds per call (median, log scale)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _flush_timeline(count: int, numel: int, buffer_bytes: int) -> dict:
    """On every rank: when each flush's all-reduce was issued and landed, one and two buffers."""
    tensors = [torch.randn(numel) for _ in range(count)]
    return {double: traced_reducer_call(FastFusedAllReducer(count * numel * 4 + 1, buffer_bytes, double_buffer=double),
                                tensors) for double in (False, True)}


def traced_reducer_call(reducer, tensors) -> tuple[list[tuple[float, float]], float]:
    """After three warm-up calls, one traced call of ``reducer``: each flush's all-reduce
    (issued, landed) in seconds from the call's start, and the call's length."""
    for _ in range(3):                      # warm-up: buffers, layout, first touch
        reducer.all_reduce(tensors)
        reducer.wait()
    dist.barrier()
    with trace.recording() as t:
        start = time.perf_counter()
        reducer.all_reduce(tensors)
        reducer.wait()
        end = time.perf_counter()
    return [(e.t0 - start, e.t1 - start) for e in t.collectives()], end - start


def figures(directory: str) -> str:
    """Draw ``05-timeline.png`` from a real trace (4 ranks, gloo): the flushes' all-reduces,
    issued to landed, with one buffer and with two."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count, numel, buffer_bytes = 1000, 1000, 1 << 20
    rank0 = launch.run(_flush_timeline, 4, args=(count, numel, buffer_bytes))[0]
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 3.6), sharex=True)
    for ax, double in zip(axes, (False, True)):
        spans, total = rank0[double]
        for k, (t0, t1) in enumerate(spans):
            ax.barh(k, (t1 - t0) * 1e3, left=t0 * 1e3, color="#3f51b5" if k % 2 == 0 else "#ff7043")
        ax.axvline(total * 1e3, color="black", lw=1, ls="--")
        ax.set_yticks(range(len(spans)), [f"flush {k}" for k in range(len(spans))], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(("two buffers: flush k+1 leaves before flush k lands" if double else
                      "one buffer (SINGA's order): each flush lands before the next is packed")
                     + f" — {total * 1e3:.1f} ms", fontsize=9)
    axes[1].set_xlabel("ms since all_reduce() was called (bar: issued → wait() returned; "
                       "dashed: wait() done)", fontsize=8)
    fig.suptitle(f"{count} float32 tensors of {numel} elements, {timing.human_bytes(buffer_bytes)} "
                 "buffers, 4 ranks, gloo (rank 0's trace)", fontsize=9)
    fig.tight_layout()
    path = os.path.join(directory, "05-timeline.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives bench-fused",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--count", type=int, default=1000, help="tensors (default 1000)")
    parser.add_argument("--numel", type=int, default=1000, help="float32 elements per tensor (default 1000)")
    parser.add_argument("--split", default="1M", help="buffer size for the multi-flush rows (default 1M)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: nccl when there is a GPU per rank, else gloo")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed runs per case (default 40 on CPU, where 4 ranks sharing 2 cores "
                             "move a run's time by up to 2x; 100 on GPUs, where a run takes under "
                             "1 ms and its median moves by tens of µs)")
    parser.add_argument("--separate-iters", type=int, default=None,
                        help="timed runs of the separate-calls case (default 2: it is slow)")
    parser.add_argument("--out", default="bench-results", help="directory for the JSON and the plot")
    parser.add_argument("--figures", default="", metavar="DIR",
                        help="only draw the lesson page's figure from a real trace into DIR (e.g. docs/img)")
    parser.add_argument("--impl", choices=("reference", "exercise"), default="reference",
                        help="exercise: also time the fused_all_reduce of your lessons/05_fused/exercise.py")
    parser.add_argument("--launch", choices=("eager", "graph"), default=None,
                        help="GPUs only (default eager): every case issued from Python, or every case "
                             "replayed from a CUDA graph (the course's rule for GPU comparisons)")
    args, _ = parser.parse_known_args(argv)   # tolerate the other benchmarks' options (make bench)
    if args.figures:
        os.makedirs(args.figures, exist_ok=True)
        print("wrote", figures(args.figures))
        return 0
    backend = args.backend or launch.auto_backend(args.world)
    if backend != "nccl" and args.launch:
        parser.error("--launch is for GPUs (--backend nccl): on CPUs every case is issued from Python")
    separate_iters = args.separate_iters or 2
    iters = args.iters or (100 if backend == "nccl" else 40)
    split = timing.parse_size(args.split)
    start = time.perf_counter()
    rule = {}
    if backend == "nccl":
        from . import fused_gpu, gpu_timing
        mode = args.launch or "eager"
        rule["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        result = launch.run(fused_gpu.bench_gpu, args.world, args=(args.count, args.numel, split, iters,
                                                                   separate_iters),
                            kwargs=dict(launch=mode, impl=args.impl), backend=backend, timeout=900,
                            env=gpu_timing.rank_env(mode))[0]
        rows = result["rows"]
        rule.update(result["rule"])
    else:
        rows = launch.run(bench, args.world, args=(args.count, args.numel, split, iters, separate_iters),
                          kwargs=dict(impl=args.impl), backend=backend, timeout=900)[0]
    title = (f"{args.count} float32 tensors of {args.numel} elements "
             f"({timing.human_bytes(args.count * args.numel * 4)}), {args.world} ranks, {backend}"
             + (f", {rule['launch']}" if "launch" in rule else ""))
    render(rows, title)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(world=args.world, count=args.count, numel=args.numel, backend=backend,
                split_bytes=split, date=datetime.date.today().isoformat(),
                device=(torch.cuda.get_device_name(0) if backend == "nccl" else "cpu"),
                wall_seconds=time.perf_counter() - start, **host(), **rule,
                command=" ".join([".venv/bin/python -m collectives bench-fused", *argv]), commit=commit())
    with open(os.path.join(args.out, "bench-fused.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    plot(rows, title, os.path.join(args.out, "bench-fused.png"))
    print(f"wrote {args.out}/bench-fused.json and bench-fused.png ({meta['wall_seconds']:.0f} s)")
    return 0


# The tour's row (the tour's table names this runner).

def _mixed_list(rank: int, device) -> list[torch.Tensor]:
    """Odd sizes, an empty tensor, one over the threshold, four dtypes, a transposed view."""
    g = torch.Generator().manual_seed(rank)
    specs = [(1, torch.float32), (0, torch.float32), (1001, torch.float16), (37, torch.int64),
             (300_000, torch.float32), (513, torch.bfloat16), (7, torch.float32), (4099, torch.int32)]
    out = [torch.randint(-8, 9, (n,), generator=g).to(dtype) for n, dtype in specs]
    out.append(torch.randint(-8, 9, (13, 11), generator=g).float().t())
    return [t.to(device) for t in out]


def tour_runner(nbytes: int) -> dict:
    """The tour's row for lesson 5, on every rank: verify every op on a mixed list, then
    time 1000 float32 tensors of 1000 elements against one ``dist.all_reduce`` of a flat
    buffer of the same bytes. ``nbytes`` is not used: the tour's size is one tensor, this
    algorithm's point is many. Bytes sent are counted from the trace's all-reduce calls,
    each at a ring's ``2(p-1)/p`` of its size."""
    p, rank, device = dist.get_world_size(), dist.get_rank(), verify.rank_device()
    problems = []
    for op in ops.SUPPORTED_OPS:
        tensors = _mixed_list(rank, device)
        if op == ReduceOp.AVG:
            tensors = [t.double() if not t.is_floating_point() else t for t in tensors]
        expected = [verify.reference_all_reduce(t, op) for t in tensors]
        fused_all_reduce(tensors, op=op, threshold_bytes=64 << 10, buffer_bytes=8 << 10)
        for i, (e, t) in enumerate(zip(expected, tensors)):
            if (bad := verify.compare(e, t)) is not None:
                problems.append(f"{ops.op_name(op)} tensor {i}: {bad}")
    count, numel = 1000, 1000
    tensors = [torch.randn(numel, device=device) for _ in range(count)]
    flat = torch.randn(count * numel, device=device)
    reducer = FastFusedAllReducer(device=device, graphs=False)   # issued from Python, as the flat call it is timed by
    with trace.recording() as t:
        reducer.all_reduce(tensors)
        reducer.wait()
    sent = sum(cost.cost("ring", e.nbytes, p).bytes_per_rank for e in t.collectives())
    ours = timing.measure(lambda: (reducer.all_reduce(tensors), reducer.wait()), device=device)
    ref = timing.measure(lambda: dist.all_reduce(flat), device=device)
    return dict(verified=not problems, detail="; ".join(problems)[:200],
                seconds=timing.median(ours), ref_seconds=timing.median(ref),
                nbytes=count * numel * 4, bytes_sent=sent,
                bytes_theory=cost.cost("ring", count * numel * 4, p).bytes_per_rank,
                baseline="flat all_reduce")
