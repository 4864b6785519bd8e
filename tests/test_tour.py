"""The tour runs every lesson's algorithm, verifies each, and prints the table."""

import io

from rich.console import Console

from collectives.course import tour
from collectives.course.catalog import LESSONS


def test_every_lesson_contributes_to_the_tour_and_every_row_is_verified(monkeypatch):
    entries = tour.entries()
    assert {e.lesson for e in entries} >= {item.number for item in LESSONS if item.number >= 2}
    rows = tour.run_tour(world_size=2, nbytes=64 << 10, progress=False)
    assert len(rows) == len(entries)
    bad = [(r.algorithm, r.detail) for r in rows if not r.verified]
    assert not bad, bad
    for r in rows:
        assert r.seconds > 0 and r.ref_seconds > 0, r
        assert r.bytes_sent > 0, r  # measured from the trace, not assumed
    # the table renders with every algorithm in it
    buf = io.StringIO()
    monkeypatch.setattr("rich.console.Console", lambda *a, **k: Console(file=buf, width=200))
    tour.render(rows, 2, "gloo")
    text = buf.getvalue()
    for r in rows:
        assert r.algorithm in text
