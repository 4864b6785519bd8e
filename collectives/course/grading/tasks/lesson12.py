"""Lesson 12's graded tasks: the flag barrier, the one-shot and the two-shot all-reduce.

The barrier (task 1) on worlds of 2 and 4 ranks: each rank enters eight barriers after a
delay drawn from its secret, and the probe (the judge's code in the rank) stamps when it
entered and left each one on the machine's monotonic clock. The judge asks that no rank
left a barrier before the last one entered it, and none long after; that the flags hold
the epoch after every barrier (a flag reset to 0 is the hazard the lesson teaches); that
no message was sent; and that a rank whose peer never comes raises ``TimeoutError``
naming itself instead of waiting for ever.

The all-reduces (tasks 2 and 3) on worlds of 1 to 4 ranks, every input drawn from the
secrets, the workspaces made by the probe before the first case: the harness's cases
judged bit for bit as every all-reduce of the course, and every call held to the design
-- no call of ``torch.distributed`` at all in the data path (the tap records every
message, collective and store access under the student's code), one barrier per
one-shot, two per two-shot, and the two-shot's reduced chunk written into the rank's own
slot, where its peers gather it from.
"""

from __future__ import annotations

import random
import time

import torch

from ....core.ops import chunk_bounds
from ... import verify
from ...verify import Case
from . import GradedTask
from .allreduce import CaseRecord, expected_output, judge_cases, judge_expanded
from .world import Grading, Probe, Verdict, outcome_problem

HERE = __name__
BARRIERS = 8
SIZES = (1, 2, 3, 4)
BARRIER_SIZES = (2, 4)
LATE = 0.5          # seconds a rank may still sit in a barrier after the last one entered it


# ---- task 1: the barrier -----------------------------------------------------------------

def probe_barrier(probe: Probe) -> dict:
    from collectives.symmetric.workspace import SharedWorkspace

    barrier = probe.student("flag_barrier")
    ws = SharedWorkspace(None, 64, timeout=5.0)       # a barrier that loses an arrival ends in 5 s
    draw = random.Random(probe.seed("barrier delays"))
    stamps, flags = [], []
    for k in range(BARRIERS):
        time.sleep(draw.choice((0.0, 0.0, 0.002, 0.02, 0.08)))
        entered = time.monotonic()
        outcome = probe.call(f"barrier {k}", barrier, ws)
        left = time.monotonic()
        if outcome.error or outcome.not_written:
            return {"outcome": outcome}
        stamps.append((entered, left))
        flags.append([int(f) for f in ws.flags.tolist()])
    return {"outcome": outcome, "stamps": stamps, "flags": flags, "epoch": int(ws.epoch)}


def probe_lonely_barrier(probe: Probe):
    """Rank 0 enters a barrier rank 1 never comes to: it must raise, within its timeout."""
    from collectives.symmetric.workspace import SharedWorkspace

    ws = SharedWorkspace(None, 64, timeout=0.5)
    if probe.rank != 0:
        return None                    # never arrives (the launcher keeps the rank up until the end)
    started = time.monotonic()
    outcome = probe.call("lonely barrier", probe.student("flag_barrier"), ws)
    return outcome, time.monotonic() - started


