"""Lesson 7's graded tasks: two simple hierarchies, Fairring's five stages, the slices
pipelined, the asynchronous call and the DDP hook.

Every input is drawn from the ranks' secrets and every expected value recomputed here
(bit for bit on integer-valued data); every message and collective is read from the tap,
and its tier from its group's ranks (:mod:`.lesson07_tiers`). The worlds pretend to be
several machines with ``layout=(D, M)`` -- (2, 2), (1, 4), (4, 1) on 4 ranks, (3, 2),
(2, 3) on 6 -- or, under torchrun on several machines, take the layout from the
environment. A task is held to its design:

1. root-based: only each machine's root sends across, 2(M − 1)/M·n, no flat collective;
2. rail: 2(M − 1)/M·n/D across per rank on its rail, 2(D − 1)/D·n inside;
3. five stages: the same bytes, no reducing collective (the add is the rank's own), the
   collect and the diffuse reach every other machine of the rail, the stages in order,
   the diffuse's messages carrying the result; the padding slot; a leaf; a bad layout;
4. pipelined: the same bytes for four slices, two stages in flight at once, two calls on
   one tensor;
5. and 6. (:mod:`.lesson07_inflight`): the asynchronous call and the DDP hook.
"""

from __future__ import annotations

import torch

from ....core import trace
from ....core.ops import ReduceOp
from ... import verify
from ...verify import SENTINEL, Case
from . import GradedTask
from .allreduce import CaseRecord, carried_result, compare_case, expected_output
from .lesson07_inflight import judge_async, judge_hook
from .lesson07_tiers import (
    PATTERN_N,
    PRIME,
    SLICE_N,
    fairring_problem,
    flat_problem,
    harness,
    layout_name,
    layouts_for,
    machines_in_environment,
    order_problem,
    shape,
    size_cases,
    staged_problem,
    tiers_of,
    unique,
)
from .world import Grading, Probe, Verdict, outcome_problem, same

HERE = __name__
SIZES = {1: (4,), 2: (4,), 3: (4, 6), 4: (4,)}     # 6 ranks: D = 3, and M = 3 (the rail of three)
# how much each layout of a world gets, in order: the harness's covering set, the sizes
# around D·M, or only the counted call and the task's own checks
DEPTH = {4: ("full", "light", "light"), 6: ("light", "counted")}
NAMES = {1: "root_based_all_reduce", 2: "rail_all_reduce", 3: "one_slice_all_reduce", 4: "hierarchical_all_reduce"}


def depth(p: int, index: int) -> str:
    return DEPTH.get(p, ("full",))[min(index, len(DEPTH.get(p, ("full",))) - 1)]


def task_cases(task: int, D: int, M: int, depth: str) -> list[tuple[Case, dict]]:
    """(case, extra keywords) for one layout: the harness's covering set (tasks 2-4), the
    sizes around D·M (all, or ``light``), the counted call, and the task's own (:data:`DEPTH`)."""
    cases = [Case(PATTERN_N)]
    if depth != "counted":
        cases = size_cases(D, M, depth == "light") + (harness(D, M) if depth == "full" and task > 1 else []) + cases
    if task == 3:
        cases.append(Case(PATTERN_N + 1))         # the tail through the padding slot
    out = [(c, {}) for c in unique(cases)]
    if task == 4:
        piped = [Case(PATTERN_N), Case(PATTERN_N + D * M - 1), Case(PRIME, torch.int32, ReduceOp.MAX),
                 Case(PRIME, torch.float64, ReduceOp.AVG), Case(PRIME, layout="transposed")]
        piped = piped if depth == "full" else piped[:2]    # the views and ops once per world
        out += [(c, {"slice_numel": SLICE_N}) for c in piped]
    return out


def key_of(layout, p: int, case: Case, kwargs: dict) -> str:
    extra = f", slices of {kwargs['slice_numel']}" if kwargs.get("slice_numel") else ""
    return f"{case.name}, {layout_name(layout, p)}{extra}"


def _counted(task: int, case: Case, kwargs: dict) -> bool:
    return case.name == Case(PATTERN_N).name and bool(kwargs.get("slice_numel")) == (task == 4)


