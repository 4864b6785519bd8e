"""``.venv/bin/python -m collectives tour``: every lesson's algorithm on a local world, verified and timed.

The tour finds the lessons, not the other way round: :data:`TOUR` below lists what each
lesson contributes, by "module:function" strings, and a lesson module knows nothing of
the tour. For an all-reduce (``fn(tensor, op, group)``) the standard runner checks it
against ``dist.all_reduce`` on the harness's quick cases, times it beside
``dist.all_reduce`` on the same bytes, and counts the bytes each rank sent from the
trace. Multi-tensor algorithms (fusion, bucketing) give a ``runner`` of their own that
returns the same fields.

On GPUs (NCCL) the tour verifies and counts bytes but compares no speeds: its runners call
``dist.all_reduce`` through the course's trace and time each side as it comes, outside the
rule for fair GPU comparisons (``docs/benchmarks.md``), so its GPU rows keep no time and
print no ratio (:data:`UNTIMED`); the benchmarks that follow the rule give GPU speeds.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from ..core import cost, launch, timing, trace
from . import verify
from .impl import resolve


@dataclass(frozen=True)
class TourEntry:
    lesson: int
    name: str
    target: str                   # "module:function"
    model: str | None = None      # cost model giving bytes sent per rank (collectives.core.cost)
    runner: str | None = None     # "module:function" run on every rank: runner(nbytes) -> dict
    identical_bits: bool = True   # every rank ends with the same bits (the naive ring: not)
    loses: str = ""               # why it can be slower than its baseline, in a few words
    wins: str = ""                # why it can be faster than its baseline, in a few words
    messages: bool = True         # False: reads shared memory, sends nothing (lesson 12)


@dataclass
class TourRow:
    lesson: int
    algorithm: str
    verified: bool
    detail: str = ""
    seconds: float = float("nan")      # median time of the algorithm
    ref_seconds: float = float("nan")  # median time of the baseline on the same bytes
    nbytes: int = 0
    world_size: int = 1
    bytes_sent: float = float("nan")   # measured, per rank (max over ranks)
    bytes_theory: float = float("nan")
    baseline: str = "dist.all_reduce"
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Speed relative to the baseline: > 1 is faster."""
        return self.ref_seconds / self.seconds if self.seconds > 0 else float("nan")

    @property
    def busbw(self) -> float:
        return timing.busbw(self.nbytes, self.seconds, self.world_size)


