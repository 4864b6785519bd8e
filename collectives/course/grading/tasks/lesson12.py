"""Lesson 12's graded tasks: the flag barrier, the one-shot and the two-shot all-reduce.

The barrier (task 1) on worlds of 2 and 4 ranks: each rank enters eight barriers after a
delay drawn from its secret -- rank 0 twice for longer than a third of a second, so that a
barrier that naps once and goes on is seen leaving early -- and the probe (the judge's code
in the rank) stamps when it entered and left each one, on a clock taken when this module
was imported, before the student's. The judge asks that no rank left a barrier before the
last one entered it, and none long after; that the flags hold the epoch after every barrier
(a flag reset to 0 is the hazard the lesson teaches); that no message was sent -- no call
of ``torch.distributed`` recorded by the fence under the process group, where every route to
a collective ends (:mod:`.fence`); and that a rank whose peer never comes raises
``TimeoutError`` naming itself, neither before nor long after its timeout (drawn afresh).

The all-reduces (tasks 2 and 3) on worlds of 1 to 4 ranks, every input drawn from a secret
of its own, drawn for the call, told to the judge before any of the student's code runs and
then dropped (no answer can be rebuilt from what the rank holds, nor kept from an earlier
call): the harness's cases judged bit for bit as every all-reduce of the course, and every
call held to the design -- no call of ``torch.distributed`` in the data path, by the fence's
record (a library's own methods and a silenced tap end in the fence; functional collectives
find no backend under it; work done round it shows in gloo's own count), one barrier per
one-shot, two per two-shot, and the two-shot's reduced chunk written into the rank's own
slot, where its peers gather it from. A broken design is reported before wrong values: it is
the cause.
"""

from __future__ import annotations

import os
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
LONG = (0.4, 0.7)   # rank 0's two long delays (s): longer than a nap-once barrier's 0.3 s
LONELY = (0.4, 1.2)  # the lonely barrier's timeout (s), drawn afresh each run
HELD = 0.1          # seconds a rank pauses, at two barriers, between raising its flag and looking

# Taken at import, before the student's module is imported: patching ``time`` afterwards
# changes none of the stamps.
_NOW, _SLEEP = time.monotonic, time.sleep


def _plain(value, kind=int):
    """``value`` as plain data the judge can read, or None where the student's code left
    something else there (a mock, an object of its own)."""
    try:
        if kind is list:
            return [int(v) for v in value.tolist()]
        return kind(value)
    except Exception:  # noqa: BLE001 - anything the student put there
        return None


# ---- task 1: the barrier -----------------------------------------------------------------

def probe_barrier(probe: Probe) -> dict:
    import torch.distributed as dist

    from collectives.symmetric.workspace import SharedWorkspace

    barrier = probe.student("flag_barrier")
    ws = SharedWorkspace(None, 64, timeout=5.0)       # a barrier that loses an arrival ends in 5 s
    seed = torch.tensor([probe.seed("barrier delays") & (2 ** 62 - 1)])
    dist.broadcast(seed, 0)                           # one schedule for the world, drawn by rank 0
    delays, held = _schedule(int(seed), probe.rank)

    def hold(point, w):                               # after raising its flag, before looking
        if point == "posted" and w.epoch - 1 in held:
            _SLEEP(HELD)
    ws.pause = hold
    stamps, flags = [], []
    for k in range(BARRIERS):
        _SLEEP(delays[k])
        entered = _NOW()
        outcome = probe.call(f"barrier {k}", barrier, ws)
        left = _NOW()
        if outcome.error or outcome.not_written:
            return {"outcome": outcome, "failed_at": k, "epoch": _plain(ws.epoch),
                    "seen": _plain(ws.flags, list)}
        stamps.append((entered, left))
        flags.append(_plain(ws.flags, list))
    return {"outcome": outcome, "stamps": stamps, "flags": flags, "epoch": _plain(ws.epoch)}


