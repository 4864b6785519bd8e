"""What an exercise file runs when started as a script.

Every ``lessons/NN_topic/exercise.py`` ends with::

    if __name__ == "__main__":
        run_tasks(LESSON, [Task(1, "ping_pong", check_ping_pong), ...])

Under ``torchrun --nproc-per-node 4 lessons/NN_topic/exercise.py`` each rank joins the
world torchrun set up, runs every task's check and prints one PASS/FAIL line per task.
Run as plain ``python lessons/NN_topic/exercise.py``, it starts a local world of 4 ranks
itself (``--world N`` for another size). A check returns a :class:`~collectives.course.verify.Report`
or raises; a stub's ``NotImplementedError`` is reported as "not implemented yet".

``--impl reference`` (or ``COLLECTIVES_EXERCISE_IMPL=reference`` in the environment, which
reaches every rank torchrun starts) runs the same checks against the reference solution:
the exercise's functions and classes are replaced by the reference module's of the same
name. ``python -m collectives.course.runner --all`` runs every lesson's checks in one
world -- under torchrun too, across several machines -- after checking that
``dist.all_reduce`` itself agrees across that world.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import runpy
import sys
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from ..core import trace
from .verify import Report


@dataclass
class Task:
    number: int
    title: str
    check: Callable[[], Report | None]   # runs on every rank; raises or returns a Report


def _say(text: str) -> None:
    # one write per report: ranks sharing a pipe (under torchrun) do not cut into each other's lines
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _run_checks(lesson: int, tasks: list[Task]) -> list[tuple[int, str, bool, str]]:
    rank = dist.get_rank()
    lines = []
    for task in tasks:
        try:
            report = task.check()
            ok = report is None or report.ok
            detail = "" if ok else report.summary(limit=3)
        except NotImplementedError as exc:
            ok, detail = False, f"not implemented yet ({exc})"
        except Exception as exc:  # noqa: BLE001 - a failing task must not hide the next
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        lines.append((task.number, task.title, ok, detail))
        verdict = "PASS" if ok else "FAIL"
        _say(f"[rank {rank}] lesson {lesson} task {task.number} {task.title}: {verdict}"
             + (f"\n    {detail}" if detail else ""))
    return lines


IMPL_ENV = "COLLECTIVES_EXERCISE_IMPL"
"""``reference``: exercise scripts check the reference solution instead of the stubs."""

_collecting: list[tuple[int, list[Task]]] | None = None   # set while --all gathers the lessons


class _Collected(Exception):
    """Raised by :func:`run_tasks` while ``--all`` gathers an exercise's tasks."""


def use_reference(lesson: int, tasks: list[Task]) -> list[str]:
    """Point the exercise's functions and classes at the reference solution's.

    Every public callable the exercise module defines and the lesson's reference module
    (:data:`collectives.course.catalog.LESSONS`) also has is replaced, in the module the checks
    read them from; returns the names replaced.
    """
    from .catalog import lesson as find

    reference = importlib.import_module(find(lesson).module)
    replaced = set()
    for task in tasks:
        names = task.check.__globals__
        for name, obj in list(names.items()):
            if (not name.startswith("_") and callable(obj) and hasattr(reference, name)
                    and getattr(obj, "__module__", None) == names.get("__name__")):
                names[name] = getattr(reference, name)
                replaced.add(name)
    return sorted(replaced)


def _init_from_torchrun() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    trace.install(dist.get_rank())


def _exit_without_teardown(failed: bool) -> None:
    # no destroy_process_group(): it would wait for every peer; exit instead
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


def run_tasks(lesson: int, tasks: list[Task], argv: list[str] | None = None) -> None:
    """Check every task on every rank and exit non-zero if any failed."""
    if _collecting is not None:
        _collecting.append((lesson, tasks))
        raise _Collected
    parser = argparse.ArgumentParser(description=f"Lesson {lesson}: check the exercise tasks")
    parser.add_argument("--world", type=int, default=4, help="ranks, when not started by torchrun")
    parser.add_argument("--impl", choices=("exercise", "reference"),
                        default=os.environ.get(IMPL_ENV, "exercise"),
                        help="check the exercise (default) or the reference solution")
    args = parser.parse_args(argv)
    if args.impl == "reference":
        use_reference(lesson, tasks)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        _init_from_torchrun()
        results = _run_checks(lesson, tasks)
        _exit_without_teardown(any(not ok for _, _, ok, _ in results))
    from ..core import launch

    try:
        per_rank = launch.run(_run_checks, args.world, args=(lesson, tasks), timeout=180)
    except (launch.RankError, launch.WorldTimeout) as exc:
        print(exc)
        sys.exit(1)
    failed = [(n, t) for lines in per_rank for n, t, ok, _ in lines if not ok]
    passed = len(tasks) - len({n for n, _ in failed})
    print(f"lesson {lesson}: {passed} of {len(tasks)} tasks pass on all {args.world} ranks")
    sys.exit(1 if failed else 0)


