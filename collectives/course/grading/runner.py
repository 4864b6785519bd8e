"""What an exercise file runs when started as a script: the graded tasks, one line each.

Every ``lessons/NN_topic/exercise.py`` ends with::

    if __name__ == "__main__":
        run_tasks(LESSON)

``.venv/bin/python lessons/NN_topic/exercise.py`` judges each of the lesson's graded tasks
(:mod:`collectives.course.grading.tasks`) on the functions of that file, exactly as ``make grade``
does -- the same worlds, the same judge -- and prints ONE line per task (PASS, or FAIL and
the first problem: which rank, which case, what differed) and a summary. ``--task K``
checks one task, ``--world N`` runs every world of N ranks instead of the task's own
sizes, ``--timeout S`` sets how long a world may run before it counts as hung,
``--verbose`` prints every problem, and ``--impl reference`` checks the reference
solution instead. A task that hangs costs its own line, which says where it hung.

The judging does not happen in the process that ran the exercise's module-level code: the
script hands over at once to a fresh interpreter (``python -m
collectives.course.grading.runner --check-lesson N --exercise FILE``), which imports the
exercise only in its ranks, as ``make grade`` does. Whatever the exercise patches when it
is imported reaches no verdict.

Under ``.venv/bin/torchrun --nproc-per-node 4 lessons/NN_topic/exercise.py`` (and one
torchrun per machine on the simulated cluster) the probes run in torchrun's world, the
ranks meet each other's records through the rendezvous store, and rank 0 prints the same
lines. Every rank exits 0 there -- the verdict is in the lines. The checks share those
processes with the student's code, so they are a check, not a grade, and say so: the grade is
``make grade``'s, judged where the student's code cannot reach.

Check mode is on in the runner's worlds (``COLLECTIVES_CHECK=1``, see
:mod:`collectives.core.checkmode`): ranks that call a course collective with different
arguments get an error naming them. The grader runs without it.

``.venv/bin/python -m collectives.course.grading.runner --all`` runs every lesson's tasks in one torchrun
world (or a local one), after checking that ``dist.all_reduce`` itself agrees across it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
from dataclasses import dataclass

import torch.distributed as dist

from ...core import trace
from ..catalog import DEFAULT_TIMEOUT, lesson, world_timeout
from .tasks import GradedTask, Grading, InWorldGrading, Verdict, run_task, tasks_of
from .tasks.world import link_bytes_sent


@dataclass
class Task:
    """A task an exercise file used to list for :func:`run_tasks`; the list is now ignored."""

    number: int
    title: str
    check: object = None


IMPL_ENV = "COLLECTIVES_EXERCISE_IMPL"
"""``reference``: exercise scripts check the reference solution instead of the stubs."""


def task_line(task: GradedTask, verdict: Verdict, verbose: bool = False) -> str:
    """ONE line for a task (more with ``verbose``)."""
    head = f"task {task.number} {task.title}:"
    if verdict.ok:
        return f"{head} PASS"
    line = f"{head} FAIL: {verdict.first_line()}"
    if verbose and len(verdict.problems) > 1:
        line += "".join(f"\n  {p}" for p in verdict.problems)
    if verbose:
        hint = next_step(verdict)
        line += f"\n  next: {hint}" if hint else ""
    return line


_NEXT_STEPS = (
    ("not written yet", "write the function the line names; its docstring says what it takes, returns and "
                        "which course functions it may call"),
    ("this task allows", "build it from dist.send, dist.recv (isend, irecv, batch_isend_irecv) and the course's "
                         "helpers: the library's collectives are not offered in this task's worlds"),
    ("in a cycle", "each rank in the cycle waits for the next: post the receive before the send, or pair them "
                   "(dist.batch_isend_irecv, ops.sendrecv)"),
    ("the world hung", "the ranks named wait for messages no rank sends: compare each rank's sends with its "
                       "peer's receives (sizes, order, peers)"),
    ("did not carry", "send the block itself (a slice of the tensor you hold), not other data of the right size"),
    ("elements, but at least", "the data must travel in the messages: a rank learns the others' data only "
                               "from what it receives"),
    ("not evidence", "write only the function asked for: the course's records are its own"),
    ("changed the course's own code", "write only in your exercise file: the course's package is not yours"),
    ("could not read what the ranks returned", "return what the docstring says: tensors, numbers, lists of them"),
)
"""What ``--verbose`` (``make check VERBOSE=1``) adds to a failing task: the next step for
the first problem the verdict names, by what its text says."""


def next_step(verdict: Verdict) -> str | None:
    """The next step for a failing verdict's first problem (a table of problems and what to do next), or None."""
    first = verdict.first_line()
    return next((hint for words, hint in _NEXT_STEPS if words in first), None)


