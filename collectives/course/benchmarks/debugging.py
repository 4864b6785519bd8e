"""``.venv/bin/python -m collectives bench-recorder``: what lesson 9's flight recorder costs per call.

Measured in the real call path, and written as JSON (with the device, versions, date and
command) to ``--out``, and as the lesson page's record with ``--record``:

* **per call in a world** (``--world`` ranks, gloo on CPU, NCCL with a GPU per rank): a loop
  of ``all_reduce`` at each of ``--sizes``, and of a ring exchange (``isend`` + ``irecv`` +
  two waits), three ways in rotating order within each of ``--blocks`` blocks of
  ``--iters`` calls: **plain** (torch's own functions, nothing wrapped), **wrapped** (the
  course's trace wrappers, no listener: what every launched world runs) and **recorded**
  (wrapped, with the flight recorder on). Each is given as the median and quartiles of its
  blocks (slowest rank): the spread says how far a difference can be trusted. On NCCL the run
  follows the rule for fair GPU comparisons (``docs/benchmarks.md``): **plain** is NCCL called
  directly, **recorded** the call a rank of ``launch.run(..., flight_recorder=DIR)`` makes,
  every side eager; each row adds ``paid`` (recorded − plain: what a user pays) and the
  blocks' ``spread``, and the record names ``rule``, what each side ``includes`` and what it
  ``excludes`` (:data:`INCLUDES`, :data:`EXCLUDES`);
* **the recorder alone** (one rank, no communication, CPU time): the listener a traced call
  tells of its call, then of its start and its completion;
* **torch's DETAIL check** on the same all-reduce loop (``TORCH_DISTRIBUTED_DEBUG=DETAIL``,
  a world of its own), for scale: it runs a barrier and an all-gather before each call.
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

from ...core import cost, flight_recorder, flight_torch, launch, ops, timing, trace
from .. import verify
from ..site.claims import commit, host
from . import gpu_timing

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


def _loops(nbytes: int, device, direct: bool = False, group=None):
    """``{name: fn}`` of the calls timed: one all-reduce (on ``group``); one ring exchange.
    ``direct``: the all-reduce is NCCL's, called without going through ``dist.*`` (the plain
    side on NCCL)."""
    x = torch.ones(max(nbytes // 4, 1), device=device)
    out, back = x.clone(), x.clone()
    rank, p = dist.get_rank(), dist.get_world_size()

    def exchange():
        # posted together (one batch on NCCL: a receive and a send posted one by one to the same
        # peer wait for each other there, and the ring of two never moved)
        for w in ops.post_exchange([(back, (rank - 1) % p)], [(out, (rank + 1) % p)]):
            w.wait()
    direct_call, call = (lambda: gpu_timing.nccl_all_reduce(x)), (lambda: dist.all_reduce(x, group=group))
    return {"all_reduce": direct_call if direct else call,
            "isend+irecv": exchange}


def _per_call(fn, iters: int, device) -> float:
    """Seconds per call of ``iters`` calls in a row (max over ranks)."""
    return timing.measure_back_to_back(fn, iters=iters, device=device)


MODES = ("plain", "wrapped", "recorded")
# On NCCL, the rule for fair GPU comparisons (docs/benchmarks.md): every side eager (the recorder
# is a Python listener: a replayed graph would skip it), each loop on its own tensor in place.
LAUNCH, INPUTS = "eager", "resident"
INCLUDES = {"plain": "NCCL called directly (torch.distributed.distributed_c10d.all_reduce; the exchange through "
                     "torch's own functions), nothing wrapped: the call without the recorder",
            "wrapped": "dist.all_reduce through the course's trace wrapper, no listener: a part of the recorded "
                       "call's cost, shown apart",
            "recorded": "dist.all_reduce as a rank of launch.run(..., flight_recorder=DIR) calls it: the trace "
                        "wrapper and the flight recorder listening (posted, started, completed), on a group made "
                        "as that world makes its own (torch's recorder on, each NCCL call timed with CUDA events)",
            "paid": "recorded − plain: what a user pays per all-reduce for the recorder, its wrapper and torch's "
                    "timing included"}
EXCLUDES = ("the exchange's recorded side runs on the default group, made without torch's CUDA-event timing: "
            "its paid leaves that part out; dumps (written when a world ends or a call hangs) are not timed")


def recorders_group():
    """A group of every rank made the way a world of ``launch.run(..., flight_recorder=DIR)``
    makes its own (:func:`collectives.core.flight_torch.enable`: torch's own recorder keeps
    calls and, on NCCL, times each with CUDA events): the recorded all-reduce runs on it, so
    that torch's part of the recorder's cost is counted; the environment is put back after."""
    names = (flight_torch.ENV_BUFFER, "TORCH_NCCL_ENABLE_TIMING")
    saved = {name: os.environ.get(name) for name in names}
    flight_torch.enable(2000)
    try:
        return dist.new_group(list(range(dist.get_world_size())))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _spread(times: list[float]) -> dict:
    """Median and quartiles of per-call seconds, one value per block."""
    q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else times * 3
    return {"median": median, "q1": q1, "q3": q3, "blocks": list(times)}


def _mode(mode: str, directory: str) -> None:
    """Put this rank's call path in ``mode``: torch's functions, wrapped, or wrapped and recorded."""
    flight_recorder.stop()
    if mode == "plain":
        trace.uninstall()
        return
    trace.install(dist.get_rank())
    if mode == "recorded":
        flight_recorder.start(directory, buffer_size=2000)


def compare_in_world(sizes: list[int], iters: int, blocks: int, under_rule: bool | None = None) -> dict:
    """On every rank: each loop plain, wrapped and recorded, in rotating order per block.
    ``under_rule`` (default: on a GPU): the plain all-reduce is NCCL's called directly, and
    each row adds ``paid`` (recorded − plain) and the blocks' ``spread``."""
    device = verify.rank_device()
    directory = tempfile.mkdtemp(prefix="collectives-bench-recorder-")
    rows, gpu = [], device.type == "cuda" if under_rule is None else under_rule
    group = recorders_group() if gpu else None
    try:
        for nbytes in sizes:
            traced = _loops(nbytes, device)
            plain = _loops(nbytes, device, direct=True) if gpu else traced
            recorded = _loops(nbytes, device, group=group) if gpu else traced
            for name, fn in traced.items():
                if name != "all_reduce" and dist.get_world_size() < 2:
                    continue
                times: dict[str, list[float]] = {m: [] for m in MODES}
                for block in range(blocks):
                    for i in range(len(MODES)):
                        mode = MODES[(block + i) % len(MODES)]
                        _mode(mode, directory)
                        run = {"plain": plain, "wrapped": traced, "recorded": recorded}[mode][name]
                        times[mode].append(_per_call(run, iters, device))
                row = {"call": name, "nbytes": nbytes, **{m: _spread(times[m]) for m in MODES}}
                row["added"] = row["recorded"]["median"] - row["wrapped"]["median"]
                if gpu:               # the rule's comparison: what a user pays, with the spread of the rounds
                    row["paid"] = row["recorded"]["median"] - row["plain"]["median"]
                    row["spread"] = {m: gpu_timing.summary(times[m])[1] for m in MODES}
                rows.append(row)
    finally:
        flight_recorder.stop()
        trace.install(dist.get_rank())
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


