"""Lesson 5's graded tasks: the plan, the copies, the fused all-reduce and the reducer.

Tasks 1 and 3 (the plan; the slots and the copy back) run in a world of one rank on lists
drawn from its secret -- sizes, dtypes, shapes, views, thresholds and buffer sizes -- and
the judge plans and slices the same lists with the reference. Task 2 (the copy in, the
flush) runs in a world of three: the packed buffer recomputed here, the flush's one
all-reduce read from the tap. Tasks 4 and 5 (the fused all-reduce, the reducer) are
:mod:`~collectives.course.grading.tasks.lesson05_all_reduce`'s.
"""

from __future__ import annotations

import math

import torch

from .... import fused as reference  # imported here, before the ranks fork: they inherit it
from ....core.ops import ReduceOp, op_name
from ... import verify
from ...verify import Case
from . import ANY, P2P, GradedTask
from .allreduce import expected_output
from .lesson05_all_reduce import judge_fused, judge_reducer
from .lesson05_inputs import (
    MAX_PROBLEMS,
    SUBGROUP,
    WORLD,
    _draw,
    _dt,
    _logical,
    _one_call_problem,
    _piece,
    _short,
    _values,
)
from .world import Grading, Probe, Verdict, outcome_problem

HERE = __name__
LAYOUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
                 torch.uint8)


# ---- task 1: plan_layout ---------------------------------------------------------------

