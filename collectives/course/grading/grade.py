"""``make grade``: every lesson's graded tasks, judged outside the student's process, as points.

The tasks and their judges are :mod:`collectives.course.grading.tasks` -- the same table
``make check`` reads, so the two cannot disagree. Each task runs in worlds of its own
under one time limit (``--timeout``): a task that hangs scores 0 and says where it hung
("the world hung in ring_all_reduce (case n=1001 float32 SUM, world of 4) ..."); the other
tasks are graded as usual. A task scores its points when its judge finds no problem. The
exit code is 0 only for a full score, so ``make grade`` on the untouched stubs prints 0
and fails.

The grader's worlds run without check mode: the student's code never shares the store
with the course's own checks, and a rank that reaches the store scores 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from ..catalog import DEFAULT_TIMEOUT, LESSONS, ROOT, lesson, world_timeout
from ..impl import spec_for
from .tasks import Grading, Verdict, run_task, tasks_of


@dataclass
class TaskScore:
    lesson: int
    task: int
    title: str
    points: int
    verdict: Verdict

    @property
    def passed(self) -> bool:
        return self.verdict.ok

    @property
    def result(self) -> str:
        return "pass" if self.passed else "fail: " + self.verdict.first_line()

    @property
    def earned(self) -> int:
        return self.points if self.passed else 0


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
          tasks: list[int] | None = None, timeout: float | None = None,
          world: int | None = None) -> tuple[int, int, list[TaskScore]]:
    """Judge the graded tasks of ``lessons`` (all by default) on ``impl``; return (earned, total, scores).

    ``tasks``: grade only these task numbers (of every chosen lesson). ``world``: judge every
    task on worlds of this size only (the runner's ``--world``), not on the sizes it names.
    """
    chosen = [lesson(n) for n in lessons] if lessons else LESSONS
    scores = []
    for item in chosen:
        grading = Grading(spec_for(item.number, impl), timeout=timeout or world_timeout(), check=False,
                          world_size=world)
        for task in tasks_of(item.number):
            if tasks and task.number not in tasks:
                continue
            scores.append(TaskScore(item.number, task.number, task.title, task.points, run_task(task, grading)))
            if not quiet:
                print(f"lesson {item.number} task {task.number}: {scores[-1].result[:100]}", flush=True)
    return sum(t.earned for t in scores), sum(t.points for t in scores), scores


def _python() -> str:
    """This interpreter as a command that runs from the repository root without activating anything."""
    exe = os.path.abspath(sys.executable)
    try:
        rel = os.path.relpath(exe, ROOT)
    except ValueError:
        return exe
    return rel if not rel.startswith("..") else exe


def details_command(number: int, impl: str = "exercise") -> str:
    """The command that shows lesson ``number``'s problems in full, as it can be pasted."""
    item = lesson(number)
    limit = os.environ.get("COLLECTIVES_TIMEOUT")
    prefix = f"COLLECTIVES_TIMEOUT={limit} " if limit else ""
    other = os.environ.get("COLLECTIVES_EXERCISE_DIR")
    path = os.path.join(other, item.exercise.parent.name, "exercise.py") if other else item.exercise.relative_to(ROOT)
    return f"{prefix}{_python()} {path} --verbose" + (" --impl reference" if impl == "reference" else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives grade", description=__doc__.splitlines()[0])
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
    parser.add_argument("--world", type=int, default=None,
                        help="judge on worlds of this size only (a quick look; full marks need every size)")
    args = parser.parse_args(argv)
    if args.exercises:
        os.environ["COLLECTIVES_EXERCISE_DIR"] = os.path.abspath(args.exercises)
    if args.timeout is not None:
        os.environ["COLLECTIVES_TIMEOUT"] = str(args.timeout)
    _, _, tasks = grade([int(x) for x in args.lesson] or None, args.impl, tasks=args.task, world=args.world)
    earned, total = render(tasks)
    print(f"SCORE {earned}/{total}" + (f"  (judged on worlds of {args.world} only: a quick look, not a grade)"
                                         if args.world else ""))
    failing = sorted({t.lesson for t in tasks if not t.passed})
    if failing:
        print("Details of the failures, lesson by lesson (run from the repository root):")
        for n in failing:
            print("  " + details_command(n, args.impl))
    sys.stdout.flush()
    return 0 if total and earned == total else 1