def _us(spread: dict) -> str:
    return f"{spread['median'] * 1e6:.1f} ({spread['q1'] * 1e6:.1f}-{spread['q3'] * 1e6:.1f})"


def _row_text(r: dict) -> str:
    detail = f"{r['detail'] * 1e6:.1f}" if "detail" in r else "-"
    return (f"{r['call']:>12} {timing.human_bytes(r['nbytes']):>8} " + " ".join(f"{_us(r[m]):>22}" for m in MODES)
            + f" {r['added'] * 1e6:+9.1f} {detail:>10}")


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
    parser.add_argument("--record", default="", help="also write the lesson page's record (09-bench-recorder.json) "
                        "into this directory (docs/img for the site)")
    parser.add_argument("--snippet", default="", help="also write the table as Markdown here, with its JSON beside "
                        "it (the page itself reads the record of --record)")
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
    print(f"flight recorder, {args.world} ranks, {backend}: µs per call, median (quartiles) of {args.blocks} "
          f"blocks of {args.iters} calls (slowest rank)")
    print(f"{'call':>12} {'size':>8} " + " ".join(f"{m:>22}" for m in MODES) + f" {'added':>9} {'DETAIL':>10}")
    for r in result["rows"]:
        print(_row_text(r))
    for r in (r for r in result["rows"] if "paid" in r):
        print(f"{r['call']} {timing.human_bytes(r['nbytes'])}: a user pays {r['paid'] * 1e6:+.1f} µs per call for "
              f"the recorder (recorded − NCCL called directly, both eager, untraced NCCL on the plain side)")
    print(f"the recorder alone: {result['listener'] * 1e6:.2f} µs of CPU per call (posted, started, completed)")
    arguments = sys.argv[2:] if argv is None else argv
    meta = dict(command=".venv/bin/python -m collectives bench-recorder " + " ".join(arguments),
                date=started.isoformat(timespec="seconds"),
                python=platform.python_version(), backend=backend, world_size=args.world, iters=args.iters,
                blocks=args.blocks, host=platform.node(),
                device=(f"{args.world}× {torch.cuda.get_device_name(0)}" if backend == "nccl" else _cpu_name()),
                nccl=".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None,
                gpus=torch.cuda.device_count() if backend == "nccl" else 0, commit=commit(), **host())
    record = {"meta": meta, "listener_seconds": result["listener"], "rows": result["rows"]}
    if backend == "nccl":
        record.update(rule=gpu_timing.fields(LAUNCH, INPUTS, []), includes=dict(INCLUDES), excludes=EXCLUDES)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recorder.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out / 'recorder.json'}")
    if args.record:
        print(f"wrote {page_record(record).save(Path(args.record) / '09-bench-recorder')}")
    if args.snippet:
        snippet = Path(args.snippet)
        snippet.parent.mkdir(parents=True, exist_ok=True)
        snippet.write_text(markdown(record))
        snippet.with_suffix(".json").write_text(json.dumps(record, indent=1))
        print(f"wrote {snippet} and {snippet.with_suffix('.json')}")
    return 0


