"""Draw lesson 6's figures from real runs: docs/img/06-timeline.png and docs/img/06-sweep.png.

    .venv/bin/python tools/lesson06_figures.py [--steps 12]

Both come from 2 local gloo ranks running the lab's transformer
(``collectives.course.bucketing_bench.LAB_SIZES``): the timeline from ``reducer.stats`` of one step,
the sweep from full training steps at each bucket cap. The figures' numbers are printed too,
with the date and torch version, so a page can quote them.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from collectives import launch, timing  # noqa: E402
from collectives.bucketing.models import plot_timeline  # noqa: E402
from collectives.course.bucketing_bench import LAB_SIZES, sweep_rank, timeline_rank  # noqa: E402

IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
CAPS = [0.02, 0.1, 0.5, 2, 8, 100]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="timed steps per bucket cap")
    parser.add_argument("--device-ms", type=float, default=5.0)
    parser.add_argument("--only", choices=["timeline", "sweep"], default=None, help="draw one figure")
    args = parser.parse_args()
    print(f"{datetime.datetime.now().isoformat(timespec='minutes')}, torch {torch.__version__}, "
          f"2 gloo ranks, {LAB_SIZES}")

    dev = dict(LAB_SIZES, device_ms=args.device_ms)
    if args.only != "sweep":
        timeline(args, dev)
    if args.only != "timeline":
        sweep(args, dev)


def timeline(args, dev) -> None:
    runs = {"CPU": launch.run(timeline_rank, 2, kwargs=dict(batch=1))[0],
            f"{args.device_ms:g} ms device time per layer": launch.run(
                timeline_rank, 2, kwargs=dict(batch=1, sizes=dev))[0]}
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.5))
    for ax, (label, res) in zip(axes, runs.items()):
        plot_timeline(res["stats"], ax=ax, title=f"rank 0, backward with {label}")
        s = res["stats"]
        print(f"timeline [{label}]: end of backward {s['end'] * 1e3:.1f} ms, gradients written "
              f"{s['finished'] * 1e3:.1f} ms; buckets launched at "
              + ", ".join(f"{t * 1e3:.1f}" for t in s["bucket_launched"]) + " ms, done at "
              + ", ".join(f"{t * 1e3:.1f}" for t in s["bucket_done"]) + " ms")
    fig.tight_layout()
    fig.savefig(IMG / "06-timeline.png", dpi=110)
    print("wrote", IMG / "06-timeline.png")


def sweep(args, dev) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=False)
    for ax, (label, sizes) in zip(axes, ((f"{args.device_ms:g} ms device time per layer", dev),
                                         ("CPU only", LAB_SIZES))):
        res = launch.run(sweep_rank, 2, args=(CAPS,), kwargs=dict(sizes=sizes, steps=args.steps))[0]
        med = [timing.median(t) * 1e3 for t in res["times"]]
        q1 = [sorted(t)[len(t) // 4] * 1e3 for t in res["times"]]
        q3 = [sorted(t)[(3 * len(t)) // 4] * 1e3 for t in res["times"]]
        ax.fill_between(res["caps"], q1, q3, alpha=0.2, label="middle half of the steps")
        ax.plot(res["caps"], med, "o-", label=f"median of {args.steps} steps")
        for cap, m, n in zip(res["caps"], med, res["buckets"]):
            ax.annotate(f"{n}", (cap, m), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax.axhline(timing.median(res["compute"]) * 1e3, color="gray", ls=":", label="forward + backward alone")
        ax.set_xscale("log")
        ax.set_xlabel("bucket cap (MiB); numbers: buckets")
        ax.set_ylabel("training step (ms)")
        ax.set_title(label)
        ax.legend(fontsize=8)
        print(f"sweep [{label}]: " + ", ".join(f"{c:g} MiB ({n} buckets) {m:.1f} ms [{a:.1f}, {b:.1f}]"
                                               for c, n, m, a, b in zip(res["caps"], res["buckets"], med, q1, q3))
              + " (median [quartiles])"
              + f"; forward+backward alone {timing.median(res['compute']) * 1e3:.1f} ms, one all-reduce "
              f"of all {res['grad_bytes'] / 2**20:.1f} MiB {timing.median(res['all_reduce']) * 1e3:.1f} ms")
    fig.suptitle(f"Bucket-size sweep: one training step, 2 gloo ranks, torch {torch.__version__}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(IMG / "06-sweep.png", dpi=110)
    print("wrote", IMG / "06-sweep.png")


if __name__ == "__main__":
    main()
