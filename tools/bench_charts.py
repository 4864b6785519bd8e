"""The charts that open the benchmarks page, drawn from the tables recorded on it.

    .venv/bin/python tools/bench_charts.py      # writes docs/img/bench-*.png

Reads the markdown tables the benchmark runs were recorded in (docs/snippets/bench-ring.md
for CPU, the registered-memory sweep in docs/benchmarks.md for GPUs) and draws each
algorithm's ratio to the library's ``dist.all_reduce`` against the tensor size: the
figures are the recorded ones, nothing is measured here. Rerun after recording a new run.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collectives import timing  # noqa: E402
from collectives.course import plots  # noqa: E402

IMG = ROOT / "docs" / "img"


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
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    table = next(t for t in tables(text) if t[0][0] == "algorithm" and "64 MiB" in t[0])
    sizes = [timing.parse_size(h.replace(" ", "")) for h in table[0][1:]]
    return sizes, {r[0]: [ratio(c) for c in r[1:]] for r in table[1:] if "NCCL" not in r[0]}


def draw(sizes, ratios, title, path: Path) -> None:
    fig = plots._figure(8, 4.2)
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
    fig.savefig(path, dpi=plots.DPI)
    print(f"{path.relative_to(ROOT)}")


def main() -> None:
    draw(*cpu_ratios(), "CPU: 4 gloo ranks on 2 cores, against gloo's all_reduce",
         IMG / "bench-ratio-cpu.png")
    draw(*gpu_ratios(), "GPU: 4 H200s, registered memory, against NCCL's all_reduce",
         IMG / "bench-ratio-gpu.png")


if __name__ == "__main__":
    main()
