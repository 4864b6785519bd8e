"""``make grade``: run the graded tests against the exercises and print a score table.

Graded tests carry ``@pytest.mark.task(lesson=N, task=K, points=P, title="...")``. A
task scores its points when every test marked with it passes; the table lists each
task, and the total. The exit code is 0 only for a full score, so ``make grade`` on the
untouched stubs prints 0 and fails.

Each task's tests run in worlds of their own, under one time limit (``--timeout``, the
same as the exercise runner's): a task that hangs scores 0 and says where it hung
("not run: the world hung in ring_all_reduce (case n=1001 float32 SUM, world of 4)");
the other tasks are graded as usual.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import pytest

from .catalog import DEFAULT_TIMEOUT, LESSONS, ROOT, lesson


@dataclass
class TaskScore:
    lesson: int
    task: int
    title: str
    points: int
    tests: int = 0
    failed: list[str] = field(default_factory=list)
    first_failure: str = ""      # the first line of the first failing test's message

    @property
    def passed(self) -> bool:
        return self.tests > 0 and not self.failed

    @property
    def result(self) -> str:
        if self.passed:
            return "pass"
        why = f": {self.first_failure}" if self.first_failure else ""
        if self.first_failure.startswith("not run"):
            return f"fail{why}"
        return f"fail ({len(self.failed)} of {self.tests} tests run){why}"

    @property
    def earned(self) -> int:
        return self.points if self.passed else 0


class GradeCollector:
    """A pytest plugin that folds test outcomes into per-task scores."""

    def __init__(self, tasks: list[int] | None = None):
        self.tasks: dict[tuple[int, int], TaskScore] = {}
        self.only = set(tasks or [])

    def pytest_runtest_setup(self, item):
        # A task scores all or nothing: once one of its tests failed, the rest need not run.
        marker = item.get_closest_marker("task")
        if marker is not None:
            score = self.tasks.get((int(marker.kwargs["lesson"]), int(marker.kwargs["task"])))
            if score is not None and score.failed:
                pytest.skip("not run: an earlier test of this task failed")

    def pytest_collection_modifyitems(self, config, items):
        if not self.only:
            return
        keep = [i for i in items if (m := i.get_closest_marker("task")) and int(m.kwargs["task"]) in self.only]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep

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
        if report.when == "setup":
            score.tests += 1            # every test counts once, whether or not it got to run
        if report.skipped and score.failed:
            score.tests -= 1 if report.when == "setup" else 0   # skipped after the task failed
            return
        if (report.failed or (report.when == "call" and report.skipped)) and item.nodeid not in score.failed:
            score.failed.append(item.nodeid)
            if not score.first_failure:
                score.first_failure = _first_line(report)


def _first_line(report) -> str:
    """The message of a failed test, first line, without pytest's "Failed: " or "AssertionError: "."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    for prefix in ("Failed: ", "AssertionError: ", "E   "):
        if text.startswith(prefix):
            text = text[len(prefix):]
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 160 else line[:157] + "..."


def render(tasks: list[TaskScore]) -> tuple[int, int]:
    from rich.console import Console
    from rich.markup import escape as rich_escape
    from rich.table import Table

    table = Table(title="Collectives from Scratch — grade")
    for col in ("lesson", "task", "title", "points", "result"):
        table.add_column(col, justify="right" if col in ("lesson", "task", "points") else "left")
    for t in sorted(tasks, key=lambda t: (t.lesson, t.task)):
        result = "[green]pass[/]" if t.passed else "[red]fail[/]" + rich_escape(t.result[4:])
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


def grade(lessons: list[int] | None = None, impl: str = "exercise", quiet: bool = True,
          tasks: list[int] | None = None) -> tuple[int, int, list[TaskScore]]:
    """Run the graded tests of ``lessons`` (all by default) against ``impl``; return (earned, total, tasks).

    ``tasks``: grade only these task numbers (of every chosen lesson).
    """
    chosen = [lesson(n) for n in lessons] if lessons else LESSONS
    files = [str(l.test_file) for l in chosen if l.test_file.exists()]
    if not files:
        raise SystemExit("no graded tests found for " + ", ".join(l.nn for l in chosen))
    collector = GradeCollector(tasks)
    args = ["-m", "task", f"--impl={impl}", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
            "-c", str(ROOT / "pyproject.toml"), "--tb=line", "-q", "--no-header"] + files
    pytest.main(args, plugins=[collector])
    tasks = list(collector.tasks.values())
    earned, total, = sum(t.earned for t in tasks), sum(t.points for t in tasks)
    return earned, total, tasks


def _python() -> str:
    """This interpreter as a command that runs from the repository root without activating anything."""
    exe = os.path.abspath(sys.executable)
    try:
        rel = os.path.relpath(exe, ROOT)
    except ValueError:
        return exe
    return rel if not rel.startswith("..") else exe


def details_command(number: int, impl: str = "exercise") -> str:
    """The command that shows lesson ``number``'s failing tests in full, as it can be pasted."""
    item = lesson(number)
    prefix = ""
    other = os.environ.get("COLLECTIVES_EXERCISE_DIR")
    if other:
        prefix = f"COLLECTIVES_EXERCISE_DIR={other} "
    if os.environ.get("COLLECTIVES_TIMEOUT"):
        prefix += f"COLLECTIVES_TIMEOUT={os.environ['COLLECTIVES_TIMEOUT']} "
    test = item.test_file.relative_to(ROOT)
    return f"{prefix}{_python()} -m pytest {test} --impl {impl} -m task -x -q"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collectives grade", description=__doc__.splitlines()[0])
    parser.add_argument("--lesson", action="append", default=[],
                        help="grade only this lesson (e.g. 04); may be repeated")
    parser.add_argument("--impl", choices=["exercise", "reference"], default="exercise",
                        help="what to grade: your exercises (default) or the reference solution")
    parser.add_argument("--exercises", default="",
                        help="grade another copy of lessons/ (a student's submission): the folder "
                             "holding 01_p2p/exercise.py, 02_collectives/exercise.py, ...")
    parser.add_argument("--task", action="append", default=[], type=int,
                        help="grade only this task number (of each chosen lesson); may be repeated")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds a world may run before it counts as hung (default {DEFAULT_TIMEOUT:g}, "
                             "or COLLECTIVES_TIMEOUT)")
    args = parser.parse_args(argv)
    if args.exercises:
        os.environ["COLLECTIVES_EXERCISE_DIR"] = os.path.abspath(args.exercises)
    if args.timeout is not None:
        os.environ["COLLECTIVES_TIMEOUT"] = str(args.timeout)
    _, _, tasks = grade([int(x) for x in args.lesson] or None, args.impl, tasks=args.task)
    earned, total = render(tasks)
    print(f"SCORE {earned}/{total}")
    failing = sorted({t.lesson for t in tasks if not t.passed})
    if failing:
        print("Details of the failures, lesson by lesson (run from the repository root):")
        for n in failing:
            print("  " + details_command(n, args.impl))
    sys.stdout.flush()
    return 0 if total and earned == total else 1
