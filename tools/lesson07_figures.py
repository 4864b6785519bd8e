"""The timeline of lesson 7's page: slices in flight, stage by stage, from a real trace.

    .venv/bin/python tools/lesson07_figures.py      # writes docs/img/07-timeline.png

4 local gloo ranks as 2 machines × 2 (``layout=(2, 2)``), 16 MiB of float32 in 8 slices;
the panels are ranks 0 and 2 (one per machine). Each bar runs from the moment a stage of a
slice was issued to the moment the next stage of that slice waited for it.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from collectives import launch  # noqa: E402
from collectives.course import plots  # noqa: E402
from collectives.course.hierarchical_bench import plot_slices, traced_slices  # noqa: E402


def main() -> None:
    numel = 4 << 20
    rows = launch.run(traced_slices, 4, args=((2, 2), numel, numel // 8), timeout=120)
    fig = plot_slices([rows[0], rows[2]], "hierarchical_all_reduce, 16 MiB float32 in 8 slices, "
                      "layout (2, 2): rank 0 (machine 0) and rank 2 (machine 1)", ranks=[0, 2])
    out = ROOT / "docs" / "img" / "07-timeline.png"
    fig.savefig(out, dpi=plots.DPI)
    print(out)


if __name__ == "__main__":
    main()
