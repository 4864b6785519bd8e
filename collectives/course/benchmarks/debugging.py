"""``.venv/bin/python -m collectives bench-recorder``: what lesson 9's flight recorder costs per call.

Three measurements, printed as a table and written as JSON (with the device, versions,
date and command) to ``--out``:

* **the recorder alone** (one rank, no communication, CPU time): the listener a traced call
  tells of its call, then of its start and its completion -- what the recorder adds to any
  call, whatever else shares the cores;
* **per call in a world** (``--world`` ranks, gloo on CPU, NCCL with a GPU per rank): a loop
  of ``all_reduce`` at each of ``--sizes``, and of a ring exchange (``isend`` + ``irecv`` +
  two waits), timed with the recorder off and on in alternating blocks (the median of
  ``--blocks``, each ``--iters`` calls, slowest rank);
* **torch's DETAIL check** on the same all-reduce loop (``TORCH_DISTRIBUTED_DEBUG=DETAIL``,
  a world of its own), for scale: it runs a barrier and an all-gather before each call.

Every world here is traced (the launcher wraps ``torch.distributed``), so "off" is the course's
ordinary call and the difference is the recorder's own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ...core import cost, flight_recorder, launch, timing, trace
from .. import verify

DEFAULT_SIZES = "4,4K,1M"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def listener_seconds(calls: int = 20000) -> float:
    """Seconds the recorder spends on one call (posted, started, completed), on this rank: CPU
    time of this thread, so that other processes sharing the cores do not count."""
    directory = tempfile.mkdtemp(prefix="collectives-bench-recorder-")
    recorder = flight_recorder.FlightRecorder(directory, dist.get_rank(), dist.get_world_size())
    x = torch.ones(8)
    try:
        for _ in range(100):
            recorder("all_reduce", None, x, None)("completed")
        t0 = time.thread_time()
        for _ in range(calls):
            end = recorder("all_reduce", None, x, None)
            end("started")
            end("completed")
        return (time.thread_time() - t0) / calls
    finally:
        recorder.close()
        shutil.rmtree(directory, ignore_errors=True)


def _loops(nbytes: int, device):
    """``{name: fn}`` of the calls timed: one all-reduce; one ring exchange."""
    x = torch.ones(max(nbytes // 4, 1), device=device)
    out, back = x.clone(), x.clone()
    rank, p = dist.get_rank(), dist.get_world_size()

    def exchange():
        works = [dist.irecv(back, (rank - 1) % p), dist.isend(out, (rank + 1) % p)]
        for w in works:
            w.wait()
    return {"all_reduce": lambda: dist.all_reduce(x), "isend+irecv": exchange}


def _per_call(fn, iters: int, device) -> float:
    """Seconds per call of ``iters`` calls in a row (max over ranks)."""
    return timing.measure_back_to_back(fn, iters=iters, device=device)


def compare_in_world(sizes: list[int], iters: int, blocks: int) -> dict:
    """On every rank: each loop off and on the recorder, alternating blocks; rank 0's table."""
    device = verify.rank_device()
    directory = tempfile.mkdtemp(prefix="collectives-bench-recorder-")
    rows = []
    for nbytes in sizes:
        for name, fn in _loops(nbytes, device).items():
            if name != "all_reduce" and dist.get_world_size() < 2:
                continue
            off, on = [], []
            for _ in range(blocks):
                off.append(_per_call(fn, iters, device))
                flight_recorder.start(directory, buffer_size=2000)
                try:
                    on.append(_per_call(fn, iters, device))
                finally:
                    flight_recorder.stop()
            rows.append(dict(call=name, nbytes=nbytes, off=statistics.median(off), on=statistics.median(on)))
    shutil.rmtree(directory, ignore_errors=True)
    return dict(rows=rows, listener=listener_seconds(max(2000, 50 * iters)))