TOUR = [
    TourEntry(1, "exchange (a ring step)", "collectives.p2p:exchange",
              runner="collectives.course.benchmarks.p2p:tour_runner",
              loses="Python around the same two calls", wins="the same two messages, no list of ops"),
    TourEntry(2, "reduce+broadcast", "collectives.basics:all_reduce_via_reduce_broadcast",
              model="reduce_broadcast", loses="the root sends p − 1 copies", wins="2 messages per rank, not 6"),
    TourEntry(3, "naive ring", "collectives.naive_ring:naive_ring_all_reduce", model="naive_ring",
              identical_bits=False, loses="sends (p − 1)·n per rank", wins="p − 1 messages, not 2(p − 1)"),
    TourEntry(4, "ring", "collectives.ring:ring_all_reduce", model="ring",
              loses="gloo's ring is C++, pipelined", wins="the same schedule as gloo's ring"),
    TourEntry(4, "pipelined ring", "collectives.ring:pipelined_ring_all_reduce", model="pipelined_ring",
              loses="4× the messages", wins="adds hidden under transfers"),
    TourEntry(4, "multi-ring (2 channels)", "collectives.ring:multi_ring_all_reduce", model="multi_ring",
              loses="2× the messages, one link", wins="two rings share the work"),
    TourEntry(4, "recursive doubling", "collectives.topologies:recursive_doubling_all_reduce",
              model="recursive_doubling", loses="sends n·log2 p per rank", wins="log2 p messages: wins small sizes"),
    TourEntry(4, "halving-doubling", "collectives.topologies:halving_doubling_all_reduce",
              model="halving_doubling", loses="gloo's ring is C++, pipelined", wins="ring's bytes, 2·log2 p messages"),
    TourEntry(4, "tree", "collectives.topologies:tree_all_reduce", model="tree",
              loses="the whole tensor on every edge", wins="2·log2 p messages: wins small sizes"),
    TourEntry(5, "fused", target="collectives.fused:fused_all_reduce",
              runner="collectives.course.benchmarks.fused:tour_runner",
              loses="copies in and back out", wins="one call instead of many"),
    TourEntry(6, "bucketed reducer", target="collectives.bucketing:BucketedReducer",
              runner="collectives.course.benchmarks.bucketing:tour_fields",
              loses="Python per gradient hook", wins="buckets overlap backward"),
    TourEntry(7, "hierarchical (2 machines)", target="collectives.hierarchical:hierarchical_all_reduce",
              runner="collectives.course.benchmarks.hierarchical:tour_runner",
              loses="one machine: no slow tier", wins="fewer messages per rank"),
    TourEntry(7, "hierarchical (in flight)", target="collectives.hierarchical:HierarchicalAllReducer",
              runner="collectives.course.benchmarks.hierarchical_inflight:tour_runner",
              loses="one machine: no slow tier", wins="buckets overlap one another"),
    TourEntry(8, "sparse top-k 1% (all-gather)", target="collectives.sparse:sparse_all_reduce",
              runner="collectives.course.benchmarks.sparse:tour_topk_allgather",
              loses="selection reads all n; fast link", wins="a hundredth of the bytes"),
    TourEntry(8, "sparse top-k 1% (split)", target="collectives.sparse:sparse_all_reduce",
              runner="collectives.course.benchmarks.sparse:tour_topk_split",
              loses="selection reads all n; fast link", wins="a hundredth of the bytes"),
    TourEntry(8, "sparse threshold 1% (all-gather)", target="collectives.sparse:sparse_all_reduce",
              runner="collectives.course.benchmarks.sparse:tour_threshold_allgather",
              loses="selection reads all n; fast link", wins="a hundredth of the bytes"),
    TourEntry(9, "ring with flight recorder", target="collectives.ring:ring_all_reduce",
              runner="collectives.course.benchmarks.debugging:tour_runner",
              loses="a record per message", wins="(noise: the same ring)"),
    TourEntry(11, "pairwise all-to-all", target="collectives.alltoall:pairwise_all_to_all",
              runner="collectives.course.benchmarks.alltoall:tour_runner", loses="one partner per round",
              wins="NCCL/gloo's own all-to-all is no faster here"),
    TourEntry(12, "one-shot (shared memory)", "collectives.symmetric:one_shot_all_reduce",
              loses="reads (p − 1)·n per rank", wins="no message: one barrier, then reads", messages=False),
    TourEntry(12, "two-shot (shared memory)", "collectives.symmetric:two_shot_all_reduce",
              loses="two barriers; copies in and out", wins="no message: reads n·(p − 1)/p twice", messages=False),
    TourEntry(10, "ZeRO-3 step (vs DDP step)", target="collectives.sharded:FSDP",
              runner="collectives.course.benchmarks.sharded:tour_runner", loses="1.5× DDP's bytes, for 1/p the memory",
              wins="(noise: its step computes the same)"),
    TourEntry(14, "1F1B pipeline step", target="collectives.pipeline:Pipeline",
              runner="collectives.course.benchmarks.pipeline:tour_runner", loses="a Python loop of steps",
              wins="the same messages and arithmetic"),
]


def entries() -> list[TourEntry]:
    """Every entry of :data:`TOUR`, in lesson order."""
    return sorted(TOUR, key=lambda e: e.lesson)


