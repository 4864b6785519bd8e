"""Lesson 5's graded tasks 4 and 5: the fused all-reduce and the reducer.

Both run in a world of three ranks. Every tensor's values come from its rank's secret,
every result is recomputed in the grading process, and every all-reduce each rank made is
read from the tap: exactly one per step of the layout the reference plans for the same
list, of the bucket's (or the tensor's) size and dtype, over the group's ranks, and
nothing else -- on a mixed list for every op, three times (the same tensors refilled the
third), on views, on a subgroup; bad input refused before anything is sent; the harness's
cases one tensor at a time (the lists, their calls and their judge: :mod:`.lesson05_lists`).
The reducer is held besides to its design, from records its rank cannot take back: the
layout planned once per list of shapes; with two buffers the next flush issued before the
previous one landed and the one after waiting for it (the course's trace times each
all-reduce, the tap counts them too); its streams ordered by events
(:func:`collectives.core.streams.checking`, run around it, the course's own).
"""

from __future__ import annotations

import sys

import torch

from ....core import streams, trace
from ....core.ops import ReduceOp
from ... import verify
from .allreduce import judge_cases, probe_cases
from .lesson05_inputs import (
    BUFFER,
    SUBGROUP,
    THRESHOLD,
    WORLD,
    _dt,
    _flat,
    _list_problem,
    _one_call_problem,
    _values,
)
from .lesson05_lists import _expected_steps, _judge_lists, _run_lists, _values_of_all, mixed_specs
from .world import Grading, Probe, Run, Verdict, outcome_problem

HERE = __name__


def harness_cases(p: int) -> list:
    """The harness's cases, each name once (at p = 1 and 2, "one element" and "fewer than p"
    are the same case)."""
    return list({case.name: case for case in verify.default_cases(p)}.values())


def _single_pattern(case, p, rank, calls):
    group = list(case.group) if case.group is not None else list(range(p))
    expected = [(case.numel, _dt(case.dtype))] if case.numel else []
    return _one_call_problem(calls, expected, group)


def probe_fused(probe: Probe) -> dict:
    import torch.distributed as dist

    group = dist.new_group(list(SUBGROUP)) if probe.size > len(SUBGROUP) else None
    out: dict = {}
    _run_lists(probe, "function", group, out)
    fused = probe.student("fused_all_reduce")

    def single(tensor, op=ReduceOp.SUM, group=None):
        fused([tensor], op=op, group=group, threshold_bytes=64 << 10, buffer_bytes=64 << 10)
    single.__name__ = "fused_all_reduce"
    out["harness"] = probe_cases(probe, "fused_all_reduce", harness_cases(probe.size), fn=single)
    return out


