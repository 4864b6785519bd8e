"""Pictures from real runs: step diagrams from traces, timelines, predicted-vs-measured plots.

Every function returns a matplotlib ``Figure`` (saved by the caller, shown inline by a
notebook); none calls ``plt.show()``. The step diagrams are drawn from the traces the
ranks recorded (:mod:`collectives.core.trace`), not from a description of the algorithm: what
you see is what the code sent.

::

    traces = launch.run(traced_run, 4)                  # each rank returns t.to_dicts()
    fig = plots.draw_steps(traces, "ring all-reduce, p = 4")
    fig.savefig("ring.png")
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Sequence

from ...core.trace import Event, Trace
from .legible import MIN_FONT_PT, check_legible, check_readable, renderer, text_problems  # noqa: F401

__all__ = ["as_traces", "message_rounds", "draw_steps", "draw_timeline", "draw_timelines",
           "plot_times", "plot_busbw", "plot_winners", "traced_call", "save", "check_legible"]


# Drawn at 2x (a notebook shows a figure at its own dpi; PNGs are saved at the same), on
# white with a light grey frame so a figure reads as a card on the site's dark pages too;
# labels at 9-11 pt. The site's figures are SVG (:func:`save`), sharp at any zoom.
DPI = 160


def save(fig, path, record=None):
    """Save ``fig`` as ``PATH.svg`` (text checked to be 9 pt or more, none overlapping another,
    sticking out of the figure or out of the bar it labels) and, with a
    :class:`~collectives.course.site.claims.Record`, the record as ``PATH.json`` beside it:
    the image and the comparisons it shows are written together. Returns the image path."""
    from pathlib import Path

    import matplotlib

    path = Path(path)
    image = path.with_suffix(".svg")
    image.parent.mkdir(parents=True, exist_ok=True)
    check_readable(fig)
    with matplotlib.rc_context({"svg.hashsalt": image.stem, "svg.fonttype": "path"}):
        fig.savefig(image, format="svg", metadata={"Date": None})
    if record is not None:
        record.image = image.name
        record.save(path.with_suffix(".json"))
    return image


def _figure(width: float, height: float):
    # The object-oriented API: no pyplot state, no GUI backend needed to save a file.
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height), layout="constrained", dpi=DPI,
                  facecolor="white", edgecolor="#d0d4dc", linewidth=1.0)


def as_traces(traces: Iterable) -> list[Trace]:
    """Accept per-rank :class:`Trace` objects or the lists of dicts that ``to_dicts()`` gives."""
    out = []
    for rank, t in enumerate(traces):
        out.append(t if isinstance(t, Trace) else Trace.from_dicts(rank, list(t)))
    return out


def message_rounds(traces: Iterable) -> list[list[Event]]:
    """Group every message into rounds: who could send what, once what had to arrive had arrived.

    A send's round is one more than the latest round among the messages its rank had
    finished receiving before posting it (sends that depend on nothing are round 1). The
    k-th message from a to b is matched with b's k-th receive from a, as the transport
    delivers them. Returns ``rounds[i]`` = the send events of round i + 1, in time order.
    """
    ts = as_traces(traces)
    sends = sorted((e for t in ts for e in t.sends()), key=lambda e: e.t0)
    # match receives to sends, pair by pair, in posting order
    matched: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for t in ts:
        for e in sorted(t.sends(), key=lambda e: e.seq):
            matched[(e.rank, e.peer)].append(e)
    source_of: dict[int, Event] = {}               # id(recv event) -> its send
    for t in ts:
        seen: dict[int, int] = defaultdict(int)
        for e in sorted(t.recvs(), key=lambda e: e.seq):
            queue = matched.get((e.peer, e.rank), [])
            if seen[e.peer] < len(queue):
                source_of[id(e)] = queue[seen[e.peer]]
            seen[e.peer] += 1
    recvs_of = {t.rank: [e for e in t.recvs() if e.t1 is not None] for t in ts}
    round_of: dict[int, int] = {}
    for e in sends:
        before = [round_of.get(id(source_of[id(r)]), 0) for r in recvs_of.get(e.rank, [])
                  if r.t1 <= e.t0 and id(r) in source_of]
        round_of[id(e)] = 1 + max(before, default=0)
    n_rounds = max(round_of.values(), default=0)
    return [[e for e in sends if round_of[id(e)] == k + 1] for k in range(n_rounds)]


def _short_label(e: Event) -> str:
    """The part of a label after ': ' ("reduce-scatter 0: c3" -> "c3"), else the element count."""
    if ": " in e.label:
        return e.label.split(": ", 1)[1]
    return f"{e.numel:,}"


def _round_title(events: Sequence[Event], k: int) -> str:
    heads = {e.label.split(": ", 1)[0] for e in events if e.label}
    return f"{k}. {heads.pop()}" if len(heads) == 1 else f"{k}. round {k}"


def _tree_positions(p: int) -> dict[int, tuple[float, float]]:
    """Binary-heap layout: rank 0 on top, the children of r (2r+1, 2r+2) below it."""
    levels = max(p.bit_length(), 1)
    where = {}
    for r in range(p):
        level = (r + 1).bit_length() - 1
        index = r + 1 - (1 << level)
        slots = 1 << level
        x = -1.3 + 2.6 * (index + 0.5) / slots
        y = 1.2 - 2.4 * level / max(levels - 1, 1)
        where[r] = (x, y)
    return where


def label_rounds(traces: Iterable) -> list[list[Event]]:
    """Group every message by the head of its label ("halving, distance 1: b0-b1" ->
    "halving, distance 1"): one panel per step as the code names it, both messages of a
    swap together. Groups come in the order of their last dependent round
    (:func:`message_rounds`), so a step that waits for another is drawn after it even
    when a rank with nothing to wait for sent first. Unlabelled messages: one group."""
    ts = as_traces(traces)
    round_of = {id(e): k for k, events in enumerate(message_rounds(ts)) for e in events}
    groups: dict[str, list[Event]] = {}
    for e in sorted((e for t in ts for e in t.sends()), key=lambda e: e.t0):
        groups.setdefault(e.label.split(": ", 1)[0] if e.label else "", []).append(e)
    return sorted(groups.values(), key=lambda g: (max(round_of.get(id(e), 0) for e in g),
                                                  min(e.t0 for e in g)))


def draw_steps(traces: Iterable, title: str = "", *, columns: int = 4, max_rounds: int = 16,
               show_sizes: bool = False, layout: str = "circle", panels: str = "rounds"):
    """One small panel per round: the ranks, and an arrow for every message of the round.

    Arrows carry the sender's label (``trace.label``, e.g. the chunk "c3" or the tensor
    "x0") or, without one, the element count. ``show_sizes`` adds the element count to
    labelled arrows too. ``layout="circle"``: rank 0 at the top, the others clockwise;
    ``layout="tree"``: a binary heap, rank 0 at the root. ``panels="rounds"``: a panel per
    round of dependent messages (:func:`message_rounds`); ``panels="labels"``: a panel per
    step as the code labels it (:func:`label_rounds`), so that a swap is never split.
    Panels are titled "k. what" alike; a long title is wrapped to the figure's width.
    """
    import textwrap

    ts = as_traces(traces)
    p = max(len(ts), 1)
    rounds = (label_rounds(ts) if panels == "labels" else message_rounds(ts))[:max_rounds]
    n = max(len(rounds), 1)
    cols = min(columns, n)
    rows = math.ceil(n / cols)
    width = max(2.3 * cols, 6.5 if title else 0)
    lines = textwrap.wrap(title, width=int(width * 10)) if title else []
    fig = _figure(width, 2.4 * rows + 0.3 * len(lines))
    axes = fig.subplots(rows, cols, squeeze=False)
    if layout == "tree":
        where = _tree_positions(p)
    else:
        where = {r: (math.sin(2 * math.pi * r / p), math.cos(2 * math.pi * r / p)) for r in range(p)}
    arrow_labels = []
    for i, ax in enumerate(axes.flat):
        ax.set_xlim(-1.55, 1.55)
        ax.set_ylim(-1.55, 1.55)
        ax.set_aspect("equal")
        ax.axis("off")
        if i >= len(rounds):
            continue
        events = rounds[i]
        ax.set_title(_round_title(events, i + 1), fontsize=10)
        for r, (x, y) in where.items():
            ax.add_patch(_circle((x, y), 0.24))
            ax.text(x, y, str(r), ha="center", va="center", fontsize=9, fontweight="bold")
        pairs: dict[tuple[int, int], list[Event]] = defaultdict(list)
        for e in events:          # two messages of one round between the same pair: one arrow
            pairs[(e.rank, e.peer)].append(e)
        for (src, dst), same in pairs.items():
            if dst not in where:
                continue
            e = same[0]
            (x0, y0), (x1, y1) = where[src], where[dst]
            ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                        arrowprops=dict(arrowstyle="-|>", color="tab:blue", lw=1.2,
                                        shrinkA=11, shrinkB=11,
                                        connectionstyle="arc3,rad=0.18"))
            text = ", ".join(_short_label(m) + (f" ({m.numel:,})" if show_sizes and ": " in m.label else "")
                             for m in same)
            # label on the outer side of the arc, a little nearer the sender than the middle,
            # so that the labels of crossing arrows do not pile up in the centre
            dx, dy = x1 - x0, y1 - y0
            norm = math.hypot(dx, dy) or 1.0
            ox, oy = dy / norm * 0.22, -dx / norm * 0.22
            spots = [(x0 + f * dx + side * ox, y0 + f * dy + side * oy)
                     for side in (1, -1) for f in (0.3, 0.45, 0.2, 0.6)]
            label = ax.text(*spots[0], text, ha="center", va="center", fontsize=9, color="tab:blue")
            arrow_labels.append((label, spots))
    if title:
        fig.suptitle("\n".join(lines), fontsize=11)
    _spread(fig, arrow_labels)
    return fig


def _spread(fig, labels: list) -> None:
    """Move each arrow's label to the first of its spots where it overlaps no label placed
    before it (the first spot when none is free)."""
    if not labels:
        return
    drawn = renderer(fig)
    placed = []
    for label, spots in labels:
        for spot in spots:
            label.set_position(spot)
            box = label.get_window_extent(drawn)
            if not any(min(box.x1, o.x1) - max(box.x0, o.x0) > 0 and min(box.y1, o.y1) - max(box.y0, o.y0) > 0
                       for o in placed):
                break
        else:
            label.set_position(spots[0])
        placed.append(label.get_window_extent(drawn))


def _circle(xy, radius):
    from matplotlib.patches import Circle
    return Circle(xy, radius, facecolor="#eef3fb", edgecolor="#4a6fa5", lw=1)


def draw_timeline(traces: Iterable, title: str = ""):
    """Each rank's messages over time: a bar from posting to completion (sends above the
    rank's line, receives below). Overlapping bars are messages in flight together."""
    ts = as_traces(traces)
    events = [e for t in ts for e in t.events if e.t1 is not None and (e.is_send or e.is_recv)]
    fig = _figure(8, 0.6 + 0.55 * max(len(ts), 1))
    ax = fig.subplots()
    if not events:
        ax.set_title(title or "no completed messages")
        return fig
    start = min(e.t0 for e in events)
    for e in events:
        y = e.rank + (-0.18 if e.is_send else 0.18)
        ax.barh(y, (e.t1 - e.t0) * 1e3, left=(e.t0 - start) * 1e3, height=0.3,
                color="tab:blue" if e.is_send else "tab:orange", alpha=0.55, edgecolor="none")
    ax.set_yticks(range(len(ts)), [f"rank {t.rank}" for t in ts])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first message was posted")
    from matplotlib.patches import Patch
    # the legend under the axis, off the bars
    fig.legend(handles=[Patch(color="tab:blue", alpha=0.55, label="send (posted → done)"),
                        Patch(color="tab:orange", alpha=0.55, label="receive (posted → done)")],
               fontsize=9, loc="outside lower center", ncols=2, frameon=False)
    if title:
        ax.set_title(title, fontsize=11)
    return fig


