"""``.venv/bin/python -m collectives tour``: every lesson's algorithm on a local world, verified and timed.

The tour finds the lessons, not the other way round: :data:`TOUR` below lists what each
lesson contributes, by "module:function" strings, and a lesson module knows nothing of
the tour. For an all-reduce (``fn(tensor, op, group)``) the standard runner checks it
against ``dist.all_reduce`` on the harness's quick cases, times it beside
``dist.all_reduce`` on the same bytes, and counts the bytes each rank sent from the
trace. Multi-tensor algorithms (fusion, bucketing) give a ``runner`` of their own that
returns the same fields.
"""

from __future__ import annotations

import argparse
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
    TourEntry(2, "reduce+broadcast", "collectives.basics:all_reduce_via_reduce_broadcast",
              model="reduce_broadcast", loses="the root sends p − 1 copies"),
    TourEntry(3, "naive ring", "collectives.naive_ring:naive_ring_all_reduce", model="naive_ring",
              identical_bits=False, loses="sends (p − 1)·n per rank"),
    TourEntry(4, "ring", "collectives.ring:ring_all_reduce", model="ring",
              loses="gloo's ring is C++, pipelined"),
    TourEntry(4, "pipelined ring", "collectives.ring:pipelined_ring_all_reduce", model="pipelined_ring",
              loses="4× the messages"),
    TourEntry(4, "multi-ring (2 channels)", "collectives.ring:multi_ring_all_reduce", model="multi_ring",
              loses="2× the messages, one link"),
    TourEntry(4, "recursive doubling", "collectives.topologies:recursive_doubling_all_reduce",
              model="recursive_doubling", loses="sends n·log2 p per rank"),
    TourEntry(4, "halving-doubling", "collectives.topologies:halving_doubling_all_reduce",
              model="halving_doubling", loses="gloo's ring is C++, pipelined"),
    TourEntry(4, "tree", "collectives.topologies:tree_all_reduce", model="tree",
              loses="the whole tensor on every edge"),
    TourEntry(5, "fused", target="collectives.fused:fused_all_reduce",
              runner="collectives.course.benchmarks.fused:tour_runner", loses="copies in and back out"),
    TourEntry(6, "bucketed reducer", target="collectives.bucketing:BucketedReducer",
              runner="collectives.course.benchmarks.bucketing:tour_fields", loses="Python per gradient hook"),
    TourEntry(7, "hierarchical (2 machines)", target="collectives.hierarchical:hierarchical_all_reduce",
              runner="collectives.course.benchmarks.hierarchical:tour_runner",
              loses="one machine: no slow tier"),
    TourEntry(7, "hierarchical (in flight)", target="collectives.hierarchical:HierarchicalAllReducer",
              runner="collectives.course.benchmarks.hierarchical_inflight:tour_runner",
              loses="one machine: no slow tier"),
    TourEntry(8, "sparse top-k 1% (all-gather)", target="collectives.sparse:sparse_all_reduce",
              runner="collectives.course.benchmarks.sparse:tour_topk_allgather",
              loses="selection reads all n; fast link"),
    TourEntry(8, "sparse top-k 1% (split)", target="collectives.sparse:sparse_all_reduce",
              runner="collectives.course.benchmarks.sparse:tour_topk_split",
              loses="selection reads all n; fast link"),
    TourEntry(8, "sparse threshold 1% (all-gather)", target="collectives.sparse:sparse_all_reduce",
              runner="collectives.course.benchmarks.sparse:tour_threshold_allgather",
              loses="selection reads all n; fast link"),
    TourEntry(9, "ring with flight recorder", target="collectives.ring:ring_all_reduce",
              runner="collectives.course.benchmarks.debugging:tour_runner", loses="a record per message"),
    TourEntry(10, "ZeRO-3 step (vs DDP step)", target="collectives.sharded:FSDP",
              runner="collectives.course.benchmarks.sharded:tour_runner", loses="1.5x DDP's bytes, for 1/p the memory"),
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
    sent = torch.tensor([float(t.bytes_sent())])
    with trace.paused():
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    ours = timing.measure(lambda: fn(x), device=device)
    ref = timing.measure(lambda: dist.all_reduce(y), device=device)
    theory = cost.cost(entry.model, x.numel() * 4, p).bytes_per_rank if entry.model else float("nan")
    bad = report.failures
    return dict(verified=report.ok, detail="" if report.ok else f"{bad[0].case}: {bad[0].detail}",
                seconds=timing.median(ours), ref_seconds=timing.median(ref),
                nbytes=x.numel() * 4, bytes_sent=sent.item(), bytes_theory=theory)


