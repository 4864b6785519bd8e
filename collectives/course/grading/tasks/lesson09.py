"""Lesson 9's graded tasks: the analyzer's four checks, on dumps of scenarios the student never saw.

For every fault the course knows (a rank that skips a collective, two collectives swapped,
a send-before-receive deadlock, a size or dtype mismatch, a straggler, a killed rank, a
link taken down) and a healthy run whose all-to-alls have uneven splits (where nothing
must be found), the rank draws scenarios from seeds of its own (``os.urandom``, never
the lab's, whose seeds are public), makes every rank's flight-recorder dump of each -- as
the course's recorder writes them (:func:`collectives.debugging.scenario_dumps`) and as
another program might (:func:`collectives.debugging.handmade_dumps`: other function and
file names, the dumps in another order) -- and tells the judge the seeds *before* it
imports the student's code (:meth:`~.world.Probe.note`). Then it hands the dumps to the
student's function, under a time limit (a loop that never ends costs the task, nothing
else).

What comes back is plain data: the rank turns each answer into JSON text (ints, strings,
lists and null only); the judge reads that text, checks every type itself (``bool`` is not
an int; an object of the student's is nothing), and only then compares it with what the
scenario's own parameters say it must find (:func:`collectives.debugging.expected`),
computed after the rank's world has ended. No expected answer exists in any memory the
student's code shares. Every field the docstrings ask for is compared: ``Missing.op``,
``Mismatch.values``, a straggler's ``late_in``, ``of`` and ``median_lag`` too (within
:data:`LAG_TOLERANCE`); a wait cycle's ``waits`` and a straggler's ``worst_seq`` describe
the dumps, not the fault, and are not. A failed case names its fields, the scenario's seed and a
command that replays it.
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from ....debugging import KINDS, draw, expected, handmade_dumps, scenario_dumps
from ....debugging.synth import HEALTHY
from . import GradedTask
from .world import Grading, InWorldGrading, Outcome, Probe, Verdict, outcome_problem

HERE = __name__
GRADED = (*KINDS, HEALTHY)   # every fault, and a healthy run whose all-to-alls have uneven splits
SEEDS_PER_FAULT = 3          # the first as the recorder writes them, the others hand-made
TIMEOUT = 20.0               # seconds for the student's analysis of every scenario of a task

# task -> (the function judged, the key of expected(), the answer's fields)
CHECKS = {
    1: ("find_missing", "missing", ("group", "seq", "op", "missing", "waiting")),
    2: ("find_mismatch", "mismatch", ("group", "seq", "field", "differ", "values")),
    3: ("find_wait_cycle", "cycle", ("ranks",)),
    4: ("find_stragglers", "stragglers", ("group", "rank", "late_in", "of", "median_lag")),
}
_ANSWER = {1: "Missing", 2: "Mismatch", 3: "WaitCycle", 4: "Straggler"}


class NotPlain(TypeError):
    pass


def _plain(value):
    """``value`` as JSON-able plain data, checking every type exactly (no subclass, no object
    that compares equal to anything): ints, strings, tuples and lists of them, None."""
    if value is None or type(value) in (int, str):
        return value
    if type(value) in (tuple, list):
        return [_plain(v) for v in value]
    if type(value) is float and value == value:          # a median lag (not NaN)
        return value
    raise NotPlain(f"a {type(value).__name__} where plain ints, strings and tuples belong")


def _fields(task: int, answer) -> object:
    """The student's answer (its objects) as plain data, field by field."""
    names = CHECKS[task][2]
    if task == 3:
        return None if answer is None else _plain(answer.ranks)
    if type(answer) not in (list, tuple):
        raise NotPlain(f"a {type(answer).__name__}, not a list of {_ANSWER[task]}")
    return [[_plain(getattr(item, name)) for name in names] for item in answer]


def probe_analysis(probe: Probe, task: int, kinds: tuple[str, ...], per_fault: int) -> list:
    """In the rank: draw, note, make the dumps; only then the student's code."""
    scenarios = []
    for kind in kinds:
        for i in range(per_fault):
            seed = int.from_bytes(os.urandom(4), "little") + 1_000_000
            handmade = i > 0
            probe.note((kind, seed, handmade))
            scenarios.append((f"{kind} scenario", (handmade_dumps if handmade else scenario_dumps)(kind, seed)))
    del seed
    fn = probe.student(CHECKS[task][0])
    out = []
    for name, dumps in scenarios:
        outcome = probe.call(name, fn, dumps)
        if not outcome.error:
            try:
                outcome.value = json.dumps(_fields(task, outcome.value))
            except Exception as exc:  # noqa: BLE001 - an answer of the wrong shape
                outcome.value, outcome.error = None, f"returned something else than the answer types: {exc}"
        out.append((outcome.value, outcome.error, outcome.not_written))
    return out


# -- the judge's half: nothing of the rank is trusted -------------------------------------------

def _int(v) -> int:
    if type(v) is not int:
        raise NotPlain(f"{v!r} is not an int")
    return v


def _ints(v) -> tuple[int, ...]:
    if type(v) is not list:
        raise NotPlain(f"{v!r} is not a tuple of ints")
    return tuple(_int(x) for x in v)


def _float(v) -> float:
    if type(v) not in (float, int) or type(v) is bool:
        raise NotPlain(f"{v!r} is not a number of seconds")
    return float(v)


def _str(v) -> str:
    if type(v) is not str:
        raise NotPlain(f"{v!r} is not a string")
    return v