def probe_hierarchy(probe: Probe, task: int) -> dict:
    fn = probe.student(NAMES[task])
    layouts = layouts_for(probe.size)
    out = {}
    for i, layout in enumerate(layouts):
        D, M = shape(layout, probe.size)
        for case, kwargs in task_cases(task, D, M, depth(probe.size, i)):
            key = key_of(layout, probe.size, case, kwargs)
            tensor, base = verify.make_input(case, probe.rank, probe.secret, verify.rank_device())
            if _counted(task, case, kwargs) and task == 4:
                with trace.recording() as t:     # only whether two stages overlap is read from it
                    outcome = probe.call(key, fn, tensor, op=case.op, layout=layout, **kwargs)
                out["overlap " + key] = [(e.kind, e.group, e.t0, e.t1) for e in t.events if e.t1 is not None]
            else:
                outcome = probe.call(key, fn, tensor, op=case.op, layout=layout, **kwargs)
            outcome.value = None
            record = CaseRecord(outcome, tensor.detach().cpu().clone(memory_format=torch.contiguous_format))
            if base is not None and case.layout == "strided":
                record.gaps_ok = not bool((base[1::2] != SENTINEL).any())
            out[key] = record
        name = layout_name(layout, probe.size)
        if task == 3:
            leaf = verify.make_values(Case(PRIME), probe.rank, probe.seed(f"leaf {name}")).requires_grad_(True)
            outcome = probe.call(f"a leaf that requires grad, {name}", fn, leaf, layout=layout)
            out[f"leaf {name}"] = (outcome, leaf.detach().clone())
            bad = (D * M + 1, 1)
            out[f"bad layout {name}"] = probe.call(f"layout {bad}, {name}", fn, torch.ones(4), layout=bad)
        if task == 4 and i == 0:
            x = verify.make_values(Case(PRIME), probe.rank, probe.seed(f"twice {name}"))
            first = probe.call(f"twice on one tensor, {name}", fn, x, layout=layout, slice_numel=SLICE_N)
            second = probe.call(f"twice on one tensor, {name}", fn, x, layout=layout, slice_numel=SLICE_N) \
                if not first.error and not first.not_written else first
            out[f"twice {name}"] = (second, x.clone())
    return out


def _overlapped(events) -> bool:
    """Two operations of different stages (another group, or another kind on a group of the
    same ranks) in flight at the same time."""
    return any((a[1], a[0]) != (b[1], b[0]) and a[2] < b[3] and b[2] < a[3]
               for i, a in enumerate(events) for b in events[i + 1:] if a[1] and b[1])


def _pattern_problem(task: int, case: Case, calls, rank: int, D: int, M: int, expected) -> str | None:
    t = tiers_of(calls, rank, D, M)
    nbytes = case.numel * torch.empty(0, dtype=case.dtype).element_size()
    if task == 1:
        problem = flat_problem(t)
        want = 2 * (M - 1) / M * nbytes if rank % D == 0 else 0.0
        if problem is None and abs(t.across - want) > 1e-6 * max(want, 1):
            problem = (f"sent {t.across:.0f} bytes across machines, expected "
                       + ("2(M-1)/M·n from a machine's root" if rank % D == 0 else "none: only each machine's root"))
        return problem
    problem = fairring_problem(t, nbytes, D, M)
    if problem or task == 2:
        return problem
    problem = staged_problem(t, rank, D, M)
    if problem is None and task == 3:
        problem = order_problem(t, D, M)
    if problem is None and task == 3 and t.across_sends and M > 1:
        problem = carried_result(expected, t.across_sends, M - 1)
        problem = problem and f"across machines: {problem} (the diffuse sends this rank's finished block)"
    return problem


def _padded_problem(calls, rank: int, D: int, M: int) -> str | None:
    t = tiers_of(calls, rank, D, M)
    base = 2 * (M - 1) / M * PATTERN_N * 4 / D
    padding = 2 * (M - 1) / M * D * M * 4 / D
    if M > 1 and not base < t.across <= base + padding + 1e-6:
        return (f"sent {t.across:.0f} bytes across for n = {PATTERN_N + 1}; the tail takes a padding slot of "
                f"D·M elements: between {base:.0f} and {base + padding:.0f}")
    return flat_problem(t)


def _judge(task: int):
    name = NAMES[task]

    def judge(grading: Grading) -> Verdict:
        verdict = Verdict()
        for size in grading.sizes(*SIZES[task]):
            run = grading.world(f"{HERE}:probe_hierarchy", size, task)
            for i, layout in enumerate(layouts_for(size)):
                D, M = shape(layout, size)
                lname = layout_name(layout, size)
                for case, kwargs in task_cases(task, D, M, depth(size, i)):
                    key = key_of(layout, size, case, kwargs)
                    inputs = [verify.make_values(case, r, run.secrets[r]) for r in range(size)]
                    expected = expected_output(case, inputs)
                    for r in range(size):
                        where = f"{name}, world of {size}, rank {r}, case {key}"
                        record = run.results[r].get(key) if isinstance(run.results[r], dict) else None
                        if record is None:
                            verdict.add(f"{where}: no result from this rank")
                            continue
                        if outcome_problem(where, record.outcome, verdict):
                            continue
                        problem = compare_case(case, expected, record.output, size)
                        if problem is None and not record.gaps_ok:
                            problem = "wrote outside the view: the elements between a strided view's changed"
                        if problem is None and _counted(task, case, kwargs):
                            problem = _pattern_problem(task, case, run.of(r, key), r, D, M, expected)
                            if problem is None and task == 4 and M > 1 and D * M >= 4 and \
                                    not _overlapped(run.results[r].get("overlap " + key, [])):
                                problem = "no two stages of its four slices were ever in flight at once: not pipelined"
                        if problem is None and task == 3 and case.numel == PATTERN_N + 1:
                            problem = _padded_problem(run.of(r, key), r, D, M)
                        verdict.add(problem and f"{where}: {problem}")
                    if verdict.not_written or len(verdict.problems) > 20:
                        return verdict
                _judge_extras(task, run, layout, lname, size, verdict)
            if verdict.not_written or verdict.problems:
                break
        return verdict
    return judge


