"""Lesson 5's graded lists of tensors, shared by task 4 (``fused_all_reduce``) and task 5
(``FusedAllReducer``, :mod:`.lesson05_all_reduce`).

Each op on a mixed list three times (the same tensors refilled the third), three flushes
exactly, a subgroup, views, and bad input: the probe's half makes every call through the
function or a reducer (:func:`_run_lists`), the judge's half recomputes every result in the
grading process and holds each call's all-reduces, read from the tap, to the layout the
reference plans for the same list (:func:`_judge_lists`).
"""

from __future__ import annotations

import math

import torch

from .... import fused as reference  # imported here, before the ranks fork: they inherit it
from ....core.ops import ReduceOp, op_name
from ... import verify
from ...verify import SENTINEL, Case
from .allreduce import expected_output
from .lesson05_inputs import (
    BUFFER,
    SUBGROUP,
    THRESHOLD,
    _dt,
    _flat,
    _list_problem,
    _logical,
    _one_call_problem,
    _values,
)
from .world import Probe, Run, Verdict, outcome_problem

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
