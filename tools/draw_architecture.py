"""Draw the architecture page's layer diagram: docs/img/architecture-layers.svg.

    .venv/bin/python tools/draw_architecture.py

Plain SVG written by hand (no plotting library): three layers of the package, a box per
module, and the surfaces outside it. The lesson row comes from the lesson map
(``collectives.course.catalog``) plus :data:`LESSONS_COMING`, so a lesson added to the map
appears here on the next run. Text is 12 px (9 pt) or larger.
"""

from __future__ import annotations

import html
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collectives.course.catalog import LESSONS  # noqa: E402

OUT = ROOT / "docs" / "img" / "architecture-layers.svg"
# Lessons being written, shown before the map has them: number -> (folder, what it teaches).
LESSONS_COMING: dict[int, tuple[str, str]] = {}
COURSE = [("catalog", "lesson map"), ("impl", "reference or yours"), ("verify", "harness"),
          ("runner", "exercises"), ("tasks/", "graded tasks"), ("tour", "make tour"),
          ("*_bench", "benchmarks"), ("plots", "figures"), ("claims", "figure records"), ("cli", "commands")]
CORE = [("launch", "worlds"), ("ops", "checks"), ("trace", "who sent what"), ("streams", "CPU stand-ins"),
        ("timing", "fair timing"), ("cost", "α–β model"), ("nccl_memory", "registered"),
        ("cluster", "machines"), ("flight_recorder", "last calls")]
OUTSIDE = [("lessons/NN/exercise.py", "stubs; run_tasks(...)"), ("tests/test_NN_*.py", "the reference's checks"),
           ("notebooks/NN_*.ipynb", "labs, run by the suite"), ("docs/, mkdocs.yml", "lesson pages, API"),
           ("tools/", "figures, site check")]
W = 1000
LAYER_X, LAYER_W = 20, 720


def _lessons() -> list[tuple[str, str]]:
    rows = {item.number: (item.module.split(".", 1)[1].replace(".", "/"), str(item.number)) for item in LESSONS}
    for number, (folder, _) in LESSONS_COMING.items():
        rows.setdefault(number, (folder, str(number)))
    names = {}
    out = []
    for number in sorted(rows):
        module, label = rows[number]
        module = names.get(module, module)
        if (ROOT / "collectives" / module.split(" ")[0]).is_dir() or module.endswith("/"):
            module = module.rstrip("/") + "/"
        out.append((module, f"lesson {label}"))
    return out


def _text(x, y, s, size=12, anchor="middle", weight="normal", fill="#222", style="normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'font-style="{style}" fill="{fill}">{html.escape(s)}</text>')


def _grid(parts: list[str], boxes, x0, y0, width, columns, box_h=46, gap=8) -> float:
    box_w = (width - gap * (columns - 1)) / columns
    for i, (name, note) in enumerate(boxes):
        x = x0 + (i % columns) * (box_w + gap)
        y = y0 + (i // columns) * (box_h + gap)
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{box_w:.1f}" height="{box_h}" rx="4" '
                     'fill="#ffffff" stroke="#555"/>')
        parts.append(_text(x + box_w / 2, y + 19, name, 14, weight="bold", fill="#111"))
        parts.append(_text(x + box_w / 2, y + 36, note, 12, fill="#333"))
    rows = (len(boxes) + columns - 1) // columns
    return y0 + rows * (box_h + gap) - gap


def draw() -> str:
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {{H}}" width="{W}" height="{{H}}" role="img" '
             'aria-label="The package\'s three layers: course tooling imports the lessons, the lessons import core" '
             'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
             "<title>The package's three layers: course tooling imports the lessons, the lessons import core</title>",
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#333"/></marker></defs>',
             f'<rect x="0" y="0" width="{W}" height="{{H}}" fill="#ffffff"/>']
    layers = [("collectives/course/", "the tooling: walks the lessons, never walked by them", "#fff4e0", "#c9892b",
               COURSE, 5, ""),
              ("collectives/<lesson>", "the lessons' reference code: one module, or a folder, per lesson",
               "#e8f1fb", "#3f78b5", _lessons(), 5,
               "each imports core and earlier lessons only; lesson 4's rivals live in topologies"),
              ("collectives/core/", "the infrastructure every lesson stands on", "#e9f6ea", "#3d8b47", CORE, 4,
               "torch.distributed (gloo on CPU, NCCL on GPUs) underneath")]
    y = 20
    bottoms = []
    for title, subtitle, fill, stroke, boxes, columns, footer in layers:
        rows = (len(boxes) + columns - 1) // columns
        height = 40 + rows * 54 + (24 if footer else 4)
        parts.append(f'<rect x="{LAYER_X}" y="{y}" width="{LAYER_W}" height="{height}" rx="10" fill="{fill}" '
                     f'stroke="{stroke}"/>')
        parts.append(_text(LAYER_X + 14, y + 24, title, 16, "start", "bold", stroke))
        parts.append(_text(LAYER_X + 14 + 10.5 * len(title), y + 24, subtitle, 12, "start", fill="#333",
                           style="italic"))
        end = _grid(parts, boxes, LAYER_X + 14, y + 36, LAYER_W - 28, columns)
        if footer:
            parts.append(_text(LAYER_X + 14, end + 20, footer, 12, "start", fill="#555"))
        bottoms.append((y, y + height))
        y += height + 34
    for (_, bottom), (top, _) in zip(bottoms, bottoms[1:]):
        for x in (200, 520):
            parts.append(f'<line x1="{x}" y1="{bottom + 2}" x2="{x}" y2="{top - 2}" stroke="#333" stroke-width="2" '
                         'marker-end="url(#arrow)"/>')
        parts.append(_text(206, bottom + 22, "imports", 12, "start", fill="#333"))
    ox = LAYER_X + LAYER_W + 24
    ow = W - ox - 16
    parts.append(f'<rect x="{ox}" y="20" width="{ow}" height="{bottoms[-1][1] - 20}" rx="10" fill="#f6f6f6" '
                 'stroke="#888" stroke-dasharray="5,4"/>')
    parts.append(_text(ox + ow / 2, 44, "outside the package", 14, weight="bold", fill="#555"))
    step = (bottoms[-1][1] - 80) / len(OUTSIDE)
    for i, (name, note) in enumerate(OUTSIDE):
        top = 62 + i * step
        parts.append(f'<rect x="{ox + 10}" y="{top:.1f}" width="{ow - 20}" height="54" rx="4" fill="#ffffff" '
                     'stroke="#555"/>')
        parts.append(_text(ox + ow / 2, top + 22, name, 12.5, weight="bold", fill="#111"))
        parts.append(_text(ox + ow / 2, top + 41, note, 12, fill="#333"))
    parts.append("</svg>")
    height = bottoms[-1][1] + 20
    parts[0] = parts[0].replace("{H}", str(height))
    parts[3] = parts[3].replace("{H}", str(height))
    return "\n".join(parts) + "\n"


def main() -> None:
    OUT.write_text(draw(), encoding="utf-8")
    print(OUT.relative_to(ROOT))


if __name__ == "__main__":
    main()
