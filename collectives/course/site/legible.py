"""Can a figure be read? The checks :func:`~collectives.course.site.plots.save` runs on every
figure before it is written: no text under 9 pt, no two labels overlapping, none sticking out
of the figure, none written on a bar it does not fit.

::

    problems = legible.text_problems(fig)      # [] when every label can be read
    legible.check_readable(fig)                # the same, as a ValueError naming them
"""

from __future__ import annotations

MIN_FONT_PT = 9


def check_legible(fig) -> None:
    """Raise ``ValueError`` naming any text of ``fig`` smaller than :data:`MIN_FONT_PT`."""
    from matplotlib.text import Text

    small = [(t.get_text(), t.get_fontsize()) for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip() and t.get_fontsize() < MIN_FONT_PT]
    if small:
        shown = ", ".join(f"{text[:30]!r} at {size:g} pt" for text, size in small[:5])
        raise ValueError(f"text under {MIN_FONT_PT} pt is unreadable on the site: {shown}")


def renderer(fig):
    """``fig`` drawn once, and the renderer that drew it: where each text and bar landed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not hasattr(fig.canvas, "get_renderer"):
        FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def text_problems(fig) -> list[str]:
    """What makes a label of ``fig`` unreadable once drawn: two texts whose boxes overlap,
    a text that sticks out of the figure, and a label written on a bar (its anchor inside a
    rectangle of the same axes) that does not fit inside that bar."""
    from matplotlib.patches import Rectangle
    from matplotlib.text import Text

    drawn = renderer(fig)
    unseen = set()                     # tick labels of ticks outside the view: kept, never drawn
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            slack = (hi - lo) * 1e-9
            shown = ax.axison and axis.get_visible()          # axis("off"): no tick is drawn
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not shown or not tick.get_visible() or not lo - slack <= tick.get_loc() <= hi + slack:
                    unseen |= {id(tick.label1), id(tick.label2)}
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in unseen]
    boxes = [(t, t.get_window_extent(drawn)) for t in texts]
    problems, frame = [], fig.bbox
    for t, b in boxes:
        if b.x0 < frame.x0 - 1 or b.x1 > frame.x1 + 1 or b.y0 < frame.y0 - 1 or b.y1 > frame.y1 + 1:
            problems.append(f"{t.get_text()[:30]!r} sticks out of the figure")
    for i, (t, b) in enumerate(boxes):
        for u, c in boxes[i + 1:]:
            w = min(b.x1, c.x1) - max(b.x0, c.x0)
            h = min(b.y1, c.y1) - max(b.y0, c.y0)
            if w > 1 and h > 1:
                problems.append(f"{t.get_text()[:30]!r} overlaps {u.get_text()[:30]!r}")
    for ax in fig.axes:
        bars = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_visible()]
        for t in ax.texts:
            if not (t.get_visible() and t.get_text().strip()):
                continue
            anchor = ax.transData.transform(t.get_position())
            box = t.get_window_extent(drawn)
            for bar in bars:
                cell = bar.get_window_extent(drawn)
                inside = cell.x0 + 1 < anchor[0] < cell.x1 - 1 and cell.y0 + 1 < anchor[1] < cell.y1 - 1
                if inside and (box.x0 < cell.x0 - 1 or box.x1 > cell.x1 + 1
                                               or box.y0 < cell.y0 - 1 or box.y1 > cell.y1 + 1):
                    problems.append(f"{t.get_text()[:30]!r} does not fit in the bar it is written on")
                    break
    return list(dict.fromkeys(problems))


def check_readable(fig) -> None:
    """Raise ``ValueError`` when text of ``fig`` is too small (:func:`check_legible`), or
    overlaps, sticks out or is clipped (:func:`text_problems`)."""
    check_legible(fig)
    problems = text_problems(fig)
    if problems:
        raise ValueError("labels that cannot be read: " + "; ".join(problems[:6]))
