"""``.venv/bin/python -m collectives bench``: all-reduce algorithms against ``dist.all_reduce``, nccl-tests style.

::

    .venv/bin/python -m collectives bench                                 # every lesson 3-4 algorithm, 4 ranks, 1K..64M
    .venv/bin/python -m collectives bench --algo ring,pipelined_ring --sizes 64M --iters 20
    .venv/bin/python -m collectives bench --backend nccl --world 4 --algo ring,multi_ring --channels 4
    .venv/bin/python -m collectives bench --algo ring --impl exercise       # your lessons/04_ring/exercise.py beside it
    .venv/bin/python -m collectives bench --json                            # the rows as JSON on stdout
    .venv/bin/python -m collectives bench --backend nccl --world 2 --launch graph   # every contender replayed

One world runs everything: at each size, ``dist.all_reduce`` (the baseline, named after
the backend: "gloo" or "nccl") and every chosen algorithm all-reduce the same tensor,
each warmed up, then timed in turn -- one run of each per round, ``--iters`` rounds, so
that a slow spell of a shared machine hits them all alike. Each run is barrier-aligned
and takes the slowest rank's time (CUDA events on GPU: :func:`collectives.core.timing.measure`);
the median is reported. Before it is timed, each algorithm's result on integer-valued
data is compared with the baseline's ("ok" column); that run counts as a warm-up run.
The output has nccl-tests' shape (``all_reduce_perf``): one block per algorithm, a row per
size with ``size`` (bytes), ``count`` (elements), ``type``, ``redop``, ``time`` (µs), ``algbw``
and ``busbw`` (GB/s, GB = 10^9 bytes; busbw = algbw · 2(p − 1)/p) and ``#wrong`` (elements
that differ from ``dist.all_reduce`` on integer-valued data, summed over ranks; N/A for the
baseline and with ``--no-check``), then the course's own column, ``ratio``: the baseline's
time over the algorithm's (above 1: faster than ``dist.all_reduce``). The rows go to
``DIR/allreduce.json`` and busbw against size is drawn in ``DIR/allreduce.png`` (``--out DIR``,
default ``bench-results``); ``--json`` prints the same document on stdout instead of the
tables (``--json FILE`` writes it there too).

``--impl exercise`` adds, after each algorithm, the function of the same name from your
``lessons/NN_topic/exercise.py`` ("ring (exercise)"), checked and timed the same way; a
function that is still a stub is listed as not written yet.

On NCCL the run follows the rule for fair GPU comparisons (``docs/benchmarks.md``, :mod:`.gpu_timing`):
the rank untraced, NCCL called directly, every contender launched alike (``--launch eager``, or
``graph``: each captured once and replayed, NCCL's included, each replay checked against NCCL)
and timed in interleaved rounds (``--iters`` rounds of ``--batch`` runs back to back between CUDA
events), each row keeping the median and spread; the record's ``meta`` and ``rule`` name
``launch`` and ``inputs`` (``copied`` on plain memory, ``resident`` on registered memory).

Algorithms are named in :data:`ALGORITHMS` (name -> "module:function"); a
"module:function" of your own works too.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from ...core import launch, nccl_memory, timing
from .. import verify
from ..site.claims import commit, environment, host
from . import gpu_timing as rule

ALGORITHMS = {
    "naive_ring": "collectives.naive_ring:naive_ring_all_reduce",
    "ring": "collectives.ring:ring_all_reduce",
    "pipelined_ring": "collectives.ring:pipelined_ring_all_reduce",
    "multi_ring": "collectives.ring:multi_ring_all_reduce",
    "recursive_doubling": "collectives.topologies:recursive_doubling_all_reduce",
    "halving_doubling": "collectives.topologies:halving_doubling_all_reduce",
    "tree": "collectives.topologies:tree_all_reduce",
    "gloo": "torch.distributed:all_reduce",     # the baselines: dist.all_reduce itself
    "nccl": "torch.distributed:all_reduce",
}
BASELINES = ("gloo", "nccl")
DEFAULT_ALGOS = "naive_ring,ring,pipelined_ring,recursive_doubling,halving_doubling,tree"
COST_MODEL = {name: name for name in ALGORITHMS if name not in BASELINES}   # collectives.core.cost names


EXERCISE = " (exercise)"     # "ring (exercise)": the function of that name in the student's file
NCCL_TESTS_TYPES = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16",
                    "int32": "int32", "int64": "int64", "int8": "int8", "uint8": "uint8"}


def exercise_target(target: str) -> str:
    """``"module:function"`` of the course -> the same function in its lesson's exercise file."""
    from ..catalog import LESSONS
    from ..impl import spec_for

    module, func = target.rsplit(":", 1)
    for item in LESSONS:
        if module in (item.module, *item.also):
            return f"{spec_for(item.number, 'exercise')}:{func}"
    raise SystemExit(f"{target} belongs to no lesson: it has no exercise to run")


