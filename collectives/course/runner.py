"""What an exercise file runs when started as a script.

Every ``lessons/NN_topic/exercise.py`` ends with::

    if __name__ == "__main__":
        run_tasks(LESSON, [Task(1, "ping_pong", check_ping_pong), ...])

``.venv/bin/python lessons/NN_topic/exercise.py`` starts a local world of 4 ranks per task
(``--world N`` for another size, ``--task K`` for one task, ``--timeout S`` for the time a
world may take before it counts as hung, ``--verbose`` for every rank's details) and prints
ONE line per task: PASS, or FAIL with the first failing rank's message and which ranks
agree with it; then a summary line. A task that hangs costs its own line only, and the
line names the function and the case it hung in.

Under ``.venv/bin/torchrun --nproc-per-node 4 lessons/NN_topic/exercise.py`` the tasks run
one after another in torchrun's world; rank 0 collects every rank's results through the
rendezvous store and prints the same lines. Every rank exits 0 there -- the verdict is in
the lines -- so torchrun does not add a ``ChildFailedError`` report of its own.

A check returns a :class:`~collectives.course.verify.Report` or raises; a stub's
``NotImplementedError`` is reported as "not implemented yet"; an exception's message says
where it was raised in the exercise file.

``--impl reference`` (or ``COLLECTIVES_EXERCISE_IMPL=reference`` in the environment, which
reaches every rank torchrun starts) runs the same checks against the reference solution:
the exercise's functions and classes are replaced by the reference module's of the same
name. ``python -m collectives.course.runner --all`` runs every lesson's checks in one
world -- under torchrun too, across several machines -- after checking that
``dist.all_reduce`` itself agrees across that world; it prints every rank's line per task.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pickle
import runpy
import sys
import traceback
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from ..core import trace
from .catalog import DEFAULT_TIMEOUT, world_timeout
from .verify import Report, is_timeout, where_raised


@dataclass
class Task:
    number: int
    title: str
    check: Callable[[], Report | None]   # runs on every rank; raises or returns a Report


@dataclass
class Outcome:
    """One rank's result for one task."""

    ok: bool
    detail: str = ""      # first line: the message; further lines: more cases
    full: str = ""        # the whole traceback, for --verbose


def _run_one(task: Task) -> Outcome:
    try:
        with trace.context(f"task {task.number} ({task.title})"):
            report = task.check()
        if report is None or report.ok:
            return Outcome(True)
        bad = report.failures
        if all("raised NotImplementedError" in r.detail for r in bad):
            return Outcome(False, "not implemented yet (" + bad[0].detail.split(": ", 1)[1].split(" (")[0] + ")")
        return Outcome(False, report.summary(limit=3))
    except NotImplementedError as exc:
        return Outcome(False, f"not implemented yet ({exc})")
    except Exception as exc:  # noqa: BLE001 - a failing task must not hide the next
        hung = is_timeout(exc)
        where = trace.current_context()
        if hung:
            message = f"the world hung{f' in {where}' if where else ''}: {str(exc).splitlines()[0][:200]}"
        else:
            message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where_raised(exc)}"
        return Outcome(False, message, traceback.format_exc())


def _run_in_rank(tasks: list[Task]) -> list[Outcome]:
    return [_run_one(task) for task in tasks]


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def summarise(task: Task, outcomes: list[Outcome], verbose: bool = False) -> tuple[bool, str]:
    """ONE line for a task (more with ``verbose``): PASS, or FAIL, the first failing rank's
    message, and which ranks failed the same way."""
    head = f"task {task.number} {task.title}:"
    failed = [r for r, o in enumerate(outcomes) if not o.ok]
    if not failed:
        return True, f"{head} PASS"
    first = outcomes[failed[0]].detail
    first_line = first.splitlines()[0] if first else "failed"
    same = [r for r in failed if outcomes[r].detail.splitlines()[:1] == first.splitlines()[:1]]
    others = [r for r in failed if r not in same]
    who = _ranks(same) if len(outcomes) > 1 else ""
    line = f"{head} FAIL" + (f" on {who}" if who else "") + f": {first_line}"
    if len(first.splitlines()) > 1:
        line += f"; first: {first.splitlines()[1].strip()}"
    if others:
        line += f" ({_ranks(others)} failed differently)"
    if verbose:
        for r, o in enumerate(outcomes):
            if not o.ok:
                line += f"\n  --- rank {r} ---\n  " + (o.full or o.detail).rstrip().replace("\n", "\n  ")
    return False, line


def _hang_line(task: Task, exc, verbose: bool) -> str:
    where = exc.where or f"task {task.number}"
    line = f"task {task.number} {task.title}: FAIL: the world hung in {where} and was stopped after {exc.seconds:g} s"
    stuck = [f"rank {r} {w}" for r, w in sorted(exc.waiting.items()) if w != "finished"]
    if stuck:
        line += f" ({stuck[0].split(', in ')[0]}{'; ...' if len(stuck) > 1 else ''})"
    if verbose:
        line += "\n  " + str(exc).replace("\n", "\n  ")
    return line