def draw_timelines(runs: dict, title: str = ""):
    """Several runs' timelines (``{panel title: traces}``) one above the other on one time
    axis, so that lengths compare at a glance; each panel's end is marked with its time."""
    from matplotlib.patches import Patch

    panels = {name: as_traces(traces) for name, traces in runs.items()}
    rows = sum(max(len(ts), 1) for ts in panels.values())
    fig = _figure(8.5, 1.2 + 0.5 * rows + 0.5 * len(panels))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                        height_ratios=[max(len(ts), 1) for ts in panels.values()])[:, 0]
    for ax, (name, ts) in zip(axes, panels.items()):
        events = [e for t in ts for e in t.events if e.t1 is not None and (e.is_send or e.is_recv)]
        if not events:
            ax.set_title(f"{name}: no completed messages", fontsize=10)
            continue
        start = min(e.t0 for e in events)
        for e in events:
            y = e.rank + (-0.18 if e.is_send else 0.18)
            ax.barh(y, (e.t1 - e.t0) * 1e3, left=(e.t0 - start) * 1e3, height=0.3,
                    color="tab:blue" if e.is_send else "tab:orange", alpha=0.55, edgecolor="none")
        end = (max(e.t1 for e in events) - start) * 1e3
        ax.axvline(end, color="black", lw=1, ls="--")
        ax.set_yticks(range(len(ts)), [f"rank {t.rank}" for t in ts])
        ax.set_ylim(len(ts) - 0.5, -0.5)
        ax.set_title(f"{name}: {end:.3g} ms", fontsize=10, loc="left")
    axes[-1].set_xlabel("ms since the first message was posted (dashed: the last message done)")
    fig.legend(handles=[Patch(color="tab:blue", alpha=0.55, label="send (posted → done)"),
                        Patch(color="tab:orange", alpha=0.55, label="receive (posted → done)")],
               fontsize=9, loc="outside lower center", ncols=2, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def _size_axis(ax, sizes: Sequence[int]) -> None:
    from ...core.timing import human_bytes
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes), [human_bytes(s).replace(" ", "") for s in sizes], fontsize=9)
    ax.minorticks_off()


