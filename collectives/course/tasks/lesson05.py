"""Lesson 5's graded tasks: the plan, the copies, the fused all-reduce and the reducer.

Tasks 1 and 3 (the plan; the slots and the copy back) run in a world of one rank on lists
drawn from its secret -- sizes, dtypes, shapes, views, thresholds and buffer sizes -- and
the judge plans and slices the same lists with the reference. Tasks 2, 4 and 5 run in a
world of three: every tensor's values come from its rank's secret, every result is
recomputed here, and every all-reduce each rank made is read from the tap: exactly one per
step of the layout the reference plans for the same list, of the bucket's (or the
tensor's) size and dtype, over the right group. The reducer (task 5) is held besides to
its design, from records its rank cannot take back: the layout planned once per list of
shapes; with two buffers the next flush issued before the previous one landed, and the one
after waiting for it (the course's trace times each all-reduce; the tap counts them too);
its streams ordered by events (:func:`collectives.core.streams.checking`, run around it).
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
from . import GradedTask
from .allreduce import expected_output, judge_cases, probe_cases
from .world import Grading, Probe, Run, Verdict, outcome_problem

HERE = __name__
WORLD = 3                     # the tasks that communicate; a subgroup of two leaves a rank out
SUBGROUP = (0, 1)
THRESHOLD, BUFFER = 4096, 2048   # 4 KiB or more: on its own; buffers of 512 float32
OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)
# float32: 200+200, then 200+100, then 300+212 (fills 512 exactly); 2000 on its own; 0 skipped
THREE_FLUSHES = (200, 200, 200, 100, 2000, 300, 0, 212)
LAYOUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
                 torch.uint8)
MAX_PROBLEMS = 20


def one_thread(judge):
    """Run ``judge`` with one intra-op thread: the expected values are small tensors, and on a
    loaded machine a second thread makes a reduction over three ranks a thousand times slower."""
    import functools

    @functools.wraps(judge)
    def judged(grading):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return judge(grading)
        finally:
            torch.set_num_threads(threads)
    return judged


def _draw(g: torch.Generator, lo: int, hi: int) -> int:
    """An integer in [lo, hi], from ``g``."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def _short(value, limit: int = 160) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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


@one_thread
def _judge_plan(grading: Grading) -> Verdict:
    verdict = Verdict()
    run = grading.world(f"{HERE}:probe_plan", 1)
    for problem in run.problems():
        verdict.add(problem)
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


# ---- inputs shared by the tasks that copy ----------------------------------------------

def _piece(g: torch.Generator, dtype: torch.dtype, kind: int) -> torch.Tensor:
    """One input tensor of a copy: 1-D, 2-D, a transposed or strided view, a scalar or empty."""
    def values(*shape):
        return torch.randint(-50, 51, shape, generator=g).to(dtype)
    if kind == 0:
        return values(_draw(g, 1, 12))
    if kind == 1:
        return values(_draw(g, 1, 4), _draw(g, 1, 5))
    if kind == 2:
        return values(_draw(g, 2, 4), _draw(g, 2, 5)).t()
    if kind == 3:
        n = _draw(g, 1, 9)
        base = torch.full((2 * n,), SENTINEL, dtype=dtype)
        base[::2] = values(n)
        return base[::2]
    if kind == 4:
        return values()
    return torch.zeros((0,) if _draw(g, 0, 1) else (0, 3), dtype=dtype)


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


def _values(shape, dtype, op, seed: int) -> torch.Tensor:
    """Integer-valued input of ``shape``: any order of combining is exact."""
    return verify.make_values(Case(math.prod(shape), dtype, op), 0, seed).view(shape)


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


def _flat(tensors) -> torch.Tensor:
    """Every element of ``tensors`` in one float64 tensor (exact for the course's values): one
    tensor to send back, not one per element of the list."""
    return torch.cat([t.detach().reshape(-1).double() for t in tensors] + [torch.zeros(0, dtype=torch.float64)])