def detail_in_world(sizes: list[int], iters: int, blocks: int) -> list[dict]:
    """The all-reduce loop in a world where torch's DETAIL check wraps the group."""
    device = verify.rank_device()
    group = dist.new_group(list(range(dist.get_world_size())))   # made after the level is set: wrapped
    rows = []
    for nbytes in sizes:
        x = torch.ones(max(nbytes // 4, 1), device=device)
        times = [_per_call(lambda: dist.all_reduce(x, group=group), iters, device) for _ in range(blocks)]
        rows.append(dict(call="all_reduce", nbytes=nbytes, detail=statistics.median(times)))
    return rows


def tour_runner(nbytes: int) -> dict:
    """The tour's row for lesson 9: lesson 4's ring with the flight recorder on, checked
    against ``dist.all_reduce`` and timed against itself with the recorder off (alternating
    rounds, so that neither gets the warm caches)."""
    from ...ring import ring_all_reduce

    device = verify.rank_device()
    directory = tempfile.mkdtemp(prefix="collectives-tour-recorder-")
    x = torch.randn(max(nbytes // 4, 1), device=device)
    off, on = [], []
    try:
        recorder = flight_recorder.start(directory)
        report = verify.check_all_reduce(ring_all_reduce, quick=True)
        with trace.recording() as t:
            ring_all_reduce(x)
        recorded = recorder.entries()
        flight_recorder.stop()
        for _ in range(3):
            off += timing.measure(lambda: ring_all_reduce(x), warmup=1, iters=3, device=device)
            flight_recorder.start(directory)
            on += timing.measure(lambda: ring_all_reduce(x), warmup=1, iters=3, device=device)
            flight_recorder.stop()
    finally:
        flight_recorder.stop()
        shutil.rmtree(directory, ignore_errors=True)
    seen = len(recorded) >= len(t.events) > 0
    bad = report.failures
    detail = "" if report.ok else f"{bad[0].case}: {bad[0].detail}"
    if not seen:
        detail = f"the recorder holds {len(recorded)} calls, the trace {len(t.events)}"
    p = dist.get_world_size()
    return dict(verified=report.ok and seen, detail=detail, seconds=timing.median(on), ref_seconds=timing.median(off),
                nbytes=x.numel() * 4, bytes_sent=float(t.bytes_sent()), baseline="ring, no recorder",
                bytes_theory=cost.cost("ring", x.numel() * 4, p).bytes_per_rank)


def _row_text(r: dict) -> str:
    off, on = r["off"] * 1e6, r["on"] * 1e6
    detail = f"{r['detail'] * 1e6:10.1f}" if "detail" in r else f"{'-':>10}"
    return (f"{r['call']:>12} {timing.human_bytes(r['nbytes']):>8} {off:10.1f} {on:10.1f} "
            f"{on - off:+9.1f} {on / off:7.3f} {detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives bench-recorder",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"bytes per call (default {DEFAULT_SIZES})")
    parser.add_argument("--iters", type=int, default=200, help="calls per timed block (default 200)")
    parser.add_argument("--blocks", type=int, default=5, help="blocks off and on, alternating (default 5)")
    parser.add_argument("--no-detail", action="store_true", help="skip the world under TORCH_DISTRIBUTED_DEBUG=DETAIL")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="default: nccl when there is a GPU per rank, else gloo")
    parser.add_argument("--out", default="build/bench-recorder", help="directory for recorder.json")
    parser.add_argument("--snippet", default="", help="also write the table as Markdown here, with its JSON beside "
                        "it (the lesson page includes docs/snippets/bench-recorder.md)")
    args = parser.parse_args(argv)
    sizes = [timing.parse_size(s) for s in args.sizes.split(",") if s]
    backend = args.backend or launch.auto_backend(args.world)
    started = datetime.datetime.now().astimezone()
    result = launch.run(compare_in_world, args.world, args=(sizes, args.iters, args.blocks), backend=backend,
                        timeout=1800)[0]
    if not args.no_detail and backend == "gloo":
        detail = launch.run(detail_in_world, args.world, args=(sizes, args.iters, args.blocks), backend=backend,
                            timeout=1800, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})[0]
        for row, d in zip((r for r in result["rows"] if r["call"] == "all_reduce"), detail):
            row["detail"] = d["detail"]
    print(f"flight recorder, {args.world} ranks, {backend}: µs per call, median of {args.blocks} blocks "
          f"of {args.iters} calls (slowest rank)")
    print(f"{'call':>12} {'size':>8} {'off':>10} {'on':>10} {'added':>9} {'on/off':>7} {'DETAIL':>10}")
    for r in result["rows"]:
        print(_row_text(r))
    print(f"the recorder alone: {result['listener'] * 1e6:.2f} µs of CPU per call (posted, started, completed)")
    arguments = sys.argv[2:] if argv is None else argv
    meta = dict(command=".venv/bin/python -m collectives bench-recorder " + " ".join(arguments),
                date=started.isoformat(timespec="seconds"), torch=torch.__version__,
                python=platform.python_version(), backend=backend, world_size=args.world, iters=args.iters,
                blocks=args.blocks, host=platform.node(), cpus=os.cpu_count(),
                device=torch.cuda.get_device_name(0) if backend == "nccl" else _cpu_name())
    record = {"meta": meta, "listener_seconds": result["listener"], "rows": result["rows"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recorder.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out / 'recorder.json'}")
    if args.snippet:
        snippet = Path(args.snippet)
        snippet.parent.mkdir(parents=True, exist_ok=True)
        snippet.write_text(markdown(record))
        snippet.with_suffix(".json").write_text(json.dumps(record, indent=1))
        print(f"wrote {snippet} and {snippet.with_suffix('.json')}")
    return 0


def markdown(record: dict) -> str:
    """The lesson page's table, from a run's record: what was measured, where, and how."""
    m = record["meta"]
    lines = [f"`{m['command']}` on {m['device']} ({m['cpus']} cores), {m['world_size']} ranks, {m['backend']}, "
             f"torch {m['torch']}, Python {m['python']}, {m['date'][:10]}: µs per call, median of {m['blocks']} "
             f"blocks of {m['iters']} calls, slowest rank.", "",
             "| call | size | recorder off | recorder on | added | on ÷ off | under DETAIL |",
             "|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        off, on = r["off"] * 1e6, r["on"] * 1e6
        detail = f"{r['detail'] * 1e6:.1f}" if "detail" in r else "--"
        lines.append(f"| `{r['call']}` | {timing.human_bytes(r['nbytes'])} | {off:.1f} | {on:.1f} | {on - off:+.1f} "
                     f"| {on / off:.3f} | {detail} |")
    lines += ["", f"The recorder's own work, timed alone (CPU time): **{record['listener_seconds'] * 1e6:.2f} µs per "
                  "call** (posted, started, completed).", ""]
    return "\n".join(lines)