def judge_fused(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(WORLD):
        run = grading.world(f"{HERE}:probe_fused", size)
        _judge_lists(run, verdict, "fused_all_reduce")
        if not verdict.problems and not verdict.not_written:
            harness = Run(run.size, run.secrets, [r["harness"] for r in run.results], run.calls, run.loose,
                          run.complete, run.check_traffic)
            judge_cases(harness, harness_cases(size), verdict,
                        what="fused_all_reduce of one tensor", pattern=_single_pattern)
        if verdict.not_written or verdict.problems:
            break
    return verdict


# ---- task 5: the reducer's own design --------------------------------------------------

def _six(seed_of) -> list[torch.Tensor]:
    """Six float32 tensors of 400 elements: with buffers of 512, one flush each."""
    return [_values((400,), torch.float32, ReduceOp.SUM, seed_of(k)) for k in range(6)]


def _ordered_list(seed_of) -> list[torch.Tensor]:
    return _six(seed_of) + [_values((1500,), torch.float32, ReduceOp.SUM, seed_of(6)),
                            _values((7, 3), torch.float32, ReduceOp.SUM, seed_of(7)).t()]


MODES = ("double", "single")


ORDERED_CALLS = 3


_WATCHED = [(streams, ("checking", "new_stream", "new_event", "current_stream", "use", "record_stream")),
            (streams.Checker, ("report", "touch", "all_reduce", "new_stream", "using")),
            (streams.CheckedStream, ("wait_event", "wait_stream", "join", "tick", "record_event")),
            (streams.CheckedEvent, ("record", "wait")), (streams._CheckedWork, ("wait",)),
            (streams._Watch, ("__torch_dispatch__",)), (trace.TracedWork, ("wait",)), (trace, ("recording",))]


_PRISTINE = {(owner, name): vars(owner)[name] for owner, names in _WATCHED for name in names}


def _restore_course() -> None:
    for (owner, name), value in _PRISTINE.items():
        if vars(owner).get(name) is not value:
            setattr(owner, name, value)


def _course_replaced(exempt=()) -> list[str]:
    return [f"{getattr(owner, '__name__', owner)}.{name}" for (owner, name), value in _PRISTINE.items()
            if vars(owner).get(name) is not value and (owner, name) not in exempt]


def probe_reducer(probe: Probe) -> dict:
    import torch.distributed as dist

    group = dist.new_group(list(SUBGROUP)) if probe.size > len(SUBGROUP) else None
    Reducer = probe.student("FusedAllReducer")
    out: dict = {"replaced": []}
    for mode in MODES:
        _run_lists(probe, mode, group, out, prefix=f"{mode}: ")
        _restore_course()
        key = f"{mode}: six flushes, timed"
        tensors = _six(lambda k, key=key: probe.seed(f"{key} {k}"))

        def timed(tensors, double):
            reducer = Reducer(THRESHOLD, BUFFER, torch.device("cpu"), double_buffer=double)
            with trace.recording() as t:
                reducer.all_reduce(tensors)
                reducer.wait()
            return [(e.t0, e.t1) for e in t.collectives() if e.kind == "all_reduce"]
        timed.__name__ = "FusedAllReducer"
        out[key] = (probe.call(key, timed, tensors, mode == "double"), _flat(tensors))
        out["replaced"] += _course_replaced()
        _restore_course()

        def ordered(double):
            calls, seen = [], []
            report = streams.Checker.report

            def reported(checker, line):        # every violation also kept here, as it is found
                seen.append(line)
                report(checker, line)
            streams.Checker.report = reported
            try:
                with streams.checking(raise_errors=False):
                    reducer = Reducer(THRESHOLD, BUFFER, torch.device("cpu"), double_buffer=double)
                    for k in range(ORDERED_CALLS):
                        tensors = _ordered_list(lambda i, k=k: probe.seed(f"{mode}: ordered {k} {i}"))
                        reducer.all_reduce(tensors)
                        reducer.wait()
                        calls.append(_flat(tensors))
                if vars(streams.Checker).get("report") is not reported:
                    out["replaced"].append("Checker.report")
            finally:
                streams.Checker.report = report
            return list(dict.fromkeys(seen)), calls
        ordered.__name__ = "FusedAllReducer"
        key = f"{mode}: streams ordered"
        out[key] = (probe.call(key, ordered, mode == "double"),)
        out["replaced"] += _course_replaced(exempt={(streams.Checker, "report")})
    module = sys.modules[Reducer.__module__]     # where the reducer looks plan_layout up
    planned = []

    def plans(count_from):
        original = getattr(module, "plan_layout", None)

        def counting(*args, **kwargs):
            planned.append(1)
            return original(*args, **kwargs)
        module.plan_layout = counting
        try:
            reducer = Reducer(THRESHOLD, BUFFER, torch.device("cpu"))
            counts = []
            for k in range(3):           # new tensors each time, the same shapes
                reducer.all_reduce([_values(s, d, ReduceOp.SUM, probe.seed(f"plans {k} {i}"))
                                    for i, (s, d) in enumerate(mixed_specs(ReduceOp.SUM))])
                reducer.wait()
                counts.append(len(planned))
            reducer.all_reduce([torch.ones(5), torch.ones(6)])
            reducer.wait()
            counts.append(len(planned))
            return counts
        finally:
            module.plan_layout = original
    plans.__name__ = "FusedAllReducer"
    out["plans"] = (probe.call("plans", plans, 0),)
    return out


def judge_reducer(grading: Grading) -> Verdict:
    verdict = Verdict()
    what = "FusedAllReducer"
    for size in grading.sizes(WORLD):
        run = grading.world(f"{HERE}:probe_reducer", size)
        for mode in MODES:
            _judge_lists(run, verdict, f"{what} (double_buffer={mode == 'double'})", prefix=f"{mode}: ")
            if verdict.not_written or verdict.problems:
                return verdict
            for r in range(size):
                verdict.add(_timed_problem(run, r, mode))
                verdict.add(_ordered_problem(run, r, mode))
            if verdict.problems:
                return verdict
        for r in range(size):
            replaced = sorted(set(run.results[r]["replaced"]))
            if replaced:
                verdict.add(f"{what}, world of {size}, rank {r}: replaced what the course reads the streams' order "
                            f"and the flushes' times with ({', '.join(replaced)})")
        for r in range(size):
            where = f"{what}, world of {size}, rank {r}, case the layout planned once per list of shapes"
            outcome, = run.results[r]["plans"]
            if outcome_problem(where, outcome, verdict):
                continue
            counts = outcome.value
            if counts[:3] != [1, 1, 1]:
                verdict.add(f"{where}: three calls with the same shapes planned the layout {counts[2]} times "
                            f"(plan_layout calls after each: {counts[:3]}); plan once, keep it by shapes and dtypes")
            elif counts[3] != 2:
                verdict.add(f"{where}: a new list of shapes must be planned (plan_layout called {counts[3] - 1} "
                            "more times, expected 1)")
        if verdict.not_written or verdict.problems:
            break
    return verdict


def _timed_problem(run: Run, rank: int, mode: str) -> str | None:
    key = f"{mode}: six flushes, timed"
    where = f"FusedAllReducer (double_buffer={mode == 'double'}), world of {run.size}, rank {rank}, case {key}"
    outcome, got = run.results[rank][key]
    if outcome.not_written or outcome.error:
        return f"{where}: {outcome.error or outcome.not_written}"
    tensors = [_six(lambda k, r=r: run.seed(r, f"{key} {k}")) for r in range(run.size)]
    problem = _list_problem(_values_of_all(tensors), got) \
        or _one_call_problem(run.of(rank, key), [(400, "float32")] * 6, list(range(run.size)))
    if problem:
        return f"{where}: {problem}"
    timeline = outcome.value
    if len(timeline) != 6:
        return (f"{where}: the course's trace saw {len(timeline)} of its 6 all-reduces: issue them with "
                "dist.all_reduce, async_op=True")
    if any(t1 is None for _, t1 in timeline):
        return f"{where}: every all_reduce must be async_op=True and waited on through its work handle"
    if mode == "double":
        if not all(timeline[k + 1][0] < timeline[k][1] for k in range(5)):
            return f"{where}: with two buffers, flush k+1 must be issued before flush k has landed"
        if not all(timeline[k + 2][0] > timeline[k][1] for k in range(4)):
            return f"{where}: a buffer was refilled (flush k+2) before its all_reduce (flush k) landed"
    elif not all(timeline[k + 1][0] > timeline[k][1] for k in range(5)):
        return f"{where}: with one buffer, flush k+1 must wait until flush k has landed"
    return None


def _ordered_problem(run: Run, rank: int, mode: str) -> str | None:
    key = f"{mode}: streams ordered"
    where = f"FusedAllReducer (double_buffer={mode == 'double'}), world of {run.size}, rank {rank}, case {key}"
    outcome, = run.results[rank][key]
    if outcome.not_written or outcome.error:
        return f"{where}: {outcome.error or outcome.not_written}"
    violations, calls = outcome.value
    for k in range(ORDERED_CALLS):
        per_rank = [_ordered_list(lambda i, r=r: run.seed(r, f"{mode}: ordered {k} {i}")) for r in range(run.size)]
        problem = _list_problem(_values_of_all(per_rank), calls[k])
        if problem:
            return f"{where}: call {k + 1}, {problem}"
    if violations:
        return (f"{where}: its streams are not ordered as a GPU needs (checked on the CPU stand-ins): "
                + "; ".join(violations[:2]))
    steps = _expected_steps([((400,), torch.float32)] * 6 + [((1500,), torch.float32), ((3, 7), torch.float32)]) \
        * ORDERED_CALLS
    problem = _one_call_problem(run.of(rank, key), steps, list(range(run.size)))
    return problem and f"{where}: {problem}"