def layout_cases(seed: int) -> list[tuple[str, list, int, int]]:
    """(name, specs, threshold_bytes, buffer_bytes): lists of (numel, dtype) drawn from
    ``seed`` with sizes at the edges -- empty, exactly at the threshold, just under it, a
    buffer filled exactly, one element more than a buffer holds -- and small ones, in one
    to four dtypes; the threshold below, near or above the buffer size."""
    g = torch.Generator().manual_seed(seed)
    cases = [("an empty list", [], 4096, 2048), ("only empty tensors", [(0, torch.float32), (0, torch.int64)], 64, 32)]
    for k in range(40):
        buffer = 8 * _draw(g, 8, 512)
        threshold = 8 * _draw(g, max(1, buffer // 16), buffer // 4)
        dtypes = [LAYOUT_DTYPES[i] for i in torch.randperm(len(LAYOUT_DTYPES), generator=g)[:_draw(g, 1, 4)]]
        specs = []
        for _ in range(_draw(g, 1, 28)):
            dtype = dtypes[_draw(g, 0, len(dtypes) - 1)]
            size = dtype.itemsize
            fits, at = buffer // size, -(-threshold // size)
            kind = _draw(g, 0, 11)
            numel = {0: 0, 1: at, 2: max(at - 1, 1), 3: fits, 4: fits + 1}.get(kind)
            if numel is None:
                numel = _draw(g, 1, max(1, min(fits, at) // 3))
            specs.append((numel, dtype))
        cases.append((f"layout {k} ({len(specs)} tensors, threshold {threshold} B, buffer {buffer} B)",
                      specs, threshold, buffer))
    return cases


def plain_layout(layout) -> dict:
    """A Layout as plain data (what crosses back from the rank)."""
    return dict(steps=tuple((str(kind), int(i)) for kind, i in layout.steps),
                buckets=tuple((_dt(b.dtype), _dt(b.wire_dtype), tuple(int(i) for i in b.indices),
                               tuple(int(n) for n in b.sizes)) for b in layout.buckets),
                direct=tuple(int(i) for i in layout.direct), skipped=tuple(int(i) for i in layout.skipped))


def probe_plan(probe: Probe) -> dict:
    plan_layout = probe.student("plan_layout")

    def planned(specs, threshold, buffer):
        return plain_layout(plan_layout(list(specs), threshold, buffer))
    planned.__name__ = "plan_layout"
    return {name: probe.call(name, planned, specs, threshold, buffer)
            for name, specs, threshold, buffer in layout_cases(probe.seed("layouts"))}


def _judge_plan(grading: Grading) -> Verdict:
    verdict = Verdict()
    run = grading.world(f"{HERE}:probe_plan", 1)
    for name, specs, threshold, buffer in layout_cases(run.seed(0, "layouts")):
        where = f"plan_layout, world of 1, rank 0, case {name}"
        outcome = run.results[0][name]
        if outcome_problem(where, outcome, verdict):
            continue
        expected = plain_layout(reference.plan_layout(specs, threshold, buffer))
        for part in ("buckets", "steps", "direct", "skipped"):
            if outcome.value.get(part) != expected[part]:
                verdict.add(f"{where}: {part} {_short(outcome.value.get(part))}, expected {_short(expected[part])}"
                            f"; the list: {_short([(n, _dt(d)) for n, d in specs], 200)}")
                break
        if verdict.not_written or len(verdict.problems) > MAX_PROBLEMS:
            break
    return verdict


# ---- task 2: copy_in, flush ------------------------------------------------------------

def copy_in_cases(seed: int) -> list[tuple[str, list[torch.Tensor], torch.Tensor]]:
    """(name, tensors, buffer): groups to pack, drawn from ``seed``; the buffer is a little
    longer than the group and holds -1 where nothing may be written."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for k, (what, dtype, kinds) in enumerate([
            ("1-D tensors of the buffer's dtype", torch.float32, (0,)),
            ("1-D tensors and empty ones", torch.float64, (0, 0, 5)),
            ("2-D tensors, views, a scalar", torch.float32, (0, 1, 2, 3, 4, 5)),
            ("transposed views", torch.int64, (2,)),
            ("float32 into a float16 buffer", torch.float16, (0, 1, 2, 3, 4)),
            ("mixed shapes", torch.float32, (0, 1, 2, 3, 4, 5))]):
        source = torch.float32 if dtype == torch.float16 else dtype
        tensors = [_piece(g, source, kinds[_draw(g, 0, len(kinds) - 1)]) for _ in range(_draw(g, 1, 6))]
        total = sum(t.numel() for t in tensors)
        cases.append((f"copy {k}: {what}", tensors, torch.full((total + _draw(g, 1, 6),), -1, dtype=dtype)))
    return cases


FLUSH_SHAPES = ((5,), (0,), (11,), (2, 3), (3,))


def _flush_cases(size: int) -> list[tuple[str, object, tuple | None]]:
    cases = [(f"flush {op_name(op)}", op, None) for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG)]
    if size > len(SUBGROUP):
        cases.append((f"flush SUM, group {SUBGROUP}", ReduceOp.SUM, SUBGROUP))
    return cases


def probe_copies(probe: Probe) -> dict:
    import torch.distributed as dist

    copy_in, flush = probe.student("copy_in"), probe.student("flush")
    group = dist.new_group(list(SUBGROUP)) if probe.size > len(SUBGROUP) else None
    out = {}

    def packed(tensors, buffer):
        filled = copy_in(tensors, buffer)
        return _filled(filled, buffer)
    packed.__name__ = "copy_in"
    for name, tensors, buffer in copy_in_cases(probe.seed("copy_in")):
        outcome = probe.call(name, packed, tensors, buffer)
        out[name] = (outcome, buffer.clone(), [_logical(t) for t in tensors])

    def flushed(tensors, buffer, op, grp):
        work, filled = flush(tensors, buffer, op=op, group=grp)
        work.wait()
        return _filled(filled, buffer)
    flushed.__name__ = "flush"
    for name, op, members in _flush_cases(probe.size):
        if members is not None and probe.rank not in members:
            continue
        tensors = [_values(s, torch.float32, op, probe.seed(f"{name} {i}")) for i, s in enumerate(FLUSH_SHAPES)]
        buffer = torch.full((64,), -1.0)
        outcome = probe.call(name, flushed, tensors, buffer, op, group if members else None)
        out[name] = (outcome, buffer.clone(), None)
    return out


def _filled(filled, buffer: torch.Tensor):
    """What ``copy_in``/``flush`` returned as the filled part: (is it the buffer's first
    elements, its values), plain data."""
    if not isinstance(filled, torch.Tensor):
        return (f"returned {type(filled).__name__}, expected the filled part of the buffer (a tensor)", None)
    if filled.numel() and (filled.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
                           or filled.data_ptr() != buffer.data_ptr() or not filled.is_contiguous()):
        return ("the filled part it returned is not the buffer's first elements (a view of the "
                "same memory): the all-reduce must reduce the buffer itself", filled.detach().clone())
    return ("", filled.detach().clone())


def _judge_copies(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(WORLD):
        run = grading.world(f"{HERE}:probe_copies", size)
        for rank in range(size):
            for name, tensors, buffer in copy_in_cases(run.seed(rank, "copy_in")):
                where = f"copy_in, world of {size}, rank {rank}, case {name}"
                outcome, after, inputs = run.results[rank][name]
                if outcome_problem(where, outcome, verdict):
                    continue
                packed = torch.cat([t.reshape(-1).to(buffer.dtype) for t in tensors])
                verdict.add(_packed_problem(where, outcome.value, after, packed, buffer)
                            or _unchanged_problem(where, tensors, inputs))
                calls = [c.kind for c in run.of(rank, name)]
                if calls:
                    verdict.add(f"{where}: called {', '.join(sorted(set(calls)))}: copy_in only copies")
        for name, op, members in _flush_cases(size):
            ranks = list(members) if members is not None else list(range(size))
            flat = [torch.cat([_values(s, torch.float32, op, run.seed(r, f"{name} {i}")).reshape(-1)
                               for i, s in enumerate(FLUSH_SHAPES)]) for r in ranks]
            wire = ReduceOp.SUM if op == ReduceOp.AVG else op
            expected = expected_output(Case(flat[0].numel(), torch.float32, wire), flat)
            for r in ranks:
                where = f"flush, world of {size}, rank {r}, case {name}"
                outcome, after, _ = run.results[r][name]
                if outcome_problem(where, outcome, verdict):
                    continue
                problem = _packed_problem(where, outcome.value, after, expected, torch.full((64,), -1.0))
                if problem is None:
                    problem = _one_call_problem(run.of(r, name), [(expected.numel(), "float32")], ranks)
                    problem = problem and f"{where}: {problem}"
                verdict.add(problem)
        if verdict.not_written or verdict.problems:
            break
    return verdict


def _packed_problem(where: str, value, after: torch.Tensor, packed: torch.Tensor,
                    buffer: torch.Tensor) -> str | None:
    """The filled part is the buffer's first elements, holding ``packed``; the rest of the
    buffer is as it was."""
    problem, filled = value
    if problem:
        return f"{where}: {problem}"
    if filled.numel() != packed.numel():
        return f"{where}: the filled part holds {filled.numel()} elements, expected {packed.numel()}"
    problem = verify.compare(packed, after[:packed.numel()])
    if problem:
        return f"{where}: the buffer's first {packed.numel()} elements: {problem}"
    if not torch.equal(after[packed.numel():], buffer[packed.numel():]):
        return f"{where}: wrote past the filled part of the buffer"
    return None


def _unchanged_problem(where: str, tensors, inputs) -> str | None:
    for i, (t, seen) in enumerate(zip(tensors, inputs)):
        if not torch.equal(_logical(t), seen):
            return f"{where}: changed its input {i} (or what lies between a view's elements)"
    return None


# ---- task 3: slot_views, copy_back -----------------------------------------------------

def _shape(g: torch.Generator) -> tuple:
    kind = _draw(g, 0, 5)
    return [(_draw(g, 1, 9),), (_draw(g, 1, 4), _draw(g, 1, 4)), (), (0,),
            (_draw(g, 1, 3), _draw(g, 1, 3), _draw(g, 1, 2)), (0, 3)][kind]


def slot_cases(seed: int) -> list[tuple[str, torch.Tensor, list[tuple]]]:
    """(name, buffer, shapes): a buffer of random values (some a slice of a longer one) and
    shapes to carve from its start, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for k in range(8):
        shapes = [_shape(g) for _ in range(_draw(g, 1, 7))]
        if k % 2:                            # a buffer at an offset always carries elements
            shapes.insert(_draw(g, 0, len(shapes)), (_draw(g, 1, 9),))
        total = sum(math.prod(s) for s in shapes)
        dtype = (torch.float32, torch.int64, torch.float16)[k % 3]
        start = _draw(g, 1, 3) if k % 2 else 0
        whole = torch.randint(-1000, 1000, (start + total + _draw(g, 0, 5),), generator=g).to(dtype)
        cases.append((f"slots {k} ({len(shapes)} shapes{', buffer at an offset' if start else ''})",
                      whole[start:], shapes))
    return cases


def copy_back_cases(seed: int) -> list[tuple[str, torch.Tensor, list[torch.Tensor], bool]]:
    """(name, buffer, targets, pass slots): results in a buffer, and the tensors (zeros,
    views, a scalar, empties; float32 out of a float16 buffer) they go back to."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for k in range(6):
        dtype = torch.float16 if k == 4 else (torch.float32, torch.float64)[k % 2]
        target = torch.float32 if dtype == torch.float16 else dtype
        targets = [_piece(g, target, _draw(g, 0, 5)).zero_() for _ in range(_draw(g, 1, 6))]
        total = sum(t.numel() for t in targets)
        buffer = torch.randint(-100, 100, (total + _draw(g, 0, 4),), generator=g).to(dtype)
        cases.append((f"copy back {k}{' (slots given)' if k == 5 else ''}", buffer, targets, k == 5))
    return cases


def probe_slots(probe: Probe) -> dict:
    slot_views, copy_back = probe.student("slot_views"), probe.student("copy_back")
    copy_in = probe.student("copy_in")
    out = {}

    def carved(buffer, shapes):
        views = slot_views(buffer, [torch.Size(s) for s in shapes])
        return [_view_record(v, buffer) for v in views]
    carved.__name__ = "slot_views"
    for name, buffer, shapes in slot_cases(probe.seed("slots")):
        before = buffer.clone()
        outcome = probe.call(name, carved, buffer, shapes)
        out[name] = (outcome, torch.equal(before, buffer))

    def copied_back(buffer, targets, slots):
        copy_back(buffer, targets, slots)
    copied_back.__name__ = "copy_back"
    for name, buffer, targets, with_slots in copy_back_cases(probe.seed("copy back")):
        before = buffer.clone()
        slots = reference.slot_views(buffer, [t.shape for t in targets]) if with_slots else None
        outcome = probe.call(name, copied_back, buffer, targets, slots)
        out[name] = (outcome, torch.equal(before, buffer), [_logical(t) for t in targets])

    def round_trip(tensors):
        buffer = torch.zeros(sum(t.numel() for t in tensors) + 3, dtype=torch.float16)
        copy_in(tensors, buffer)
        for t in tensors:
            t.zero_()
        copy_back(buffer, tensors)
        return [_logical(t) for t in tensors]
    round_trip.__name__ = "copy_in then copy_back"
    g = torch.Generator().manual_seed(probe.seed("round trip"))
    tensors = [_piece(g, torch.float32, kind) for kind in (0, 1, 2, 3, 4, 5)]
    out["round trip"] = (probe.call("round trip", round_trip, tensors),)
    return out


def _view_record(view, buffer: torch.Tensor):
    if not isinstance(view, torch.Tensor):
        return (type(view).__name__, None, None, None)
    shares = view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    return (tuple(view.shape), shares, view.storage_offset() - buffer.storage_offset(), view.detach().clone())


def _judge_slots(grading: Grading) -> Verdict:
    verdict = Verdict()
    run = grading.world(f"{HERE}:probe_slots", 1)
    results = run.results[0]
    for name, buffer, shapes in slot_cases(run.seed(0, "slots")):
        where = f"slot_views, world of 1, rank 0, case {name}"
        outcome, untouched = results[name]
        if outcome_problem(where, outcome, verdict):
            continue
        expected = reference.slot_views(buffer, [torch.Size(s) for s in shapes])
        verdict.add(_slots_problem(where, outcome.value, expected, buffer) or
                    (None if untouched else f"{where}: changed the buffer"))
    for name, buffer, targets, _ in copy_back_cases(run.seed(0, "copy back")):
        where = f"copy_back, world of 1, rank 0, case {name}"
        outcome, untouched, got = results[name]
        if outcome_problem(where, outcome, verdict):
            continue
        slots = reference.slot_views(buffer, [t.shape for t in targets])
        for i, (t, slot, seen) in enumerate(zip(targets, slots, got)):
            t.copy_(slot)
            problem = verify.compare(_logical(t), seen)
            if problem:
                base = t._base if t._base is not None else t
                inside = verify.compare(_logical(t)[:t.numel()], seen[:t.numel()])
                what = (f"tensor {i} (shape {tuple(t.shape)}{'' if t.is_contiguous() else ', a view'}): "
                        + (inside or f"wrote outside its elements (between a view's elements, {base.numel()} "
                                      "in its memory)"))
                verdict.add(f"{where}: {what}")
                break
        else:
            if not untouched:
                verdict.add(f"{where}: changed the buffer")
    where = "copy_in then copy_back, world of 1, rank 0, case a round trip through a float16 buffer"
    outcome, = results["round trip"]
    if not outcome_problem(where, outcome, verdict):
        g = torch.Generator().manual_seed(run.seed(0, "round trip"))
        originals = [_piece(g, torch.float32, kind) for kind in (0, 1, 2, 3, 4, 5)]
        for i, (t, seen) in enumerate(zip(originals, outcome.value)):
            problem = verify.compare(_logical(t), seen)
            if problem:
                verdict.add(f"{where}: tensor {i} (shape {tuple(t.shape)}) came back changed: {problem}")
                break
    return verdict


def _slots_problem(where: str, got, expected, buffer) -> str | None:
    if len(got) != len(expected):
        return f"{where}: returned {len(got)} views for {len(expected)} shapes"
    for i, ((shape, shares, offset, values), want) in enumerate(zip(got, expected)):
        if shares is None:
            return f"{where}: view {i} is a {shape}, not a tensor"
        if shape != tuple(want.shape):
            return f"{where}: view {i} has shape {shape}, expected {tuple(want.shape)}"
        if want.numel() and not shares:
            return f"{where}: view {i} does not share the buffer's memory"
        start = want.storage_offset() - buffer.storage_offset()
        if want.numel() and offset != start:
            return f"{where}: view {i} starts at element {offset} of the buffer, expected {start}"
        problem = verify.compare(want, values)
        if problem:
            return f"{where}: view {i}: {problem}"
    return None


TASKS = [
    GradedTask(5, 1, "plan_layout: buckets by dtype, flush on overflow", 4, _judge_plan, ("plan_layout",), routes=P2P),
    GradedTask(5, 2, "copy_in and flush", 4, _judge_copies, ("copy_in", "flush"), routes=ANY),
    GradedTask(5, 3, "slot_views and copy_back", 3, _judge_slots, ("slot_views", "copy_back"), routes=P2P),
    GradedTask(5, 4, "fused_all_reduce: the complete fused all-reduce", 5, judge_fused, ("fused_all_reduce",),
               routes=ANY),
    GradedTask(5, 5, "FusedAllReducer: cached layout, double buffering", 4, judge_reducer, ("FusedAllReducer",),
               routes=ANY),
]
