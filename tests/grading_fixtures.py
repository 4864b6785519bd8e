"""Grading a fixture in process: a copy of ``lessons/`` with one lesson's exercise replaced by
a whole exercise file from ``tests/`` (a cheat, a mistake, a student's solution), judged by
``grade.grade`` as ``make grade`` judges it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from collectives.course.catalog import ROOT, lesson
from collectives.course.grading import grade as grading
from collectives.course.grading.grade import TaskScore


def with_exercise(number: int, fixture: Path, into: Path) -> Path:
    """A copy of ``lessons/`` at ``into`` whose lesson ``number`` has ``fixture`` as its
    exercise; returns ``into``."""
    shutil.copytree(ROOT / "lessons", into)
    shutil.copy(fixture, into / lesson(number).exercise.parent.name / "exercise.py")
    return into


def scores(number: int, impl: str = "exercise", exercises: Path | None = None,
           tasks: list[int] | None = None, world: int | None = None) -> dict[int, TaskScore]:
    """Every (or each of ``tasks``) task of lesson ``number`` graded on ``impl``, the exercises
    read from ``exercises`` (a copy of ``lessons/``) when given: task -> its score."""
    before = os.environ.get("COLLECTIVES_EXERCISE_DIR")
    if exercises is not None:
        os.environ["COLLECTIVES_EXERCISE_DIR"] = str(exercises)
    try:
        _, _, graded = grading.grade([number], impl, tasks=tasks, world=world)
    finally:
        if exercises is not None:
            if before is None:
                os.environ.pop("COLLECTIVES_EXERCISE_DIR")
            else:
                os.environ["COLLECTIVES_EXERCISE_DIR"] = before
    return {s.task: s for s in graded}


def grader(number: int, impl: str = "exercise", exercises: Path | None = None,
           tasks: list[int] | None = None, world: int | None = None) -> dict[int, tuple[bool, str]]:
    """As ``scores``: task -> (full marks, the judge's result)."""
    return {task: (s.earned == s.points > 0, s.result)
            for task, s in scores(number, impl, exercises, tasks, world).items()}


def grade_fixture(number: int, fixture: Path, into: Path, tasks: list[int] | None = None,
                  world: int | None = None) -> dict[int, TaskScore]:
    """``fixture`` graded as lesson ``number``'s exercise (in a copy of ``lessons/`` at ``into``)."""
    return scores(number, exercises=with_exercise(number, fixture, into), tasks=tasks, world=world)


@contextlib.contextmanager
def shm_cleared(prefix: str) -> Iterator[None]:
    """On the way out, remove what a fixture's ranks left in /dev/shm under ``prefix``-<this
    process's id>-* (they name their files after their parent)."""
    try:
        yield
    finally:
        for leftover in Path("/dev/shm").glob(f"{prefix}-{os.getpid()}-*"):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def finished_worlds_side_channels_removed() -> None:
    """Remove the folders the side-channel cheats left in /dev/shm (``side-<world>``, named
    after the launcher's folder of that world) for every world that has ended: its folder
    under the temporary directory is gone. A world still running, on the other pytest worker,
    keeps its own."""
    import tempfile

    for leftover in Path("/dev/shm").glob("side-collectives-world-*"):
        world = leftover.name[len("side-"):]
        if not (Path(tempfile.gettempdir()) / world).exists():
            shutil.rmtree(leftover, ignore_errors=True)