def _run_entry(entry: TourEntry, nbytes: int) -> dict:
    if entry.runner:
        fields = resolve(entry.runner)(nbytes)
    else:
        fields = all_reduce_runner(entry, nbytes)
    fields.setdefault("world_size", dist.get_world_size())
    return fields


def run_tour(world_size: int = 4, nbytes: int = 4 << 20, backend: str | None = None,
             only: list[str] | None = None, progress: bool = True) -> list[TourRow]:
    """Run every entry in its own world (fork start-up is ~0.1 s); return the rows."""
    from rich.progress import Progress

    todo = [e for e in entries() if not only or e.name in only]
    rows = []
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("tour", total=len(todo))
        for entry in todo:
            bar.update(task, description=f"lesson {entry.lesson}: {entry.name}")
            try:
                fields = launch.run(_run_entry, world_size, args=(entry, nbytes), backend=backend,
                                    timeout=300)[0]
                rows.append(TourRow(entry.lesson, entry.name, **fields))
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
    size = timing.human_bytes(sizes[0]) if len(sizes) == 1 else "several sizes"
    table = Table(title=f"the tour: {world_size} ranks, {backend}, {size} per call", box=box.SIMPLE_HEAD,
                  padding=(0, 1), collapse_padding=True, pad_edge=False)
    for col in ("#", "algorithm", "ok", "time", "busbw", "speed", "sent/theory"):
        table.add_column(col, justify="left" if col in ("algorithm", "ok") else "right", no_wrap=True)
    table.add_column("why slower", min_width=18)      # the one column that wraps
    reasons = {e.name: e.loses for e in TOUR}
    for r in rows:
        ok = "[green]yes[/]" if r.verified else "[red]NO[/]"
        timed = r.seconds == r.seconds
        speed = f"{r.ratio:.2f}×" if r.ratio == r.ratio else "-"
        why = ""
        if not r.verified:
            why = r.detail[:40]
        elif r.ratio == r.ratio and r.ratio < 1:
            why = reasons.get(r.algorithm, "")
        if r.baseline != "dist.all_reduce" and not why:
            why = f"vs {r.baseline}"
        table.add_row(str(r.lesson), r.algorithm, ok,
                      timing.human_seconds(r.seconds) if timed else "-",
                      f"{r.busbw / 1e9:.2f}" if timed else "-", speed,
                      f"{_short(r.bytes_sent)}/{_short(r.bytes_theory)}", why)
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log or a pipe: the width the table is made for
            console = Console(width=WIDTH)
    console.print(table)
    console.print("busbw in GB/s; speed = baseline time / algorithm time (above 1: faster than "
                  "dist.all_reduce, or the baseline named); sent/theory: the bytes each rank sent, "
                  "from the trace, against the cost model's.", width=WIDTH)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives tour", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--size", default="4M", help="bytes per all-reduce, e.g. 4M (default)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: nccl when there is a GPU per rank, else gloo")
    parser.add_argument("--only", default="", help="comma-separated algorithm names")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    backend = args.backend or launch.auto_backend(args.world)
    rows = run_tour(args.world, timing.parse_size(args.size), backend,
                    [s for s in args.only.split(",") if s] or None)
    render(rows, args.world, backend)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"ratio": r.ratio, "busbw": r.busbw} for r in rows], f, indent=1)
    return 0 if rows and all(r.verified for r in rows) else 1