def _seconds_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator

    from ...core.timing import human_seconds
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    fmt = FuncFormatter(lambda v, _: human_seconds(v))
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def plot_times(sizes: Sequence[int], measured: dict[str, Sequence[float]] | None = None,
               predicted: dict[str, Sequence[float]] | None = None, title: str = ""):
    """Time against size, log-log: measured as solid lines with dots, the model's
    prediction for the same algorithm as a dashed line of the same colour."""
    fig = _figure(8.5, 4.2)
    ax = fig.subplots()
    names = list(dict.fromkeys(list(measured or {}) + list(predicted or {})))
    colours = {name: f"C{i % 10}" for i, name in enumerate(names)}
    for name in names:
        if measured and name in measured:
            ax.plot(sizes, measured[name], "o-", color=colours[name], ms=3.5, lw=1.4,
                    label=f"{name.replace('_', ' ')} (measured)")
        if predicted and name in predicted:
            ax.plot(sizes, predicted[name], "--", color=colours[name], lw=1.1,
                    label=f"{name.replace('_', ' ')} (α–β model)")
    _size_axis(ax, sizes)
    ax.set_yscale("log")
    _seconds_axis(ax)
    ax.set_xlabel("tensor size")
    ax.set_ylabel("time")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # beside the axis, off the data
    if title:
        ax.set_title(title, fontsize=11)
    return fig