def _judge_extras(task: int, run, layout, lname: str, size: int, verdict: Verdict) -> None:
    name = NAMES[task]
    for r in range(size):
        where = f"{name}, world of {size}, rank {r}, {lname}"
        if task == 3:
            outcome, got = run.results[r][f"leaf {lname}"]
            if not outcome_problem(f"{where}, a leaf that requires grad", outcome, verdict):
                want = expected_output(Case(PRIME), [verify.make_values(Case(PRIME), q, run.seed(q, f"leaf {lname}"))
                                                     for q in range(size)])
                problem = same(want, got)
                verdict.add(problem and f"{where}, a leaf that requires grad: {problem}")
            bad = run.results[r][f"bad layout {lname}"]
            if bad.not_written:
                verdict.not_written = verdict.not_written or bad.not_written
            elif "ValueError" not in bad.error or "layout" not in bad.error or "rank" not in bad.error:
                verdict.add(f"{where}: a layout of D·M + 1 ranks must raise a ValueError naming the layout "
                            f"and the ranks, got {bad.error or 'no error'}")
        if task == 4 and f"twice {lname}" in run.results[r]:
            outcome, got = run.results[r][f"twice {lname}"]
            if not outcome_problem(f"{where}, twice on one tensor", outcome, verdict):
                inputs = [verify.make_values(Case(PRIME), q, run.seed(q, f"twice {lname}")) for q in range(size)]
                once = expected_output(Case(PRIME), inputs)
                problem = same(expected_output(Case(PRIME), [once] * size), got)
                verdict.add(problem and f"{where}, twice on one tensor (the second call sums the first's result): "
                            f"{problem}")


TIMED_BYTES = 4 << 20


def in_world_timing(spec: str, verdicts: dict) -> str | None:
    """On several machines (torchrun per machine, the simulated cluster), after the tasks:
    the student's pipelined hierarchy timed beside the reference's and the flat ring
    (``dist.all_reduce``) on 4 MiB; every rank calls it, rank 0's line is printed. Only a
    task 4 that passed is timed. None on one machine: there is no slow tier to measure."""
    import torch.distributed as dist

    from ....core import timing
    from ...impl import resolve

    p = dist.get_world_size()
    if machines_in_environment(p) is None:
        return None
    x = torch.ones(TIMED_BYTES // 4)
    names = [("the flat ring (dist.all_reduce)", dist.all_reduce),
             ("the reference", resolve("collectives.hierarchical:hierarchical_all_reduce"))]
    if verdicts.get(4) and not spec.startswith("collectives.hierarchical"):
        names.insert(0, ("yours", resolve(f"{spec}:hierarchical_all_reduce")))
    seconds = {name: timing.median(timing.measure(lambda fn=fn: fn(x), warmup=1, iters=5)) for name, fn in names}
    D, M = shape(None, p)
    line = f"timing, {M} machines × {D} ranks, {timing.human_bytes(TIMED_BYTES)}: " + ", ".join(
        f"{name} {timing.human_seconds(t)}" for name, t in seconds.items())
    if "yours" in seconds and seconds["yours"] > seconds["the flat ring (dist.all_reduce)"]:
        line += " -- yours passes and is slower than the flat ring here"
    elif not verdicts.get(4):
        line += " (yours is timed once task 4 passes)"
    return line


TASKS = [
    GradedTask(7, 1, "root-based hierarchy", 2, _judge(1), ("root_based_all_reduce",)),
    GradedTask(7, 2, "rail all-reduce", 3, _judge(2), ("rail_all_reduce",)),
    GradedTask(7, 3, "five stages on one slice", 5, _judge(3), ("one_slice_all_reduce",)),
    GradedTask(7, 4, "pipelined slices", 5, _judge(4), ("hierarchical_all_reduce",)),
    GradedTask(7, 5, "buckets in flight", 4, judge_async, ("hierarchical_all_reduce_async",)),
    GradedTask(7, 6, "DDP communication hook", 3, judge_hook, ("hierarchical_hook", "HierarchicalHookState")),
]
