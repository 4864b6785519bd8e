"""The tour runs every lesson's algorithm, verifies each, and prints the table."""

import io

from rich.console import Console

from collectives.course import tour
from collectives.course.catalog import LESSONS


def test_every_lesson_contributes_to_the_tour_and_every_row_is_verified():
    entries = tour.entries()
    assert {e.lesson for e in entries} >= {item.number for item in LESSONS if item.number >= 2}
    rows = tour.run_tour(world_size=2, nbytes=64 << 10, progress=False)
    assert len(rows) == len(entries)
    bad = [(r.algorithm, r.detail) for r in rows if not r.verified]
    assert not bad, bad
    sends = {e.name: e.messages for e in entries}
    for r in rows:
        assert r.seconds > 0 and r.ref_seconds > 0, r
        # measured from the trace, not assumed: lesson 12's all-reduces send nothing at all
        assert (r.bytes_sent > 0) == sends[r.algorithm], r
    # the table fits 100 columns with every algorithm's name whole, and a row slower than
    # its baseline says why (the reasons are the tour's own, one per entry)
    buf = io.StringIO()
    tour.render(rows, 2, "gloo", console=Console(file=buf, width=tour.WIDTH))
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= tour.WIDTH, text
    for r in rows:
        assert r.algorithm in text, r.algorithm
    reasons = {e.name: e.loses for e in tour.TOUR}
    assert all(reasons.values()), "every entry says why it can lose"
    words = " ".join(text.split())
    for r in rows:
        if r.ratio < 1:
            assert reasons[r.algorithm].split()[0] in words, (r.algorithm, text)
