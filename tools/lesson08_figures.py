"""Lesson 8's figures, each with the record of what it shows, from the benchmarks' JSON.

    .venv/bin/python tools/lesson08_figures.py          # redraw from docs/data/08-sparse-*.json

Nothing is measured here: the JSON records are written on a quiet 16-core host with the
simulated cluster (as root, ~3 min for training with 2 seeds, ~2 min for the sweeps):

    sudo .venv/bin/python -m collectives bench-sparse-train --seeds 5 --publish
    sudo .venv/bin/python -m collectives bench-sparse-train --plan cnn --seeds 5 --publish
    sudo .venv/bin/python -m collectives bench-sparse --cluster --iters 3 \\
        --sweep 0.001,0.01,0.05,0.1,0.25,0.5 --json docs/data/08-sparse-bench.json

and this script draws ``docs/img/08-time-to-accuracy``, ``08-convergence`` (and their
``-cnn`` twins) and ``08-density-sweep`` (SVG and record,
:mod:`collectives.course.benchmarks.sparse_record`), and writes
every row of the ``bench-sparse`` records to ``docs/snippets/bench-sparse-runs.md``.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from collectives.course.benchmarks import sparse_record  # noqa: E402
from collectives.course.benchmarks import sparse_train as sparse_train_bench  # noqa: E402

DATA = ROOT / "docs" / "data"
COMMAND = ".venv/bin/python tools/lesson08_figures.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA), help="folder of the 08-sparse-*.json records")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = parser.parse_args()
    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load = lambda name: json.loads((data / name).read_text()) if (data / name).exists() else None  # noqa: E731
    written = []
    for name in ("08-sparse-train.json", "08-sparse-train-cnn.json"):
        train = load(name)
        if train:                            # summaries from the runs themselves, as bench-sparse-train makes them
            written += sparse_record.train_figures(sparse_train_bench.refresh(train), out, COMMAND)
    bench = load("08-sparse-bench.json")
    if bench:
        written.append(sparse_record.sweep_figure(bench, out, COMMAND, load("08-sparse-loopback.json")))
    runs = {label: rec for label, rec in (("the density sweep", bench),
                                          ("noise against recorded gradients", load("08-sparse-recorded.json")),
                                          ("loopback, no shaping", load("08-sparse-loopback.json"))) if rec}
    if runs:
        snippet = ROOT / "docs" / "snippets" / "bench-sparse-runs.md"
        snippet.write_text(sparse_record.runs_snippet(runs))
        written.append(snippet)
    if not written:
        raise SystemExit(f"no 08-sparse-*.json records in {data}")
    print("wrote " + ", ".join(str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in written))


if __name__ == "__main__":
    main()
