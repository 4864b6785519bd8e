"""Lesson 7's figures, and its Measured section from the benchmarks' records.

    .venv/bin/python tools/lesson07_figures.py                  # the two timelines (a local run)
    .venv/bin/python tools/lesson07_figures.py --records build/bench   # the Measured section

Timelines, from real runs on 4 local gloo ranks as 2 machines × 2 (``layout=(2, 2)``):

* ``docs/img/07-timeline.png``: 16 MiB of float32 in 8 slices through the blocking
  pipeline, ranks 0 and 2; each bar runs from the moment a stage of a slice was issued to
  the moment the next stage of that slice waited for it;
* ``docs/img/07-inflight.png``: six buckets handed to the in-flight reducer at once, from its
  own timeline (one row per stage lane, one colour per bucket).

``--records DIR`` reads the ``bench-hier-<suite>.json`` records that ``.venv/bin/python -m collectives
bench-hier <suite>`` wrote there (on the quiet host), copies their figures to
``docs/img/07-bench-<suite>.png`` and writes ``docs/snippets/bench-hier-results.md``: for
each record its command, machine, versions and date, its figure, and the comparisons it
computed -- nothing typed by hand.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from collectives import launch  # noqa: E402
from collectives.course import plots  # noqa: E402

SUITES = ("train", "inflight", "crossover", "machines", "sizes")
RESULTS = ROOT / "docs" / "snippets" / "bench-hier-results.md"


def timelines() -> None:
    from collectives.course.hierarchical_bench import plot_slices, traced_slices
    from collectives.course.hierarchical_inflight_bench import plot_timeline, timeline_in_rank

    numel = 4 << 20
    rows = launch.run(traced_slices, 4, args=((2, 2), numel, numel // 8), timeout=120)
    fig = plot_slices([rows[0], rows[2]], "hierarchical_all_reduce, 16 MiB float32 in 8 slices, "
                      "layout (2, 2): rank 0 (machine 0) and rank 2 (machine 1)", ranks=[0, 2])
    fig.savefig(ROOT / "docs" / "img" / "07-timeline.png", dpi=plots.DPI)
    sizes = [1 << 18, 3 << 16, 1 << 18, 1 << 17, 1 << 18, 5 << 15]
    rows = launch.run(timeline_in_rank, 4, args=((2, 2), sizes, 2 << 20, 1 << 18), timeout=120)[0]
    fig = plot_timeline(rows, "six buckets handed over at once to HierarchicalAllReducer, layout (2, 2), "
                        "4 local gloo ranks: rank 0's lanes")
    fig.savefig(ROOT / "docs" / "img" / "07-inflight.png", dpi=plots.DPI)
    print("wrote docs/img/07-timeline.png and docs/img/07-inflight.png")


def results(folder: Path) -> None:
    """The Measured section from the records in ``folder``."""
    lines = []
    for suite in SUITES:
        path = folder / f"bench-hier-{suite}.json"
        if not path.exists():
            continue
        rec = json.loads(path.read_text())
        machine = rec["machine"]
        lines += [f"**`bench-hier {suite}`**: `{rec['command']}`, {machine['cpu']} ({machine['cores']} cores), "
                  f"torch {rec['versions']['torch']}, {rec['date'][:10]}.", ""]
        if rec.get("figure"):
            image = f"07-bench-{suite}.png"
            shutil.copy(folder / rec["figure"], ROOT / "docs" / "img" / image)
            lines += [f"![bench-hier {suite}](../img/{image})", ""]
        lines += ["| comparison | faster | by |", "|---|---|---|"]
        lines += [f"| {c['what']} | {c['faster']} | {c['by']:.2f}× |" for c in rec.get("comparisons", [])]
        for key, value in (rec.get("crossover") or {}).items():
            lines.append(f"| crossover, {key} | {value} | |")
        lines.append("")
    if not lines:
        raise SystemExit(f"no bench-hier-*.json records in {folder}")
    RESULTS.write_text("\n".join(lines))
    print(f"wrote {RESULTS.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", default="", help="folder of bench-hier-<suite>.json records")
    args = parser.parse_args()
    if args.records:
        results(Path(args.records))
    else:
        timelines()


if __name__ == "__main__":
    main()