def _barrier(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(*BARRIER_SIZES):
        run = grading.world(f"{HERE}:probe_barrier", size)
        for problem in run.problems():
            verdict.add(problem)
        for rank, got in enumerate(run.results):
            if outcome_problem(f"flag_barrier, world of {size}, rank {rank}", got["outcome"], verdict):
                break
        if verdict.not_written or verdict.problems:
            return verdict
        for k in range(BARRIERS):
            where = f"flag_barrier, world of {size}, barrier {k}"
            last_in = max(r["stamps"][k][0] for r in run.results)
            for rank, got in enumerate(run.results):
                left = got["stamps"][k][1]
                if left < last_in:
                    verdict.add(f"{where}: rank {rank} left {1e3 * (last_in - left):.1f} ms before the last rank "
                                "entered: a barrier lets nobody through until everyone has arrived")
                elif left - last_in > LATE:
                    verdict.add(f"{where}: rank {rank} left {left - last_in:.2f} s after the last rank entered: "
                                "it should leave as soon as every flag is up")
                if min(got["flags"][k]) < k + 1 and size > 1:
                    verdict.add(f"{where}: rank {rank} saw flags {got['flags'][k]} after it; they must hold the "
                                f"epoch ({k + 1}): a flag reset on the way out can hide an arrival from a slow peer")
                calls = [c for c in run.of(rank, f"barrier {k}") if not c.kind.startswith(("store.", "backend."))]
                if calls:
                    verdict.add(f"{where}: rank {rank} called {sorted({c.kind for c in calls})} of "
                                "torch.distributed: the barrier is made of flags in shared memory alone")
            if len(verdict.problems) > 10:
                return verdict
        for rank, got in enumerate(run.results):
            if got["epoch"] != BARRIERS:
                verdict.add(f"flag_barrier, world of {size}, rank {rank}: ws.epoch is {got['epoch']} after "
                            f"{BARRIERS} barriers; count them in ws.epoch")
        if verdict.problems:
            return verdict
    verdict.add(_lonely(grading))
    return verdict


def _lonely(grading: Grading) -> str | None:
    run = grading.world(f"{HERE}:probe_lonely_barrier", 2, timeout=max(grading.timeout, 15.0))
    outcome, seconds = run.results[0]
    if outcome.not_written:
        return None
    if not outcome.error:
        return "flag_barrier, world of 2: rank 0 passed a barrier rank 1 never entered"
    if "Timeout" not in outcome.error.split(":")[0] or "rank 0" not in outcome.error:
        return ("flag_barrier, world of 2: rank 0 waited for a peer that never came and raised "
                f"{outcome.error}; raise ws.timed_out(...) (a TimeoutError naming the rank) after ws.timeout s")
    if seconds > 5.0:
        return f"flag_barrier, world of 2: rank 0 gave up after {seconds:.1f} s; ws.timeout was 0.5 s"
    return None


# ---- tasks 2 and 3: the all-reduces ------------------------------------------------------

def task_cases(p: int) -> list[Case]:
    """The harness's covering set at 3 ranks, the quick set elsewhere, and one call
    of 4099 int64 elements whose two-shot chunks are read back from the workspace."""
    depth = "full" if p == 3 else "quick"
    cases = verify.default_cases(p, quick=depth == "quick", large=p == 2)
    cases.append(Case(4099, torch.int64, verify.ReduceOp.SUM))
    return list({c.name: c for c in cases}.values())


def probe_all_reduce(probe: Probe, name: str, cases: list[Case]) -> dict:
    import torch.distributed as dist

    from collectives.symmetric.workspace import workspace

    fn = probe.student(name)
    groups = {}
    for case in cases:                  # every rank makes every group, in the same order
        if case.group is not None and case.group not in groups:
            groups[case.group] = dist.new_group(list(case.group))
    largest = max(c.numel * torch.empty(0, dtype=c.dtype).element_size() for c in cases)
    spaces = {None: workspace(None, largest)}   # made here: no case may need a message
    for key, group in groups.items():
        if probe.rank in key:
            spaces[key] = workspace(group, largest)
    records = {}
    for case in cases:
        if case.group is not None and probe.rank not in case.group:
            continue
        grank = probe.rank if case.group is None else case.group.index(probe.rank)
        tensor, base = verify.make_input(case, grank, probe.secret)
        extra = {} if case.group is None else {"group": groups[case.group]}
        ws = spaces[case.group]
        epoch, calls = ws.epoch, ws.calls
        outcome = probe.call(case.name, fn, tensor, op=case.op, **extra)
        outcome.value = None
        record = CaseRecord(outcome, tensor.detach().clone(memory_format=torch.contiguous_format))
        if base is not None and case.layout == "strided":
            record.gaps_ok = not bool((base[1::2] != verify.SENTINEL).any())
        own = None
        if ws.calls == calls + 1 and case.numel:
            lo, hi = chunk_bounds(case.numel, ws.size)[ws.rank]
            own = ws.slot((ws.calls - 1) % 2 if ws.two_buffers else 0, ws.rank, case.dtype,
                          case.numel)[lo:hi].clone()
        records[case.name] = {"record": record, "barriers": int(ws.epoch - epoch), "calls": int(ws.calls - calls),
                              "own_chunk": own}
    return records


def _pattern(name: str):
    barriers = 1 if name == "one_shot_all_reduce" else 2

    def pattern(case, p, rank, calls):
        # the store and the backend are judged by Run.problems (check mode's own store traffic is the course's)
        calls = [c for c in calls if not c.kind.startswith(("store.", "backend."))]
        if calls:
            kinds = sorted({c.kind for c in calls})
            return (f"called {', '.join(kinds)} of torch.distributed in the data path: the ranks read each "
                    "other's slots in shared memory, and send nothing")
        return None
    return pattern, barriers


def _judge_all_reduce(name: str):
    def judge(grading: Grading) -> Verdict:
        verdict = Verdict()
        pattern, barriers = _pattern(name)
        for size in grading.sizes(*SIZES):
            cases = task_cases(size)
            run = grading.world(f"{HERE}:probe_all_reduce", size, name, cases)
            extras = run.results
            run.results = [{k: v["record"] for k, v in r.items()} for r in extras]
            judge_cases(run, cases, verdict, what=name, pattern=pattern)
            if verdict.not_written or verdict.problems:
                break
            for case in cases:
                members = list(case.group) if case.group is not None else list(range(size))
                for i, r in enumerate(members):
                    got = extras[r][case.name]
                    where = f"{name}, world of {size}, rank {r}, case {case.name}"
                    if case.numel and got["calls"] != 1:
                        verdict.add(f"{where}: began {got['calls']} calls on the group's workspace "
                                    "(ws.begin), expected 1")
                    elif case.numel and len(members) > 1 and got["barriers"] != barriers:
                        verdict.add(f"{where}: passed {got['barriers']} barriers, expected {barriers}")
                    elif name == "two_shot_all_reduce" and case.values == "int" and case.numel >= len(members) \
                            and case.layout == "contiguous":
                        verdict.add(_own_chunk(run, case, members, i, got["own_chunk"], where))
                if len(verdict.problems) > 10:
                    break
            if verdict.problems:
                break
        if verdict.ok:
            judge_expanded(grading, name, verdict)
        return verdict
    return judge


def _own_chunk(run, case: Case, members: list[int], i: int, own, where: str) -> str | None:
    inputs = [verify.make_values(case, j, run.secrets[r]) for j, r in enumerate(members)]
    lo, hi = chunk_bounds(case.numel, len(members))[i]
    expected = expected_output(case, inputs)[lo:hi]
    if own is None or not isinstance(own, torch.Tensor) or own.shape != expected.shape \
            or not torch.equal(own.to(expected.dtype), expected):
        return (f"{where}: after the call, chunk {i} of this rank's slot does not hold the reduced chunk "
                f"{i}: the two-shot reduces chunk r into rank r's own slot, and its peers gather it from there")
    return None


TASKS = [
    GradedTask(12, 1, "the flag barrier", 3, _barrier, ("flag_barrier",)),
    GradedTask(12, 2, "one-shot all-reduce", 4, _judge_all_reduce("one_shot_all_reduce"), ("one_shot_all_reduce",)),
    GradedTask(12, 3, "two-shot all-reduce", 4, _judge_all_reduce("two_shot_all_reduce"), ("two_shot_all_reduce",)),
]