def all_reduce_runner(entry: TourEntry, nbytes: int) -> dict:
    """The standard runner for an all-reduce: verify, measure bytes from the trace, time."""
    fn = resolve(entry.target)
    p = dist.get_world_size()
    device = verify.rank_device()
    report = verify.check_all_reduce(fn, quick=True, identical_bits=entry.identical_bits)
    x = torch.randn(max(nbytes // 4, 1), device=device)
    y = x.clone()
    with trace.recording() as t:
        fn(x)
    sent = timing.max_over_ranks(t.bytes_sent())
    ours = timing.measure(lambda: fn(x), device=device)
    ref = timing.measure(lambda: dist.all_reduce(y), device=device)
    theory = cost.cost(entry.model, x.numel() * 4, p).bytes_per_rank if entry.model else float("nan")
    bad = report.failures
    return dict(verified=report.ok, detail="" if report.ok else f"{bad[0].case}: {bad[0].detail}",
                seconds=timing.median(ours), ref_seconds=timing.median(ref),
                nbytes=x.numel() * 4, bytes_sent=sent, bytes_theory=theory)


def _run_entry(entry: TourEntry, nbytes: int) -> dict:
    if entry.runner:
        fields = resolve(entry.runner)(nbytes)
    else:
        fields = all_reduce_runner(entry, nbytes)
    fields.setdefault("world_size", dist.get_world_size())
    return fields


UNTIMED = ("not timed on GPUs: the tour's timings are outside the rule for fair GPU comparisons "
           "(docs/benchmarks.md); the benchmarks give GPU speeds")


def untimed(row: TourRow) -> TourRow:
    """``row`` verified and counted, its times and ratios dropped (a GPU's row: :data:`UNTIMED`)."""
    row.seconds = row.ref_seconds = float("nan")
    row.extra.pop("ratios", None)
    row.extra["timed"] = UNTIMED
    return row


def run_tour(world_size: int = 4, nbytes: int = 4 << 20, backend: str | None = None,
             only: list[str] | None = None, progress: bool = True, repeat: int = 1) -> list[TourRow]:
    """Run every entry in its own world (fork start-up is ~0.1 s); return the rows.

    ``repeat``: run each entry that many times, each in a world of its own; the row keeps the
    run of median speed, and ``extra["ratios"]`` every run's speed, for the spread. On NCCL
    every row is :func:`untimed`."""
    from rich.progress import Progress

    if world_size < 2:
        raise ValueError(f"the tour needs at least 2 ranks, got {world_size}: one rank sends no message "
                         "(on a machine with one GPU, run it on CPU ranks: --backend gloo)")
    backend = backend or "gloo"         # as launch.run's default: the command line picks NCCL itself
    gpus = backend == "nccl"
    repeat = 1 if gpus else repeat      # untimed on GPUs: a repeat would only run the row again

    todo = [e for e in entries() if not only or e.name in only]
    rows = []
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("tour", total=len(todo))
        for entry in todo:
            bar.update(task, description=f"lesson {entry.lesson}: {entry.name}")
            try:
                runs = [launch.run(_run_entry, world_size, args=(entry, nbytes), backend=backend,
                                   timeout=300)[0] for _ in range(max(repeat, 1))]
                made = [TourRow(entry.lesson, entry.name, **fields) for fields in runs]
                ratios = sorted(r.ratio for r in made)
                row = sorted(made, key=lambda r: r.ratio)[(len(made) - 1) // 2]     # the median run
                row.verified = all(r.verified for r in made)
                row.detail = next((r.detail for r in made if r.detail), "")
                if len(made) > 1:
                    row.extra["ratios"] = ratios
                rows.append(untimed(row) if gpus else row)
            except (launch.RankError, launch.WorldTimeout) as exc:
                rows.append(TourRow(entry.lesson, entry.name, False, str(exc).splitlines()[0]))
            bar.advance(task)
    return rows


WIDTH = 100     # the table fits a 100-column terminal


def _short(nbytes: float) -> str:
    """1536 -> "1.5K", 4194304 -> "4.0M" (binary units); NaN -> "-"."""
    if nbytes != nbytes:
        return "-"
    for unit in ("", "K", "M", "G"):
        if abs(nbytes) < 1024 or unit == "G":
            return f"{nbytes:.0f}{unit}" if unit == "" else f"{nbytes:.1f}{unit}"
        nbytes /= 1024
    return f"{nbytes:.1f}G"


def render(rows: list[TourRow], world_size: int, backend: str, console=None) -> None:
    """The table, at most :data:`WIDTH` columns: a row slower than its baseline says why."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    sizes = sorted({r.nbytes for r in rows if r.nbytes})
    size = ", ".join(timing.human_bytes(n) for n in sizes) or "no size"
    table = Table(title=f"the tour: {world_size} ranks, {backend}; bytes per call: {size}", box=box.SIMPLE_HEAD,
                  padding=0, pad_edge=False)
    spread = any("ratios" in r.extra for r in rows)
    for col in ("#", "algorithm", "ok", "time", "busbw", "speed") + (("range",) if spread else ()) + ("sent/theory",):
        table.add_column(col, justify="left" if col in ("algorithm", "ok") else "right", no_wrap=True)
    table.add_column("why", min_width=18)      # the one column that wraps
    loses = {e.name: e.loses for e in TOUR}
    wins = {e.name: getattr(e, "wins", "") for e in TOUR}
    for r in rows:
        ok = "[green]yes[/]" if r.verified else "[red]NO[/]"
        timed = r.seconds == r.seconds
        speed = f"{r.ratio:.2f}×" if r.ratio == r.ratio else "-"
        why = ""
        if not r.verified:
            why = r.detail[:40]
        elif r.ratio == r.ratio:
            why = loses.get(r.algorithm, "") if r.ratio < 1 else wins.get(r.algorithm, "")
        if r.baseline != "dist.all_reduce":
            why = f"vs {r.baseline}" + (f": {why}" if why else "")
        cells = [timing.human_seconds(r.seconds) if timed else "-",
                 f"{r.busbw / 1e9:.2f}" if timed else "-", speed]
        if spread:
            ratios = r.extra.get("ratios") or []
            cells.append(f"{ratios[0]:.2f}–{ratios[-1]:.2f}" if ratios else "-")
        table.add_row(str(r.lesson), r.algorithm, ok, *cells,
                      f"{_short(r.bytes_sent)}/{_short(r.bytes_theory)}", why)
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log or a pipe: the width the table is made for
            console = Console(width=WIDTH)
    console.print(table)
    console.print("busbw in GB/s; speed = baseline time / algorithm time (above 1: faster than "
                  "dist.all_reduce, or the baseline named); sent/theory: the bytes each rank sent, "
                  "from the trace, against the cost model's; why: what makes the row faster or slower."
                  + (" range: the slowest and fastest of the repeats." if spread else
                     " One run each: rerun with --repeat 5 to see how much a speed moves."), width=WIDTH)
    if backend == "nccl":
        console.print(f"No time and no speed on GPUs: {UNTIMED}.", width=WIDTH)
    cores = os.cpu_count() or 1
    if world_size > cores:
        console.print(f"[yellow]warning:[/] {world_size} ranks share {cores} cores: the ranks wait for a core, "
                      "speeds swing from run to run and any row's reason may not hold in the next run.",
                      width=WIDTH)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives tour", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--size", default="4M",
                        help="BYTES per all-reduce (K = KiB, M = MiB; e.g. 4M, the default, is 4 MiB of float32)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each algorithm N times, each in its own world, and show the spread")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: nccl when there is a GPU per rank, else gloo")
    parser.add_argument("--only", default="", help="comma-separated algorithm names")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.world < 2:
        parser.error(f"--world {args.world}: the tour needs at least 2 ranks (one rank sends no message); "
                     "on a machine with one GPU, run it on CPU ranks (--backend gloo)")
    backend = args.backend or launch.auto_backend(args.world)
    rows = run_tour(args.world, timing.parse_size(args.size), backend,
                    [s for s in args.only.split(",") if s] or None, repeat=args.repeat)
    render(rows, args.world, backend)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump([asdict(r) | ({"ratio": None, "busbw": None} if "timed" in r.extra else
                                    {"ratio": r.ratio, "busbw": r.busbw}) for r in rows], f, indent=1)
    return 0 if rows and all(r.verified for r in rows) else 1
