"""``.venv/bin/python -m collectives bench-hier inflight``: Fairring's own benchmark on the simulated cluster.

::

    .venv/bin/python -m collectives bench-hier inflight     # 16 buckets of 4 MiB, 2 x 2 at 1 Gbit/s, one link and rails
    .venv/bin/python -m collectives bench-hier inflight --quick    # 8 buckets of 1 MiB, 1 and 4 in flight

Fairring's benchmark hands many buckets to the all-reduce and keeps a few of them in flight.
Here: 16 buckets of 4 MiB of float32, with 1, 2, 4 and 8 in flight (a call is made as soon
as fewer than k are outstanding; the oldest is waited for first), through
:class:`~collectives.hierarchical.HierarchicalAllReducer` -- and against DDP's default, one
``dist.all_reduce`` per bucket (issued asynchronously and waited for at the end, as DDP's
``allreduce_hook`` does: the process group runs them one after the other). A round is all
16 buckets; its time is the slowest rank's, the median of ``--iters`` rounds, the variants
taken in turn within each round. The model is
:func:`collectives.hierarchical.cost.predict_buckets`: one bucket at a time fills and drains
its pipeline every time; with two or more in flight the slices of all buckets flow as one.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ...core import launch, timing, trace
from ...hierarchical import cost as hcost
from . import hierarchical_record as record
from .hierarchical import EXERCISE, QUEUE, model_tiers

FLAT = "dist.all_reduce per bucket (DDP's default)"
MEMORY = 64 << 20


def _call(impl: str):
    """``call(tensor) -> handle``: the course's reducer, or the student's task 5."""
    if impl == "exercise":
        from ..impl import resolve
        fn = resolve(f"{EXERCISE}:hierarchical_all_reduce_async")
        return functools.partial(fn, memory_bytes=MEMORY)
    from collectives.hierarchical import HierarchicalAllReducer
    return HierarchicalAllReducer(memory_bytes=MEMORY).all_reduce


def _rank(buckets: int, bucket_bytes: int, in_flight: list[int], iters: int, impl: str) -> dict:
    from collectives.hierarchical import resolve as layout_of

    trace.uninstall()                # a plain program: no per-call tracing
    layout = layout_of()
    call = _call(impl)
    rank = dist.get_rank()
    # checked first, on integer-valued data: every variant must give dist.all_reduce's values
    check = [torch.randint(-8, 9, (bucket_bytes // 4 + 3,), generator=torch.Generator().manual_seed(rank + b)).float()
             for b in range(4)]
    want = [t.clone() for t in check]
    for t in want:
        dist.all_reduce(t)
    try:
        handles = [call(t) for t in check]
        for h in handles:
            h.wait()
    except NotImplementedError as exc:     # the exercise's task 5, not written yet
        return dict(layout=(layout.D, layout.M), verified=False, times={}, detail=f"not written yet: {exc}")
    verified = all(torch.equal(a, b) for a, b in zip(check, want))
    if not verified:
        return dict(layout=(layout.D, layout.M), verified=False, times={}, detail="values differ from dist.all_reduce")
    data = [torch.randn(bucket_bytes // 4) * 1e-10 for _ in range(buckets)]   # x4 a round: stays finite

    def flat():
        works = [dist.all_reduce(t, async_op=True) for t in data]
        for w in works:
            w.wait()

    def hierarchical(k: int):
        window = []
        for t in data:
            if len(window) == k:
                window.pop(0).wait()
            window.append(call(t))
        for h in window:
            h.wait()

    variants = {FLAT: flat} | {f"hierarchical, {k} in flight": functools.partial(hierarchical, k) for k in in_flight}
    for run in variants.values():          # warm-up: groups, slots, plans, connections
        run()
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(iters):                 # one round of each variant, starting point rotated
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name] += timing.measure(variants[name], warmup=0, iters=1)
    return dict(layout=(layout.D, layout.M), verified=verified, times=times)


def run(link: str, rails: bool, buckets: int, bucket_bytes: int, in_flight: list[int], iters: int,
        impl: str = "reference", latency: str = QUEUE) -> dict:
    from ...core.cluster import Cluster

    with Cluster(2, 2, link=link, rails=rails, latency=latency) as made:
        out = launch.run(_rank, 4, args=(buckets, bucket_bytes, in_flight, iters, impl), cluster=made,
                         timeout=180 + 30 * iters * (len(in_flight) + 1))[0]
    D, M = out["layout"]
    if not out["verified"]:
        print(f"not timed: {out['detail']}")
        return dict(link=link, rails=rails, layout=out["layout"], buckets=buckets, bucket_bytes=bucket_bytes,
                    rows=[dict(name="hierarchical", verified=False, detail=out["detail"], seconds=float("nan"),
                               model_seconds=float("nan"), in_flight=0, times=[])])
    tiers = model_tiers(link, rails)
    slices = max(1, round(bucket_bytes / hcost.best_slice_bytes(bucket_bytes, D, M, tiers)))
    rows = []
    for name, xs in out["times"].items():
        k = 1 if name == FLAT else int(name.split(", ")[1].split()[0])
        model = hcost.predict_buckets("flat_ring" if name == FLAT else "hierarchical", bucket_bytes, buckets, k,
                                      D, M, tiers, slices=1 if name == FLAT else slices)
        rows.append(dict(name=name, in_flight=k, seconds=timing.median(xs), times=xs, model_seconds=model,
                         verified=out["verified"]))
    return dict(link=link, rails=rails, layout=out["layout"], buckets=buckets, bucket_bytes=bucket_bytes,
                slices_per_bucket=slices, rows=rows)


def suite(args, argv):
    buckets, bucket_bytes = (8, 1 << 20) if args.quick else (16, 4 << 20)
    in_flight = [1, 4] if args.quick else [1, 2, 4, 8]
    iters = 2 if args.quick else args.iters
    result = {"runs": [], "comparisons": [], "config": dict(buckets=buckets, bucket_bytes=bucket_bytes,
                                                            in_flight=in_flight, iters=iters, impl=args.impl,
                                                            memory_bytes=MEMORY, queue=args.latency)}
    for rails in (False, True):
        res = run(args.link, rails, buckets, bucket_bytes, in_flight, iters, args.impl, args.latency)
        result["runs"].append(res)
        label = f"2 x 2, {args.link} {'per rail' if rails else 'per machine'}"
        by = {r["name"]: r for r in res["rows"]}
        if FLAT not in by:                  # not verified: nothing was timed
            continue
        for r in res["rows"]:
            print(f"{label}: {r['name']:44s} {timing.human_seconds(r['seconds']):>10s}  "
                  f"model {timing.human_seconds(r['model_seconds'])}")
        one = by["hierarchical, 1 in flight"]
        for r in res["rows"]:
            if r["name"].startswith("hierarchical"):
                result["comparisons"].append(record.compare(f"{label}, {r['name']} vs {FLAT}",
                                                            r["name"], r["seconds"], FLAT, by[FLAT]["seconds"]))
                if r is not one:
                    result["comparisons"].append(record.compare(f"{label}, {r['name']} vs one at a time",
                                                                r["name"], r["seconds"], one["name"], one["seconds"]))
    result["rows"] = [dict(r, link="rails" if run_["rails"] else "one link") for run_ in result["runs"]
                      for r in run_["rows"]]
    return result, _plot(result, buckets, bucket_bytes)


def _plot(result: dict, buckets: int, bucket_bytes: int):
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.8), sharey=True, squeeze=False)
    for ax, res in zip(axes[0], runs):
        if not all(r["verified"] for r in res["rows"]):
            ax.set_title("not verified: not timed", fontsize=9)
            continue
        names = [r["name"] for r in res["rows"]]
        xs = range(len(names))
        ax.bar(xs, [r["seconds"] for r in res["rows"]], color=["grey"] + ["C0"] * (len(names) - 1))
        ax.plot(xs, [r["model_seconds"] for r in res["rows"]], "k_", ms=18, mew=2, label="model")
        ax.set_xticks(list(xs), ["dist.all_reduce\n(DDP default)" if n == FLAT else n.split(", ")[1].replace(
            " in flight", "\nin flight") for n in names], fontsize=8)
        ax.set_title(f"{'rails' if res['rails'] else 'one link per machine'}: {buckets} x "
                     f"{timing.human_bytes(bucket_bytes)}, 2 x 2 at {res['link']}", fontsize=9)
    axes[0, 0].set_ylabel("seconds for all buckets")
    axes[0, -1].legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---- for the lab: buckets in flight, drawn from the reducer's own timeline -------------------

def timeline_in_rank(layout: tuple[int, int], sizes: list[int], memory_bytes: int, slice_bytes: int) -> list[dict]:
    """Hand ``len(sizes)`` buckets to a recording reducer at once; return its timeline
    (times relative to the first call)."""
    import time

    from collectives.hierarchical import HierarchicalAllReducer

    reducer = HierarchicalAllReducer(layout=layout, memory_bytes=memory_bytes, slice_bytes=slice_bytes, record=True)
    buckets = [torch.randn(n) for n in sizes]
    reducer.all_reduce(torch.ones(8)).wait()        # groups made, threads started
    reducer.timeline.clear()
    dist.barrier()
    start = time.perf_counter()
    handles = [reducer.all_reduce(b) for b in buckets]
    for h in handles:
        h.wait()
    reducer.close()
    return [dict(r, issued=r["issued"] - start, done=r["done"] - start) for r in reducer.timeline]


STAGE_COLOURS = {"reduce-scatter": "tab:blue", "collect": "tab:orange", "add": "tab:red", "diffuse": "tab:green",
                 "all-gather": "tab:purple"}


def plot_timeline(rows: list[dict], title: str = ""):
    """One row per stage lane; a bar per slice of a bucket, from the moment its lane started
    the stage to the moment the stage's messages were in (or its add done), coloured by bucket."""
    import matplotlib.pyplot as plt

    stages = list(STAGE_COLOURS)
    fig, ax = plt.subplots(figsize=(10, 2.8))
    first = min((r["bucket"] for r in rows), default=0)
    for r in rows:
        y = stages.index(r["stage"])
        ax.barh(y, (r["done"] - r["issued"]) * 1e3, left=r["issued"] * 1e3, height=0.7,
                color=f"C{(r['bucket'] - first) % 10}", edgecolor="white", linewidth=0.4)
    buckets = sorted({r["bucket"] - first for r in rows})
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=f"C{b % 10}") for b in buckets], [f"bucket {b}" for b in buckets],
              ncol=len(buckets), fontsize=7, loc="lower right", frameon=False, bbox_to_anchor=(1, 1.0))
    ax.set_yticks(range(len(stages)), stages)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first bucket was handed over (bar: the lane starts the stage -> the next "
                  "lane has what it waits for)")
    fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    fig.tight_layout()
    return fig