def _say(text: str) -> None:
    # one write per report: ranks sharing a pipe (under torchrun) do not cut into each other's lines
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


_EXERCISE: dict[int, str] = {}      # lesson -> the exercise file run as a script (judged afresh)


def exercise_spec(number: int, impl: str) -> str:
    """What the runner checks: the reference module, or the exercise file being run."""
    if impl == "reference":
        return lesson(number).module
    if number in _EXERCISE:
        return _EXERCISE[number]                  # the exercise file that was run, judged here afresh
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path and path.endswith(".py") and getattr(main, "LESSON", None) == number:
        return os.path.abspath(path)              # the exercise file being run, wherever it is
    other = os.environ.get("COLLECTIVES_EXERCISE_DIR")     # an instructor's copy of lessons/
    if other:
        return os.path.join(other, lesson(number).exercise.parent.name, "exercise.py")
    return str(lesson(number).exercise)


def check_lesson(number: int, spec: str, *, tasks: list[int] | None = None, world: int | None = None,
                 timeout: float | None = None, check: bool = True) -> list[tuple[GradedTask, Verdict]]:
    """Every (chosen) task of lesson ``number`` judged on ``spec`` in local worlds."""
    grading = Grading(spec, timeout=timeout or world_timeout(), check=check, world_size=world)
    return [(task, run_task(task, grading)) for task in _pick(tasks_of(number), tasks or [])]


def _pick(tasks: list[GradedTask], numbers: list[int]) -> list[GradedTask]:
    if not numbers:
        return tasks
    unknown = sorted(set(numbers) - {t.number for t in tasks})
    if unknown:
        raise SystemExit(f"no task {unknown[0]}; the tasks are " + ", ".join(str(t.number) for t in tasks))
    return [t for t in tasks if t.number in numbers]


def run_tasks(number: int, tasks=None, argv: list[str] | None = None) -> None:
    """Check lesson ``number``'s graded tasks, print one line per task and a summary; exit
    non-zero if any failed (locally; under torchrun every rank exits 0, see the module doc).
    ``tasks`` is ignored: the tasks are the course's table."""
    parser = argparse.ArgumentParser(description=f"Lesson {number}: check the exercise's graded tasks")
    parser.add_argument("--world", type=int, default=None,
                        help="run every world with this many ranks (default: each task's own sizes)")
    parser.add_argument("--task", type=int, action="append", default=[], help="check only this task; may be repeated")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds a world may run before it counts as hung (default {DEFAULT_TIMEOUT:g})")
    parser.add_argument("--verbose", "-v", action="store_true", help="every problem, not only the first")
    parser.add_argument("--impl", choices=("exercise", "reference"), default=os.environ.get(IMPL_ENV, "exercise"),
                        help="check the exercise (default) or the reference solution")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="nccl: on GPUs; the cases drawn on a rank's device hold GPU tensors, "
                             "whose messages still cross through the grader; the collectives a task "
                             "allows run on NCCL (on gloo through host copies when ranks share GPUs)")
    args = parser.parse_args(argv)
    spec = exercise_spec(number, args.impl)
    timeout = args.timeout if args.timeout is not None else world_timeout()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        _under_torchrun(number, spec, args.task, timeout, args.verbose)
    if _ran_as_script(number):
        _judge_elsewhere(number, spec, sys.argv[1:] if argv is None else argv)
    passed = total = 0
    grading = Grading(spec, timeout=timeout, check=True, world_size=args.world, gpus=args.backend == "nccl")
    for task in _pick(tasks_of(number), args.task):
        verdict = run_task(task, grading)
        passed += verdict.ok
        total += 1
        print(task_line(task, verdict, args.verbose), flush=True)
    print(f"lesson {number}: {passed} of {total} tasks pass"
          + ("" if passed == total or args.verbose else "  (--verbose for every problem)"))
    sys.exit(0 if passed == total else 1)


def _ran_as_script(number: int) -> bool:
    """True when this process is the exercise file run as a script: its module-level code
    has run here, so nothing here is fit to judge it."""
    main = sys.modules.get("__main__")
    return getattr(main, "LESSON", None) == number and str(getattr(main, "__file__", "")).endswith(".py") \
        and os.environ.get(_FRESH_ENV) != "1"


_FRESH_ENV = "COLLECTIVES_FRESH_JUDGE"


