"""``python -m collectives tour``: every lesson's algorithm on a local world, verified and timed.

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
              model="reduce_broadcast"),
    TourEntry(3, "naive ring", "collectives.naive_ring:naive_ring_all_reduce", model="naive_ring",
              identical_bits=False),
    TourEntry(4, "ring", "collectives.ring:ring_all_reduce", model="ring"),
    TourEntry(4, "pipelined ring", "collectives.ring:pipelined_ring_all_reduce", model="pipelined_ring"),
    TourEntry(4, "multi-ring (2 channels)", "collectives.ring:multi_ring_all_reduce", model="multi_ring"),
    TourEntry(4, "recursive doubling", "collectives.topologies:recursive_doubling_all_reduce",
              model="recursive_doubling"),
    TourEntry(4, "halving-doubling", "collectives.topologies:halving_doubling_all_reduce",
              model="halving_doubling"),
    TourEntry(4, "tree", "collectives.topologies:tree_all_reduce", model="tree"),
    TourEntry(5, "fused", target="collectives.fused:fused_all_reduce",
              runner="collectives.course.fused_bench:tour_runner"),
    TourEntry(6, "bucketed reducer", target="collectives.bucketing:BucketedReducer",
              runner="collectives.course.bucketing_bench:tour_fields"),
    TourEntry(7, "hierarchical (2 machines)", target="collectives.hierarchical:hierarchical_all_reduce",
              runner="collectives.course.hierarchical_bench:tour_runner"),
    TourEntry(7, "hierarchical (in flight)", target="collectives.hierarchical:HierarchicalAllReducer",
              runner="collectives.course.hierarchical_inflight_bench:tour_runner"),
    TourEntry(8, "sparse top-k 1% (all-gather)", target="collectives.sparse:sparse_all_reduce",
              runner="collectives.course.sparse_bench:tour_topk_allgather"),
    TourEntry(8, "sparse top-k 1% (split)", target="collectives.sparse:sparse_all_reduce",
              runner="collectives.course.sparse_bench:tour_topk_split"),
    TourEntry(8, "sparse threshold 1% (all-gather)", target="collectives.sparse:sparse_all_reduce",
              runner="collectives.course.sparse_bench:tour_threshold_allgather"),
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


def render(rows: list[TourRow], world_size: int, backend: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Collectives from Scratch — the tour ({world_size} ranks, {backend})")
    for col in ("lesson", "algorithm", "verified", "size", "time", "busbw", "baseline",
                "ratio", "sent / rank", "theory"):
        table.add_column(col, justify="left" if col in ("algorithm", "baseline") else "right",
                         no_wrap=col != "verified")
    for r in rows:
        ok = "[green]yes[/]" if r.verified else f"[red]NO[/] {r.detail[:60]}"
        table.add_row(str(r.lesson), r.algorithm, ok, timing.human_bytes(r.nbytes),
                      timing.human_seconds(r.seconds) if r.seconds == r.seconds else "-",
                      f"{r.busbw / 1e9:.2f} GB/s" if r.seconds == r.seconds else "-",
                      r.baseline, f"{r.ratio:.2f}×" if r.ratio == r.ratio else "-",
                      timing.human_bytes(r.bytes_sent) if r.bytes_sent == r.bytes_sent else "-",
                      timing.human_bytes(r.bytes_theory) if r.bytes_theory == r.bytes_theory else "-")
    console = Console()
    if not console.is_terminal:  # a log or a pipe: don't squeeze the table into 80 columns
        console = Console(width=150)
    console.print(table)
    console.print("ratio = baseline time / algorithm time (above 1: faster than the baseline). "
                  "sent / rank is measured from the trace; theory from collectives.core.cost.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collectives tour", description=__doc__.splitlines()[0])
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