# ---- the tour's row ---------------------------------------------------------------------------

def tour_runner(nbytes: int) -> dict:
    """The tour's row: ``nbytes`` as four buckets handed to the in-flight reducer at once on a
    local world pretending to be 2 machines (1 when p is odd), verified, the bytes of the
    traced buckets counted, timed against one ``dist.all_reduce`` per bucket."""
    from collectives import verify
    from collectives.hierarchical import HierarchicalAllReducer, tier_bytes

    p = dist.get_world_size()
    layout = (p // 2, 2) if p % 2 == 0 else (p, 1)
    reducer = HierarchicalAllReducer(layout=layout)
    fn = functools.partial(_wait_for, reducer)
    cases = [c for c in verify.default_cases(p, quick=True, large=False) if c.group is None]
    report = verify.check_all_reduce(fn, cases)
    buckets = [torch.randn(max(nbytes // 16, 1), device=verify.rank_device()) for _ in range(4)]
    with trace.recording() as t:
        for h in [reducer.all_reduce(b) for b in buckets]:
            h.wait()
    sent = sum(v for k, v in tier_bytes(t.events, reducer.groups, p).items() if k in ("inside", "across"))

    def ours():
        for h in [reducer.all_reduce(b) for b in buckets]:
            h.wait()

    def flat():
        for w in [dist.all_reduce(b, async_op=True) for b in buckets]:
            w.wait()
    mine, ref = timing.measure(ours), timing.measure(flat)
    D, M = layout
    theory = 4 * sum(s.bytes_per_rank for s in hcost.tiered("hierarchical", buckets[0].numel() * 4, D, M))
    reducer.close()
    bad = report.failures
    return dict(verified=report.ok, detail="" if report.ok else f"{bad[0].case}: {bad[0].detail}",
                seconds=timing.median(mine), ref_seconds=timing.median(ref), nbytes=4 * buckets[0].numel() * 4,
                bytes_sent=sent, bytes_theory=theory, baseline="dist.all_reduce per bucket")


def _wait_for(reducer, tensor, op=dist.ReduceOp.SUM, group=None):
    reducer.all_reduce(tensor, op).wait()