def _schedule(seed: int, rank: int) -> tuple[list[float], set[int]]:
    """Rank ``rank``'s delay before each barrier, and the barriers after which it pauses
    :data:`HELD` s between raising its flag and looking. Rank 0 comes late twice (:data:`LONG`: a
    barrier that naps once and goes on leaves before it arrives), and comes at once to the
    barriers where the others pause and to the one after, so that its flag is already the
    next epoch when they look (a barrier that waits for flags *equal* to its epoch then
    waits for ever)."""
    draw = random.Random(seed)
    late = set(draw.sample(range(1, BARRIERS), 2))
    held = set(draw.sample([k for k in range(BARRIERS - 1) if k not in late and k + 1 not in late], 2))
    delays = [draw.choice((0.0, 0.0, 0.002, 0.02, 0.08)) for _ in range(BARRIERS * 4)]
    mine = delays[rank::4][:BARRIERS] if rank < 4 else delays[:BARRIERS]
    if rank == 0:
        return [draw.uniform(*LONG) if k in late else 0.0 if k in held or k - 1 in held else mine[k]
                for k in range(BARRIERS)], set()
    return mine, held


def probe_lonely_barrier(probe: Probe, timeout: float):
    """Rank 0 enters a barrier rank 1 never comes to: it must raise, within its timeout."""
    from collectives.symmetric.workspace import SharedWorkspace

    ws = SharedWorkspace(None, 64, timeout=timeout)
    if probe.rank != 0:
        return None                    # never arrives (the launcher keeps the rank up until the end)
    started = _NOW()
    outcome = probe.call("lonely barrier", probe.student("flag_barrier"), ws)
    return outcome, _NOW() - started, timeout      # the timeout rank 0 was given: ranks that judge
                                                   # in their own world (torchrun) each drew one


def _epochs(flags) -> str:
    return ", ".join(f"rank {r}: {f}" for r, f in enumerate(flags or [])) or "unreadable"


