"""The charts that open the benchmarks page, drawn from the tables recorded on it.

    .venv/bin/python tools/bench_charts.py      # writes docs/img/bench-ratio-*.svg and their records

Reads the markdown tables the benchmark runs were recorded in (docs/snippets/bench-ring.md
for CPU, docs/snippets/bench-gpu-sweep.md for GPUs) and draws each algorithm's ratio to the
library's ``dist.all_reduce`` against the tensor size: the figures are the recorded ones,
nothing is measured here. Each chart's record (:mod:`collectives.course.site.claims`) carries the
recorded run's device, versions, date and command (:data:`RUNS`) and the fastest algorithm at
each size, which the page's caption states. Rerun after recording a new run, and update
:data:`RUNS` with it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collectives import timing  # noqa: E402
from collectives.course.site import claims, plots  # noqa: E402

IMG = ROOT / "docs" / "img"
# Where each recorded table came from, as its snippet says.
RUNS = {
    "cpu": {"command": ".venv/bin/python -m collectives bench", "date": "2026-11-22T07:37+00:00",
            "device": "2-core x86_64 host (AMD EPYC), 4 gloo ranks sharing it", "torch": "2.13.0+cpu",
            "backend": "gloo", "source": "docs/snippets/bench-ring.md"},
    "gpu": {"command": ".venv/bin/python -m collectives bench --backend nccl --world 4 --registered-memory "
                       "--sizes 64M,256M --algo naive_ring,ring,pipelined_ring,multi_ring,recursive_doubling,"
                       "halving_doubling,tree --iters 10 --warmup 3",
            "date": "2026-11-22", "device": "4x NVIDIA H200, NVLink (NV18 between every pair)",
            "torch": "2.11.0+cu130", "nccl": "2.28.9", "backend": "nccl",
            "source": "docs/snippets/bench-gpu-sweep.md"},
}


def tables(text: str) -> list[list[list[str]]]:
    """Every pipe table in ``text``: a list of rows, each a list of cell texts."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def ratio(cell: str) -> float | None:
    cell = cell.replace("**", "")          # bold: the best of a column
    if cell.endswith("*"):                  # a footnote marks a run another job disturbed
        return None
    m = re.search(r"([\d.]+)×", cell)
    return float(m.group(1)) if m else None


def cpu_ratios() -> tuple[list[int], dict[str, list[float | None]]]:
    text = (ROOT / "docs" / "snippets" / "bench-ring.md").read_text(encoding="utf-8")
    table = next(t for t in tables(text) if t[0][0] == "size" and len(t[0]) >= 8)
    head, rows = table[0], table[1:]
    sizes = [timing.parse_size(r[0].replace(" ", "")) for r in rows]
    return sizes, {name: [ratio(r[i]) for r in rows] for i, name in enumerate(head) if i >= 2}


def gpu_ratios() -> tuple[list[int], dict[str, list[float | None]]]:
    text = (ROOT / "docs" / "snippets" / "bench-gpu-sweep.md").read_text(encoding="utf-8")
    table = next(t for t in tables(text) if t[0][0] == "algorithm" and "64 MiB" in t[0])
    sizes = [timing.parse_size(h.replace(" ", "")) for h in table[0][1:]]
    return sizes, {r[0]: [ratio(c) for c in r[1:]] for r in table[1:] if "NCCL" not in r[0]}


def draw(sizes, ratios, title, path: Path, run: dict, library: str) -> None:
    fig = plots._figure(8.5, 4.2)
    ax = fig.subplots()
    for i, (name, values) in enumerate(ratios.items()):
        points = [(s, v) for s, v in zip(sizes, values) if v is not None]
        ax.plot([s for s, _ in points], [v for _, v in points], "o-", color=f"C{i % 10}",
                ms=4, lw=1.5, label=name)
    ax.axhline(1.0, color="black", lw=1.2, ls="--", label="the library (= 1)")
    plots._size_axis(ax, sizes)
    ax.set_yscale("log", base=2)
    ax.set_yticks([0.125, 0.25, 0.5, 1, 2, 4], ["0.125×", "0.25×", "0.5×", "1×", "2×", "4×"])
    ax.set_xlabel("tensor size")
    ax.set_ylabel("library time / algorithm time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title, fontsize=11)
    names = {name: name for name in ratios} | {"library": library}
    aliases = {"library": ["the library", "dist.all_reduce", library.split("'")[0].lower()]}
    record = claims.Record(path.stem, names=names, aliases=aliases, meta=dict(run),
                           title=title)
    # times relative to the library's: 1 / ratio (lower is faster), the library itself 1
    relative = {name: [1 / v if v else float("inf") for v in values] for name, values in ratios.items()}
    relative["library"] = [1.0] * len(sizes)
    record.sweep("relative time", sizes, relative, label="recorded")
    record.caption = (f"Each algorithm's speed as a fraction of the library's ({library}) on the same "
                      "tensor in the same world: above 1 is faster. " + record.text())
    print(plots.save(fig, path, record).relative_to(ROOT))


def main() -> None:
    draw(*cpu_ratios(), "CPU: 4 gloo ranks on 2 cores, against gloo's all_reduce",
         IMG / "bench-ratio-cpu", RUNS["cpu"], "gloo's all_reduce")
    draw(*gpu_ratios(), "GPU: 4 H200s, registered memory, against NCCL's all_reduce",
         IMG / "bench-ratio-gpu", RUNS["gpu"], "NCCL's all_reduce")


if __name__ == "__main__":
    main()
