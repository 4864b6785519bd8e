"""Lessons 1-3's figures from real runs, each with the record of what it shows, into docs/img/.

    .venv/bin/python tools/draw_lesson_diagrams.py              # the diagrams of lessons 2 and 3 (seconds)
    .venv/bin/python tools/draw_lesson_diagrams.py --measure    # also lesson 1's ping-pong (~30 s)

* **02-message-matrices**: the bytes each rank sent to each other rank in one call of every
  hand-built collective of lesson 2 (8 gloo ranks, root 0, 1 KiB per piece), from the trace.
* **03-naive-ring-steps**: one call of the naive ring on 4 ranks, drawn from its trace.
* **01-ping-pong** (``--measure``): one-way time against message size by lesson 1's
  ping-pong on 2 gloo ranks, with the α + n·β fit; the record holds the fit and the table.
* **02-broadcast** (``--measure``, a record without an image): linear against binomial-tree
  broadcast on 4 and 8 ranks at 4 KiB and 4 MiB, median of 7 interleaved runs, beside the
  α–β model fitted by a ping-pong in the same world.

Lesson 4's figures are drawn by ``tools/lesson04_figures.py``. Every image goes with a record
(``NAME.json``, :mod:`collectives.course.site.claims`) that the page's caption comes from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from collectives import cost, launch, plots, timing  # noqa: E402
from collectives.course.site import claims  # noqa: E402

COLLECTIVES = ["broadcast", "tree_broadcast", "reduce", "scatter", "gather", "all_gather"]


def _traced_collectives(numel: int) -> dict:
    """Runs on every rank: one call of each hand-built collective, root 0, recorded."""
    import torch
    import torch.distributed as dist

    from collectives import basics, trace

    rank, p = dist.get_rank(), dist.get_world_size()
    calls = {
        "broadcast": lambda: basics.broadcast(torch.ones(numel), 0),
        "tree_broadcast": lambda: basics.tree_broadcast(torch.ones(numel), 0),
        "reduce": lambda: basics.reduce(torch.ones(numel), 0),
        "scatter": lambda: basics.scatter(torch.ones(numel), [torch.ones(numel)] * p if rank == 0 else None, 0),
        "gather": lambda: basics.gather(torch.ones(numel), [torch.ones(numel) for _ in range(p)]
                                        if rank == 0 else None, 0),
        "all_gather": lambda: basics.all_gather([torch.ones(numel) for _ in range(p)], torch.ones(numel)),
    }
    out = {}
    for name, call in calls.items():
        with trace.recording() as t:
            call()
        out[name] = t.to_dicts()
    return out


def draw_matrices(out: Path, p: int = 8, numel: int = 256) -> None:
    from collectives import trace

    per_rank = launch.run(_traced_collectives, p, args=(numel,), timeout=300)
    fig = plots._figure(10, 7)
    axes = fig.subplots(2, 3, sharex=True, sharey=True)
    record = claims.Record("02-message-matrices", names={c: c for c in COLLECTIVES},
                           title=f"Who sends to whom: bytes from each rank (row) to each rank (column), "
                                 f"each hand-built collective on {p} ranks, root 0")
    counts = {}
    for ax, name in zip(axes.flat, COLLECTIVES):
        matrix = [[0] * p for _ in range(p)]
        for rank in range(p):
            for e in trace.Trace.from_dicts(rank, per_rank[rank][name]).sends():
                matrix[rank][e.peer] += e.nbytes
        messages = sum(1 for row in matrix for b in row if b)
        root_sent = sum(1 for b in matrix[0] if b)
        counts[name] = {"messages": messages, "root_sends": root_sent,
                        "root_receives": sum(1 for r in range(p) if matrix[r][0])}
        ax.imshow(matrix, cmap="Blues", vmin=0)
        ax.set_title(f"{name}: {messages} messages", fontsize=10)
        ax.set_xticks(range(p))
        ax.set_yticks(range(p))
    for ax in axes[-1]:
        ax.set_xlabel("to rank")
    for ax in axes[:, 0]:
        ax.set_ylabel("from rank")
    text = "; ".join(f"{n} {c['messages']} messages (the root sends {c['root_sends']}, receives "
                     f"{c['root_receives']})" for n, c in counts.items())
    record.fact("messages", f"{p} ranks, root 0, {numel * 4} bytes per piece: {text}.", counts=counts)
    record.caption = "Drawn from the trace of one call of each. " + record.text()
    print(plots.save(fig, out / "02-message-matrices", record))


def draw_naive_ring(out: Path) -> None:
    from collectives import trace

    title = "naive ring, p = 4: every rank's whole tensor (xk: rank k's input) goes all the way round"
    rows = launch.run(plots.traced_call, 4, args=("collectives.naive_ring:naive_ring_all_reduce", 4096))
    traces = [trace.Trace.from_dicts(r, events) for r, events in enumerate(rows)]
    fig = plots.draw_steps(traces, title, panels="labels")
    model = cost.cost("naive_ring", 4096 * 4, 4)
    record = claims.Record("03-naive-ring-steps", names={"naive_ring": "the naive ring"}, title=title)
    record.fact("messages", f"4 ranks, 4,096 float32 elements: every rank sent "
                f"{len(traces[0].sends())} messages and {traces[0].bytes_sent():,} bytes; the cost model "
                f"counts {model.steps} messages and {model.bytes_per_rank:,.0f} bytes per rank.",
                bytes=[t.bytes_sent() for t in traces])
    record.caption = "Drawn from the trace of one call. " + record.text()
    print(plots.save(fig, out / "03-naive-ring-steps", record))


def _ping_pong(sizes: list[int], iters: int):
    from collectives import p2p
    return p2p.measure_alpha_beta(sizes, iters)


def draw_ping_pong(out: Path, iters: int = 20) -> None:
    sizes = [8, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
    link, table = launch.run(_ping_pong, 2, args=(sizes, iters))[0]
    measured = [row["one_way"] for row in table]
    fig = plots.plot_times(sizes, {"one message": measured},
                           {"one message": [link.message(s) for s in sizes]},
                           "lesson 1's ping-pong on 2 gloo ranks: one-way time and the α + n·β fit")
    record = claims.Record("01-ping-pong", names={"one_message": "one message"},
                           title="One-way time against message size, measured by ping-pong, with the "
                                 "α + n·β fit", meta=claims.environment(ranks=2, iters=iters))
    small = [t for s, t in zip(sizes, measured) if s <= 256 << 10]
    record.fact("fit", f"The fit: α = {claims.human(link.alpha)}, 1/β = {link.bandwidth / 1e9:.2f} GB/s, so "
                f"α/β = {timing.human_bytes(link.alpha / link.beta)}. Messages of 8 B to 256 KiB took "
                f"{claims.human(min(small))} to {claims.human(max(small))} one way; 16 MiB took "
                f"{claims.human(measured[-1])}.", alpha_s=link.alpha, beta_s_per_byte=link.beta,
                one_way_s=dict(zip(map(str, sizes), measured)))
    record.caption = f"Half the median of {iters} round trips at each size. " + record.text()
    record.table = {"head": ["size", "one way"],
                    "rows": [[timing.human_bytes(s), claims.human(t)] for s, t in zip(sizes, measured)]
                    + [["fit", f"α = {claims.human(link.alpha)}, 1/β = {link.bandwidth / 1e9:.2f} GB/s"]]}
    print(plots.save(fig, out / "01-ping-pong", record))


def _broadcasts(sizes: list[int], iters: int) -> dict:
    """Runs on every rank: fit α, β (ranks 0 and 1), then time both broadcasts at each size."""
    import torch

    from collectives import basics, p2p

    link, _ = p2p.measure_alpha_beta([8, 1 << 10, 64 << 10, 1 << 20, 4 << 20], 10)
    out = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        runs = {"linear": lambda: basics.broadcast(x, 0), "tree": lambda: basics.tree_broadcast(x, 0)}
        times = {k: [] for k in runs}
        for fn in runs.values():
            fn()
        for _ in range(iters):
            for k, fn in runs.items():
                times[k] += timing.measure(fn, warmup=0, iters=1)
        out[nbytes] = {k: timing.median(v) for k, v in times.items()}
    return {"alpha": link.alpha, "beta": link.beta, "times": out}


def measure_broadcasts(out: Path, iters: int = 7) -> None:
    from collectives import basics

    sizes = [4 << 10, 4 << 20]
    names = {"linear": "the linear broadcast", "tree": "the tree broadcast"}
    record = claims.Record("02-broadcast", names=names, aliases={"tree": ["the tree", "binomial tree"],
                                                                 "linear": ["the linear one"]},
                           title="Linear against binomial-tree broadcast",
                           meta=claims.environment(iters=iters))
    rows = []
    for p in (4, 8):
        res = launch.run(_broadcasts, p, args=(sizes, iters), timeout=600)[0]
        link = cost.AlphaBeta(res["alpha"], res["beta"])
        for nbytes in sizes:
            t = res["times"][nbytes]
            model = {k: basics.broadcast_cost(nbytes, p, tree=(k == "tree")).seconds(link) for k in t}
            record.times(f"p{p} {nbytes}", t, where=f"{p} ranks, {timing.human_bytes(nbytes)}")
            rows.append([str(p), timing.human_bytes(nbytes), claims.human(t["linear"]), claims.human(t["tree"]),
                         claims.human(model["linear"]), claims.human(model["tree"])])
    record.table = {"head": ["ranks", "size", "linear", "tree", "model: linear", "model: tree"], "rows": rows}
    wins = sum(1 for c in record.comparisons if c["order"][0] == "tree")
    record.fact("tally", f"The tree broadcast was the faster in {wins} of {len(record.comparisons)} cases.",
                tree_wins=wins)
    record.caption = record.text("tally")
    print(record.save(out / "02-broadcast"))
    print(record.caption)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="also measure lesson 1's ping-pong")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    draw_matrices(args.out)
    draw_naive_ring(args.out)
    if args.measure:
        draw_ping_pong(args.out)
        measure_broadcasts(args.out)


if __name__ == "__main__":
    main()
