"""The graded tasks of every lesson, judged outside the student's process.

One table, read by both ways a student's work is checked, so they cannot disagree:

* ``make check LESSON=04`` (``lessons/04_ring/exercise.py`` run as a script, or under
  ``torchrun``): one PASS/FAIL line per task;
* ``make grade``: the same verdicts, as points.

Each :class:`GradedTask` has a *judge*: a function of the grading process that starts
worlds (:class:`~collectives.course.grading.tasks.world.Grading`), lets the task's *probe* run the
student's code in each rank on inputs drawn from secrets only the judge knows, and decides
from what comes back -- the outputs, and every message each rank made, recorded where the
student's code cannot edit it (:mod:`~collectives.course.grading.tasks.tap`). Nothing computed in
a rank is trusted as a verdict. A task is judged on its own function and the earlier
tasks' only, so a partial solution scores exactly its solved tasks.

The modules ``lessonNN`` hold each lesson's probes and judges.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from ....core import launch
from .world import Grading, InWorldGrading, Run, Verdict

__all__ = ["GradedTask", "tasks_of", "run_task", "Grading", "InWorldGrading", "Run", "Verdict"]


@dataclass(frozen=True)
class GradedTask:
    lesson: int
    number: int
    title: str
    points: int
    judge: Callable[[Grading], Verdict]
    functions: tuple[str, ...] = ()      # the exercise's names this task writes


def tasks_of(lesson: int) -> list[GradedTask]:
    """Lesson ``lesson``'s graded tasks, in order."""
    module = importlib.import_module(f"{__name__}.lesson{lesson:02d}")
    return list(module.TASKS)


def run_task(task: GradedTask, grading: Grading) -> Verdict:
    """The task's verdict; a world that hangs or dies fails this task only, saying where.

    The judge runs with one intra-op thread: its expected values are small tensors, and on
    a loaded machine a second thread made a reduction over a few ranks' inputs a thousand
    times slower (the ranks run with one thread already)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return task.judge(grading)
    except launch.WorldTimeout as exc:
        stuck = [f"rank {r} {w}" for r, w in sorted(exc.waiting.items()) if w != "finished"]
        where = exc.where or f"lesson {task.lesson} task {task.number}"
        line = f"the world hung in {where} and was stopped after {exc.seconds:g} s"
        if stuck:
            line += f" ({stuck[0].split(', in ')[0]}{'; ...' if len(stuck) > 1 else ''})"
        return Verdict([line])
    except launch.RankError as exc:
        return Verdict([f"rank {exc.rank} died: {exc.summary}"])
    finally:
        torch.set_num_threads(threads)
