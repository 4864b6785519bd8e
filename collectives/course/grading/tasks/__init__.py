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

A task also says which routes its worlds offer (``routes``: :data:`P2P` for a task built
from messages, :data:`ANY` where the library's collectives are the design): every call
is recorded by the process group of a graded world (:mod:`~collectives.course.grading.
tasks.fence`), and :func:`run_task` fails a task whose worlds recorded a call outside its
routes, whatever its judge checks.

The modules ``lessonNN`` hold each lesson's probes and judges.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from ....core import launch
from .fence import ANY, P2P
from .world import Grading, InWorldGrading, Run, Verdict

__all__ = ["GradedTask", "tasks_of", "run_task", "Grading", "InWorldGrading", "Run", "Verdict", "ANY", "P2P"]


@dataclass(frozen=True)
class GradedTask:
    lesson: int
    number: int
    title: str
    points: int
    judge: Callable[[Grading], Verdict]
    functions: tuple[str, ...] = ()      # the exercise's names this task writes
    routes: frozenset | None = ANY        # what its worlds offer: fence.P2P (messages only) or ANY


def tasks_of(lesson: int) -> list[GradedTask]:
    """Lesson ``lesson``'s graded tasks, in order."""
    module = importlib.import_module(f"{__name__}.lesson{lesson:02d}")
    return list(module.TASKS)


def run_task(task: GradedTask, grading: Grading) -> Verdict:
    """The task's verdict; a world that hangs or dies fails this task only, saying where.

    Whatever its judge checks, the task fails when any of its worlds recorded what no graded
    code may do (:meth:`Run.problems`: a call outside the task's routes, a forged or moved
    record, a write into the course's tree): every judge gets these checks. A judge that
    cannot read what a rank returned (an object of the student's, say) fails the task with
    a verdict; it never stops the grader.

    The judge runs with one intra-op thread: its expected values are small tensors, and on
    a loaded machine a second thread made a reduction over a few ranks' inputs a thousand
    times slower (the ranks run with one thread already)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    grading.routes, grading.runs = task.routes, []
    try:
        verdict = task.judge(grading)
    except launch.WorldTimeout as exc:
        verdict = Verdict([hang_line(exc, f"lesson {task.lesson} task {task.number}")])
    except launch.RankError as exc:
        verdict = Verdict([f"rank {exc.rank} died: {exc.summary}"])
    except Exception as exc:  # noqa: BLE001 - what a rank returned broke the judge: a verdict, not a crash
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        verdict = Verdict([f"the judge could not read what the ranks returned ({type(exc).__name__}: {first}): "
                           "return plain tensors and numbers"])
    finally:
        torch.set_num_threads(threads)
    seen, first = set(verdict.problems), []
    for run in grading.runs:
        for problem in run.problems():
            if problem not in seen:
                first.append(problem)
                seen.add(problem)
    verdict.problems[:0] = first
    return verdict


def hang_line(exc: launch.WorldTimeout, fallback: str) -> str:
    """One line for a world that hung: where, every stuck rank's wait, and the cycle of
    ranks waiting on each other when there is one ("rank 0 -> rank 1 -> rank 0")."""
    stuck = {r: w for r, w in sorted(exc.waiting.items()) if w != "finished"}
    where = exc.where or fallback
    line = f"the world hung in {where} and was stopped after {exc.seconds:g} s"
    if stuck:
        waits = [f"rank {r} {w.split(', in ')[0]}" for r, w in stuck.items()]
        line += f" ({'; '.join(waits)})"
        cycle = wait_cycle({r: _peer_of(w) for r, w in stuck.items()})
        if cycle:
            line += ": the ranks wait on each other in a cycle, " + " -> ".join(f"rank {r}" for r in cycle)
    return line


def _peer_of(wait: str) -> int | None:
    import re
    match = re.search(r"\b(?:from|to) rank (\d+)", wait)
    return int(match.group(1)) if match else None


def wait_cycle(waits_on: dict[int, int | None]) -> list[int]:
    """The first cycle in "rank r waits on rank waits_on[r]", closed (``[0, 1, 0]``), or []."""
    for start in waits_on:
        path, r = [], start
        while r is not None and r not in path:
            path.append(r)
            r = waits_on.get(r)
        if r is not None and r in path:
            return path[path.index(r):] + [r]
    return []