def _target(name: str) -> str:
    if name.endswith(EXERCISE):
        return exercise_target(_target(name[: -len(EXERCISE)]))
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if ":" in name:
        return name
    raise SystemExit(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)} (or module:function)")


def _resolve(name: str):
    """The function, or the reason it cannot run (an exercise without it)."""
    from ..impl import resolve

    try:
        return resolve(_target(name)), ""
    except AttributeError as exc:
        return None, str(exc)


def _options(name: str, pieces: int | None, channels: int | None) -> dict:
    if name == "pipelined_ring" and pieces:
        return {"pieces": pieces}
    if name == "multi_ring" and channels:
        return {"channels": channels}
    return {}


def _wrong_elements(fn, options, mine: torch.Tensor) -> int:
    """One run on integer-valued data (exact in any order) against dist.all_reduce: the elements
    that differ, summed over ranks (nccl-tests' #wrong). A run that raises counts every element.

    ``mine`` is overwritten with the data (it comes from the same memory as the timed tensor)."""
    numel = mine.numel()
    values = torch.randint(-4, 5, (numel,), generator=torch.Generator().manual_seed(dist.get_rank()))
    mine.copy_(values.to(dtype=mine.dtype))
    expected = verify.reference_all_reduce(mine)
    try:
        fn(mine, **options)
        wrong = int((mine != expected).sum())
    except Exception:  # noqa: BLE001 - reported as wrong; the timing below would fail too
        wrong = numel
    count = torch.tensor([wrong], device=mine.device)
    dist.all_reduce(count)
    return int(count.item())


