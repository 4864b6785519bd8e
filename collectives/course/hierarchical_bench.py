"""``python -m collectives bench-hier``: hierarchical all-reduce on the simulated cluster.

::

    python -m collectives bench-hier                      # 2 machines × 2 ranks, 1 Gbit/s, 64 MiB
    python -m collectives bench-hier --rails              # one link per local rank
    python -m collectives bench-hier --sizes 1M,16M,64M --iters 5 --json out.json

Each run makes a :class:`~collectives.core.cluster.Cluster` (needs root and iproute2),
starts one world on it and times, on the same float32 tensor: lesson 4's flat ring,
``dist.all_reduce`` (gloo's own, also flat), the root-based and rail hierarchies, and
:func:`~collectives.hierarchical.hierarchical_all_reduce` as one slice and pipelined. The
layout comes from the environment the cluster gives each rank, as under torchrun. Every
algorithm is first checked against ``dist.all_reduce``. The table shows the median time
(max over ranks), the speed-up over the flat ring and over ``dist.all_reduce``, and the
tier-aware model's prediction (:func:`collectives.core.cost.predict_tiered`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json

import torch
import torch.distributed as dist

from ..core import cost, launch, netns, timing, trace
from ..hierarchical import cost as hcost
from . import verify

# The queue of each shaped link, as tc's tbf ``latency``: how long a packet may wait. With
# the cluster's default 10 ms (1.25 MB at 1 Gbit/s) two TCP flows sharing a link lose
# packets and back off: 64 MiB as two flows of 32 MiB took 1.02 s where one flow took
# 0.63-0.77 s (2026-11-23). 50 ms lets them share it: 0.58-0.59 s both ways. A hierarchy
# without rails sends D flows over each link at once, so it is measured with 50 ms.
QUEUE = "50ms"

ALGORITHMS = {   # name -> (target, cost model, slices: "one" or "model")
    "flat ring": ("collectives.ring:ring_all_reduce", "flat_ring", "one"),
    "dist.all_reduce": (None, "flat_ring", "one"),
    "root-based": ("collectives.hierarchical:root_based_all_reduce", "root_based", "one"),
    "rail all-reduce": ("collectives.hierarchical:rail_all_reduce", "rail_all_reduce", "one"),
    "hierarchical, one slice": ("collectives.hierarchical:one_slice_all_reduce", "hierarchical", "one"),
    "hierarchical, pipelined": ("collectives.hierarchical:hierarchical_all_reduce", "hierarchical", "model"),
}


def _fn(target):
    if target is None:
        return lambda x: dist.all_reduce(x)
    from .impl import resolve
    return resolve(target)


def _bench_in_rank(sizes: list[int], iters: int, names: list[str]) -> dict:
    from collectives.hierarchical import resolve as layout_of
    layout = layout_of()
    out = {"layout": (layout.D, layout.M), "rows": []}
    check = [verify.Case(n) for n in (0, 1, 7, 1001)] + [verify.Case(1001, torch.int64, dist.ReduceOp.MAX)]
    for name in names:
        target, _, _ = ALGORITHMS[name]
        report = verify.check_all_reduce(_fn(target), check) if target else verify.Report()
        for nbytes in sizes:
            x = torch.randn(nbytes // 4)
            fn = _fn(target)
            with trace.recording() as t:
                fn(x)
            times = timing.measure(lambda: fn(x), warmup=1, iters=iters)
            out["rows"].append(dict(name=name, nbytes=nbytes, verified=report.ok,
                                    seconds=timing.median(times), times=times, calls=len(t.events)))
    return out


def run_bench(sizes: list[int], machines: int = 2, ranks_per_machine: int = 2, link: str = "1gbit",
              rails: bool = False, iters: int = 3, names: list[str] | None = None,
              latency: str = QUEUE) -> dict:
    """Run the benchmark on a fresh cluster; return rank 0's results with the model beside them."""
    from ..core.cluster import Cluster

    names = names or list(ALGORITHMS)
    p = machines * ranks_per_machine
    with Cluster(machines, ranks_per_machine, link=link, rails=rails, latency=latency) as made:
        result = launch.run(_bench_in_rank, p, args=(sizes, iters, names), cluster=made,
                            timeout=60 + 60 * iters * len(sizes) * len(names))[0]
    rate = netns.rate_bytes_per_second(link)
    tiers = hcost.Tiers(hcost.DEFAULT_TIERS.inside, cost.AlphaBeta(100e-6, 1 / rate), rails=rails)
    D, M = result["layout"]
    for row in result["rows"]:
        _, model, slices = ALGORITHMS[row["name"]]
        s = 1 if slices == "one" else max(1, round(row["nbytes"] / hcost.best_slice_bytes(row["nbytes"], D, M, tiers)))
        row["model_seconds"] = hcost.predict_tiered(model, row["nbytes"], D, M, tiers, slices=s)
    result.update(machines=machines, ranks_per_machine=ranks_per_machine, link=link, rails=rails, latency=latency,
                  date=datetime.date.today().isoformat(), torch=torch.__version__)
    return result