def _judge_elsewhere(number: int, spec: str, argv: list[str]) -> None:
    """Judge in a fresh interpreter that never ran the exercise's module-level code (the
    ranks import the exercise, as ``make grade``'s do), and end with its exit code: what
    the exercise patches in this process when it is imported cannot reach the verdicts."""
    sys.stdout.flush()
    command = [sys.executable, "-m", __spec__.name, "--check-lesson", str(number), "--exercise", spec, *argv]
    os.execve(sys.executable, command, {**os.environ, _FRESH_ENV: "1"})


# In torchrun's world the checks run in the processes that run the student's code: they check,
# they do not grade. ``make grade`` judges in processes the student's code never shares
# (results read back as plain data, expected answers made after the world ended).
IN_WORLD_NOTE = ("(checked in torchrun's world, inside the processes your code runs in: a check, not a grade; "
                 "make grade judges where your code cannot reach)")


def _init_from_torchrun(timeout: float | None = None) -> None:
    timeout = world_timeout() if timeout is None else timeout
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    trace.install(dist.get_rank())


def _costs(grading: InWorldGrading, rounds: int) -> str:
    """Every rank's time in the task's probes and the bytes each machine's links sent in them,
    exchanged through the store: "  (0.41-0.43 s per rank; links: machine 0 sent 3.1 MB, ...)"."""
    import pickle

    iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    sent = grading.probe_link_bytes if link_bytes_sent() is not None else None
    mine = (grading.probe_seconds, os.environ.get("GROUP_RANK", "0"), iface, sent)
    store = dist.distributed_c10d._get_default_store()
    keys = [f"collectives/costs/{rounds}/{r}" for r in range(dist.get_world_size())]
    store.set(keys[dist.get_rank()], pickle.dumps(mine))
    store.wait(keys)
    every = [pickle.loads(v) for v in store.multi_get(keys)]
    times = sorted(t for t, *_ in every)
    text = f"{times[0]:.2f}-{times[-1]:.2f} s per rank" if len(times) > 1 else f"{times[0]:.2f} s"
    per_machine: dict[str, dict[str, int]] = {}      # machine -> its interfaces' bytes sent
    for _, machine, name, nbytes in every:
        if nbytes is not None:
            per_machine.setdefault(machine, {})[name] = nbytes
    if per_machine:
        text += "; links: " + ", ".join(f"machine {m} sent {sum(v.values()) / 1e6:.1f} MB"
                                        for m, v in sorted(per_machine.items()))
    return f"  ({text})"


def _in_world(number: int, grading: InWorldGrading, chosen: list[int],
              costs: bool = False) -> list[tuple[GradedTask, Verdict, str]]:
    """Every chosen task in this world; after a hang the world is broken and the rest are not
    run. ``costs``: each task's time per rank and the bytes its links sent (for the lines)."""
    out, hung = [], ""
    for i, task in enumerate(_pick(tasks_of(number), chosen)):
        if hung:
            out.append((task, Verdict([f"not run: the world hung earlier, in {hung}"]), ""))
            continue
        grading.reset_costs()
        try:
            verdict = run_task(task, grading)
        except (RuntimeError, TimeoutError, dist.DistBackendError) as exc:  # a gloo timeout: this world can do no more
            hung = trace.current_context() or f"lesson {number} task {task.number}"
            verdict = Verdict([f"the world hung in {hung}: {str(exc).splitlines()[0][:200]}"])
        except Exception as exc:  # noqa: BLE001 - the judge's own failure is not the world's
            verdict = Verdict([f"the grader could not judge this task ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0][:160] if str(exc) else ''}): please report it"])
        out.append((task, verdict, _costs(grading, i) if costs and not hung else ""))
    return out


def _under_torchrun(number: int, spec: str, chosen: list[int], timeout: float, verbose: bool) -> None:
    _init_from_torchrun(timeout)
    results = _in_world(number, InWorldGrading(spec, timeout=timeout), chosen, costs=True)
    extra = _lesson_timing(number, spec, {task.number: verdict.ok for task, verdict, _ in results})
    if dist.get_rank() == 0:
        for task, verdict, costs in results:
            _say(task_line(task, verdict, verbose) + costs)
        if extra:
            _say(extra)
        passed = sum(v.ok for _, v, _ in results)
        _say(f"lesson {number}: {passed} of {len(results)} tasks pass on torchrun's world of {dist.get_world_size()}")
        _say(IN_WORLD_NOTE)
    _exit_without_teardown(False)


