"""Lesson 4's figures, each with the record of what it shows, into docs/img/.

    sudo .venv/bin/python tools/lesson04_figures.py                  # everything (~4 min on 16 cores)
    .venv/bin/python tools/lesson04_figures.py --only steps          # the step diagrams (no root)
    .venv/bin/python tools/lesson04_figures.py --only pipelining     # ring against pipelined ring (no root)
    sudo .venv/bin/python tools/lesson04_figures.py --only sweep     # predicted against measured
    sudo .venv/bin/python tools/lesson04_figures.py --quick --out /tmp/fig   # a small run, to try it

Every image goes with a record (``NAME.json``, :mod:`collectives.course.site.claims`) of what
it shows, which the page's caption is generated from:

* **steps** -- one real call of each algorithm on a local gloo world, drawn from its trace,
  one panel per step as the code labels it (a swap is never split over two panels); the
  record holds the messages and bytes each rank sent against the cost model.
* **pipelining** -- the ring and the pipelined ring on 4 local ranks, 4 Mi float32: one
  traced call of each on one time axis, and the median of interleaved timed runs.
* **sweep** -- every algorithm of the lesson from 1 KiB to 64 MiB on the simulated
  cluster (``--machines`` machines of one rank, every link shaped to ``--link``, default
  1 Gbit/s: slow enough that α/β falls inside the sweep), measured with the runner of
  ``.venv/bin/python -m collectives bench`` against the α–β–γ model fitted on the same link: α from
  the one-way time of the smallest messages, β from the slope between 1 and 4 MiB (the
  link's token bucket lets the first 256 KiB through at once, which a least-squares line
  through every size would read as a smaller α), γ from a timed add. Needs root and
  iproute2, as the cluster does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from collectives import cost, launch, plots, timing  # noqa: E402
from collectives.course.site import claims  # noqa: E402

ALGOS = ["naive_ring", "ring", "pipelined_ring", "recursive_doubling", "halving_doubling", "tree"]
NAMES = {"naive_ring": "the naive ring", "ring": "the ring", "pipelined_ring": "the pipelined ring",
         "recursive_doubling": "recursive doubling", "halving_doubling": "halving-doubling",
         "tree": "the tree", "gloo": "gloo's all_reduce"}
ALIASES = {"pipelined_ring": ["pipelining", "pipelined"], "ring": ["plain ring"],
           "tree": ["binary tree"], "gloo": ["the library", "dist.all_reduce"]}

# (record, target, ranks, elements, layout, panels, title)
STEP_DIAGRAMS = [
    ("04-ring-steps", "collectives.ring:ring_all_reduce", 4, 4096, "circle", "labels",
     "ring all-reduce, p = 4: reduce-scatter, then all-gather; one chunk (ck) per message"),
    ("04-recursive-doubling-steps", "collectives.topologies:recursive_doubling_all_reduce", 4, 4096,
     "circle", "labels", "recursive doubling, p = 4: whole tensors, partner rank XOR 2^k"),
    ("04-halving-doubling-steps", "collectives.topologies:halving_doubling_all_reduce", 4, 4096,
     "circle", "labels", "halving-doubling, p = 4: blocks b0-b3 halve, then double back"),
    ("04-halving-doubling-p3-steps", "collectives.topologies:halving_doubling_all_reduce", 3, 4096,
     "circle", "labels", "halving-doubling, p = 3: rank 0 folds in, ranks 1 and 2 swap, rank 1 hands back"),
    ("04-tree-steps", "collectives.topologies:tree_all_reduce", 7, 4096, "tree", "rounds",
     "binary tree, p = 7: reduce up, broadcast down; every message is the whole tensor"),
]


def _model_name(target: str) -> str:
    return target.split(":")[1].removesuffix("_all_reduce")


def draw_steps(out: Path) -> None:
    from collectives import trace

    for name, target, p, numel, layout, panels, title in STEP_DIAGRAMS:
        rows = launch.run(plots.traced_call, p, args=(target, numel))
        traces = [trace.Trace.from_dicts(r, events) for r, events in enumerate(rows)]
        fig = plots.draw_steps(traces, title, layout=layout, panels=panels)
        model = cost.cost(_model_name(target), numel * 4, p)
        sent = [t.bytes_sent() for t in traces]
        messages = [len(t.sends()) for t in traces]
        record = claims.Record(name, names=NAMES, title=title, alt=title)
        record.fact("messages", f"{p} ranks, {numel:,} float32 elements ({numel * 4:,} bytes): the busiest "
                    f"rank sent {max(messages)} messages and {max(sent):,} bytes; the cost model counts "
                    f"{model.steps} messages on the critical path and {model.bytes_per_rank:,.0f} bytes "
                    "per rank.", messages=messages, bytes=sent, model_steps=model.steps,
                    model_bytes=model.bytes_per_rank)
        record.caption = f"Drawn from the trace of one call. {record.text('messages')}"
        print(plots.save(fig, out / name, record))


def _timed_pair(targets: list[str], numel: int, iters: int) -> dict:
    """Runs on every rank: a traced call of each target, then ``iters`` rounds of one timed
    call of each, in turn, so that a slow spell hits them alike."""
    import torch
    import torch.distributed as dist

    from collectives import trace
    from collectives.course.impl import resolve

    fns = [resolve(t) for t in targets]
    x = torch.ones(numel)
    drawn = []
    for fn in fns:
        fn(x)                                   # warm-up: connections, memory
        dist.barrier()
        with trace.recording() as t:
            fn(x)
        drawn.append(t.to_dicts())
    times = [[] for _ in fns]
    for _ in range(iters):
        for i, fn in enumerate(fns):
            times[i] += timing.measure(lambda fn=fn: fn(x), warmup=0, iters=1)
    return {"drawn": drawn, "times": times}


def draw_pipelining(out: Path, numel: int = 4 << 20, iters: int = 9) -> None:
    targets = ["collectives.ring:ring_all_reduce", "collectives.ring:pipelined_ring_all_reduce"]
    keys = ["ring", "pipelined_ring"]
    runs = launch.run(_timed_pair, 4, args=(targets, numel, iters), timeout=600)
    medians = {k: statistics.median(runs[0]["times"][i]) for i, k in enumerate(keys)}
    fig = plots.draw_timelines(
        {"ring": [r["drawn"][0] for r in runs], "pipelined ring, 4 pieces": [r["drawn"][1] for r in runs]},
        f"one call of each, {numel >> 20} Mi float32 per rank, 4 gloo ranks")
    where = f"{numel >> 20} Mi float32 on 4 gloo ranks, median of {iters} timed calls each"
    record = claims.Record("04-pipelining", names=NAMES, aliases=ALIASES,
                           title="The ring and the pipelined ring, one call each on one time axis",
                           meta=claims.environment(ranks=4, numel=numel, iters=iters))
    record.times("timed", medians, baseline="ring", where=where)
    record.caption = ("Bars: each message from posting to completion, from the trace of one call; "
                      "dashed: the last message done. " + record.text("timed"))
    print(plots.save(fig, out / "04-pipelining", record))


def _sweep_rank(names: list[str], sizes: list[int], iters: int, warmup: int, fit_iters: int) -> dict:
    """Runs on every rank of the cluster: fit α, β (ranks 0 and 1, on different machines),
    γ, then the benchmark runner over ``sizes``."""
    import torch
    import torch.distributed as dist

    from collectives import p2p
    from collectives.course.benchmarks import allreduce as bench

    small, large = [8, 64, 512], [1 << 20, 2 << 20, 4 << 20]
    p2p.ping_pong(8, iters=3)                                    # connection set-up, not timed
    one_way = []
    for nbytes in small + large:
        trips = p2p.ping_pong(nbytes, iters=fit_iters)
        one_way.append(statistics.median(trips) / 2 if trips else 0.0)
    shared = torch.tensor(one_way + [cost.measure_gamma(4 << 20)], dtype=torch.float64)
    dist.broadcast(shared, 0)
    one_way, gamma = shared[:-1].tolist(), shared[-1].item()
    alpha = statistics.median(one_way[:len(small)])
    beta = (one_way[-1] - one_way[len(small)]) / (large[-1] - large[0])
    rows = bench._bench_rank(names, sizes, "float32", warmup, iters, {}, True, None)
    return {"alpha": alpha, "beta": beta, "gamma": gamma, "one_way": dict(zip(small + large, one_way)),
            "rows": rows}


def draw_sweep(out: Path, machines: int, link: str, sizes: list[int], iters: int, warmup: int) -> None:
    p = machines
    result = launch.run(_sweep_rank, p, args=(ALGOS, sizes, iters, warmup, 15), machines=machines,
                        link=link, timeout=1800)[0]
    fit = cost.AlphaBeta(result["alpha"], result["beta"], result["gamma"])
    rows = result["rows"]
    bad = [r["algo"] for r in rows if r["ok"] is False]
    if bad:
        raise SystemExit(f"results differ from dist.all_reduce: {sorted(set(bad))}")
    measured = {a: [r["seconds"] for r in rows if r["algo"] == a] for a in ALGOS + ["gloo"]}
    model = {a: [cost.predict(a, s, p, fit) for s in sizes] for a in ALGOS}
    where = (f"{machines} simulated machines of one gloo rank, every link {link}; median of {iters}, "
             "each run the slowest rank's")
    meta = claims.environment(ranks=p, machines=machines, link=link, iters=iters, warmup=warmup,
                              alpha_s=fit.alpha, beta_s_per_byte=fit.beta, gamma_s_per_byte=fit.gamma,
                              fit="α: median one-way time of 8-512 B; β: slope from 1 to 4 MiB; γ: a timed add",
                              one_way=result["one_way"])
    record = claims.Record("04-model-vs-measured", names=NAMES, aliases=ALIASES, meta=meta,
                           title=f"Every algorithm, measured and predicted, {timing.human_bytes(sizes[0])} "
                                 f"to {timing.human_bytes(sizes[-1])}, {p} ranks over {link} links")
    record.sweep("measured", sizes, {a: measured[a] for a in ALGOS}, label="measured")
    record.sweep("model", sizes, model, label="the α–β–γ model")
    record.crossover("model-crossover", sizes, "recursive_doubling", "ring", model, label="the model",
                     at=_model_crossover(p, fit, sizes))
    record.crossover("measured-crossover", sizes, "recursive_doubling", "ring",
                     {"recursive_doubling": measured["recursive_doubling"], "ring": measured["ring"]},
                     label="measured")
    ratio_alpha_beta = fit.alpha / fit.beta
    record.fact("alpha-over-beta", f"The fit on this link: α = {claims.human(fit.alpha)}, 1/β = "
                f"{fit.bandwidth / 1e6:.0f} MB/s, so α/β = {timing.human_bytes(ratio_alpha_beta)}; "
                f"1/γ = {1 / fit.gamma / 1e9:.1f} GB/s.", alpha_over_beta=ratio_alpha_beta)
    record.caption = (f"{where}. Solid: measured; dashed: the model. "
                      + record.text("alpha-over-beta", "measured", "model", "model-crossover", "measured-crossover"))
    head = ["size"] + [NAMES[a].removeprefix("the ") for a in ALGOS] + ["gloo"]
    record.table = {"head": head, "rows": [
        [timing.human_bytes(s)] + [f"{claims.human(measured[a][i])} ({claims.human(model[a][i])})" for a in ALGOS]
        + [claims.human(measured["gloo"][i])] for i, s in enumerate(sizes)]}
    fig = plots.plot_times(sizes, {a: measured[a] for a in ALGOS}, model,
                           f"{p} ranks, one per simulated machine, {link} links: measured and α–β–γ model")
    print(plots.save(fig, out / "04-model-vs-measured", record))
    winners = plots.plot_winners(sizes, {"measured": {a: measured[a] for a in ALGOS}, "model": model},
                                 f"the fastest algorithm at each size, p = {p}, {link} links", names=NAMES)
    strip = claims.Record("04-winners", names=NAMES, aliases=ALIASES, meta=meta,
                          title="The fastest algorithm at each size, measured and predicted")
    strip.sweep("measured", sizes, {a: measured[a] for a in ALGOS}, label="measured")
    strip.sweep("model", sizes, model, label="the model")
    print(plots.save(winners, out / "04-winners", strip))
    print(record.caption)
    naive = claims.Record("03-naive-ring-measured", names=NAMES, aliases=ALIASES, meta=meta,
                          title="The naive ring against the ring and gloo's all_reduce")
    three = {a: measured[a] for a in ("naive_ring", "ring", "gloo")}
    naive.sweep("measured", sizes, three, label=f"measured on {p} ranks over {link} links")
    naive.table = {"head": ["size", "gloo's all_reduce", "naive ring", "ring", "naive ring ÷ gloo"],
                   "rows": [[timing.human_bytes(s), claims.human(three["gloo"][i]),
                             claims.human(three["naive_ring"][i]), claims.human(three["ring"][i]),
                             f"{three['naive_ring'][i] / three['gloo'][i]:.2f}×"] for i, s in enumerate(sizes)]}
    naive.caption = naive.text()
    print(naive.save(out / "03-naive-ring-measured"))


def _model_crossover(p: int, fit: cost.AlphaBeta, sizes: list[int]) -> float | None:
    """Where the model's ring overtakes its recursive doubling: bisection on the size."""
    def gap(n):
        return cost.predict("ring", n, p, fit) - cost.predict("recursive_doubling", n, p, fit)
    lo, hi = float(sizes[0]), float(sizes[-1])
    if gap(lo) <= 0 or gap(hi) >= 0:
        return None
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    return hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["steps", "pipelining", "sweep"], action="append",
                        help="draw only these (repeatable); default: all three")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--machines", type=int, default=4, help="simulated machines, one rank each (default 4)")
    parser.add_argument("--link", default="1gbit", help="every link's rate (default 1gbit)")
    parser.add_argument("--sizes", default="1K..64M", help="sweep sizes (default 1K..64M, powers of 4)")
    parser.add_argument("--iters", type=int, default=5, help="timed rounds per size (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="a small run to try the script: sizes 1K..1M, 2 rounds, 1 Mi floats")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    parts = args.only or ["steps", "pipelining", "sweep"]
    if "steps" in parts:
        draw_steps(args.out)
    if "pipelining" in parts:
        draw_pipelining(args.out, numel=(1 << 20) if args.quick else (4 << 20), iters=3 if args.quick else 9)
    if "sweep" in parts:
        sizes = timing.parse_sizes("1K..1M" if args.quick else args.sizes)
        draw_sweep(args.out, args.machines, args.link, sizes, 2 if args.quick else args.iters, 1)


if __name__ == "__main__":
    main()
