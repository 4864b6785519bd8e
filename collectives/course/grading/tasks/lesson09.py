"""Lesson 9's graded tasks: the analyzer's four checks, on dumps of scenarios the student never saw.

For every fault the course knows (a rank that skips a collective, two collectives swapped,
a send-before-receive deadlock, a size or dtype mismatch, a straggler, a killed rank, a
link taken down), the judge draws scenarios from seeds of its own, at random on every run
(never the lab's, whose seeds are public), makes every rank's flight-recorder dump of each
(:func:`collectives.debugging.scenario_dumps`), and hands the dumps to the student's
function in a rank of its own, under a time limit (a loop that never ends costs the task,
nothing else). What the function names -- group, sequence number, ranks, field -- is
compared with what the scenario's own parameters say it must find
(:func:`collectives.debugging.expected`), for every fault: finding a problem where there
is none fails too.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ....debugging import KINDS, draw, expected, scenario_dumps
from . import GradedTask
from .world import Grading, InWorldGrading, Probe, Verdict, outcome_problem

HERE = __name__
SEEDS_PER_FAULT = 3
TIMEOUT = 20.0       # seconds for the student's analysis of every scenario of a task

# task -> (the function judged, the key of expected(), how its answer reads as plain data)
CHECKS = {
    1: ("find_missing", "missing"),
    2: ("find_mismatch", "mismatch"),
    3: ("find_wait_cycle", "cycle"),
    4: ("find_stragglers", "stragglers"),
}


def _plain(task: int, answer):
    """The student's answer as the tuples :func:`collectives.debugging.expected` gives."""
    if task == 1:
        return [(m.group, m.seq, m.missing, m.waiting) for m in answer]
    if task == 2:
        return [(m.group, m.seq, m.field, m.differ) for m in answer]
    if task == 3:
        return answer.ranks if answer else None
    return [(s.group, s.rank) for s in answer]


def probe_analysis(probe: Probe, task: int, scenarios: list[tuple[str, list[dict]]]) -> list:
    fn = probe.student(CHECKS[task][0])
    out = []
    for name, dumps in scenarios:
        outcome = probe.call(name, fn, dumps)
        if not outcome.error:
            try:
                outcome.value = _plain(task, outcome.value)
            except Exception as exc:  # noqa: BLE001 - an answer of the wrong shape
                outcome.value, outcome.error = None, f"returned something else than the answer types: {exc}"
        out.append(outcome)
    return out


def _judge(task: int):
    def judge(grading: Grading) -> Verdict:
        verdict = Verdict()
        name, key = CHECKS[task]
        scenarios, wanted = [], []
        for kind in KINDS:
            for _ in range(SEEDS_PER_FAULT):
                seed = 1_000_000 + int.from_bytes(os.urandom(4), "little")   # never the lab's, never told
                scenarios.append((f"{kind} scenario", scenario_dumps(kind, seed)))
                wanted.append(expected(draw(kind, seed))[key])
        run = grading.world(f"{HERE}:probe_analysis", 1, task, scenarios, timeout=TIMEOUT)
        for problem in run.problems():
            verdict.add(problem)
        # in one torchrun world every rank draws, probes and judges its own scenarios
        mine = dist.get_rank() if isinstance(grading, InWorldGrading) else 0
        for (label, _), want, outcome in zip(scenarios, wanted, run.results[mine]):
            where = f"{name}, a {label}"
            if outcome_problem(where, outcome, verdict):
                continue
            if outcome.value != want:
                verdict.add(f"{where}: expected {want}, got {outcome.value}")
        return verdict
    return judge


TASKS = [
    GradedTask(9, 1, "missing rank", 3, _judge(1), ("find_missing",)),
    GradedTask(9, 2, "mismatch by sequence number", 4, _judge(2), ("find_mismatch",)),
    GradedTask(9, 3, "wait-for-graph cycle", 4, _judge(3), ("wait_for_graph", "find_wait_cycle")),
    GradedTask(9, 4, "straggler", 3, _judge(4), ("find_stragglers",)),
]