def _lesson_timing(number: int, spec: str, verdicts: dict[int, bool]) -> str | None:
    """A lesson's own timing line after its tasks (lesson 7 on several machines: the
    student's hierarchy against the flat ring and the reference), or None."""
    module = importlib.import_module(f"{__package__}.tasks.lesson{number:02d}")
    timed = getattr(module, "in_world_timing", None)
    if timed is None:
        return None
    try:
        return timed(spec, verdicts)
    except Exception as exc:  # noqa: BLE001 - a timing that fails costs no verdict
        return f"timing: not measured ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"


def _exit_without_teardown(failed: bool) -> None:
    # no destroy_process_group(): it would wait for every peer; exit instead
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


# ---------------------------------------------------------------------------------------
# Every lesson in one world: ``.venv/bin/python -m collectives.course.grading.runner --all``

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


def _run_all(numbers: list[int], impl: str, timeout: float) -> list[tuple[int, str, bool, str]]:
    """Every lesson's tasks in this world. Every rank says whether ``dist.all_reduce`` agrees
    across the world (and where it sits); rank 0 prints every task's verdict."""
    rank = dist.get_rank()
    problems = check_all_reduce_agrees()
    where = ", ".join(f"{k}={os.environ[k]}" for k in ("GROUP_RANK", "LOCAL_RANK") if k in os.environ)
    _say(f"[rank {rank}] dist.all_reduce agrees across {dist.get_world_size()} ranks"
         f"{f' ({where})' if where else ''}: {'PASS' if not problems else 'FAIL'}"
         + "".join(f"\n    {p}" for p in problems))
    lines = [(0, "dist.all_reduce agrees", not problems, "; ".join(problems))]
    for number in numbers:
        spec = lesson(number).module if impl == "reference" else str(lesson(number).exercise)
        for task, verdict, _ in _in_world(number, InWorldGrading(spec, timeout=timeout), []):
            lines.append((number, f"task {task.number} {task.title}", verdict.ok, verdict.first_line()))
            if rank == 0 or not verdict.ok:      # another rank speaks only when it judged otherwise
                _say(f"{'' if rank == 0 else f'[rank {rank}] '}[lesson {number}] task {task.number} {task.title}: "
                     + ("PASS" if verdict.ok else "FAIL: " + verdict.first_line()))
    return lines


def main(argv: list[str] | None = None) -> int:
    """``.venv/bin/python -m collectives.course.grading.runner --all [--impl reference] [--lesson N ...]``."""
    from ..catalog import LESSONS

    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives.course.grading.runner",
                                     description="run the exercises' graded tasks, every lesson in one world")
    parser.add_argument("--all", action="store_true", help="every lesson (default when no --lesson)")
    parser.add_argument("--lesson", action="append", default=[], help="a lesson number (repeatable)")
    parser.add_argument("--impl", choices=("exercise", "reference"), default=os.environ.get(IMPL_ENV, "exercise"))
    parser.add_argument("--world", type=int, default=4, help="ranks, when not started by torchrun")
    parser.add_argument("--timeout", type=float, default=None, help="seconds a world may wait before it is hung")
    handed = argparse.ArgumentParser(add_help=False)      # an exercise run as a script (_judge_elsewhere)
    handed.add_argument("--check-lesson", type=int, default=None)
    handed.add_argument("--exercise", default=None)
    over, rest = handed.parse_known_args(argv)
    if over.check_lesson is not None:
        os.environ[_FRESH_ENV] = "1"
        _EXERCISE[over.check_lesson] = over.exercise
        run_tasks(over.check_lesson, argv=rest)
    args = parser.parse_args(rest)
    numbers = [int(n) for n in args.lesson] if args.lesson and not args.all else [item.number for item in LESSONS]
    timeout = args.timeout or world_timeout(60)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        _init_from_torchrun(timeout)
        lines = _run_all(numbers, args.impl, timeout)
        failed = [line for line in lines if not line[2]]
        if dist.get_rank() == 0:
            _say(f"rank 0: {len(lines) - len(failed)} of {len(lines)} checks pass")
            _say(IN_WORLD_NOTE)
        _exit_without_teardown(bool(failed))
    from ...core import launch

    try:
        per_rank = launch.run(_run_all, args.world, args=(numbers, args.impl, timeout), timeout=600, check=True)
    except (launch.RankError, launch.WorldTimeout) as exc:
        print(exc)
        return 1
    lines = per_rank[0]
    failed = [line for line in lines if not line[2]]
    print(f"{len(lines) - len(failed)} of {len(lines)} checks pass on all {args.world} ranks")
    return 1 if failed else 0


if __name__ == "__main__":
    # the exercises import this module by its name: run that one, not a second copy
    sys.exit(importlib.import_module(__spec__.name).main())
