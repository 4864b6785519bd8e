"""``.venv/bin/python -m collectives bench-hier``: lesson 7 measured on the simulated cluster.

::

    .venv/bin/python -m collectives bench-hier                       # sizes: 2 machines x 2 ranks, 1 Gbit/s, 64 MiB
    .venv/bin/python -m collectives bench-hier sizes --rails         # one link per local rank
    .venv/bin/python -m collectives bench-hier inflight              # Fairring's benchmark: 16 buckets, 1-8 in flight
    .venv/bin/python -m collectives bench-hier host-cost             # the host's Python per bucket and per slice
    .venv/bin/python -m collectives bench-hier train                 # a DDP step: hierarchical hook against DDP's own
    .venv/bin/python -m collectives bench-hier crossover             # where the flat ring wins: small messages
    .venv/bin/python -m collectives bench-hier machines              # M = 2, 4 with D = 1, 2 against the model
    .venv/bin/python -m collectives bench-hier <suite> --quick       # small and fast (a minute or two on 2 cores)
    .venv/bin/python -m collectives bench-hier <suite> --impl exercise   # your lessons/07_hierarchical/exercise.py

Each run makes a :class:`~collectives.core.cluster.Cluster` (needs root and iproute2),
starts a world on it (the layout comes from the environment each rank gets, as under
torchrun), checks every algorithm against ``dist.all_reduce`` before timing it, and writes
``build/bench/bench-hier-<suite>.json`` and ``.png`` (``--out DIR``): machine, versions,
date, command, the rows, and the comparisons the figure shows
(:mod:`~collectives.course.benchmarks.hierarchical_record`). Times are medians of ``--iters`` runs,
each the slowest rank's. The model beside each row is
:func:`collectives.hierarchical.cost.predict_tiered`: every message its α, the link's
rate as ``tc`` counts it, gloo's loopback inside.

The suites ``inflight`` and ``train`` are in :mod:`.hierarchical_inflight_bench` and
:mod:`.hierarchical_train_bench`.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.distributed as dist

from ...core import cost, launch, netns, timing, trace
from ...hierarchical import cost as hcost
from .. import verify
from . import hierarchical_record as record

# The queue of each shaped link, as tc's tbf ``latency``: how long a packet may wait. With
# the cluster's default 10 ms (1.25 MB at 1 Gbit/s) two TCP flows sharing a link lose
# packets and back off: 64 MiB as two flows of 32 MiB took 1.02 s where one flow took
# 0.63-0.77 s (2026-11-23). 50 ms lets them share it: 0.58-0.59 s both ways. A hierarchy
# without rails sends D flows over each link at once, so it is measured with 50 ms.
QUEUE = "50ms"
EXERCISE = "lessons/07_hierarchical/exercise.py"

ALGORITHMS = {   # name -> (target, cost model, slices: "one" or "plan", exercise function or None)
    "flat ring": ("collectives.ring:ring_all_reduce", "flat_ring", "one", None),
    "dist.all_reduce": (None, "flat_ring", "one", None),
    "rail ring": ("collectives.hierarchical:rail_ring_all_reduce", "rail_ring", "one", None),
    "root-based": ("collectives.hierarchical:root_based_all_reduce", "root_based", "one", "root_based_all_reduce"),
    "rail all-reduce": ("collectives.hierarchical:rail_all_reduce", "rail_all_reduce", "one", "rail_all_reduce"),
    "hierarchical, one slice": ("collectives.hierarchical:one_slice_all_reduce", "hierarchical", "one",
                                "one_slice_all_reduce"),
    "hierarchical, pipelined": ("collectives.hierarchical:hierarchical_all_reduce", "hierarchical", "plan",
                                "hierarchical_all_reduce"),
    "hierarchical, library inside": ("collectives.course.benchmarks.hierarchical:library_inside_all_reduce",
                                     "hierarchical", "plan", None),
}


def library_inside_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, layout=None) -> None:
    """The pipelined hierarchy with the inside stages as the library's reduce-scatter and
    all-gather (NCCL's way) instead of messages: what the page's choice on gloo is measured by."""
    from collectives.hierarchical import hierarchical_all_reduce

    hierarchical_all_reduce(tensor, op, group, layout, inside="collectives")


def target_of(name: str, impl: str = "reference") -> str | None:
    """What ``name`` runs: the course's function, or under ``--impl exercise`` the student's
    (the flat baselines stay the course's)."""
    target, _, _, student = ALGORITHMS[name]
    if impl == "exercise" and student is not None:
        return f"{EXERCISE}:{student}"
    return target


def _fn(target):
    if target is None:
        return lambda x: dist.all_reduce(x)
    from ..impl import resolve
    return resolve(target)


def why_not_timed(report: verify.Report) -> str:
    """One line: "not written yet (Lesson 7, task 4: ...)", or the first case that differed."""
    import re

    text = report.summary(2)
    stub = re.search(r"Lesson \d+, task \d+: \w+", text)
    if stub:
        return f"not written yet ({stub.group(0)})"
    lines = text.splitlines()
    return lines[1].strip() if len(lines) > 1 else text


def _bench_in_rank(sizes: list[int], iters: int, names: list[str], impl: str = "reference") -> dict:
    from collectives.hierarchical import resolve as layout_of
    layout = layout_of()
    out = {"layout": (layout.D, layout.M), "rows": []}
    check = [verify.Case(n) for n in (0, 1, 7, 1001)] + [verify.Case(1001, torch.int64, dist.ReduceOp.MAX)]
    for name in names:
        target = target_of(name, impl)
        report = verify.check_all_reduce(_fn(target), check) if target else verify.Report()
        for nbytes in sizes:
            if not report.ok:          # not written yet, or wrong: nothing to time
                out["rows"].append(dict(name=name, nbytes=nbytes, verified=False, detail=why_not_timed(report),
                                        seconds=float("nan"), times=[], calls=0))
                continue
            x = torch.randn(nbytes // 4) * 1e-10        # times 4 each call: stays finite
            fn = _fn(target)
            with trace.recording() as t:
                fn(x)
            times = timing.measure(lambda: fn(x), warmup=1, iters=iters)
            out["rows"].append(dict(name=name, nbytes=nbytes, verified=report.ok,
                                    detail="" if report.ok else report.summary(2),
                                    seconds=timing.median(times), times=times, calls=len(t.events)))
    return out


def model_tiers(link: str, rails: bool) -> hcost.Tiers:
    """What the model assumes on the simulated cluster: gloo's loopback inside, the shaped
    link's rate across (α 100 µs)."""
    rate = netns.rate_bytes_per_second(link)
    return hcost.Tiers(hcost.DEFAULT_TIERS.inside, cost.AlphaBeta(100e-6, 1 / rate), rails=rails)


def predicted(name: str, nbytes: int, D: int, M: int, tiers: hcost.Tiers) -> float:
    _, model, slices, _ = ALGORITHMS[name]
    s = 1 if slices == "one" else max(1, round(nbytes / hcost.best_slice_bytes(nbytes, D, M, tiers)))
    return hcost.predict_tiered(model, nbytes, D, M, tiers, slices=s)


def run_bench(sizes: list[int], machines: int = 2, ranks_per_machine: int = 2, link: str = "1gbit",
              rails: bool = False, iters: int = 3, names: list[str] | None = None,
              latency: str = QUEUE, impl: str = "reference") -> dict:
    """Run the benchmark on a fresh cluster; return rank 0's results with the model beside them."""
    from ...core.cluster import Cluster

    names = names or list(ALGORITHMS)
    p = machines * ranks_per_machine
    with Cluster(machines, ranks_per_machine, link=link, rails=rails, latency=latency) as made:
        result = launch.run(_bench_in_rank, p, args=(sizes, iters, names, impl), cluster=made,
                            timeout=120 + 60 * iters * len(sizes) * len(names))[0]
    tiers = model_tiers(link, rails)
    D, M = result["layout"]
    for row in result["rows"]:
        row["model_seconds"] = predicted(row["name"], row["nbytes"], D, M, tiers)
    result.update(machines=machines, ranks_per_machine=ranks_per_machine, link=link, rails=rails, latency=latency,
                  impl=impl, iters=iters)
    return result


def render(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    D, M = result["layout"]
    title = (f"hierarchical all-reduce, {M} machines × {D} ranks, {result['link']} "
             f"{'per rail' if result['rails'] else 'per machine'} (queue {result['latency']}), "
             f"float32 (torch {torch.__version__})")
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
                  "(above 1: this one is faster). model: collectives.hierarchical.cost.predict_tiered.")
    for name, detail in dict.fromkeys((r["name"], r["detail"]) for r in result["rows"] if not r["verified"]):
        console.print(f"[red]{name} not timed[/]: {detail}")


# ---- the suites built on run_bench ---------------------------------------------------------

def _comparisons(rows: list[dict], label: str, against=("dist.all_reduce", "flat ring", "rail ring")) -> list[dict]:
    by = {(r["name"], r["nbytes"]): r for r in rows if r["verified"]}
    out = []
    for (name, nbytes), r in by.items():
        if not name.startswith("hierarchical"):
            continue
        for other in against:
            if (other, nbytes) in by:
                out.append(record.compare(f"{label}, {timing.human_bytes(nbytes)}, {name} vs {other}",
                                          name, r["seconds"], other, by[(other, nbytes)]["seconds"]))
    return out


def crossover(rows: list[dict], ours: str, theirs: str) -> int | None:
    """The smallest measured size from which ``ours`` is faster than ``theirs`` at every
    larger measured size (None: never; the smallest size: everywhere)."""
    by = {(r["name"], r["nbytes"]): r["seconds"] for r in rows if r["verified"]}
    sizes = sorted({r["nbytes"] for r in rows if (ours, r["nbytes"]) in by and (theirs, r["nbytes"]) in by})
    winning = None
    for n in reversed(sizes):
        if by[(ours, n)] < by[(theirs, n)]:
            winning = n
        else:
            break
    return winning


def _plot_sizes(panels: list[tuple[str, dict]], title: str):
    """One panel per cluster setting, shared axes: time against size, measured (solid) and
    the model (dotted), one colour per algorithm."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), sharex=True, sharey=True,
                             squeeze=False)
    names = sorted({r["name"] for _, res in panels for r in res["rows"]})
    for ax, (label, res) in zip(axes[0], panels):
        for i, name in enumerate(names):
            rows = sorted((r for r in res["rows"] if r["name"] == name), key=lambda r: r["nbytes"])
            if not rows:
                continue
            ax.plot([r["nbytes"] for r in rows], [r["seconds"] for r in rows], "o-", color=f"C{i}", label=name)
            ax.plot([r["nbytes"] for r in rows], [r["model_seconds"] for r in rows], ":", color=f"C{i}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("bytes per all-reduce")
    axes[0, 0].set_ylabel("seconds (dotted: model)")
    axes[0, -1].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def suite_sizes(args, argv) -> dict:
    sizes = [1 << 20] if args.quick else timing.parse_sizes(args.sizes)
    names = [n for n in ALGORITHMS if n in args.only] or list(ALGORITHMS)   # names hold commas themselves
    iters = 2 if args.quick else args.iters
    res = run_bench(sizes, args.machines, args.ranks_per_machine, args.link, args.rails, iters, names,
                    args.latency, args.impl)
    render(res)
    label = f"{args.machines} x {args.ranks_per_machine}, {args.link} {'per rail' if args.rails else 'per machine'}"
    result = {"runs": [res], "comparisons": _comparisons(res["rows"], label)}
    return result, _plot_sizes([(label, res)], f"bench-hier sizes ({'quick' if args.quick else 'full'})")


CROSSOVER_SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20]


def suite_crossover(args, argv) -> dict:
    """Where the hierarchy loses to the flat algorithms: small messages, on one link and on rails."""
    sizes = [64 << 10, 1 << 20, 4 << 20] if args.quick else CROSSOVER_SIZES
    names = ["flat ring", "dist.all_reduce", "rail ring", "hierarchical, pipelined"]
    iters = 2 if args.quick else args.iters
    panels, result = [], {"runs": [], "comparisons": [], "crossover": {}}
    for rails in (False, True):
        res = run_bench(sizes, 2, 2, args.link, rails, iters, names, args.latency, args.impl)
        render(res)
        label = f"2 x 2, {args.link} {'per rail' if rails else 'per machine'}"
        panels.append((label, res))
        result["runs"].append(res)
        result["comparisons"] += _comparisons(res["rows"], label)
        for other in ("dist.all_reduce", "flat ring", "rail ring"):
            n = crossover(res["rows"], "hierarchical, pipelined", other)
            result["crossover"][f"{label}: hierarchical, pipelined vs {other}"] = (
                "never faster" if n is None else f"faster from {timing.human_bytes(n)} up (measured sizes)")
    return result, _plot_sizes(panels, "bench-hier crossover: the hierarchy against flat rings, by size")


MACHINE_LAYOUTS = [(1, 2), (2, 2), (1, 4), (2, 4)]     # (D, M)


def suite_machines(args, argv) -> dict:
    """More machines: M = 2, 4 with D = 1, 2, the hierarchy and the flat all-reduce against the
    per-message model."""
    layouts = [(1, 2), (1, 4)] if args.quick else MACHINE_LAYOUTS
    sizes = [1 << 20] if args.quick else [256 << 10, 16 << 20]
    names = ["dist.all_reduce", "hierarchical, pipelined"]
    iters = 2 if args.quick else args.iters
    result = {"runs": [], "comparisons": [], "rows": []}
    for D, M in layouts:
        res = run_bench(sizes, M, D, args.link, False, iters, names, args.latency, args.impl)
        render(res)
        result["runs"].append(res)
        for r in res["rows"]:
            result["rows"].append(dict(D=D, M=M, **{k: r[k] for k in ("name", "nbytes", "seconds", "model_seconds")},
                                       model_error=r["seconds"] / r["model_seconds"] - 1))
        result["comparisons"] += _comparisons(res["rows"], f"{M} machines x {D}", against=("dist.all_reduce",))
    return result, _plot_machines(result["rows"], sizes)


def _plot_machines(rows: list[dict], sizes: list[int]):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), sharey=False, squeeze=False)
    for ax, nbytes in zip(axes[0], sizes):
        layouts = sorted({(r["M"], r["D"]) for r in rows})
        xs = range(len(layouts))
        for i, name in enumerate(("dist.all_reduce", "hierarchical, pipelined")):
            got = {(r["M"], r["D"]): r for r in rows if r["name"] == name and r["nbytes"] == nbytes}
            ax.plot(xs, [got[k]["seconds"] if k in got else float("nan") for k in layouts], "o-", color=f"C{i}",
                    label=name)
            ax.plot(xs, [got[k]["model_seconds"] if k in got else float("nan") for k in layouts], ":",
                    color=f"C{i}")
        ax.set_xticks(list(xs), [f"M={m}\nD={d}" for m, d in layouts])
        ax.set_title(f"{timing.human_bytes(nbytes)}, one link per machine", fontsize=9)
        ax.set_ylabel("seconds (dotted: model)")
    axes[0, -1].legend(fontsize=7)
    fig.suptitle("bench-hier machines: more machines, against the per-message model", fontsize=10)
    fig.tight_layout()
    return fig


SUITES = {"sizes": suite_sizes, "crossover": suite_crossover, "machines": suite_machines,
          "inflight": "collectives.course.benchmarks.hierarchical_inflight:suite",
          "train": "collectives.course.benchmarks.hierarchical_train:suite",
          "host-cost": "collectives.course.benchmarks.hierarchical_hostcost:suite"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    suite = argv[0] if argv and not argv[0].startswith("-") else "sizes"
    rest = argv[1:] if argv and argv[0] == suite else argv
    if suite not in SUITES:
        print(f"unknown suite {suite!r}; one of: {', '.join(SUITES)}")
        return 2
    parser = argparse.ArgumentParser(prog=f".venv/bin/python -m collectives bench-hier {suite}",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few runs: a minute or two on 2 cores")
    parser.add_argument("--impl", choices=("reference", "exercise"), default="reference",
                        help="time the course's functions or yours (lessons/07_hierarchical/exercise.py)")
    parser.add_argument("--out", default="", help="folder for the JSON and the figure (default build/bench)")
    parser.add_argument("--iters", type=int, default=5, help="timed runs (median)")
    parser.add_argument("--link", default="1gbit", help="rate of each cross-machine link (tc syntax)")
    parser.add_argument("--latency", default=QUEUE,
                        help=f"queue of each link, tc tbf latency (default {QUEUE}; the cluster's own: 100ms)")
    parser.add_argument("--sizes", default="64M", help="sizes suite: bytes per all-reduce, e.g. 1M,16M,64M")
    parser.add_argument("--machines", type=int, default=2, help="sizes suite")
    parser.add_argument("--ranks-per-machine", type=int, default=2, help="sizes suite")
    parser.add_argument("--rails", action="store_true", help="sizes suite: one link per local rank")
    parser.add_argument("--only", default="", help='sizes suite: algorithm names, e.g. "flat ring, rail ring"')
    parser.add_argument("--model", default="mlp", help="train suite: mlp (communication-heavy) or transformer")
    args = parser.parse_args(rest)
    run = SUITES[suite]
    if isinstance(run, str):
        from ..impl import resolve
        run = resolve(run)
    result, figure = run(args, rest)
    path = record.write(suite, rest, result, figure, args.out or None)
    record.print_comparisons(result)
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    rows = [r for run_ in result.get("runs", []) for r in run_.get("rows", [])] + result.get("checked", [])
    return 0 if all(r.get("verified", True) for r in rows) else 1


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
    x = torch.randn(max(nbytes // 4, 1), device=verify.rank_device())
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


# ---- for the lab: a real trace of slices in flight, drawn stage by stage -----------------

STAGE_COLOURS = {"reduce-scatter": "tab:blue", "collect": "tab:orange", "diffuse": "tab:green",
                 "all-gather": "tab:purple"}


def traced_slices(layout: tuple[int, int], numel: int, slice_numel: int, rounds: int = 2,
                  target: str = "collectives.hierarchical:hierarchical_all_reduce") -> list[dict]:
    """On every rank: the trace of ``hierarchical_all_reduce`` (the last of ``rounds`` calls,
    so the groups exist already), as dicts, times relative to the call's start. ``target``:
    whose (a lab's ``lab.target("hierarchical_all_reduce")``: the student's under "exercise")."""
    import time

    from ..impl import resolve

    hierarchical_all_reduce = resolve(target)
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