def read_answer(task: int, text) -> object:
    """The rank's JSON text as the tuples :func:`collectives.debugging.expected` gives; every
    type checked here. :class:`NotPlain` for anything else."""
    if type(text) is not str:
        raise NotPlain(f"the answer came back as a {type(text).__name__}, not as plain data")
    data = json.loads(text)
    if task == 3:
        return None if data is None else _ints(data)
    if type(data) is not list:
        raise NotPlain("not a list")
    rows = []
    for row in data:
        if type(row) is not list or len(row) != len(CHECKS[task][2]):
            raise NotPlain(f"{row!r} has not the fields {', '.join(CHECKS[task][2])}")
        if task == 1:
            rows.append((_ints(row[0]), _int(row[1]), _str(row[2]), _ints(row[3]), _ints(row[4])))
        elif task == 2:
            if type(row[4]) is not list:
                raise NotPlain(f"values {row[4]!r} is not a tuple of (rank, value)")
            values = []
            for pair in row[4]:
                if type(pair) is not list or len(pair) != 2:
                    raise NotPlain(f"values holds {pair!r}, not a (rank, value) pair")
                values.append((_int(pair[0]), _str(pair[1])))
            rows.append((_ints(row[0]), _int(row[1]), _str(row[2]), _ints(row[3]), tuple(values)))
        else:
            rows.append((_ints(row[0]), _int(row[1]), _int(row[2]), _int(row[3]), _float(row[4])))
    return rows


LAG_TOLERANCE = 0.005     # seconds: a median lag within this of the culprit's delay is right


def wanted(task: int, kind: str, seed: int):
    """What the scenario's parameters say task ``task`` must answer. A straggler is late in
    every collective after #1 (``steps - 1`` of them), by its delay."""
    if kind == HEALTHY:
        return None if task == 3 else []
    params = draw(kind, seed)
    want = expected(params)[CHECKS[task][1]]
    if task == 4:
        want = [(group, rank, params.steps - 1, params.steps - 1, params.delay) for group, rank in want]
    return want


def same(task: int, want, got) -> bool:
    if task != 4:
        return want == got
    return len(want) == len(got) and all(w[:4] == g[:4] and abs(w[4] - g[4]) <= LAG_TOLERANCE
                                         for w, g in zip(want, got))


def _shown(task: int, answer) -> str:
    """An answer with its field names: ``[Missing(group=(0, 1, 2), seq=5, ...)]``."""
    if task == 3:
        return "None" if answer is None else f"WaitCycle(ranks={answer}, ...)"
    names = CHECKS[task][2]
    return "[" + ", ".join(f"{_ANSWER[task]}(" + ", ".join(f"{n}={v!r}" for n, v in zip(names, row)) + ")"
                           for row in answer) + "]"


def replay(task: int, kind: str, seed: int, handmade: bool, spec: str = "exercise") -> str:
    """A one-line command that runs the student's function on the same scenario."""
    make = "handmade_dumps" if handmade else "scenario_dumps"
    return (f".venv/bin/python -c \"from collectives.course.impl import resolve; from collectives.debugging "
            f"import {make}; print(resolve('{spec}:{CHECKS[task][0]}')({make}('{kind}', {seed})))\"")


def _judge(task: int):
    def judge(grading: Grading) -> Verdict:
        verdict = Verdict()
        name = CHECKS[task][0]
        run = grading.world(f"{HERE}:probe_analysis", 1, task, GRADED, SEEDS_PER_FAULT, timeout=TIMEOUT)
        # in one torchrun world every rank draws, probes and judges its own scenarios
        mine = dist.get_rank() if isinstance(grading, InWorldGrading) else 0
        notes, results = run.notes[mine], run.results[mine]
        noted = all(type(n) is tuple and len(n) == 3 and n[0] in GRADED and type(n[1]) is int and type(n[2]) is bool
                    for n in notes)
        if not noted or type(results) is not list or len(notes) != len(GRADED) * SEEDS_PER_FAULT \
                or len(results) != len(notes):
            verdict.add(f"{name}: the probe's record is incomplete ({len(notes)} scenarios noted)")
            return verdict
        for (kind, seed, handmade), result in zip(notes, results):
            where = f"{name}, a {kind} scenario (seed {seed}{', hand-made dumps' if handmade else ''})"
            if type(result) is not tuple or len(result) != 3:
                verdict.add(f"{where}: no answer came back")
                continue
            value, error, not_written = result
            outcome = Outcome(None, error if type(error) is str else "an error of the wrong type",
                              not_written if type(not_written) is str else "")
            if outcome_problem(where, outcome, verdict):
                continue
            want = wanted(task, kind, seed)                  # computed now, the rank's world has ended
            try:
                got = read_answer(task, value)
            except (NotPlain, ValueError) as exc:
                verdict.add(f"{where}: the answer is not plain data ({exc})")
                continue
            if not same(task, want, got):
                verdict.add(f"{where}: expected {_shown(task, want)}, got {_shown(task, got)}; "
                            f"replay: {replay(task, kind, seed, handmade, grading.spec)}")
        return verdict
    return judge


TASKS = [
    GradedTask(9, 1, "missing rank", 3, _judge(1), ("find_missing",)),
    GradedTask(9, 2, "mismatch by sequence number", 4, _judge(2), ("find_mismatch",)),
    GradedTask(9, 3, "wait-for-graph cycle", 4, _judge(3), ("wait_for_graph", "find_wait_cycle")),
    GradedTask(9, 4, "straggler", 3, _judge(4), ("find_stragglers",)),
]
