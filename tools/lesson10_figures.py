"""Lesson 10's timeline figure: ZeRO-3's prefetched all-gathers under the compute, measured.

    .venv/bin/python tools/lesson10_figures.py            # writes docs/img/10-prefetch-timeline.{svg,json}

Two gloo ranks train a 4-unit model with :class:`collectives.sharded.FSDP` (lesson 4's ring,
prefetch on, ``max_alive`` 2); each unit sleeps a fixed time in forward and in backward to
stand for compute (a CPU's own compute would share the cores with the transfers). The
second step's timeline of rank 0 is drawn: each unit's forward and backward, each
all-gather and reduce-scatter on the side thread. The record counts, from the same
timeline, how many transfers overlapped a unit's compute.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from collectives import launch  # noqa: E402
from collectives.course.site import claims, plots  # noqa: E402
from collectives.sharded import FSDP  # noqa: E402

COMPUTE = 0.02      # seconds each unit sleeps in forward and in backward
UNITS, WIDTH = 4, 256


class _SlowGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(COMPUTE)
        return g


class Slow(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        time.sleep(COMPUTE)
        return _SlowGrad.apply(self.lin(x))


def _timeline():
    torch.manual_seed(0)
    f = FSDP(nn.Sequential(*[Slow(WIDTH) for _ in range(UNITS)]), max_alive=2)
    opt = torch.optim.Adam(f.parameters(), lr=1e-3)
    x = torch.randn(16, WIDTH)
    for _ in range(2):
        f.timeline.clear()
        f(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    events = [dict(e) for e in f.timeline if e["end"] is not None and e["what"] != "issue_all_gather"]
    f.close()
    return events


def overlaps(events: list[dict]) -> dict:
    """For each kind of transfer: how many ran, and how many overlapped some unit's compute."""
    compute = [(e["start"], e["end"]) for e in events if e["what"] in ("forward", "backward")]
    out = {}
    for kind in ("all_gather", "reduce_scatter"):
        xs = [e for e in events if e["what"] == kind]
        hidden = sum(1 for e in xs if any(e["start"] < b and a < e["end"] for a, b in compute))
        out[kind] = {"count": len(xs), "under_compute": hidden}
    return out


ROWS = {"forward": 3, "backward": 2, "all_gather": 1, "reduce_scatter": 0}
COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "all_gather": "#dd8452", "reduce_scatter": "#c44e52"}
BAR = 0.5          # a bar's height, in rows: a label that does not fit on it goes above or below


def _clashes(box, others) -> bool:
    return any(min(box.x1, o.x1) - max(box.x0, o.x0) > 0 and min(box.y1, o.y1) - max(box.y0, o.y0) > 0
               for o in others)


def draw(events: list[dict]):
    """Each unit's forward and backward, each transfer of the side thread, as bars labelled
    with the unit: on the bar in white where the label fits, else in black beside it -- above
    the bar, below it, or further along the row, wherever it meets no other label or bar."""
    t0 = min(e["start"] for e in events)
    end = max(e["end"] for e in events) - t0
    fig = plots._figure(7.5, 3.0)
    ax = fig.subplots()
    ax.set_xlim(0, end * 1e3 * 1.04)
    ax.set_ylim(-0.7, 3.7)
    bars = []
    for e in sorted(events, key=lambda e: e["start"]):
        x0, width = (e["start"] - t0) * 1e3, max((e["end"] - e["start"]) * 1e3, 0.4)
        bar = ax.barh(ROWS[e["what"]], width, left=x0, height=BAR, color=COLOURS[e["what"]])[0]
        bars.append((e, bar))
    ax.set_yticks(list(ROWS.values()), [k.replace("_", "-") for k in ROWS], fontsize=9)
    ax.set_xlabel("ms since the step began (rank 0 of 2, gloo)", fontsize=9)
    ax.tick_params(labelsize=9)
    renderer = plots.renderer(fig)
    taken = [bar.get_window_extent(renderer) for _, bar in bars]
    labels = []
    for e, bar in bars:
        row, cell = ROWS[e["what"]], bar.get_window_extent(renderer)
        middle = bar.get_x() + bar.get_width() / 2
        text = ax.text(middle, row, str(e["unit"]), fontsize=9, ha="center", va="center", color="white",
                       fontweight="bold")
        box = text.get_window_extent(renderer)
        if cell.x0 + 1 <= box.x0 and box.x1 <= cell.x1 - 1 and not _clashes(box, labels):
            labels.append(box)
            continue
        text.set_color("#222222")
        step = (ax.get_xlim()[1] - ax.get_xlim()[0]) / 60
        spots = [(middle + k * step, row + dy, va) for k in range(0, 40)
                 for dy, va in ((BAR / 2 + 0.04, "bottom"), (-BAR / 2 - 0.04, "top"))]
        for x, y, va in spots:
            text.set_position((x, y))
            text.set_va(va)
            box = text.get_window_extent(renderer)
            if not _clashes(box, labels + taken):
                break
        labels.append(text.get_window_extent(renderer))
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--img", default=str(claims.IMG), help="folder of the figure and its record")
    args = ap.parse_args(argv)
    events = launch.run(_timeline, 2, timeout=120)[0]
    counts = overlaps(events)
    record = claims.Record("10-prefetch-timeline", names={"all_gather": "all-gathers",
                                                          "reduce_scatter": "reduce-scatters"},
                           title="ZeRO-3's transfers on the side thread, under each unit's compute",
                           alt="Timeline of one ZeRO-3 step: forward and backward bars per unit above "
                               "the all-gather and reduce-scatter bars of the side thread")
    ag, rs = counts["all_gather"], counts["reduce_scatter"]
    record.fact("overlap", f"In this step {ag['under_compute']} of {ag['count']} all-gathers and "
                           f"{rs['under_compute']} of {rs['count']} reduce-scatters ran while a unit computed "
                           f"({UNITS} units, {COMPUTE * 1e3:g} ms of compute each way).", counts=counts)
    record.caption = record.text()
    path = plots.save(draw(events), Path(args.img) / "10-prefetch-timeline", record)
    print(record.caption)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