def _barrier(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(*BARRIER_SIZES):
        run = grading.world(f"{HERE}:probe_barrier", size)
        for rank, got in enumerate(run.results):      # first the cause: a rank waiting for a flag gone past
            if got["outcome"].error and got.get("seen") and got.get("epoch") is not None \
                    and max(got["seen"]) > got["epoch"]:
                verdict.add(f"flag_barrier, world of {size}, rank {rank}, barrier {got['failed_at']}: waited for "
                            f"epoch {got['epoch']} while a peer's flag was already past it (the epochs the flags "
                            f"held: {_epochs(got['seen'])}): a peer that passed and raised its flag for the next "
                            "barrier has arrived too -- wait for every flag to be at least the epoch (>=), not "
                            "equal to it")
                break
        for rank, got in enumerate(run.results):
            if outcome_problem(f"flag_barrier, world of {size}, rank {rank}", got["outcome"], verdict):
                break
        if verdict.not_written or verdict.problems:
            return verdict
        _judge_stamps(run, size, verdict)
        if verdict.problems:
            return verdict
    verdict.add(_lonely(grading))
    return verdict


def _judge_stamps(run, size: int, verdict: Verdict) -> None:
    for rank, got in enumerate(run.results):
        if got["epoch"] != BARRIERS:
            verdict.add(f"flag_barrier, world of {size}, rank {rank}: ws.epoch is {got['epoch']} after "
                        f"{BARRIERS} barriers; count them in ws.epoch")
            return
    early, late, other = [], [], []     # a rank let through too early says most: it comes first
    for k in range(BARRIERS):
        where = f"flag_barrier, world of {size}, barrier {k}"
        last_in = max(r["stamps"][k][0] for r in run.results)
        for rank, got in enumerate(run.results):
            left, seen = got["stamps"][k][1], got["flags"][k]
            if left < last_in:
                early.append(f"{where}: rank {rank} left {1e3 * (last_in - left):.1f} ms before the last rank "
                             f"entered, having seen the epochs {_epochs(seen)}: a barrier lets nobody through "
                             "until every flag has reached this barrier's epoch -- keep looking until then")
            elif left - last_in > LATE:
                late.append(f"{where}: rank {rank} left {left - last_in:.2f} s after the last rank entered: "
                            "it should leave as soon as every flag is up")
            if seen is None or (min(seen) < k + 1 and size > 1):
                other.append(f"{where}: rank {rank} saw flags {seen} after it; they must hold the epoch "
                             f"({k + 1}): a flag reset on the way out can hide an arrival from a slow peer")
            calls = [c for c in run.of(rank, f"barrier {k}") if not c.kind.startswith(("store.", "backend."))]
            if calls:
                other.append(f"{where}: rank {rank} called {sorted({c.kind for c in calls})} of "
                             "torch.distributed: the barrier is made of flags in shared memory alone")
    for problem in (early + late + other)[:11]:
        verdict.add(problem)


def _lonely(grading: Grading) -> str | None:
    timeout = round(random.Random(os.urandom(8)).uniform(*LONELY), 3)
    run = grading.world(f"{HERE}:probe_lonely_barrier", 2, timeout, timeout=max(grading.timeout, 15.0))
    outcome, seconds, timeout = run.results[0]
    if outcome.not_written:
        return None
    if not outcome.error:
        return "flag_barrier, world of 2: rank 0 passed a barrier rank 1 never entered"
    if "Timeout" not in outcome.error.split(":")[0] or "rank 0" not in outcome.error:
        return ("flag_barrier, world of 2: rank 0 waited for a peer that never came and raised "
                f"{outcome.error}; raise ws.timed_out(...) (a TimeoutError naming the rank) after ws.timeout s")
    if seconds < 0.9 * timeout:
        return (f"flag_barrier, world of 2: rank 0 gave up after {seconds:.2f} s, before its timeout of "
                f"{timeout} s: wait ws.timeout seconds, measured on the clock, before raising")
    if seconds > timeout + max(2.0, timeout):
        return f"flag_barrier, world of 2: rank 0 gave up after {seconds:.1f} s; ws.timeout was {timeout} s"
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
    import secrets

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
    # Every input from a secret of its own, told to the judge and dropped before the first call:
    # what the rank holds then are its own inputs, nothing a peer's input could be rebuilt from.
    mine = [c for c in cases if c.group is None or probe.rank in c.group]
    fresh = {case.name: secrets.randbits(62) for case in mine}
    inputs = {case.name: verify.make_input(case, probe.rank if case.group is None else case.group.index(probe.rank),
                                           fresh[case.name]) for case in mine}
    probe.note(("inputs", fresh))
    del fresh
    records = {}
    for case in mine:
        tensor, base = inputs.pop(case.name)
        extra = {} if case.group is None else {"group": groups[case.group]}
        ws = spaces[case.group]
        epoch, calls = _plain(ws.epoch), _plain(ws.calls)
        outcome = probe.call(case.name, fn, tensor, op=case.op, **extra)
        outcome.value = None
        output = tensor.detach().clone(memory_format=torch.contiguous_format)
        record = CaseRecord(outcome, output if type(output) is torch.Tensor else None)
        if base is not None and case.layout == "strided":
            record.gaps_ok = not bool((base[1::2] != verify.SENTINEL).any())
        own, barriers, began = None, _plain(ws.epoch), _plain(ws.calls)
        known = None not in (epoch, calls, barriers, began)
        if known and began == calls + 1 and case.numel:
            lo, hi = chunk_bounds(case.numel, ws.size)[ws.rank]
            own = ws.slot((began - 1) % 2 if ws.two_buffers else 0, ws.rank, case.dtype,
                          case.numel)[lo:hi].clone()
        records[case.name] = {"record": record, "barriers": barriers - epoch if known else None,
                              "calls": began - calls if known else None, "own_chunk": own}
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
            fresh = _fresh_secrets(run, verdict, size)
            if fresh is None:
                break
            _judge_design(name, run, cases, extras, fresh, barriers, pattern, size, verdict)
            if verdict.not_written or verdict.problems:
                break
            run.results = [{k: v["record"] for k, v in r.items()} for r in extras]
            run.problems = list                        # reported above, once
            for case in cases:                         # each case's inputs came from secrets of their own
                run.secrets = [fresh[r].get(case.name, 0) for r in range(size)]
                judge_cases(run, [case], verdict, what=name, pattern=pattern)
                if verdict.not_written or len(verdict.problems) > 10:
                    break
            verdict.problems = [p + (": every rank must reduce the slots in the same order -- slot 0 first, then "
                                     "1, ..., p − 1 -- not its own first, since a float sum depends on its order"
                                     if "same bits" in p else "") for p in verdict.problems]
            if verdict.not_written or verdict.problems:
                break
        if verdict.ok:
            judge_expanded(grading, name, verdict)
        return verdict
    return judge


def _fresh_secrets(run, verdict: Verdict, size: int) -> list[dict] | None:
    """Each rank's note of the secrets its inputs were drawn from, or None (and why)."""
    fresh = []
    for rank in range(size):
        notes = [n for n in (run.notes[rank] if run.notes else []) if isinstance(n, tuple) and n[:1] == ("inputs",)]
        if not notes or not isinstance(notes[0][1], dict):
            verdict.add(f"world of {size}, rank {rank}: the probe's note of its inputs never reached the judge")
            return None
        fresh.append(notes[0][1])
    return fresh


def _judge_design(name: str, run, cases: list[Case], extras: list, fresh: list[dict], barriers: int, pattern,
                  size: int, verdict: Verdict) -> None:
    """What each call did, before what it returned: a broken design is the cause of wrong values."""
    for case in cases:
        members = list(case.group) if case.group is not None else list(range(size))
        for i, r in enumerate(members):
            got = extras[r].get(case.name) if isinstance(extras[r], dict) else None
            where = f"{name}, world of {size}, rank {r}, case {case.name}"
            if got is None:
                verdict.add(f"{where}: no result from this rank")
                continue
            if got["record"].outcome.error or got["record"].outcome.not_written:
                continue                               # judged with the values
            if not isinstance(got["record"].output, torch.Tensor):
                verdict.add(f"{where}: the tensor was replaced by something else after the call")
                continue
            sent = pattern(case, len(members), i, run.of(r, case.name))
            if sent:
                verdict.add(f"{where}: {sent}")
            elif case.numel and got["calls"] != 1:
                verdict.add(f"{where}: began {got['calls']} calls on the group's workspace (ws.begin), expected 1")
            elif case.numel and len(members) > 1 and got["barriers"] != barriers:
                verdict.add(f"{where}: passed {got['barriers']} barriers, expected {barriers}"
                            + (": without the barrier a rank reads slots its peers have not written yet"
                               if got["barriers"] == 0 else "")
                            + (": the gather must wait until every chunk is reduced, after a second barrier"
                               if name == "two_shot_all_reduce" and got["barriers"] == 1 else ""))
            elif name == "two_shot_all_reduce" and case.values == "int" and case.numel >= len(members) \
                    and case.layout == "contiguous":
                verdict.add(_own_chunk(case, members, i, got["own_chunk"], where, [fresh[m] for m in members]))
            if len(verdict.problems) > 10:
                return


def _own_chunk(case: Case, members: list[int], i: int, own, where: str, fresh: list[dict]) -> str | None:
    inputs = [verify.make_values(case, j, fresh[j][case.name]) for j in range(len(members))]
    lo, hi = chunk_bounds(case.numel, len(members))[i]
    expected = expected_output(case, inputs)[lo:hi]
    if own is None or not isinstance(own, torch.Tensor) or own.shape != expected.shape \
            or not torch.equal(own.to(expected.dtype), expected):
        return (f"{where}: after the call, chunk {i} of this rank's slot does not hold the reduced chunk "
                f"{i}: the two-shot reduces chunk r into rank r's own slot, and its peers gather it from there")
    return None


SET_UP = frozenset({"broadcast", "allreduce"})
"""The routes of lesson 12's worlds: the given workspace's set-up (a broadcast of where it
lives, an all-reduce of what each rank asked for) and the probe's one broadcast, outside
every case; a call inside a case -- the student's barrier or all-reduce -- fails its task
whatever it is (the cases' own check)."""

TASKS = [
    GradedTask(12, 1, "the flag barrier", 3, _barrier, ("flag_barrier",), routes=SET_UP),
    GradedTask(12, 2, "one-shot all-reduce", 4, _judge_all_reduce("one_shot_all_reduce"), ("one_shot_all_reduce",),
               routes=SET_UP),
    GradedTask(12, 3, "two-shot all-reduce", 4, _judge_all_reduce("two_shot_all_reduce"), ("two_shot_all_reduce",),
               routes=SET_UP),
]