def _say(text: str) -> None:
    # one write per report: ranks sharing a pipe (under torchrun) do not cut into each other's lines
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _run_checks(lesson: int, tasks: list[Task]) -> list[tuple[int, str, bool, str]]:
    """Every task on this rank, one line per task and rank (the ``--all`` mode's report)."""
    rank = dist.get_rank()
    lines = []
    for task in tasks:
        outcome = _run_one(task)
        lines.append((task.number, task.title, outcome.ok, outcome.detail))
        _say(f"[rank {rank}] lesson {lesson} task {task.number} {task.title}: {'PASS' if outcome.ok else 'FAIL'}"
             + (f"\n    {outcome.detail}" if outcome.detail else ""))
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


def _init_from_torchrun(timeout: float | None = None) -> None:
    timeout = world_timeout() if timeout is None else timeout
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    trace.install(dist.get_rank())


def _exit_without_teardown(failed: bool) -> None:
    # no destroy_process_group(): it would wait for every peer; exit instead
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


def _pick(tasks: list[Task], numbers: list[int]) -> list[Task]:
    if not numbers:
        return tasks
    unknown = sorted(set(numbers) - {t.number for t in tasks})
    if unknown:
        raise SystemExit(f"no task {unknown[0]}; the tasks are " + ", ".join(str(t.number) for t in tasks))
    return [t for t in tasks if t.number in numbers]


def run_tasks(lesson: int, tasks: list[Task], argv: list[str] | None = None) -> None:
    """Check the tasks, print one line per task and a summary; exit non-zero if any failed
    (locally; under torchrun every rank exits 0, see the module doc)."""
    if _collecting is not None:
        _collecting.append((lesson, tasks))
        raise _Collected
    parser = argparse.ArgumentParser(description=f"Lesson {lesson}: check the exercise tasks")
    parser.add_argument("--world", type=int, default=4, help="ranks, when not started by torchrun (default 4)")
    parser.add_argument("--task", type=int, action="append", default=[], help="check only this task; may be repeated")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds a task's world may run before it counts as hung (default {DEFAULT_TIMEOUT:g})")
    parser.add_argument("--verbose", "-v", action="store_true", help="every failing rank's details and traceback")
    parser.add_argument("--impl", choices=("exercise", "reference"),
                        default=os.environ.get(IMPL_ENV, "exercise"),
                        help="check the exercise (default) or the reference solution")
    args = parser.parse_args(argv)
    if args.impl == "reference":
        use_reference(lesson, tasks)
    timeout = args.timeout if args.timeout is not None else world_timeout()
    chosen = _pick(tasks, args.task)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        _under_torchrun(lesson, chosen, timeout, args.verbose)
    from ..core import launch

    passed = 0
    for task in chosen:
        try:
            outcomes = launch.run(_run_in_rank, args.world, args=([task],), timeout=timeout)
            ok, line = summarise(task, [o[0] for o in outcomes], args.verbose)
        except launch.WorldTimeout as exc:
            ok, line = False, _hang_line(task, exc, args.verbose)
        except launch.RankError as exc:
            ok = False
            line = f"task {task.number} {task.title}: FAIL: rank {exc.rank} died: {exc.summary}"
            if args.verbose:
                line += "\n  " + str(exc).replace("\n", "\n  ")
        passed += ok
        print(line, flush=True)
    print(f"lesson {lesson}: {passed} of {len(chosen)} tasks pass on a world of {args.world}"
          + ("" if passed == len(chosen) or args.verbose else "  (--verbose for every rank's details)"))
    sys.exit(0 if passed == len(chosen) else 1)


def _under_torchrun(lesson: int, tasks: list[Task], timeout: float, verbose: bool) -> None:
    _init_from_torchrun(timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    results: list[Outcome] = []
    hung = ""
    for task in tasks:
        if hung:
            results.append(Outcome(False, f"not run: the world hung earlier, in {hung}"))
            continue
        outcome = _run_one(task)
        if not outcome.ok and outcome.detail.startswith("the world hung"):
            hung = outcome.detail[len("the world hung in "):].split(":")[0] or f"task {task.number}"
        results.append(outcome)
    # Through the store, not a collective: it works after a hang too.
    store.set(f"runner/{lesson}/{rank}", pickle.dumps(results))
    if rank == 0:
        per_rank = []
        for r in range(world):
            try:
                per_rank.append(pickle.loads(store.get(f"runner/{lesson}/{r}")))
            except Exception:  # noqa: BLE001 - a rank that never reported
                per_rank.append([Outcome(False, f"rank {r} sent no result")] * len(tasks))
        passed = 0
        for i, task in enumerate(tasks):
            ok, line = summarise(task, [rows[i] for rows in per_rank], verbose)
            passed += ok
            print(line, flush=True)
        print(f"lesson {lesson}: {passed} of {len(tasks)} tasks pass on torchrun's world of {world}", flush=True)
        store.set(f"runner/{lesson}/done", b"1")
    else:
        try:
            store.wait([f"runner/{lesson}/done"])   # rank 0 hosts the store: stay until it has read
        except Exception:  # noqa: BLE001
            pass
    # no destroy_process_group(): it would wait for every peer; exit instead
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
        _init_from_torchrun(world_timeout(60))
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
