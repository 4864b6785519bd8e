"""Draw the figures of lessons 3 and 4 from real runs, into docs/img/.

    .venv/bin/python tools/draw_lesson_diagrams.py            # the step diagrams (a few seconds)
    .venv/bin/python tools/draw_lesson_diagrams.py --measure  # also the model-vs-measured plot (~1 min)

Every step diagram is drawn from the trace of one real call on a local gloo world
(:func:`collectives.course.plots.traced_call`): who sent which chunk to whom, round by round.
``--measure`` fits α and β with lesson 1's ping-pong and γ from a timed add, sweeps every
lesson 3-4 algorithm with ``python -m collectives bench``'s runner, and plots the α–β
prediction against the measurement; it prints what it measured, for the lesson page.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collectives import cost, launch, plots, timing  # noqa: E402

IMG = ROOT / "docs" / "img"
DPI = plots.DPI   # 2x, readable when the page scales them to its column

# (file, target, ranks, elements, layout, title)
STEP_DIAGRAMS = [
    ("03-naive-ring-steps.png", "collectives.naive_ring:naive_ring_all_reduce", 4, 4096, "circle",
     "naive ring, p = 4: every rank's whole tensor (xk: rank k's input) goes all the way round"),
    ("04-ring-steps.png", "collectives.ring:ring_all_reduce", 4, 4096, "circle",
     "ring all-reduce, p = 4: reduce-scatter then all-gather, one chunk (ck) per message"),
    ("04-recursive-doubling-steps.png", "collectives.topologies:recursive_doubling_all_reduce", 4, 4096,
     "circle", "recursive doubling, p = 4: whole tensors (4,096 elements), partner rank XOR 2^k"),
    ("04-halving-doubling-steps.png", "collectives.topologies:halving_doubling_all_reduce", 4, 4096,
     "circle", "halving-doubling, p = 4: blocks b0-b3 halve, then double back"),
    ("04-halving-doubling-p3-steps.png", "collectives.topologies:halving_doubling_all_reduce", 3, 4096,
     "circle", "halving-doubling, p = 3: rank 0 folds into rank 1, ranks 1 and 2 run p = 2, rank 1 hands back"),
    ("04-tree-steps.png", "collectives.topologies:tree_all_reduce", 7, 4096, "tree",
     "binary tree, p = 7: reduce up, broadcast down; every message is the whole tensor"),
]


def _timeline(target: str, p: int, numel: int, title: str, path: Path) -> None:
    traces = launch.run(plots.traced_call, p, args=(target, numel))
    plots.draw_timeline(traces, title).savefig(path, dpi=DPI)


def draw_steps() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    for name, target, p, numel, layout, title in STEP_DIAGRAMS:
        traces = launch.run(plots.traced_call, p, args=(target, numel))
        plots.draw_steps(traces, title, layout=layout).savefig(IMG / name, dpi=DPI)
        print(f"{IMG / name}: {(IMG / name).stat().st_size // 1024} KiB")
    for name, target, title in [
            ("04-ring-timeline.png", "collectives.ring:ring_all_reduce",
             "ring, p = 4, 4 Mi floats: each step waits for its whole chunk"),
            ("04-pipelined-timeline.png", "collectives.ring:pipelined_ring_all_reduce",
             "pipelined ring (4 pieces), p = 4, 4 Mi floats: pieces in flight while others are added")]:
        _timeline(target, 4, 4 << 20, title, IMG / name)
        print(f"{IMG / name}: {(IMG / name).stat().st_size // 1024} KiB")


ALGOS = ["naive_ring", "ring", "pipelined_ring", "recursive_doubling", "halving_doubling", "tree"]


def _link_in_rank():
    from collectives import p2p
    link, _ = p2p.measure_alpha_beta([8, 1 << 10, 64 << 10, 1 << 20, 4 << 20], iters=10)
    return link, cost.measure_gamma(16 << 20)


def measure(p: int = 4, sizes: str = "1K..4M") -> None:
    from collectives.course import bench

    when = datetime.datetime.now().astimezone().isoformat(timespec="minutes")
    link, gamma = launch.run(_link_in_rank, 2)[0]
    link = cost.AlphaBeta(link.alpha, link.beta, gamma)
    byte_sizes = timing.parse_sizes(sizes)
    rows = bench.run_bench(ALGOS, p, byte_sizes, iters=5, warmup=2, progress=False)
    measured = {a: [r["seconds"] for r in rows if r["algo"] == a] for a in ALGOS}
    measured["gloo"] = [r["seconds"] for r in rows if r["algo"] == "gloo"]
    predicted = {a: [cost.predict(a, s, p, link) for s in byte_sizes] for a in ALGOS}
    fig = plots.plot_times(byte_sizes, {a: measured[a] for a in ALGOS}, predicted,
                           f"{p} gloo ranks, 2-core CPU: measured (median of 5) and α–β–γ model")
    fig.savefig(IMG / "04-model-vs-measured.png", dpi=DPI)
    fig = plots.plot_winners(byte_sizes, {"measured": {a: measured[a] for a in ALGOS}, "model": predicted},
                             f"fastest algorithm at each size, p = {p}")
    fig.savefig(IMG / "04-winners.png", dpi=DPI)
    print(f"measured {when}: α = {link.alpha * 1e6:.0f} µs, 1/β = {link.bandwidth / 1e9:.2f} GB/s, "
          f"1/γ = {1 / gamma / 1e9:.2f} GB/s")
    print("size      " + "  ".join(f"{a:>18}" for a in ALGOS + ["gloo"]))
    for i, s in enumerate(byte_sizes):
        cells = []
        for a in ALGOS + ["gloo"]:
            model = timing.human_seconds(predicted[a][i]) if a in predicted else "-"
            cells.append(f"{timing.human_seconds(measured[a][i]):>9} ({model:>7})")
        print(f"{timing.human_bytes(s):>8}  " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="also measure and plot model vs measured")
    args = parser.parse_args()
    draw_steps()
    if args.measure:
        measure()


if __name__ == "__main__":
    main()
