"""Lesson 5's graded tasks 4 and 5: the fused all-reduce and the reducer.

Both run in a world of three ranks. Every tensor's values come from its rank's secret,
every result is recomputed in the grading process, and every all-reduce each rank made is
read from the tap: exactly one per step of the layout the reference plans for the same
list, of the bucket's (or the tensor's) size and dtype, over the group's ranks, and
nothing else -- on a mixed list for every op, three times (the same tensors refilled the
third), on views, on a subgroup; bad input refused before anything is sent; the harness's
cases one tensor at a time. The reducer is held besides to its design, from records its
rank cannot take back: the layout planned once per list of shapes; with two buffers the
next flush issued before the previous one landed and the one after waiting for it (the
course's trace times each all-reduce, the tap counts them too); its streams ordered by
events (:func:`collectives.core.streams.checking`, run around it, the course's own).
"""

from __future__ import annotations

import math
import sys

import torch

from ... import fused as reference  # imported here, before the ranks fork: they inherit it
from ...core import streams, trace
from ...core.ops import ReduceOp, op_name
from .. import verify
from ..verify import SENTINEL, Case
from .allreduce import expected_output, judge_cases, probe_cases
from .lesson05_inputs import (
    BUFFER,
    SUBGROUP,
    THRESHOLD,
    WORLD,
    _dt,
    _flat,
    _list_problem,
    _logical,
    _one_call_problem,
    _values,
)
from .world import Grading, Probe, Run, Verdict, outcome_problem

HERE = __name__
OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)
# float32: 200+200, then 200+100, then 300+212 (fills 512 exactly); 2000 on its own; 0 skipped
THREE_FLUSHES = (200, 200, 200, 100, 2000, 300, 0, 212)


def mixed_specs(op) -> list[tuple[tuple, torch.dtype]]:
    """Odd sizes, empty tensors, one over the threshold, a 2-D tensor, every dtype (no
    integers for AVG), and sizes that come again further down the list."""
    specs = [((3,), torch.float32), ((0,), torch.float32), ((2000,), torch.float32),
             ((301,), torch.float16), ((77,), torch.bfloat16), ((1,), torch.float32),
             ((13, 7), torch.float32), ((255,), torch.float64), ((129,), torch.int32),
             ((33,), torch.int64), ((1500,), torch.float16), ((0,), torch.int32),
             ((3,), torch.float32), ((301,), torch.float16), ((1,), torch.float32)]
    if op == ReduceOp.AVG:
        specs = [(s, d) for s, d in specs if d.is_floating_point]
    return specs


def _list_cases(size: int) -> list[tuple[str, object, list, tuple | None]]:
    """(key, op, specs, group) of every list a fused call gets: each op on the mixed list
    three times (new tensors, then the same tensors refilled), three flushes exactly, and
    a subgroup."""
    cases = []
    for op in OPS:
        for call in (1, 2, 3):
            cases.append((f"{op_name(op)} mixed, call {call}", op, mixed_specs(op), None))
    cases.append(("three flushes", ReduceOp.SUM, [((n,), torch.float32) for n in THREE_FLUSHES], None))
    if size > len(SUBGROUP):
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            cases.append((f"{op_name(op)} mixed, group {SUBGROUP}", op, mixed_specs(op), SUBGROUP))
    return cases


VIEW_CALLS = ("views, call 1", "views, call 2")


def _views(seed_of) -> list[torch.Tensor]:
    """A strided view (fused), a transposed one, and a strided view over the threshold
    (on its own), each over memory that holds SENTINEL between its elements."""
    base_a = torch.full((2 * 301,), float(SENTINEL))
    strided = base_a[::2]
    strided.copy_(_values((301,), torch.float32, ReduceOp.SUM, seed_of(0)))
    transposed = _values((11, 13), torch.float32, ReduceOp.SUM, seed_of(1)).t()
    big_base = torch.full((2 * 1500,), float(SENTINEL))
    big = big_base[1::2]
    big.copy_(_values((1500,), torch.float32, ReduceOp.SUM, seed_of(2)))
    return [strided, transposed, big]


def _caller(probe: Probe, mode: str):
    """``call(tensors, op, group)``: the student's fused_all_reduce, or a FusedAllReducer
    (one per op and group, kept across calls, with two buffers or one)."""
    if mode == "function":
        fused = probe.student("fused_all_reduce")

        def fused_all_reduce(tensors, op, group):
            fused(tensors, op=op, group=group, threshold_bytes=THRESHOLD, buffer_bytes=BUFFER)
        return fused_all_reduce
    Reducer = probe.student("FusedAllReducer")
    reducers = {}

    def FusedAllReducer(tensors, op, group):
        key = (op, id(group))
        if key not in reducers:
            reducers[key] = Reducer(THRESHOLD, BUFFER, torch.device("cpu"), op=op, group=group,
                                    double_buffer=mode == "double")
        reducers[key].all_reduce(tensors)
        reducers[key].wait()
    return FusedAllReducer


def _bad_inputs() -> dict[str, list[torch.Tensor]]:
    return {"mixed devices": [torch.ones(4), torch.ones(4, device="meta")],
            "an expanded tensor": [torch.ones(3), torch.ones(1).expand(8)]}