NAMES = {"plain": "torch's own call", "wrapped": "the course's wrapped call",
         "recorded": "the wrapped call with the recorder on"}


def page_record(record: dict):
    """The lesson page's record (``{{ claim: 09-bench-recorder ID }}``, ``{{ table: ... }}``)."""
    from ..site import claims

    m = record["meta"]
    said = dict(record["rule"], includes=record["includes"],
                excludes=record["excludes"]) if "rule" in record else {}      # on NCCL: the rule, in the meta
    page = claims.Record("09-bench-recorder", names=NAMES, meta=dict(m, **said),
                         title="What the flight recorder costs per call")
    rows = [r for r in record["rows"] if r["call"] == "all_reduce"]
    small = min(rows, key=lambda r: r["nbytes"])
    size = timing.human_bytes(small["nbytes"])
    where = f"an all_reduce of {size} on {m['world_size']} ranks, {m['backend']}"
    page.times("call-path", {k: small[k]["median"] for k in MODES}, baseline="plain", where=where)
    us = {k: small[k]["median"] * 1e6 for k in MODES}
    overlap = small["recorded"]["q1"] <= small["wrapped"]["q3"] and small["wrapped"]["q1"] <= small["recorded"]["q3"]
    page.fact("alpha", f"On {m['device']}, {where} takes {us['plain']:.1f} µs with nothing wrapped (median of "
              f"{m['blocks']} blocks; quartiles {small['plain']['q1'] * 1e6:.1f} to {small['plain']['q3'] * 1e6:.1f}"
              " µs): this is the α the recorder's cost is set against.", microseconds=us["plain"])
    page.fact("added", f"There, recording adds {us['recorded'] - us['wrapped']:+.1f} µs per call to the wrapped call "
              f"({us['wrapped']:.1f} µs, quartiles {small['wrapped']['q1'] * 1e6:.1f} to "
              f"{small['wrapped']['q3'] * 1e6:.1f}; recorded {us['recorded']:.1f} µs, quartiles "
              f"{small['recorded']['q1'] * 1e6:.1f} to {small['recorded']['q3'] * 1e6:.1f}), and the wrapping itself "
              f"{us['wrapped'] - us['plain']:+.1f} µs to torch's call: "
              f"{(us['recorded'] - us['plain']) / us['plain'] * 100:+.0f} % in all on the smallest call"
              + (" -- the quartiles of the wrapped and the recorded call overlap: in this run the difference is "
                 "within the noise of the machine." if overlap else " -- the quartiles do not overlap."),
              microseconds=us["recorded"] - us["wrapped"], quartiles_overlap=overlap)
    page.fact("listener", f"The recorder's own work, timed alone: {record['listener_seconds'] * 1e6:.2f} µs of CPU "
              "per call (posted, started, completed).", microseconds=record["listener_seconds"] * 1e6)
    page.fact("source", f"Measured by `{m['command']}` on {m['device']} ({m.get('cpus', '?')} cores"
              + (f", {m['gpus']} GPUs, NCCL {m['nccl']}" if m.get("nccl") else "")
              + f"), {m['world_size']} ranks, {m['backend']}, torch {m['torch']}, {str(m['date'])[:10]}: µs per call, "
              f"median (quartiles) of {m['blocks']} blocks of {m['iters']} calls, slowest rank.")
    page.table = {"head": ["call", "size", "torch's call", "wrapped", "wrapped + recorded", "recorded − wrapped",
                           "under DETAIL"],
                  "rows": [[f"`{r['call']}`", timing.human_bytes(r["nbytes"])] + [_us(r[k]) for k in MODES]
                           + [f"{r['added'] * 1e6:+.1f}", f"{r['detail'] * 1e6:.1f}" if "detail" in r else "--"]
                           for r in record["rows"]]}
    page.caption = page.text("alpha", "added")
    return page


def markdown(record: dict) -> str:
    """The table as Markdown, from a run's record: what was measured, where, and how."""
    m = record["meta"]
    page = page_record(record)
    lines = [f"`{m['command']}` on {m['device']} ({m['cpus']} cores), {m['world_size']} ranks, {m['backend']}, "
             f"torch {m['torch']}, Python {m['python']}, {m['date'][:10]}: µs per call, median (quartiles) of "
             f"{m['blocks']} blocks of {m['iters']} calls, slowest rank.", "",
             "| " + " | ".join(page.table["head"]) + " |", "|" + "---|" * len(page.table["head"])]
    lines += ["| " + " | ".join(row) + " |" for row in page.table["rows"]]
    lines += ["", page.text("listener"), ""]
    return "\n".join(lines)
