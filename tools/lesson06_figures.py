"""Lesson 6's figures and measured table from real runs, each with the record of what it
shows: docs/img/06-timeline.svg/.json, docs/img/06-sweep.svg/.json, docs/img/06-ddp-bench.json.

    .venv/bin/python tools/lesson06_figures.py [--steps 24]          # ~3 min on 16 cores
    .venv/bin/python tools/lesson06_figures.py --only sweep --steps 4 --out /tmp/fig   # to try it

Both come from 2 local gloo ranks running the lab's transformer
(``collectives.course.benchmarks.bucketing.LAB_SIZES``): the timeline from ``reducer.stats`` of a
typical step, the sweep from full training steps at each bucket cap, once with backward on
the CPU alone and once with ``--device-ms`` of off-CPU time per layer. Panels that compare
share their axes; the records hold the numbers the captions state. The table is
``.venv/bin/python -m collectives bench-ddp``'s comparison (its defaults: the transformer, 2 ranks,
25 MiB buckets, 20 rounds of one step of each variant).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from collectives import launch, plots, timing  # noqa: E402
from collectives.bucketing.models import plot_timeline  # noqa: E402
from collectives.course.benchmarks.bucketing import LAB_SIZES, sweep_rank, timeline_rank  # noqa: E402
from collectives.course.site import claims  # noqa: E402

CAPS = [0.02, 0.1, 0.5, 2, 8, 100]


def _legible(fig) -> None:
    """plot_timeline (lesson 6's own plotting) labels at 7-8 pt: raise them to the site's 9."""
    from matplotlib.text import Text
    for t in fig.findobj(Text):
        if t.get_fontsize() < plots.MIN_FONT_PT:
            t.set_fontsize(plots.MIN_FONT_PT)


def timeline(out: Path, device_ms: float) -> None:
    labels = {"cpu": "backward on the CPU alone", "device": f"{device_ms:g} ms off-CPU time per layer"}
    dev = dict(LAB_SIZES, device_ms=device_ms)
    runs = {"cpu": launch.run(timeline_rank, 2, kwargs=dict(batch=1))[0],
            "device": launch.run(timeline_rank, 2, kwargs=dict(batch=1, sizes=dev))[0]}
    fig = plots._figure(9, 7)
    axes = fig.subplots(2, 1, sharex=True)
    record = claims.Record("06-timeline", names={k: v for k, v in labels.items()},
                           title="Backward against bucket all-reduces, on 2 gloo ranks",
                           meta=claims.environment(ranks=2, sizes=LAB_SIZES, device_ms=device_ms))
    for ax, (key, res) in zip(axes, runs.items()):
        s = res["stats"]
        plot_timeline(s, ax=ax, title=f"rank 0, {labels[key]}")
        inside = sum(1 for done in s["bucket_done"] if done <= s["end"])
        record.fact(key, f"With {labels[key]}: backward ends at {s['end'] * 1e3:.3g} ms, "
                    f"{inside} of {len(s['bucket_done'])} buckets are all-reduced before it ends, "
                    f"and the gradients are written at {s['finished'] * 1e3:.3g} ms.",
                    end_s=s["end"], finished_s=s["finished"], bucket_done_s=s["bucket_done"],
                    bucket_launched_s=s["bucket_launched"], buckets_inside=inside)
    axes[0].set_xlabel("")
    _legible(fig)
    record.caption = ("Blue ticks: gradient hooks; orange bars: a bucket's all-reduce from launch to "
                      "completion; black tick: the bucket became ready; red dashed: backward ends; green "
                      "dotted: .grad holds the averages. " + record.text())
    print(plots.save(fig, out / "06-timeline", record))


def sweep(out: Path, device_ms: float, steps: int) -> None:
    dev = dict(LAB_SIZES, device_ms=device_ms)
    panels = {"device": (f"{device_ms:g} ms off-CPU time per layer", dev),
              "cpu": ("backward on the CPU alone", LAB_SIZES)}
    fig = plots._figure(11, 4.4)
    axes = fig.subplots(1, 2, sharey=True)
    names = {f"cap {c:g}": f"a {c:g} MiB cap" for c in CAPS}
    record = claims.Record("06-sweep", names=names, title="Step time against bucket cap",
                           meta=claims.environment(ranks=2, sizes=LAB_SIZES, device_ms=device_ms, steps=steps))
    for ax, (key, (label, sizes)) in zip(axes, panels.items()):
        res = launch.run(sweep_rank, 2, args=(CAPS,), kwargs=dict(sizes=sizes, steps=steps))[0]
        med = [timing.median(t) for t in res["times"]]
        q1 = [sorted(t)[len(t) // 4] for t in res["times"]]
        q3 = [sorted(t)[(3 * len(t)) // 4] for t in res["times"]]
        ax.fill_between(res["caps"], [q * 1e3 for q in q1], [q * 1e3 for q in q3], alpha=0.2,
                        label="middle half of the steps")
        ax.plot(res["caps"], [m * 1e3 for m in med], "o-", label=f"median of {steps} steps")
        for cap, m, n in zip(res["caps"], med, res["buckets"]):
            ax.annotate(f"{n}", (cap, m * 1e3), textcoords="offset points", xytext=(0, 6), ha="center",
                        fontsize=9)
        compute = timing.median(res["compute"])
        ax.axhline(compute * 1e3, color="gray", ls=":", label="forward + backward alone")
        ax.set_xscale("log")
        ax.set_xlabel("bucket cap (MiB); numbers: buckets")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=9)
        values = {f"cap {c:g}": m for c, m in zip(res["caps"], med)}
        entry = record.times(key, values, where=f"{label}, median step")
        best = entry["order"][0]
        buckets = dict(zip((f"cap {c:g}" for c in res["caps"]), res["buckets"]))
        entry["buckets"] = buckets
        entry["text"] = (f"With {label}: the fastest step ({claims.human(values[best])}) has "
                         f"{buckets[best]} bucket(s); the smallest cap ({buckets['cap ' + format(CAPS[0], 'g')]} "
                         f"buckets) takes {claims.human(values['cap ' + format(CAPS[0], 'g')])} and one bucket "
                         f"{claims.human(values['cap ' + format(CAPS[-1], 'g')])}; forward and backward alone "
                         f"{claims.human(compute)}.")
    axes[0].set_ylabel("training step (ms)")
    fig.suptitle("Bucket-size sweep: one training step of the lab's transformer, 2 gloo ranks", fontsize=11)
    record.caption = ("Numbers above the points: buckets; band: the middle half of the steps. "
                      + record.text())
    print(plots.save(fig, out / "06-sweep", record))


def ddp_table(out: Path, steps: int) -> None:
    import importlib

    from collectives.course.benchmarks import bucketing as bb

    importlib.import_module("torch._dynamo")     # DDP imports it on first use: once, before forking
    model = bb.MODELS["transformer"]
    cfg = dict(world=2, backend="gloo", bucket_cap_mb=25.0, first_bucket_cap_mb=25.0, steps=steps, warmup=3,
               model="transformer", sizes=model["sizes"], batch=model["batch"])
    result = launch.run(bb.run_rank, 2, args=(cfg,), timeout=900)[0]
    keys = {"bucketed reducer": "reducer", "torch DDP": "ddp", "per-gradient after backward": "per_gradient"}
    names = {"reducer": "the bucketed reducer", "ddp": "torch DDP",
             "per_gradient": "one all-reduce per gradient after backward"}
    values = {keys[v]: timing.median(result["times"][v]) for v in bb.VARIANTS}
    paired = bb.paired_ratios(result["times"])
    record = claims.Record("06-ddp-bench", names=names, aliases={"reducer": ["buckets", "bucketing"],
                                                                 "per_gradient": ["per-gradient"]},
                           title="One training step three ways",
                           meta=claims.environment(ranks=2, config=cfg,
                                                   command_equivalent=".venv/bin/python -m collectives bench-ddp"))
    where = (f"one training step of a transformer ({result['tensors']} tensors, "
             f"{timing.human_bytes(result['grad_bytes'])} of gradients), 2 gloo ranks, median of {steps} rounds")
    record.times("step", values, where=where)
    record.fact("paired", f"Within a round: the reducer took {paired['reducer / torch DDP']:.3f}× torch DDP's "
                f"time (median of the rounds), and one all-reduce per gradient "
                f"{paired['per-gradient / reducer']:.2f}× the reducer's.", paired=paired,
                max_param_diff=result["diff"])
    record.table = {"head": ["variant", "median step", "× the reducer"],
                    "rows": [[names[k], claims.human(v), f"{v / values['reducer']:.2f}×"] for k, v in values.items()]}
    record.caption = record.text()
    print(record.save(out / "06-ddp-bench"))
    print(record.caption)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="timed steps per bucket cap")
    parser.add_argument("--device-ms", type=float, default=5.0)
    parser.add_argument("--only", choices=["timeline", "sweep", "ddp"], default=None, help="make one of them")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "timeline"):
        timeline(args.out, args.device_ms)
    if args.only in (None, "sweep"):
        sweep(args.out, args.device_ms, args.steps)
    if args.only in (None, "ddp"):
        ddp_table(args.out, 20 if args.steps >= 20 else args.steps)


if __name__ == "__main__":
    main()
