"""The tour runs every lesson's algorithm, verifies each, and prints the table."""

import io

import pytest
from rich.console import Console

from collectives.course import tour
from collectives.course.catalog import LESSONS


def test_every_lesson_contributes_to_the_tour_and_every_row_is_verified():
    entries = tour.entries()
    assert {e.lesson for e in entries} >= {item.number for item in LESSONS if item.number <= 9}
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
    loses = {e.name: e.loses for e in tour.TOUR}
    wins = {e.name: e.wins for e in tour.TOUR}
    assert all(loses.values()) and all(wins.values()), "every entry says why it can lose and why it can win"
    words = " ".join(text.split())
    assert "why slower" not in words and "bytes per call: " in words
    for r in rows:
        reason = loses[r.algorithm] if r.ratio < 1 else wins[r.algorithm]
        assert reason.split()[0] in words, (r.algorithm, text)


def test_the_table_gives_the_spread_of_repeats_and_warns_when_ranks_outnumber_cores(monkeypatch):
    rows = [tour.TourRow(4, "ring", True, seconds=2.0, ref_seconds=1.0, nbytes=4 << 20, world_size=4,
                         bytes_sent=6e6, bytes_theory=6e6, extra={"ratios": [0.33, 0.5, 1.2]}),
            tour.TourRow(5, "fused", True, seconds=1.0, ref_seconds=1.5, nbytes=3_999_744, world_size=4,
                         bytes_sent=6e6, bytes_theory=6e6, extra={"ratios": [1.1, 1.5, 1.6]})]
    monkeypatch.setattr(tour.os, "cpu_count", lambda: 2)
    buf = io.StringIO()
    tour.render(rows, 4, "gloo", console=Console(file=buf, width=tour.WIDTH))
    words = " ".join(buf.getvalue().split())
    assert "bytes per call: 3.81 MiB, 4 MiB" in words, words
    assert "0.33–1.20" in words and "1.10–1.60" in words
    assert "4 ranks share 2 cores" in words
    assert "gloo's ring is C++" in words and "one call instead of many" in words     # slower and faster rows
    assert max(len(line) for line in buf.getvalue().splitlines()) <= tour.WIDTH


def test_a_tour_of_one_rank_is_refused_before_anything_runs(capsys):
    with pytest.raises(ValueError, match="at least 2 ranks"):
        tour.run_tour(world_size=1, progress=False)
    with pytest.raises(SystemExit):
        tour.main(["--world", "1"])
    assert "at least 2 ranks" in capsys.readouterr().err