# ---------------------------------------------------------------------------------------
# Every lesson in one world: ``python -m collectives.course.runner --all``

def collect(exercise: str) -> tuple[int, list[Task]]:
    """Run an exercise file as a script up to its ``run_tasks`` call; its lesson and tasks."""
    global _collecting
    _collecting = []
    try:
        runpy.run_path(exercise, run_name="__main__")
    except _Collected:
        pass
    finally:
        found, _collecting = _collecting, None
    if not found:
        raise RuntimeError(f"{exercise} never called run_tasks")
    return found[0]


def check_all_reduce_agrees() -> list[str]:
    """``dist.all_reduce`` of integer data equals its closed form, bit for bit, on every rank."""
    import torch

    rank, p = dist.get_rank(), dist.get_world_size()
    problems = []
    for dtype in (torch.int64, torch.float32):
        x = torch.arange(1000, dtype=dtype) * (rank + 1)
        dist.all_reduce(x)
        expected = torch.arange(1000, dtype=dtype) * (p * (p + 1) // 2)
        if not torch.equal(x, expected):
            index = int((x != expected).nonzero()[0])
            problems.append(f"{dtype}: index {index} is {x[index].item()}, expected {expected[index].item()}")
    return problems


def _run_all(plan: list[tuple[int, list[Task]]]) -> list[tuple[int, int, str, bool, str]]:
    rank = dist.get_rank()
    problems = check_all_reduce_agrees()
    where = ", ".join(f"{k}={os.environ[k]}" for k in ("GROUP_RANK", "LOCAL_RANK") if k in os.environ)
    _say(f"[rank {rank}] dist.all_reduce agrees across {dist.get_world_size()} ranks"
         f"{f' ({where})' if where else ''}: {'PASS' if not problems else 'FAIL'}"
         + "".join(f"\n    {p}" for p in problems))
    lines = [(0, 0, "dist.all_reduce agrees", not problems, "; ".join(problems))]
    for lesson, tasks in plan:
        lines += [(lesson, *line) for line in _run_checks(lesson, tasks)]
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m collectives.course.runner --all [--impl reference] [--lesson N ...]``."""
    from .catalog import LESSONS, lesson as find

    parser = argparse.ArgumentParser(prog="python -m collectives.course.runner",
                                     description="run the exercises' checks, every lesson in one world")
    parser.add_argument("--all", action="store_true", help="every lesson (default when no --lesson)")
    parser.add_argument("--lesson", action="append", default=[], help="a lesson number (repeatable)")
    parser.add_argument("--impl", choices=("exercise", "reference"),
                        default=os.environ.get(IMPL_ENV, "exercise"))
    parser.add_argument("--world", type=int, default=4, help="ranks, when not started by torchrun")
    args = parser.parse_args(argv)
    chosen = [find(n) for n in args.lesson] if args.lesson and not args.all else LESSONS
    plan = []
    for item in chosen:
        lesson, tasks = collect(str(item.exercise))
        if args.impl == "reference":
            use_reference(lesson, tasks)
        plan.append((lesson, tasks))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        _init_from_torchrun()
        lines = _run_all(plan)
        failed = [line for line in lines if not line[3]]
        if dist.get_rank() == 0:
            print(f"rank 0: {len(lines) - len(failed)} of {len(lines)} checks pass", flush=True)
        _exit_without_teardown(bool(failed))
    from ..core import launch

    try:
        per_rank = launch.run(_run_all, args.world, args=(plan,), timeout=600)
    except (launch.RankError, launch.WorldTimeout) as exc:
        print(exc)
        return 1
    failed = {(line[0], line[1]) for lines in per_rank for line in lines if not line[3]}
    total = len(per_rank[0])
    print(f"{total - len(failed)} of {total} checks pass on all {args.world} ranks")
    return 1 if failed else 0


if __name__ == "__main__":
    # the exercises import this module by its name: run that one, not a second copy
    sys.exit(importlib.import_module(__spec__.name).main())
