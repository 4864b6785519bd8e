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
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
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
    parser = argparse.ArgumentParser(description=f"Lesson {lesson}: check the exercise tasks")
    parser.add_argument("--world", type=int, default=4, help="ranks, when not started by torchrun (default 4)")
    parser.add_argument("--task", type=int, action="append", default=[], help="check only this task; may be repeated")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds a task's world may run before it counts as hung (default {DEFAULT_TIMEOUT:g})")
    parser.add_argument("--verbose", "-v", action="store_true", help="every failing rank's details and traceback")
    args = parser.parse_args(argv)
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
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    trace.install(rank)
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
