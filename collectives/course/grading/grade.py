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

A class run (``--exercises`` repeated) grades every folder whatever one of them does: a
task whose judge cannot read what a rank returned scores 0 with a verdict, a folder that
cannot be graded at all scores 0 with the reason, and ``--json`` is written in the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    def needs(self) -> int | None:
        """The earlier task of the same lesson this one failed for (its stub stopped this task)."""
        m = re.search(r"Lesson (\d+), task (\d+)", self.verdict.first_line())
        if m and int(m.group(1)) == self.lesson and int(m.group(2)) != self.task:
            return int(m.group(2))
        return None

    @property
    def result(self) -> str:
        if self.passed:
            return "pass"
        if self.needs is not None:
            return f"fail: needs task {self.needs}, {self.verdict.first_line()}"
        return "fail: " + self.verdict.first_line()

    def as_dict(self) -> dict:
        return {"lesson": self.lesson, "task": self.task, "title": self.title, "points": self.points,
                "earned": self.earned, "passed": self.passed, "needs_task": self.needs, "result": self.result}

    @property
    def earned(self) -> int:
        return self.points if self.passed else 0


WIDTH = 100     # the table fits a 100-column terminal, one line per task


def render(tasks: list[TaskScore], console=None) -> tuple[int, int]:
    from rich import box
    from rich.console import Console
    from rich.markup import escape as rich_escape
    from rich.table import Table

    table = Table(title="Collectives from Scratch — grade", box=box.SIMPLE_HEAD, padding=(0, 1),
                  collapse_padding=True, pad_edge=False)
    for col in ("lesson", "task", "title", "points", "result"):
        right = col in ("lesson", "task", "points")
        table.add_column(col, justify="right" if right else "left", no_wrap=True, overflow="ellipsis",
                         max_width={"title": 34, "result": 46}.get(col),
                         min_width={"lesson": 6, "task": 4, "points": 6}.get(col))
    for t in sorted(tasks, key=lambda t: (t.lesson, t.task)):
        result = "[green]pass[/]" if t.passed else "[red]fail[/]" + rich_escape(t.result[4:])
        table.add_row(f"{t.lesson:02d}", str(t.task), t.title, f"{t.earned}/{t.points}", result)
    earned = sum(t.earned for t in tasks)
    total = sum(t.points for t in tasks)
    table.add_section()
    table.add_row("", "", "[bold]total[/]", f"[bold]{earned}/{total}[/]", "")
    if console is None:
        console = Console()
        console = Console(width=min(console.width, WIDTH) if console.is_terminal else WIDTH)
    console.print(table, width=min(console.width, WIDTH))
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
    parser.add_argument("--exercises", action="append", default=[],
                        help="grade another copy of lessons/ (a student's submission): the folder "
                             "holding 01_p2p/exercise.py, 02_collectives/exercise.py, ...; repeat it "
                             "for a class, one folder per student")
    parser.add_argument("--json", default="",
                        help="also write one record per student (folder, score, every task) to this file")
    parser.add_argument("--task", action="append", default=[], type=int,
                        help="grade only this task number (of each chosen lesson); may be repeated")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds a world may run before it counts as hung (default {DEFAULT_TIMEOUT:g}, "
                             "or COLLECTIVES_TIMEOUT)")
    parser.add_argument("--world", type=int, default=None,
                        help="judge on worlds of this size only (a quick look; full marks need every size)")
    args = parser.parse_args(argv)
    saved = {name: os.environ.get(name) for name in ("COLLECTIVES_TIMEOUT", "COLLECTIVES_EXERCISE_DIR")}
    if args.timeout is not None:
        os.environ["COLLECTIVES_TIMEOUT"] = str(args.timeout)
    students = [os.path.abspath(d) for d in args.exercises] or [""]
    records, code = [], 0
    try:
        for folder in students:
            if folder:
                os.environ["COLLECTIVES_EXERCISE_DIR"] = folder
                print(f"== {folder}")
            try:
                code = max(code, _grade_one(args, records, folder))
            except Exception as exc:  # noqa: BLE001 - one folder never stops a class run
                what = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                print(f"SCORE 0 (this folder could not be graded: {what})")
                records.append({"student": os.path.basename(folder) if folder else args.impl,
                                "exercises": folder or None, "impl": args.impl, "earned": 0, "total": None,
                                "world": args.world, "error": what, "tasks": []})
                code = 1
            _write_json(args.json, records)      # after each folder: what was graded stays written
    finally:
        _write_json(args.json, records)
        for name, value in saved.items():     # called in a process that goes on (a test, a lab):
            if value is None:                 # the environment is left as it was found
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return code


def _write_json(path: str, records: list[dict]) -> None:
    if path:
        with open(path + ".part", "w", encoding="utf-8") as f:
            json.dump(records, f, indent=1, ensure_ascii=False)
        os.replace(path + ".part", path)


def _grade_one(args, records: list[dict], folder: str) -> int:
    _, _, tasks = grade([int(x) for x in args.lesson] or None, args.impl, tasks=args.task, world=args.world)
    earned, total = render(tasks)
    records.append({"student": os.path.basename(folder) if folder else args.impl, "exercises": folder or None,
                    "impl": args.impl, "earned": earned, "total": total, "world": args.world,
                    "tasks": [t.as_dict() for t in sorted(tasks, key=lambda t: (t.lesson, t.task))]})
    print(f"SCORE {earned}/{total}" + (f"  (judged on worlds of {args.world} only: a quick look, not a grade)"
                                         if args.world else ""))
    failing = sorted({t.lesson for t in tasks if not t.passed})
    if failing:
        print("Details of the failures, lesson by lesson (run from the repository root):")
        for n in failing:
            print("  " + details_command(n, args.impl))
    sys.stdout.flush()
    return 0 if total and earned == total else 1