def render(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    D, M = result["layout"]
    title = (f"hierarchical all-reduce, {M} machines × {D} ranks, {result['link']} "
             f"{'per rail' if result['rails'] else 'per machine'} (queue {result['latency']}), "
             f"float32 (torch {result['torch']})")
    table = Table(title=title)
    for col in ("size", "algorithm", "verified", "time", "model", "× flat ring", "× dist.all_reduce"):
        table.add_column(col, justify="left" if col == "algorithm" else "right")
    by = {(r["name"], r["nbytes"]): r for r in result["rows"]}
    for r in result["rows"]:
        ring = by.get(("flat ring", r["nbytes"]))
        flat = by.get(("dist.all_reduce", r["nbytes"]))
        table.add_row(timing.human_bytes(r["nbytes"]), r["name"], "yes" if r["verified"] else "[red]NO[/]",
                      timing.human_seconds(r["seconds"]), timing.human_seconds(r["model_seconds"]),
                      f"{ring['seconds'] / r['seconds']:.2f}" if ring else "-",
                      f"{flat['seconds'] / r['seconds']:.2f}" if flat else "-")
    console = Console()
    if not console.is_terminal:
        console = Console(width=130)
    console.print(table)
    console.print("× flat ring / × dist.all_reduce: that algorithm's time divided by this one's "
                  "(above 1: this one is faster). model: collectives.core.cost.predict_tiered.")


def tour_runner(nbytes: int) -> dict:
    """The tour's row for lesson 7 on a local world pretending to be 2 machines (1 when p is
    odd): verify, count the bytes of the traced collectives, time against ``dist.all_reduce``."""
    from collectives.hierarchical import hierarchical_all_reduce, stage_groups, tier_bytes
    from collectives.hierarchical import resolve as layout_of

    p = dist.get_world_size()
    layout = (p // 2, 2) if p % 2 == 0 else (p, 1)
    fn = functools.partial(hierarchical_all_reduce, layout=layout)
    cases = [c for c in verify.default_cases(p, quick=True, large=False) if c.group is None]
    report = verify.check_all_reduce(fn, cases)
    x = torch.randn(max(nbytes // 4, 1))
    y = x.clone()
    with trace.recording() as t:
        fn(x)
    groups = stage_groups(layout_of(layout))
    sent = sum(v for k, v in tier_bytes(t.events, groups, p).items() if k in ("inside", "across"))
    ours = timing.measure(lambda: fn(x))
    ref = timing.measure(lambda: dist.all_reduce(y))
    D, M = layout
    theory = sum(s.bytes_per_rank for s in hcost.tiered("hierarchical", x.numel() * 4, D, M))
    bad = report.failures
    return dict(verified=report.ok, detail="" if report.ok else f"{bad[0].case}: {bad[0].detail}",
                seconds=timing.median(ours), ref_seconds=timing.median(ref), nbytes=x.numel() * 4,
                bytes_sent=sent, bytes_theory=theory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collectives bench-hier", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64M", help="bytes per all-reduce, e.g. 1M,16M,64M (default 64M)")
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--ranks-per-machine", type=int, default=2)
    parser.add_argument("--link", default="1gbit", help="rate of each cross-machine link (tc syntax)")
    parser.add_argument("--rails", action="store_true", help="one link per local rank")
    parser.add_argument("--latency", default=QUEUE,
                        help=f"queue of each link, tc tbf latency (default {QUEUE}; the cluster's own: 10ms)")
    parser.add_argument("--iters", type=int, default=3, help="timed runs per algorithm and size (median)")
    parser.add_argument("--only", default="", help="comma-separated algorithm names")
    parser.add_argument("--json", default="", help="also write the results to this file")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or None
    result = run_bench(timing.parse_sizes(args.sizes), args.machines, args.ranks_per_machine, args.link,
                       args.rails, args.iters, names, args.latency)
    render(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r["verified"] for r in result["rows"]) else 1


# ---- for the lab: a real trace of slices in flight, drawn stage by stage -----------------

STAGE_COLOURS = {"reduce-scatter": "tab:blue", "collect": "tab:orange", "diffuse": "tab:green",
                 "all-gather": "tab:purple"}


def traced_slices(layout: tuple[int, int], numel: int, slice_numel: int, rounds: int = 2) -> list[dict]:
    """On every rank: the trace of ``hierarchical_all_reduce`` (the last of ``rounds`` calls,
    so the groups exist already), as dicts, times relative to the call's start."""
    import time

    from collectives.hierarchical import hierarchical_all_reduce

    x = torch.randn(numel)
    for _ in range(rounds - 1):
        hierarchical_all_reduce(x, layout=layout, slice_numel=slice_numel)
    with trace.paused():
        dist.barrier()
    start = time.perf_counter()
    with trace.recording() as t:
        hierarchical_all_reduce(x, layout=layout, slice_numel=slice_numel)
    rows = t.to_dicts()
    for r in rows:
        r["t0"] -= start
        r["t1"] = None if r["t1"] is None else r["t1"] - start
    return rows


def plot_slices(per_rank: list[list[dict]], title: str = "", ranks: list[int] | None = None):
    """One panel per rank (``ranks`` names them; default 0, 1, ...): a bar per stage of each
    slice, from issue to the wait that ended it."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(per_rank), 1, figsize=(10, 1.2 + 1.1 * len(per_rank)), sharex=True,
                             squeeze=False)
    ranks = list(range(len(per_rank))) if ranks is None else ranks
    for rank, ax, rows in zip(ranks, axes[:, 0], per_rank):
        for r in rows:
            if not r["label"].startswith("slice ") or r["t1"] is None:
                continue
            head, stage = r["label"].split(": ", 1)
            i = int(head.split()[1])
            ax.barh(i, (r["t1"] - r["t0"]) * 1e3, left=r["t0"] * 1e3, height=0.8,
                    color=STAGE_COLOURS.get(stage, "grey"), edgecolor="white", linewidth=0.5)
        ax.set_ylabel(f"rank {rank}\nslice")
        ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STAGE_COLOURS.values()]
    axes[-1, 0].set_xlabel("ms since the call (bar: issued → waited for)")
    fig.suptitle(title, x=0.01, y=0.99, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    fig.legend(handles, list(STAGE_COLOURS), ncol=4, loc="upper left", bbox_to_anchor=(0.01, 0.93),
               fontsize=8, frameon=False)
    return fig
