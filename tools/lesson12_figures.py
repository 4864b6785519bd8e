"""Lesson 12's GPU chart, redrawn from its record: the fastest all-reduce at each size.

    .venv/bin/python tools/lesson12_figures.py          # docs/img/12-bench-gpu.svg from 12-bench-gpu.json

The GPU run (``tools/gpu_lesson12.py``, on a machine with GPUs) writes the record and the chart
together. This draws the chart again from the record alone -- each dtype's measured sweep, the
calls launched from Python -- so that a change to how the chart is drawn needs no GPU: nothing
is measured and the record is left as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectives.course.site import claims, plots  # noqa: E402


def draw(record: dict):
    """The winners chart of a ``12-bench-gpu`` record (the eager calls of each dtype's sweep)."""
    sweeps = [c for c in record["comparisons"] if c["kind"] == "sweep" and c["id"].startswith("measured-")]
    if not sweeps:
        raise ValueError(f"record {record.get('figure')} has no measured sweep")
    sizes = sweeps[0]["sizes"]
    rows = {c["id"].removeprefix("measured-"): {k: v for k, v in c["values"].items() if not k.startswith("graph_")}
            for c in sweeps}
    world = record.get("meta", {}).get("ranks", 2)
    return plots.plot_winners(sizes, rows, names=record.get("names", {}),
                              title=f"{world} GPUs: the fastest all-reduce at each size (each launched from Python)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--img", default=str(claims.IMG), help="folder of 12-bench-gpu.json and its chart")
    args = parser.parse_args(argv)
    source = Path(args.img) / "12-bench-gpu.json"
    if not source.exists():
        print(f"no record {source}: tools/gpu_lesson12.py on a machine with GPUs writes it", file=sys.stderr)
        return 1
    record = json.loads(source.read_text(encoding="utf-8"))
    path = plots.save(draw(record), Path(args.img) / record.get("image", "12-bench-gpu.svg").removesuffix(".svg"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
