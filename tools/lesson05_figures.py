"""Lesson 5's figure and measured table, with the records of what they show:
docs/img/05-double-buffering.svg/.json and docs/img/05-fused-bench.json.

    .venv/bin/python tools/lesson05_figures.py                 # ~1 min on 16 cores
    .venv/bin/python tools/lesson05_figures.py --quick --out /tmp/fig

The plain reducer of the lesson (:class:`collectives.fused.FusedAllReducer`) all-reduces
1000 float32 tensors of 1000 elements through 1 MiB buffers (four flushes) on 4 local gloo
ranks, with one buffer (SINGA's order) and with two (double buffering). Drawn: rank 0's
trace of one call of each, the flushes' all-reduces from issue to landing, on one time
axis. Recorded: the median of interleaved timed calls of each, which the caption states.
The table: ``.venv/bin/python -m collectives bench-fused``'s cases (its defaults: 1000 tensors of 1000
float32 on 4 ranks, 40 runs in 4 interleaved rounds), each against one flat all-reduce of
the same bytes.
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

from collectives import launch, plots, timing  # noqa: E402
from collectives.course.site import claims  # noqa: E402

NAMES = {"one_buffer": "one buffer", "two_buffers": "two buffers"}
ALIASES = {"two_buffers": ["double buffering", "double-buffering", "double-buffered", "the overlap", "overlap"],
           "one_buffer": ["a single buffer", "SINGA's order"]}


def _flushes(count: int, numel: int, buffer_bytes: int, iters: int) -> dict:
    """On every rank: one traced call with each setting, then ``iters`` rounds timing one
    call of each in turn."""
    import torch

    from collectives.course.benchmarks.fused import traced_reducer_call
    from collectives.fused import FusedAllReducer

    tensors = [torch.randn(numel) for _ in range(count)]
    reducers = {double: FusedAllReducer(count * numel * 4 + 1, buffer_bytes, double_buffer=double)
                for double in (False, True)}
    drawn = {double: traced_reducer_call(reducer, tensors) for double, reducer in reducers.items()}
    times = {double: [] for double in reducers}
    for _ in range(iters):
        for double, reducer in reducers.items():
            times[double] += timing.measure(lambda r=reducer: (r.all_reduce(tensors), r.wait()),
                                            warmup=0, iters=1)
    return {"drawn": drawn, "times": times}


def draw(out: Path, count: int, numel: int, buffer_bytes: int, iters: int) -> None:
    result = launch.run(_flushes, 4, args=(count, numel, buffer_bytes, iters), timeout=900)[0]
    medians = {"one_buffer": statistics.median(result["times"][False]),
               "two_buffers": statistics.median(result["times"][True])}
    fig = plots._figure(8.5, 4.2)
    axes = fig.subplots(2, 1, sharex=True)
    for ax, double in zip(axes, (False, True)):
        spans, total = result["drawn"][double]
        for k, (t0, t1) in enumerate(spans):
            ax.barh(k, (t1 - t0) * 1e3, left=t0 * 1e3, color="#3f51b5" if k % 2 == 0 else "#ff7043")
        ax.axvline(total * 1e3, color="black", lw=1, ls="--")
        ax.set_yticks(range(len(spans)), [f"flush {k}" for k in range(len(spans))], fontsize=9)
        ax.set_ylim(len(spans) - 0.5, -0.5)
        ax.set_title(("two buffers: flush k+1 is issued before flush k lands" if double else
                      "one buffer (SINGA's order): each flush lands before the next is packed")
                     + f"; this call {total * 1e3:.3g} ms", fontsize=10, loc="left")
    axes[1].set_xlabel("ms since all_reduce() was called (bar: issued → landed; dashed: wait() done)")
    fig.suptitle(f"rank 0's trace of one call: {count} float32 tensors of {numel} elements, "
                 f"{timing.human_bytes(buffer_bytes)} buffers, 4 gloo ranks", fontsize=11)
    where = (f"{count} float32 tensors of {numel} elements through {timing.human_bytes(buffer_bytes)} "
             f"buffers on 4 gloo ranks, median of {iters} timed calls each")
    record = claims.Record("05-double-buffering", names=NAMES, aliases=ALIASES,
                           title="The flushes' all-reduces in rank 0's trace, one buffer and two",
                           meta=claims.environment(ranks=4, count=count, numel=numel,
                                                   buffer_bytes=buffer_bytes, iters=iters))
    record.times("timed", medians, baseline="one_buffer", where=where)
    record.caption = ("Each bar runs from the moment a flush's all-reduce was issued to the moment it "
                      "landed; flush k+2 reuses flush k's buffer and waits for it. " + record.text("timed"))
    print(plots.save(fig, out / "05-double-buffering", record))
    print(record.caption)


BENCH_CASES = {"separate calls": "one all-reduce per tensor", "flat all_reduce": "one flat all-reduce",
               "flat + 2 copies": "the copy floor", "fused": "the fused all-reducer",
               "fused, bound": "the fused all-reducer after bind()"}


def bench_table(out: Path, count: int, numel: int, iters: int) -> None:
    from collectives.course.benchmarks import fused as fused_bench

    rows = launch.run(fused_bench.bench, 4, args=(count, numel, 1 << 20, iters, 2), timeout=900)[0]
    by_case = {r["case"]: r for r in rows}
    values = {case: by_case[case]["seconds"] for case in BENCH_CASES if case in by_case}
    record = claims.Record("05-fused-bench", names=BENCH_CASES,
                           aliases={"fused": ["fusion", "the fused call"], "fused, bound": ["bind()"]},
                           title="The fused all-reducer against its alternatives",
                           meta=claims.environment(ranks=4, count=count, numel=numel, iters=iters,
                                                   command_equivalent=".venv/bin/python -m collectives bench-fused"))
    where = f"{count} float32 tensors of {numel} elements on 4 gloo ranks, median of {iters} runs"
    record.times("fusion", {k: values[k] for k in ("separate calls", "fused")}, where=where)
    copies = record.times("copies", {k: values[k] for k in ("flat all_reduce", "flat + 2 copies", "fused",
                                                             "fused, bound")}, baseline="flat all_reduce")
    copies["text"] = ("As multiples of one flat all-reduce of the same bytes: " + ", ".join(
        f"{BENCH_CASES[k]} {values[k] / values['flat all_reduce']:.2f}×"
        for k in ("flat + 2 copies", "fused", "fused, bound")) + ".")
    record.table = {"head": ["case", "time (median)", "× one flat all-reduce"],
                    "rows": [[BENCH_CASES[c], claims.human(values[c]), f"{values[c] / values['flat all_reduce']:.2f}×"]
                             for c in BENCH_CASES if c in values]}
    record.caption = record.text()
    print(record.save(out / "05-fused-bench"))
    print(record.caption)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--iters", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--quick", action="store_true", help="a small run to try the script")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        draw(args.out, 200, 1000, 256 << 10, 3)
        bench_table(args.out, 200, 1000, 4)
    else:
        draw(args.out, 1000, 1000, 1 << 20, args.iters)
        bench_table(args.out, 1000, 1000, 40)


if __name__ == "__main__":
    main()