def plot_busbw(rows: Sequence[dict], title: str = ""):
    """Bus bandwidth against size, one line per algorithm (rows: ``algo``, ``nbytes``, ``busbw``
    in bytes/s, as ``.venv/bin/python -m collectives bench`` writes them)."""
    fig = _figure(7, 4.2)
    ax = fig.subplots()
    by_algo: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        by_algo[row["algo"]].append((row["nbytes"], row["busbw"]))
    sizes = sorted({row["nbytes"] for row in rows})
    for i, (algo, points) in enumerate(by_algo.items()):
        points.sort()
        baseline = algo in ("gloo", "nccl", "dist.all_reduce")
        ax.plot([s for s, _ in points], [b / 1e9 for _, b in points], "o-" if not baseline else "s-",
                color="black" if baseline else f"C{i % 10}", lw=2.2 if baseline else 1.3, ms=3.5,
                label=f"{algo} (dist.all_reduce)" if baseline else algo)
    if sizes:
        _size_axis(ax, sizes)
    ax.set_xlabel("tensor size")
    ax.set_ylabel("busbw, GB/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # beside the axis, off the data
    if title:
        ax.set_title(title, fontsize=11)
    return fig


def plot_winners(sizes: Sequence[int], rows: dict[str, dict[str, Sequence[float]]], title: str = "",
                 names: dict[str, str] | None = None):
    """Which algorithm is fastest at each size: one strip per row of ``rows``
    (e.g. ``{"measured": {algo: times}, "α–β model": {algo: times}}``). Each cell holds the
    winner's number and the legend below names it (``names``: key -> what to call it)."""
    names = names or {}
    every = list(dict.fromkeys(n for times in rows.values() for n in times))
    colours = {name: f"C{i % 10}" for i, name in enumerate(every)}
    winners = list(dict.fromkeys(min(times, key=lambda n: times[n][i])
                                 for times in rows.values() for i in range(len(sizes))))
    fig = _figure(max(7, 1.5 + 0.85 * len(sizes)), 1.2 + 0.55 * len(rows) + 0.25 * -(-len(winners) // 3))
    ax = fig.subplots()
    number = {name: k + 1 for k, name in enumerate(winners)}     # a cell holds a number; the legend, the name
    for y, (row_name, times) in enumerate(rows.items()):
        for i, size in enumerate(sizes):
            best = min(times, key=lambda n: times[n][i])
            ax.barh(y, 1, left=i, color=colours[best], edgecolor="white")
            ax.text(i + 0.5, y, str(number[best]), ha="center", va="center", fontsize=10,
                    fontweight="bold", color="white")
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(color=colours[n], label=f"{number[n]}  {names.get(n, n.replace('_', ' '))}")
                        for n in winners],
               fontsize=9, loc="outside lower center", ncols=min(3, len(winners)), frameon=False)
    from ...core.timing import human_bytes
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_xticks([i + 0.5 for i in range(len(sizes))],
                  [human_bytes(s).replace(" ", "") for s in sizes], fontsize=9)
    ax.set_xlim(0, len(sizes))
    ax.invert_yaxis()
    ax.set_xlabel("tensor size: the fastest algorithm")
    if title:
        ax.set_title(title, fontsize=11)
    return fig


def traced_call(target: str, numel: int = 8, dtype: str = "float32") -> list[dict]:
    """Run inside a world (``launch.run(plots.traced_call, p, args=(target,))``): one call of
    the all-reduce ``target`` ("module:function") on a tensor of ``numel`` elements, recorded
    after an unrecorded warm-up call and a barrier; returns this rank's events as dicts,
    ready for :func:`draw_steps` and :func:`draw_timeline`."""
    import torch
    import torch.distributed as dist

    from ...core import trace
    from ..impl import resolve

    fn = resolve(target)
    x = torch.full((numel,), float(dist.get_rank() + 1), dtype=getattr(torch, dtype))
    fn(x.clone())                       # connections set up, memory touched: not in the picture
    dist.barrier()                      # every rank starts the recorded call together
    with trace.recording() as t:
        fn(x)
    return t.to_dicts()