def _list_problem(expected: list[torch.Tensor], flat: torch.Tensor) -> str | None:
    """What differs between each expected tensor and its part of ``flat`` (from :func:`_flat`)."""
    offset = 0
    for i, e in enumerate(expected):
        problem = verify.compare(e.reshape(-1).double(), flat[offset:offset + e.numel()])
        if problem:
            return f"tensor {i} ({_dt(e.dtype)}, shape {tuple(e.shape)}): {problem}"
        offset += e.numel()
    return None


def _logical(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements in logical order, plus what lies between a strided view's."""
    base = t._base if t._base is not None else t
    return torch.cat([t.detach().reshape(-1).double(), base.detach().reshape(-1).double()])


@one_thread
def _judge_copies(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(WORLD):
        run = grading.world(f"{HERE}:probe_copies", size)
        for problem in run.problems():
            verdict.add(problem)
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


def _one_call_problem(calls, expected: list[tuple[int, str]], ranks: list[int]) -> str | None:
    """Exactly the all-reduces ``expected`` ((numel, dtype) each, in order), over ``ranks``."""
    others = sorted({c.kind for c in calls if c.kind != "allreduce" and not c.kind.startswith(("store.", "backend."))})
    if others:
        return f"called {', '.join(others)}: a fused all-reduce makes all-reduces only"
    got = [(c.numel, c.dtype) for c in calls if c.kind == "allreduce"]
    if got != expected:
        what = "one all-reduce per flush and one per tensor on its own, in the layout's order"
        return f"all-reduced {_short(got)}, expected {what}: {_short(expected)}"
    group = tuple(ranks)
    if any(c.ranks and tuple(c.ranks) != group for c in calls if c.kind == "allreduce"):
        bad = next(c.ranks for c in calls if c.kind == "allreduce" and c.ranks and tuple(c.ranks) != group)
        return f"all-reduced over ranks {bad}, expected the group's {group}"
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
        total = sum(math.prod(s) for s in shapes)
        dtype = (torch.float32, torch.int64, torch.float16)[k % 3]
        start = _draw(g, 0, 3) if k % 2 else 0
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


@one_thread
def _judge_slots(grading: Grading) -> Verdict:
    verdict = Verdict()
    run = grading.world(f"{HERE}:probe_slots", 1)
    for problem in run.problems():
        verdict.add(problem)
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


# ---- tasks 4 and 5: the fused all-reduce, the reducer ----------------------------------

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
    out["harness"] = probe_cases(probe, "fused_all_reduce", verify.default_cases(probe.size), fn=single)
    return out


@one_thread
def _judge_fused(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(WORLD):
        run = grading.world(f"{HERE}:probe_fused", size)
        for problem in run.problems():
            verdict.add(problem)
        _judge_lists(run, verdict, "fused_all_reduce")
        if not verdict.problems and not verdict.not_written:
            harness = Run(run.size, run.secrets, [r["harness"] for r in run.results], run.calls, run.loose,
                          run.complete, run.check_traffic)
            judge_cases(harness, verify.default_cases(size), verdict,
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

# What the reducer's ordering and timing are read with, as the course wrote it: taken here,
# in the grading process, before any rank imports the student's code; put back in the
# rank before each check, and looked at again after it.
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


@one_thread
def _judge_reducer(grading: Grading) -> Verdict:
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


TASKS = [
    GradedTask(5, 1, "plan_layout: buckets by dtype, flush on overflow", 4, _judge_plan, ("plan_layout",)),
    GradedTask(5, 2, "copy_in and flush", 4, _judge_copies, ("copy_in", "flush")),
    GradedTask(5, 3, "slot_views and copy_back", 3, _judge_slots, ("slot_views", "copy_back")),
    GradedTask(5, 4, "fused_all_reduce: the complete fused all-reduce", 5, _judge_fused, ("fused_all_reduce",)),
    GradedTask(5, 5, "FusedAllReducer: cached layout, double buffering", 4, _judge_reducer, ("FusedAllReducer",)),
]
