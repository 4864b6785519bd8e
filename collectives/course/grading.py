"""``make grade``: run the graded tests against the exercises and print a score table.

Graded tests carry ``@pytest.mark.task(lesson=N, task=K, points=P, title="...")``. A
task scores its points when every test marked with it passes; the table lists each
task, and the total. The exit code is 0 only for a full score, so ``make grade`` on the
untouched stubs prints 0 and fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import pytest

from .catalog import LESSONS, ROOT, lesson


@dataclass
class TaskScore:
    lesson: int
    task: int
    title: str
    points: int
    tests: int = 0
    failed: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.tests > 0 and not self.failed

    @property
    def earned(self) -> int:
        return self.points if self.passed else 0


class GradeCollector:
    """A pytest plugin that folds test outcomes into per-task scores."""

    def __init__(self):
        self.tasks: dict[tuple[int, int], TaskScore] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        marker = item.get_closest_marker("task")
        if marker is None:
            return
        kw = marker.kwargs
        key = (int(kw["lesson"]), int(kw["task"]))
        score = self.tasks.setdefault(key, TaskScore(key[0], key[1], kw.get("title", ""), int(kw["points"])))
        if report.when == "call":
            score.tests += 1
        if report.failed or (report.when == "call" and report.skipped):
            score.failed.append(item.nodeid)


def render(tasks: list[TaskScore]) -> tuple[int, int]:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Collectives from Scratch — grade")
    for col in ("lesson", "task", "title", "points", "result"):
        table.add_column(col, justify="right" if col in ("lesson", "task", "points") else "left")
    for t in sorted(tasks, key=lambda t: (t.lesson, t.task)):
        result = "[green]pass[/]" if t.passed else f"[red]fail[/] ({len(t.failed)} of {t.tests} tests)"
        table.add_row(f"{t.lesson:02d}", str(t.task), t.title, f"{t.earned}/{t.points}", result)
    earned = sum(t.earned for t in tasks)
    total = sum(t.points for t in tasks)
    table.add_section()
    table.add_row("", "", "[bold]total[/]", f"[bold]{earned}/{total}[/]", "")
    console = Console()
    if not console.is_terminal:  # a log or a pipe: don't squeeze the table into 80 columns
        console = Console(width=120)
    console.print(table)
    return earned, total


def grade(lessons: list[int] | None = None, impl: str = "exercise",
          quiet: bool = True) -> tuple[int, int, list[TaskScore]]:
    """Run the graded tests of ``lessons`` (all by default) against ``impl``; return (earned, total, tasks)."""
    chosen = [lesson(n) for n in lessons] if lessons else LESSONS
    files = [str(item.test_file) for item in chosen if item.test_file.exists()]
    if not files:
        raise SystemExit("no graded tests found for " + ", ".join(item.nn for item in chosen))
    collector = GradeCollector()
    # The graded worlds compare every course collective's arguments across ranks, so a
    # student whose ranks disagree reads which ranks and how (collectives.core.ops).
    os.environ.setdefault("COLLECTIVES_CHECK", "1")
    args = ["-m", "task", f"--impl={impl}", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
            "-c", str(ROOT / "pyproject.toml"), "--tb=line", "-q", "--no-header"] + files
    pytest.main(args, plugins=[collector])
    tasks = list(collector.tasks.values())
    earned, total, = sum(t.earned for t in tasks), sum(t.points for t in tasks)
    return earned, total, tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collectives grade", description=__doc__.splitlines()[0])
    parser.add_argument("--lesson", action="append", default=[],
                        help="grade only this lesson (e.g. 04); may be repeated")
    parser.add_argument("--impl", choices=["exercise", "reference"], default="exercise",
                        help="what to grade: your exercises (default) or the reference solution")
    parser.add_argument("--exercises", default="",
                        help="grade another copy of lessons/ (a student's submission): the folder "
                             "holding 01_p2p/exercise.py, 02_collectives/exercise.py, ...")
    args = parser.parse_args(argv)
    if args.exercises:
        os.environ["COLLECTIVES_EXERCISE_DIR"] = os.path.abspath(args.exercises)
    _, _, tasks = grade([int(x) for x in args.lesson] or None, args.impl)
    earned, total = render(tasks)
    print(f"SCORE {earned}/{total}")
    if total and earned < total:
        print("Details: python -m pytest tests/test_NN_*.py --impl exercise  (for one lesson's failures)")
    sys.stdout.flush()
    return 0 if total and earned == total else 1
