"""What an exercise file runs when started as a script.

Every ``lessons/NN_topic/exercise.py`` ends with::

    if __name__ == "__main__":
        run_tasks(LESSON, [Task(1, "ping_pong", check_ping_pong), ...])

Under ``torchrun --nproc-per-node 4 lessons/NN_topic/exercise.py`` each rank joins the
world torchrun set up, runs every task's check and prints one PASS/FAIL line per task.
Run as plain ``python lessons/NN_topic/exercise.py``, it starts a local world of 4 ranks
itself (``--world N`` for another size). Check mode is on (``COLLECTIVES_CHECK=1``, see
:mod:`collectives.core.ops`): ranks that call a course collective with different arguments
get an error naming them. A check returns a :class:`~collectives.course.verify.Report`
or raises; a stub's ``NotImplementedError`` is reported as "not implemented yet".
"""

from __future__ import annotations

import argparse
import datetime
import os
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
        print(f"[rank {rank}] lesson {lesson} task {task.number} {task.title}: {verdict}"
              + (f"\n    {detail}" if detail else ""), flush=True)
    return lines


def run_tasks(lesson: int, tasks: list[Task], argv: list[str] | None = None) -> None:
    """Check every task on every rank and exit non-zero if any failed."""
    parser = argparse.ArgumentParser(description=f"Lesson {lesson}: check the exercise tasks")
    parser.add_argument("--world", type=int, default=4, help="ranks, when not started by torchrun")
    args = parser.parse_args(argv)
    # Ranks that disagree on a call's arguments get an error naming them (COLLECTIVES_CHECK=0: off).
    os.environ.setdefault("COLLECTIVES_CHECK", "1")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        trace.install(dist.get_rank())
        results = _run_checks(lesson, tasks)
        failed = any(not ok for _, _, ok, _ in results)
        # no destroy_process_group(): it would wait for every peer; exit instead
        sys.stdout.flush()
        os._exit(1 if failed else 0)
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