def _bench_rank(names: list[str], sizes: list[int], dtype_name: str, warmup: int, iters: int,
                options: dict, check: bool, progress_path: str | None,
                registered: bool = False, launch: str | None = None, batch: int = 5) -> list[dict]:
    """Runs on every rank: every size, the baseline then each algorithm. Rank 0's rows count.
    ``launch``: ``"eager"`` or ``"graph"`` under the rule; ``None``: each run timed alone (CPUs)."""
    if launch is not None:
        rule.check_launch(launch)
        rule.untrace_rank()             # the rule: no trace wrapper on either side
    device = verify.rank_device()
    dtype = getattr(torch, dtype_name)
    itemsize = torch.empty((), dtype=dtype).element_size()
    p, backend = dist.get_world_size(), dist.get_backend()
    fns, missing = {}, {}               # missing: name -> why it does not run ("not written yet: ...")
    for name in names:
        fns[name], why = _resolve(name)
        if why:
            missing[name] = why
    rows = []

    def note(row):
        rows.append(row)
        if progress_path and dist.get_rank() == 0:
            with open(progress_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    # With ``registered`` (NCCL) the tensors come from memory registered with NCCL
    # (collectives.core.nccl_memory), so point-to-point transfers are zero-copy; NCCL's all_reduce
    # gets the same tensor. Registration is once per process: allocate for the largest size, warm every algorithm
    # up there (its landing buffers reach their final size), register, then use views.
    largest = max(max(nbytes // itemsize, 1) for nbytes in sizes)
    make = (lambda: nccl_memory.empty(largest, dtype=dtype, device=device)) if registered else \
        (lambda: torch.empty(largest, dtype=dtype, device=device))
    whole, checked = make(), make()   # the timed tensor; the correctness check's tensor
    whole.copy_(torch.rand(largest, device=device).to(dtype))
    if not registered:
        dist.all_reduce(whole)      # registered: NCCL's first all_reduce of it comes after
    for name in names:
        if name not in BASELINES and name not in missing:
            try:
                fns[name](whole, **options.get(name, {}))
            except NotImplementedError as exc:   # a stub: every rank raises it before communicating
                missing[name] = f"not written yet ({exc})"
            except Exception:  # noqa: BLE001 - the check below reports it as wrong
                pass
    if registered:
        nccl_memory.register()
    for nbytes in sizes:
        numel = max(nbytes // itemsize, 1)
        x = whole[:numel]
        runs = {backend: (lambda: dist.all_reduce(x)) if launch is None else (lambda: rule.nccl_all_reduce(x))}
        wrongs = {backend: None}
        for name in names:
            if name not in BASELINES and name not in missing:
                fn, kw = fns[name], options.get(name, {})
                runs[name] = lambda fn=fn, kw=kw: fn(x, **kw)
                # replayed contenders are checked as replayed (_as_launched), not here as well
                wrongs[name] = _wrong_elements(fn, kw, checked[:numel]) if check and launch != "graph" else None
        if launch is not None:
            skipped = _as_launched(runs, wrongs, launch, check, x, backend)
            for name, times in rule.rounds(runs, iters=batch, skipped=skipped, count=iters, device=device).items():
                middle, spread = rule.summary(times)
                note(_row(name, numel * itemsize, numel, middle, None, p, backend, dtype_name, wrongs[name])
                     | {"spread": spread, "launch": launch})
            gone = dict(line.split(": ", 1) for line in skipped) | {n: missing[n] for n in names if n in missing}
            for name, why in gone.items():
                note(dict(algo=name, nbytes=numel * itemsize, numel=numel, seconds=None, missing=why, ok=None,
                          wrong=None, world_size=p, backend=backend, dtype=dtype_name, skipped=name not in missing))
            _against_baseline(rows, backend, numel * itemsize)
            continue
        for name, run in runs.items():      # warm-up (a checked run already counts as one)
            for _ in range(max(warmup - (wrongs[name] is not None), 0)):
                run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times = {name: [] for name in runs}
        for _ in range(iters):              # side by side: one run of each, in turn, per round
            for name, run in runs.items():
                times[name] += timing.measure(run, warmup=0, iters=1, device=device)
        base = timing.median(times[backend])
        for name in [backend] + [n for n in names if n not in BASELINES]:
            if name in missing:
                note(dict(algo=name, nbytes=numel * itemsize, numel=numel, seconds=None, missing=missing[name],
                          ok=None, wrong=None, world_size=p, backend=backend, dtype=dtype_name))
            else:
                note(_row(name, numel * itemsize, numel, timing.median(times[name]), base, p, backend,
                          dtype_name, wrongs[name]))
    return rows


def _as_launched(runs: dict, wrongs: dict, launch: str, check: bool, x: torch.Tensor, backend: str) -> list[str]:
    """``runs`` launched as ``launch`` has them (in place); with ``"graph"`` each is captured
    now and, with ``check``, its replay checked against NCCL (a contender that cannot be
    captured is dropped, saying why). Returns the skipped lines."""
    launched, skipped = rule.launched(runs, launch), []
    runs.clear()
    for name, run in launched.items():
        try:
            run()                              # graph: captured here (the warm-up calls replay it)
            if launch == "graph" and check and name != backend:
                wrongs[name] = _wrong_elements(lambda _, run=run: run(), {}, x)
            runs[name] = run
        except RuntimeError as exc:
            skipped.append(f"{name}: {rule.first_line(exc)}")
    return skipped


def _against_baseline(rows: list[dict], backend: str, nbytes: int) -> None:
    """Fill in each timed row of size ``nbytes`` its speed over the baseline's row."""
    base = next((r["seconds"] for r in rows if r["algo"] == backend and r["nbytes"] == nbytes and r["seconds"]), None)
    for r in rows:
        if r["nbytes"] == nbytes and r["seconds"] and base:
            r.update(baseline_seconds=base, ratio=base / r["seconds"])


def _row(algo, nbytes, numel, seconds, baseline, p, backend, dtype, wrong) -> dict:
    return dict(algo=algo, nbytes=nbytes, numel=numel, seconds=seconds,
                algbw=timing.algbw(nbytes, seconds), busbw=timing.busbw(nbytes, seconds, p),
                baseline_seconds=baseline,
                ratio=baseline / seconds if baseline is not None and seconds > 0 else float("nan"),
                wrong=wrong, ok=None if wrong is None else wrong == 0, world_size=p, backend=backend,
                dtype=dtype)


def run_bench(names: list[str], world_size: int = 4, sizes: list[int] | None = None, *,
              backend: str = "gloo", iters: int = 5, warmup: int = 2, dtype: str = "float32",
              options: dict | None = None, check: bool = True, progress: bool = True,
              timeout: float = 3600, registered: bool = False, launch_mode: str | None = None,
              batch: int = 5) -> list[dict]:
    """Measure ``names`` (keys of :data:`ALGORITHMS` or "module:function") against
    ``dist.all_reduce`` on one world; return one dict per (size, algorithm), baseline first.
    ``launch_mode``: under the rule for fair GPU comparisons (:func:`_bench_rank`)."""
    sizes = sizes or timing.parse_sizes("1K..64M")
    total = len(sizes) * (1 + sum(1 for n in names if n not in BASELINES))
    fd, progress_path = tempfile.mkstemp(prefix="collectives-bench-", suffix=".jsonl")
    os.close(fd)
    outcome: dict = {}

    # NCCL-registered memory: one world per size (registration is once per process).
    worlds = [[size] for size in sizes] if backend == "nccl" and registered else [sizes]

    def work():
        try:
            outcome["rows"] = [row for group in worlds for row in launch.run(
                _bench_rank, world_size, args=(names, group, dtype, warmup, iters, options or {},
                                               check, progress_path, registered, launch_mode, batch),
                backend=backend, timeout=timeout,
                env=rule.rank_env(launch_mode) if launch_mode else None)[0]]
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = exc

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    worker = threading.Thread(target=work, daemon=True)
    reported = 0
    try:
        with Progress(TextColumn("[bold]bench[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), transient=True, disable=not progress) as bar:
            task = bar.add_task(f"{world_size} ranks, {backend}", total=total)
            worker.start()
            while worker.is_alive():
                worker.join(0.2)
                with open(progress_path) as f:
                    done = f.read().splitlines()
                if done:
                    last = json.loads(done[-1])
                    bar.update(task, completed=len(done),
                               description=f"{timing.human_bytes(last['nbytes'])}: {last['algo']}")
                    if progress and not bar.console.is_terminal:   # a log: one line per new row
                        for line in done[reported:]:
                            row = json.loads(line)
                            took = row.get("missing") or timing.human_seconds(row["seconds"])
                            print(f"bench: {timing.human_bytes(row['nbytes'])} {row['algo']} "
                                  f"{took} ok={row['ok']}", flush=True)
                        reported = len(done)
    finally:
        os.unlink(progress_path)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["rows"]


def render(rows: list[dict], title: str, file=None) -> None:
    """Print the rows as nccl-tests prints them: a block per algorithm, a line per size."""
    file = file or sys.stdout
    say = functools.partial(print, file=file)
    p = rows[0]["world_size"] if rows else 1
    say(f"# {title}")
    say(f"# in place; GB = 10^9 bytes; algbw = size / time; busbw = algbw * 2(p-1)/p = algbw * {2 * (p - 1) / p:g}")
    say("# #wrong: elements that differ from dist.all_reduce on integer-valued data, summed over ranks")
    say("# ratio: dist.all_reduce's time / this one's (above 1: faster than the library)")
    for algo in dict.fromkeys(r["algo"] for r in rows):
        mine = [r for r in rows if r["algo"] == algo]
        target = "dist.all_reduce" if algo in BASELINES else _target(algo)
        say("#")
        missing = next((r["missing"] for r in mine if r.get("missing")), "")
        if missing:
            say(f"# {algo}: {target} -- {missing}")
            continue
        say(f"# {algo}: {target}")
        say(f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'time':>10} {'algbw':>7} {'busbw':>7}"
            f" {'#wrong':>7} {'ratio':>7}")
        say(f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7}")
        for r in mine:
            wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
            say(f"  {r['nbytes']:>10} {r['numel']:>12} {NCCL_TESTS_TYPES.get(r['dtype'], r['dtype']):>8} "
                f"{'sum':>6} {r['seconds'] * 1e6:>10.2f} {r['algbw'] / 1e9:>7.3f} {r['busbw'] / 1e9:>7.3f} "
                f"{wrong:>7} {r['ratio']:>7.2f}")
        say(f"# Avg bus bandwidth    : {sum(r['busbw'] for r in mine) / len(mine) / 1e9:.4f} GB/s")
    wrong = sum(r["wrong"] or 0 for r in rows)
    say("#")
    say(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives bench",
                                     description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--algo", default=DEFAULT_ALGOS,
                        help=f"comma-separated, from: {', '.join(ALGORITHMS)} (default: {DEFAULT_ALGOS})")
    parser.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--sizes", default="1K..64M",
                        help='bytes per all-reduce: "1K..64M" (powers of 4) or "1K,1M,64M" (default 1K..64M)')
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: nccl when there is a GPU per rank, else gloo")
    parser.add_argument("--iters", type=int, default=5, help="timed runs per measurement (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), float16, bfloat16, ...")
    parser.add_argument("--pieces", type=int, default=None, help="pipelined_ring: pieces per chunk")
    parser.add_argument("--channels", type=int, default=None, help="multi_ring: number of rings")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check before timing")
    parser.add_argument("--out", default="bench-results", help="directory for allreduce.json/.png")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds before the world is stopped, naming where each rank waits (default 3600)")
    parser.add_argument("--registered-memory", action="store_true",
                        help="NCCL: time on memory registered with NCCL (zero-copy point-to-point); "
                             "one world per size, as registration is once per process")
    parser.add_argument("--launch", choices=rule.LAUNCHES, default=None,
                        help="NCCL: eager (the default) issues every contender from Python, graph replays "
                             "every one, NCCL's included (the rule for fair GPU comparisons)")
    parser.add_argument("--batch", type=int, default=None,
                        help="NCCL: runs issued back to back per contender and round (default 5)")
    parser.add_argument("--impl", choices=("reference", "exercise"), default="reference",
                        help="exercise: also time each algorithm from your lessons/NN_*/exercise.py")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="print the results as JSON on stdout instead of the tables (FILE: write them there too)")
    args = parser.parse_args(argv)

    backend = args.backend or launch.auto_backend(args.world)
    if backend != "nccl" and (args.launch or args.batch):
        parser.error("--launch and --batch are for GPUs (--backend nccl): on CPUs every run is timed alone")
    if args.batch is not None and args.batch < 1:
        parser.error("--batch must be at least 1")
    mode = (args.launch or "eager") if backend == "nccl" else None
    names = [n for n in args.algo.split(",") if n]
    if args.impl == "exercise":
        names = [m for n in names for m in ([n] if n in BASELINES else [n, n + EXERCISE])]
    for n in names:
        _target(n)
    options = {n: _options(n, args.pieces, args.channels) for n in names}
    sizes = timing.parse_sizes(args.sizes)
    started = datetime.datetime.now().astimezone()
    load = [round(x, 1) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None   # before: others' work
    rows = run_bench(names, args.world, sizes, backend=backend, iters=args.iters, warmup=args.warmup,
                     dtype=args.dtype, options=options, check=not args.no_check,
                     registered=args.registered_memory, timeout=args.timeout, progress=args.json != "-",
                     launch_mode=mode, batch=args.batch or 5)
    memory = (", NCCL-registered memory" if args.registered_memory else ", plain memory") \
        if backend == "nccl" else ""
    title = (f"all-reduce, {args.world} ranks, {backend}{memory}, {args.dtype}, "
             + (f"every contender {mode}, median of {args.iters} rounds of {args.batch or 5}" if mode else
                f"median of {args.iters} after {args.warmup} warm-up"))
    if args.json != "-":
        render(rows, title)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(command=".venv/bin/python -m collectives bench " + " ".join(argv if argv is not None else []),
                date=started.isoformat(timespec="seconds"),
                backend=backend, world_size=args.world, dtype=args.dtype, iters=args.iters,
                warmup=args.warmup, host=platform.node(),
                nccl=".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None,
                registered_memory=backend == "nccl" and args.registered_memory,
                device=(f"{args.world}× {torch.cuda.get_device_name(0)}" if backend == "nccl"
                        else environment("gloo")["device"]),
                load_average_before=load, commit=commit(), **host())
    said = rule.fields_of_rows(mode, "resident" if args.registered_memory else "copied", rows)
    if said:                            # in the meta too: a chart's record copies the meta
        meta.update(launch=mode, inputs=said["rule"]["inputs"], batch=args.batch or 5)
    document = json.dumps({"meta": meta, "rows": rows, **said}, indent=1)
    (out / "allreduce.json").write_text(document)
    from ..site.plots import plot_busbw
    plot_busbw([r for r in rows if r["seconds"] is not None], title).savefig(out / "allreduce.png", dpi=110)
    if args.json == "-":
        print(document)
    else:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(document)
        print(f"wrote {out / 'allreduce.json'}, {out / 'allreduce.png'}" + (f" and {args.json}" if args.json else ""))
    bad = [r for r in rows if r["ok"] is False]
    return 1 if bad else 0