def _run_lists(probe: Probe, mode: str, group, out: dict, prefix: str = "") -> None:
    call = _caller(probe, mode)
    held = None
    for key, op, specs, members in _list_cases(probe.size):
        if members is not None and probe.rank not in members:
            continue
        fresh = [_values(s, d, op, probe.seed(f"{key} {i}")) for i, (s, d) in enumerate(specs)]
        if key.endswith("call 3"):
            torch._foreach_copy_(held, fresh)       # the same tensors as call 2, refilled
            tensors = held
        else:
            tensors = fresh
        outcome = probe.call(prefix + key, call, tensors, op, group if members else None)
        out[prefix + key] = (outcome, _flat(tensors))
        held = tensors
    views = _views(lambda i: probe.seed(f"{VIEW_CALLS[0]} {i}"))
    for key in VIEW_CALLS:
        if key == VIEW_CALLS[1]:
            views[0].copy_(_values((301,), torch.float32, ReduceOp.SUM, probe.seed(f"{key} 0")))
        outcome = probe.call(prefix + key, call, views, ReduceOp.SUM, None)
        out[prefix + key] = (outcome, [_logical(t) for t in views])
    for key, tensors in _bad_inputs().items():
        out[prefix + key] = (probe.call(prefix + key, call, tensors, ReduceOp.SUM, None),)


def _expected_views(run: Run) -> dict[str, list[torch.Tensor]]:
    """Per call of the views case: each view's result, and what lies around it (``_logical``)."""
    out = {}
    per_rank = [_views(lambda i, r=r: run.seed(r, f"{VIEW_CALLS[0]} {i}")) for r in range(run.size)]
    for key in VIEW_CALLS:
        if key == VIEW_CALLS[1]:
            for r, views in enumerate(per_rank):
                views[0].copy_(_values((301,), torch.float32, ReduceOp.SUM, run.seed(r, f"{key} 0")))
        reduced = _values_of_all(per_rank)
        for views in per_rank:
            for view, total in zip(views, reduced):
                view.copy_(total)
        out[key] = [_logical(t) for t in per_rank[0]]
    return out


def _values_of_all(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [expected_output(Case(views[0].numel(), views[0].dtype, ReduceOp.SUM),
                            [v.reshape(-1) for v in views]).view(views[0].shape)
            for views in zip(*per_rank)]


def _expected_steps(specs) -> list[tuple[int, str]]:
    """(numel, dtype) of each all-reduce the reference's layout of ``specs`` makes, in order."""
    numels = [math.prod(s) for s, _ in specs]
    layout = reference.plan_layout([(n, d) for n, (_, d) in zip(numels, specs)], THRESHOLD, BUFFER)
    return [(layout.buckets[k].numel, _dt(layout.buckets[k].wire_dtype)) if kind == "flush"
            else (numels[k], _dt(specs[k][1])) for kind, k in layout.steps]


def _judge_lists(run: Run, verdict: Verdict, what: str, prefix: str = "") -> None:
    size = run.size
    for key, op, specs, members in _list_cases(size):
        ranks = list(members) if members is not None else list(range(size))
        inputs = [[_values(s, d, op, run.seed(r, f"{key} {i}")) for i, (s, d) in enumerate(specs)] for r in ranks]
        expected = [expected_output(Case(math.prod(s), d, op), [x[i].reshape(-1) for x in inputs]).view(s)
                    for i, (s, d) in enumerate(specs)]
        steps = _expected_steps(specs)
        for r in ranks:
            where = f"{what}, world of {size}, rank {r}, case {key}"
            outcome, got = run.results[r][prefix + key]
            if outcome_problem(where, outcome, verdict):
                continue
            problem = _list_problem(expected, got) or _one_call_problem(run.of(r, prefix + key), steps, ranks)
            verdict.add(problem and f"{where}: {problem}")
    views = _expected_views(run)
    shapes = [((301,), torch.float32), ((13, 11), torch.float32), ((1500,), torch.float32)]
    view_steps = _expected_steps(shapes)
    for key in VIEW_CALLS:
        for r in range(size):
            where = f"{what}, world of {size}, rank {r}, case {key} (strided, transposed, strided on its own)"
            outcome, got = run.results[r][prefix + key]
            if outcome_problem(where, outcome, verdict):
                continue
            for i, (e, g, (shape, _)) in enumerate(zip(views[key], got, shapes)):
                n = math.prod(shape)
                problem = verify.compare(e[:n], g[:n])
                if problem is None and not torch.equal(e, g):
                    problem = "wrote between the elements of a strided view"
                if problem:
                    verdict.add(f"{where}: tensor {i}: {problem}")
                    break
            else:
                problem = _one_call_problem(run.of(r, prefix + key), view_steps, list(range(size)))
                verdict.add(problem and f"{where}: {problem}")
    for key in _bad_inputs():
        for r in range(size):
            where = f"{what}, world of {size}, rank {r}, case {key}"
            outcome, = run.results[r][prefix + key]
            if outcome.not_written:
                outcome_problem(where, outcome, verdict)
            elif "ValueError" not in outcome.error:
                verdict.add(f"{where}: must be refused with ValueError, got {outcome.error or 'no error'}")
            elif key == "mixed devices" and "device" not in outcome.error:
                verdict.add(f"{where}: the error does not say why (name the device): {outcome.error}")
            elif [c for c in run.of(r, prefix + key) if not c.kind.startswith("store.")]:
                verdict.add(f"{where}: refused only after communicating: check every tensor before the first call")


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
        for problem in run.problems():
            verdict.add(problem)
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
        for problem in run.problems():
            verdict.add(problem)
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
