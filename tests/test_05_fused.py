"""Lesson 5: fused buffers -- each tensor of a list reduced as ``dist.all_reduce`` would, in
fewer calls.

Layout and copies are checked directly (no world); everything that communicates runs in
one world of 4 ranks per module (``graded``), plus one for the reference's own extras
(float16 on the wire, ``bind``). Values are integer-valued, so results must match
``dist.all_reduce`` bit for bit.
"""

import math
import sys
import weakref

import pytest
import torch
import torch.distributed as dist

from collectives import launch, trace, verify
from collectives.course.catalog import world_timeout
from collectives.course.impl import resolve
from collectives.core.ops import ReduceOp

LESSON = 5
WORLD = 4
OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)

# The settings most checks run with: a tensor of 4 KiB or more goes on its own; the others
# share buffers of 2 KiB (512 float32 elements).
THRESHOLD, BUFFER = 4096, 2048
# All float32: 200+200 fill 400 of 512 elements, the next 200 would overflow -> flush 1;
# 200+100, then 300 would overflow -> flush 2; 300+212 = 512 exactly fits -> flush 3 at the
# end. 2000 elements (8000 bytes) are over the threshold: one all-reduce of their own.
# The empty tensor sends nothing. This makes exactly three flushes.
THREE_FLUSH_SIZES = (200, 200, 200, 100, 2000, 300, 0, 212)
THREE_FLUSH_CALLS = sorted([400, 2000, 300, 512])


def _mixed_specs(op):
    """Odd sizes, an empty tensor, one over the threshold, a 2-D tensor, every dtype the
    harness knows (integers left out for AVG, which they cannot do), and sizes that come
    again further down the list (their slots in a buffer are not next to each other)."""
    specs = [((3,), torch.float32), ((0,), torch.float32), ((2000,), torch.float32),
             ((301,), torch.float16), ((77,), torch.bfloat16), ((1,), torch.float32),
             ((13, 7), torch.float32), ((255,), torch.float64), ((129,), torch.int32),
             ((33,), torch.int64), ((1500,), torch.float16), ((0,), torch.int32),
             ((3,), torch.float32), ((301,), torch.float16), ((1,), torch.float32)]
    if op == ReduceOp.AVG:
        specs = [(s, d) for s, d in specs if d.is_floating_point]
    return specs


def _values(shape, dtype, op, rank, seed):
    numel = math.prod(shape)
    return verify.make_values(verify.Case(numel, dtype, op), rank, seed).view(shape)


def _mixed(op, rank, seed):
    return [_values(s, d, op, rank, seed) for s, d in _mixed_specs(op)]


def _compare_all(expected, got, what):
    for i, (e, g) in enumerate(zip(expected, got)):
        problem = verify.compare(e, g)
        if problem:
            raise AssertionError(f"{what}, tensor {i} ({g.dtype}, shape {tuple(g.shape)}): {problem}")


def _check(results, name, fn):
    """Run one check; record "ok", or what went wrong, without stopping the others."""
    try:
        out = fn()
        results[name] = "ok" if out is None else out
    except NotImplementedError as exc:
        results[name] = f"not implemented: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported per check
        results[name] = f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------------------
# The world: every communicating check of the implementation under test.

def _graded_checks(spec):
    mod = resolve(spec)
    rank = dist.get_rank()
    results = {}
    subgroup = dist.new_group([0, 1, 2])

    def flush_sends_one_all_reduce():
        tensors = [_values((n,), torch.float32, ReduceOp.SUM, rank, 0) for n in (5, 0, 11, 3)]
        expected = torch.cat([verify.reference_all_reduce(t) for t in tensors])
        buffer = torch.full((64,), -1.0)
        with trace.recording() as t:
            work, filled = mod.flush(tensors, buffer)
            work.wait()
        calls = [(e.kind, e.numel) for e in t.collectives()]
        assert calls == [("all_reduce", 19)], f"expected one all_reduce of 19 elements, saw {calls}"
        assert filled.data_ptr() == buffer.data_ptr(), "flush must reduce the buffer's first elements"
        assert verify.compare(expected, filled) is None, verify.compare(expected, filled)
        assert bool((buffer[19:] == -1).all()), "flush wrote past the filled part of the buffer"

    def fused_matches_every_op_twice(make):
        for op in OPS:
            for seed in (0, 1):      # twice: reused buffers, and the layout from the first call
                tensors = _mixed(op, rank, seed)
                expected = [verify.reference_all_reduce(t, op) for t in tensors]
                make(tensors, op)
                _compare_all(expected, tensors, f"op {op}, call {seed + 1}")
            # then the same tensor objects again, refilled: a training loop's list, seen before
            torch._foreach_copy_(tensors, _mixed(op, rank, 2))
            expected = [verify.reference_all_reduce(t, op) for t in tensors]
            make(tensors, op)
            _compare_all(expected, tensors, f"op {op}, call 3 (the same tensors as call 2)")

    def one_all_reduce_per_flush(make):
        tensors = [_values((n,), torch.float32, ReduceOp.SUM, rank, 0) for n in THREE_FLUSH_SIZES]
        expected = [verify.reference_all_reduce(t) for t in tensors]
        with trace.recording() as t:
            make(tensors, ReduceOp.SUM)
        calls = sorted(e.numel for e in t.collectives() if e.kind == "all_reduce")
        others = [e.kind for e in t.collectives() if e.kind != "all_reduce"]
        assert not others, f"only all_reduce expected, saw {others}"
        assert calls == THREE_FLUSH_CALLS, f"expected all_reduce sizes {THREE_FLUSH_CALLS}, saw {calls}"
        _compare_all(expected, tensors, "three flushes")

    def views_come_out_right(make):
        base_a = torch.full((2 * 301,), 77.0)       # every other element: a strided view
        strided = base_a[::2]
        strided.copy_(_values((301,), torch.float32, ReduceOp.SUM, rank, 0))
        transposed = _values((11, 13), torch.float32, ReduceOp.SUM, rank, 1).t()
        big_base = torch.full((2 * 1500,), 77.0)    # 6000 bytes: over the threshold, direct
        big = big_base[1::2]
        big.copy_(_values((1500,), torch.float32, ReduceOp.SUM, rank, 2))
        tensors = [strided, transposed, big]
        expected = [verify.reference_all_reduce(t) for t in tensors]
        make(tensors, ReduceOp.SUM)
        _compare_all(expected, tensors, "views")
        strided.copy_(_values((301,), torch.float32, ReduceOp.SUM, rank, 3))   # the same list again
        expected = [verify.reference_all_reduce(t) for t in tensors]
        make(tensors, ReduceOp.SUM)
        _compare_all(expected, tensors, "views, second call")
        assert bool((base_a[1::2] == 77).all()) and bool((big_base[0::2] == 77).all()), \
            "wrote between the elements of a strided view"

    def subgroup_only(make):
        if rank == 3:
            return
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            tensors = _mixed(op, rank, 3)
            expected = [verify.reference_all_reduce(t, op, subgroup) for t in tensors]
            make(tensors, op, subgroup)
            _compare_all(expected, tensors, f"subgroup [0,1,2], op {op}")

    def bad_input_is_refused(make):
        problems = []
        cases = {"mixed devices": [torch.ones(4), torch.ones(4, device="meta")],
                 "an expanded tensor": [torch.ones(3), torch.ones(1).expand(8)]}
        for what, tensors in cases.items():
            try:
                with trace.recording() as t:
                    make(tensors, ReduceOp.SUM)
                problems.append(f"{what} was accepted")
            except ValueError as exc:
                if t.collectives():
                    problems.append(f"{what}: refused only after communicating")
                if what == "mixed devices" and "device" not in str(exc):
                    problems.append(f"{what}: the error does not say why: {exc}")
        assert not problems, "; ".join(problems)

    def one_call(tensors, op, group=None):
        mod.fused_all_reduce(tensors, op=op, group=group, threshold_bytes=THRESHOLD, buffer_bytes=BUFFER)

    def reducer_call(double):
        reducers = {}

        def run(tensors, op, group=None):
            key = (op, group)
            if key not in reducers:
                reducers[key] = mod.FusedAllReducer(THRESHOLD, BUFFER, torch.device("cpu"), op=op,
                                                    group=group, double_buffer=double)
            reducers[key].all_reduce(tensors)
            reducers[key].wait()
        return run

    def harness_cases():
        def single(tensor, op=ReduceOp.SUM, group=None):
            mod.fused_all_reduce([tensor], op=op, group=group, threshold_bytes=64 << 10,
                                 buffer_bytes=64 << 10)
        verify.check_all_reduce(single).raise_if_failed()

    _check(results, "flush", flush_sends_one_all_reduce)
    _check(results, "fused ops", lambda: fused_matches_every_op_twice(one_call))
    _check(results, "fused flushes", lambda: one_all_reduce_per_flush(one_call))
    _check(results, "fused views", lambda: views_come_out_right(one_call))
    _check(results, "fused subgroup", lambda: subgroup_only(one_call))
    _check(results, "fused errors", lambda: bad_input_is_refused(one_call))
    _check(results, "fused harness", harness_cases)
    for double in (True, False):
        name = "double" if double else "single"
        _check(results, f"reducer ops {name}", lambda: fused_matches_every_op_twice(reducer_call(double)))
        _check(results, f"reducer flushes {name}", lambda: one_all_reduce_per_flush(reducer_call(double)))
        _check(results, f"reducer views {name}", lambda: views_come_out_right(reducer_call(double)))
        _check(results, f"reducer overlap {name}", lambda: _flush_timeline(mod, double, rank))
    _check(results, "reducer subgroup", lambda: subgroup_only(reducer_call(True)))
    _check(results, "reducer errors", lambda: bad_input_is_refused(reducer_call(True)))
    _check(results, "reducer plans once", lambda: _planned_once(mod, rank))
    _check(results, "reducer ordered", lambda: _streams_ordered(mod, rank))
    return results


def _streams_ordered(mod, rank):
    """The reducer under streams.checking(): the CPU stand-in streams keep count as a GPU's
    would, so a missing wait (the copy-in's "filled", the copy-back's "free", the producer,
    the caller) is reported here. Returns the violations, per setting."""
    from collectives import streams

    found = {}
    for double in (True, False):
        with streams.checking(raise_errors=False) as checker:
            reducer = mod.FusedAllReducer(THRESHOLD, BUFFER, torch.device("cpu"), double_buffer=double)
            # six flushes of one tensor each (both buffers used three times), a tensor on its
            # own, a transposed view; three calls
            for seed in range(3):
                tensors = [_values((400,), torch.float32, ReduceOp.SUM, rank, seed + k) for k in range(6)]
                tensors += [_values((1500,), torch.float32, ReduceOp.SUM, rank, seed),
                            _values((7, 3), torch.float32, ReduceOp.SUM, rank, seed).t()]
                expected = [verify.reference_all_reduce(t) for t in tensors]
                reducer.all_reduce(tensors)
                reducer.wait()
                _compare_all(expected, tensors, f"double_buffer={double}, call {seed + 1}")
        found["double" if double else "single"] = checker.violations
    return found


def _flush_timeline(mod, double, rank):
    """Six float32 tensors of 400 elements, buffers of 512: six flushes, one tensor each.
    Returns, per flush, (issued, landed) times of its all_reduce from the trace."""
    reducer = mod.FusedAllReducer(THRESHOLD, BUFFER, torch.device("cpu"), double_buffer=double)
    tensors = [_values((400,), torch.float32, ReduceOp.SUM, rank, k) for k in range(6)]
    expected = [verify.reference_all_reduce(t) for t in tensors]
    with trace.recording() as t:
        reducer.all_reduce(tensors)
        reducer.wait()
    _compare_all(expected, tensors, "six flushes")
    events = [e for e in t.collectives() if e.kind == "all_reduce"]
    assert len(events) == 6, f"expected 6 all_reduce calls, saw {len(events)}"
    assert all(e.t1 is not None for e in events), \
        "every all_reduce must be async_op=True and waited on through its work handle"
    return [(e.t0, e.t1) for e in events]


def _planned_once(mod, rank):
    """The layout is planned once per list of shapes and dtypes, then reused."""
    calls = []
    mod = sys.modules[mod.FusedAllReducer.__module__]   # where the reducer looks plan_layout up
    original = mod.plan_layout

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    mod.plan_layout = counting
    try:
        reducer = mod.FusedAllReducer(THRESHOLD, BUFFER, torch.device("cpu"))
        for seed in range(3):      # new tensors each time, same shapes
            tensors = _mixed(ReduceOp.SUM, rank, seed)
            reducer.all_reduce(tensors)
            reducer.wait()
        same_shapes = len(calls)
        reducer.all_reduce([torch.ones(5), torch.ones(6)])
        reducer.wait()
    finally:
        mod.plan_layout = original
    assert same_shapes == 1, f"three calls with the same shapes planned the layout {same_shapes} times"
    assert len(calls) == 2, "a new list of shapes must be planned"


@pytest.fixture(scope="module")
def graded(impl):
    return launch.run(_graded_checks, WORLD, args=(impl,), timeout=world_timeout(120))


def _assert_ok(graded, name):
    bad = {rank: r[name] for rank, r in enumerate(graded) if r[name] != "ok"}
    assert not bad, f"{name}: " + "; ".join(f"rank {k}: {v}" for k, v in sorted(bad.items()))


# ---------------------------------------------------------------------------------------
# Task 1: the layout.

def _plan(impl, sizes_dtypes, **kw):
    kw.setdefault("threshold_bytes", THRESHOLD)
    kw.setdefault("buffer_bytes", BUFFER)
    return resolve(impl + ":plan_layout")(sizes_dtypes, **kw)


@pytest.mark.task(lesson=5, task=1, points=4, title="plan_layout: buckets by dtype, flush on overflow")
def test_layout_makes_exactly_three_flushes_and_sends_the_big_tensor_alone(impl):
    layout = _plan(impl, [(n, torch.float32) for n in THREE_FLUSH_SIZES])
    assert [b.indices for b in layout.buckets] == [(0, 1), (2, 3), (5, 7)]
    assert [b.sizes for b in layout.buckets] == [(200, 200), (200, 100), (300, 212)]
    assert layout.direct == (4,) and layout.skipped == (6,)
    # in list order: the big tensor goes out between the first and second flush
    assert list(layout.steps) == [("flush", 0), ("direct", 4), ("flush", 1), ("flush", 2)]


@pytest.mark.task(lesson=5, task=1, points=4, title="plan_layout: buckets by dtype, flush on overflow")
def test_layout_never_mixes_dtypes_in_a_buffer(impl):
    specs = [(10, torch.float32), (10, torch.float16), (10, torch.bfloat16), (10, torch.float32),
             (10, torch.int64), (10, torch.float16)]
    layout = _plan(impl, specs)
    for b in layout.buckets:
        assert len({specs[i][1] for i in b.indices}) == 1, f"bucket {b.indices} mixes dtypes"
        assert b.dtype == b.wire_dtype == specs[b.indices[0]][1]
    by_dtype = {b.dtype: b.indices for b in layout.buckets}
    assert by_dtype == {torch.float32: (0, 3), torch.float16: (1, 5), torch.bfloat16: (2,),
                        torch.int64: (4,)}
    # buckets left open at the end are flushed in the order they were opened
    assert [b.indices[0] for b in layout.buckets] == [0, 1, 2, 4]


@pytest.mark.task(lesson=5, task=1, points=4, title="plan_layout: buckets by dtype, flush on overflow")
def test_layout_threshold_counts_bytes_not_elements(impl):
    # 900 float16 elements are 1800 bytes: fused (900 float32 would be 3600, over the
    # 2048-byte buffer); 1500 float32 (6000 bytes) and 1024 float32 (exactly 4096: "at or
    # above") go on their own; 600 float32 (2400 bytes) are under the threshold but overflow
    # a buffer alone: on their own too.
    layout = _plan(impl, [(900, torch.float16), (1500, torch.float32), (1024, torch.float32),
                          (600, torch.float32), (1, torch.float32)])
    assert layout.direct == (1, 2, 3)
    assert [b.indices for b in layout.buckets] == [(0,), (4,)]
    assert sum(b.numel * b.wire_dtype.itemsize for b in layout.buckets) == 1804


@pytest.mark.task(lesson=5, task=1, points=4, title="plan_layout: buckets by dtype, flush on overflow")
def test_layout_of_an_empty_list_and_of_empty_tensors_sends_nothing(impl):
    assert _plan(impl, []).steps == ()
    layout = _plan(impl, [(0, torch.float32), (0, torch.int32)])
    assert layout.steps == () and layout.buckets == () and layout.skipped == (0, 1)


# ---------------------------------------------------------------------------------------
# Task 2: copy-in and flush.

@pytest.mark.task(lesson=5, task=2, points=4, title="copy_in and flush")
def test_copy_in_packs_tensors_end_to_end_and_returns_the_filled_part(impl):
    copy_in = resolve(impl + ":copy_in")
    a, b, c = torch.arange(3.0), torch.arange(10.0, 16.0).view(2, 3), torch.arange(20.0, 30.0)[::3]
    buffer = torch.full((20,), -1.0)
    filled = copy_in([a, torch.empty(0), b, c], buffer)
    assert filled.data_ptr() == buffer.data_ptr() and filled.numel() == 13
    assert filled.tolist() == [0, 1, 2, 10, 11, 12, 13, 14, 15, 20, 23, 26, 29]
    assert bool((buffer[13:] == -1).all()), "copy_in wrote past the filled part"


@pytest.mark.task(lesson=5, task=2, points=4, title="copy_in and flush")
def test_copy_in_of_transposed_view_uses_its_logical_order(impl):
    copy_in = resolve(impl + ":copy_in")
    x = torch.arange(6.0).view(2, 3).t()            # logical order 0, 3, 1, 4, 2, 5
    filled = copy_in([x], torch.zeros(8))
    assert filled.tolist() == [0, 3, 1, 4, 2, 5]


@pytest.mark.task(lesson=5, task=2, points=4, title="copy_in and flush")
def test_flush_issues_exactly_one_all_reduce_of_the_filled_part(graded):
    _assert_ok(graded, "flush")


# ---------------------------------------------------------------------------------------
# Task 3: copy-back.

@pytest.mark.task(lesson=5, task=3, points=3, title="slot_views and copy_back")
def test_copy_back_writes_each_slot_into_its_tensor_with_its_shape(impl):
    copy_back = resolve(impl + ":copy_back")
    slot_views = resolve(impl + ":slot_views")
    buffer = torch.arange(100.0)
    a, b, e = torch.zeros(4), torch.zeros(2, 3), torch.zeros(0)
    views = slot_views(buffer, [a.shape, e.shape, b.shape])
    assert [tuple(v.shape) for v in views] == [(4,), (0,), (2, 3)]
    assert all(v.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for v in views)
    copy_back(buffer, [a, e, b])
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [[4, 5, 6], [7, 8, 9]]


@pytest.mark.task(lesson=5, task=3, points=3, title="slot_views and copy_back")
def test_copy_back_into_views_touches_only_their_elements(impl):
    copy_back = resolve(impl + ":copy_back")
    base = torch.full((10,), 77.0)
    strided = base[::2]                              # 5 elements, gaps in between
    grid = torch.zeros(3, 2)
    transposed = grid.t()                            # (2, 3), logical order
    copy_back(torch.arange(11.0), [strided, transposed])
    assert strided.tolist() == [0, 1, 2, 3, 4]
    assert bool((base[1::2] == 77).all()), "copy_back wrote between a strided view's elements"
    assert transposed.tolist() == [[5, 6, 7], [8, 9, 10]]


@pytest.mark.task(lesson=5, task=3, points=3, title="slot_views and copy_back")
def test_copy_in_then_copy_back_round_trips_mixed_shapes_and_casts(impl):
    copy_in, copy_back = resolve(impl + ":copy_in"), resolve(impl + ":copy_back")
    tensors = [torch.arange(5.0), torch.arange(6.0).view(3, 2), torch.tensor(7.0)]
    originals = [t.clone() for t in tensors]
    buffer = torch.zeros(32, dtype=torch.float16)    # float32 through a float16 buffer
    copy_in(tensors, buffer)
    for t in tensors:
        t.zero_()
    copy_back(buffer, tensors)
    for o, t in zip(originals, tensors):
        assert t.dtype == torch.float32 and torch.equal(o, t)


# ---------------------------------------------------------------------------------------
# Task 4: the complete fused all-reduce.

@pytest.mark.task(lesson=5, task=4, points=5, title="fused_all_reduce: the complete fused all-reduce")
def test_fused_all_reduce_matches_dist_all_reduce_for_every_op_twice(graded):
    _assert_ok(graded, "fused ops")


@pytest.mark.task(lesson=5, task=4, points=5, title="fused_all_reduce: the complete fused all-reduce")
def test_fused_all_reduce_sends_one_all_reduce_per_flush_and_one_for_the_big_tensor(graded):
    _assert_ok(graded, "fused flushes")


@pytest.mark.task(lesson=5, task=4, points=5, title="fused_all_reduce: the complete fused all-reduce")
def test_fused_all_reduce_writes_through_strided_and_transposed_views(graded):
    _assert_ok(graded, "fused views")


@pytest.mark.task(lesson=5, task=4, points=5, title="fused_all_reduce: the complete fused all-reduce")
def test_fused_all_reduce_on_a_subgroup(graded):
    _assert_ok(graded, "fused subgroup")


@pytest.mark.task(lesson=5, task=4, points=5, title="fused_all_reduce: the complete fused all-reduce")
def test_fused_all_reduce_refuses_mixed_devices_and_expanded_tensors_before_sending(graded):
    _assert_ok(graded, "fused errors")


@pytest.mark.task(lesson=5, task=4, points=5, title="fused_all_reduce: the complete fused all-reduce")
def test_fused_all_reduce_passes_the_equivalence_harness_one_tensor_at_a_time(graded):
    _assert_ok(graded, "fused harness")


# ---------------------------------------------------------------------------------------
# Task 5: the reducer -- layout cache, streams, double buffering.

@pytest.mark.task(lesson=5, task=5, points=4, title="FusedAllReducer: cached layout, double buffering")
@pytest.mark.parametrize("mode", ["double", "single"])
def test_reducer_matches_dist_all_reduce_for_every_op_twice(graded, mode):
    _assert_ok(graded, f"reducer ops {mode}")
    _assert_ok(graded, f"reducer flushes {mode}")
    _assert_ok(graded, f"reducer views {mode}")


@pytest.mark.task(lesson=5, task=5, points=4, title="FusedAllReducer: cached layout, double buffering")
def test_reducer_on_a_subgroup_and_refusing_bad_input(graded):
    _assert_ok(graded, "reducer subgroup")
    _assert_ok(graded, "reducer errors")


@pytest.mark.task(lesson=5, task=5, points=4, title="FusedAllReducer: cached layout, double buffering")
def test_reducer_plans_the_layout_once_per_list_of_shapes(graded):
    _assert_ok(graded, "reducer plans once")


@pytest.mark.task(lesson=5, task=5, points=4, title="FusedAllReducer: cached layout, double buffering")
def test_double_buffering_issues_the_next_flush_before_the_previous_lands(graded):
    for rank, r in enumerate(graded):
        timeline = r["reducer overlap double"]
        assert isinstance(timeline, list), f"rank {rank}: {timeline}"
        # flush k+1 goes out while flush k is still in flight (its wait has not returned) ...
        assert all(timeline[k + 1][0] < timeline[k][1] for k in range(5)), \
            f"rank {rank}: with two buffers, the next flush must not wait for the previous one"
        # ... but flush k+2 reuses flush k's buffer, so it waits for flush k to land
        assert all(timeline[k + 2][0] > timeline[k][1] for k in range(4)), \
            f"rank {rank}: a buffer was refilled before its all_reduce landed"


@pytest.mark.task(lesson=5, task=5, points=4, title="FusedAllReducer: cached layout, double buffering")
def test_streams_are_ordered_by_events_as_a_gpu_needs(graded):
    # checked on the CPU stand-ins: every read of memory another stream wrote (and every
    # write of memory another stream used) comes after a wait on an event recorded there
    for rank, r in enumerate(graded):
        found = r["reducer ordered"]
        assert isinstance(found, dict), f"rank {rank}: {found}"
        for mode, violations in found.items():
            assert not violations, f"rank {rank}, {mode} buffer: " + "; ".join(violations[:3])


@pytest.mark.task(lesson=5, task=5, points=4, title="FusedAllReducer: cached layout, double buffering")
def test_one_buffer_waits_for_each_flush_before_the_next(graded):
    for rank, r in enumerate(graded):
        timeline = r["reducer overlap single"]
        assert isinstance(timeline, list), f"rank {rank}: {timeline}"
        assert all(timeline[k + 1][0] > timeline[k][1] for k in range(5)), \
            f"rank {rank}: with one buffer, flush k+1 must wait until flush k has landed"


# ---------------------------------------------------------------------------------------
# The reference's extras: float16 on the wire, bind(). Not graded.

def _fp16_bound(p, abs_sum, avg=False):
    """The bound stated in collectives.fused: γ_k·Σ|x| (/p for AVG) + p·2⁻²⁵."""
    u = 2.0 ** -11
    k = p + 1 if avg else p
    gamma = k * u / (1 - k * u)
    return gamma * abs_sum / (p if avg else 1) + p * 2.0 ** -25


def _reference_checks():
    from collectives import fused

    rank, p = dist.get_rank(), dist.get_world_size()
    results = {}
    sizes = (3, 700, 1, 2000, 129)      # 2000 float32 is over the threshold: direct, compressed too

    def random_inputs(r, op):
        return [verify.make_values(verify.Case(n, torch.float32, op, values="random"), r, 5)
                for n in sizes]

    def compressed_within_bound():
        worst = 0.0
        for op in (ReduceOp.SUM, ReduceOp.AVG):
            everyone = [random_inputs(r, op) for r in range(p)]
            tensors = [t.clone() for t in everyone[rank]]
            with trace.recording() as t:
                fused.fused_all_reduce(tensors, op=op, threshold_bytes=THRESHOLD, buffer_bytes=BUFFER,
                                       compress_fp16=True)
            wire = {e.dtype for e in t.collectives()}
            assert wire == {"float16"}, f"expected float16 on the wire, saw {wire}"
            for i, got in enumerate(tensors):
                exact = sum(e[i].double() for e in everyone)
                abs_sum = sum(e[i].double().abs() for e in everyone)
                if op == ReduceOp.AVG:
                    exact = exact / p
                err = (got.double() - exact).abs()
                bound = _fp16_bound(p, abs_sum, avg=op == ReduceOp.AVG)
                assert got.dtype == torch.float32
                assert bool((err <= bound).all()), f"{op} tensor {i}: error {err.max().item():.3g} over the bound"
                worst = max(worst, float((err / bound).max()))
        return worst

    def overflow_falls_back_to_float32():
        small = torch.full((10,), 40000.0)       # 4 ranks: 160000 > 65504, float16 overflows
        big = torch.full((1500,), 1e5)           # over float16's range before any sum (direct)
        fine = torch.full((10,), 1.0)
        with trace.recording() as t:
            fused.fused_all_reduce([small, fine, big], threshold_bytes=THRESHOLD, buffer_bytes=BUFFER,
                                   compress_fp16=True)
        assert bool((small == 40000.0 * p).all()) and bool((big == 1e5 * p).all())
        assert bool((fine == p).all())
        return [(e.dtype, e.numel) for e in t.collectives()]

    def bind_copies_nothing():
        reducer = fused.FastFusedAllReducer(THRESHOLD, BUFFER, torch.device("cpu"))
        tensors = [torch.zeros(n, dtype=d) for n, d in
                   [(200, torch.float32), (3000, torch.float32), (300, torch.float16), (200, torch.float32)]]
        for t in tensors:
            t.copy_(_values(t.shape, t.dtype, ReduceOp.SUM, rank, 9))
        before = [t.clone() for t in tensors]
        reducer.bind(tensors)
        _compare_all(before, tensors, "values kept by bind")
        fused_storages = {tensors[i].untyped_storage().data_ptr() for i in (0, 3)}
        assert len(fused_storages) == 1, "bound float32 tensors must share one buffer"
        for seed in (0, 1):
            for t in tensors:         # write new values the ordinary way: they land in the buffer
                t.copy_(_values(t.shape, t.dtype, ReduceOp.SUM, rank, seed))
            expected = [verify.reference_all_reduce(t) for t in tensors]
            with trace.recording() as t:
                reducer.all_reduce(tensors)
                reducer.wait()
            _compare_all(expected, tensors, f"bound, call {seed + 1}")
            calls = sorted(e.numel for e in t.collectives())
            assert calls == [300, 400, 3000], calls
        try:
            reducer.bind([torch.zeros(10)[::2]])
            raise AssertionError("bind accepted a strided view")
        except ValueError:
            pass

    def repeated_list_reuses_its_plan_until_its_memory_changes():
        reducer = fused.FastFusedAllReducer(threshold_bytes=1 << 20, buffer_bytes=1 << 16)
        ts = [torch.full((5,), float(rank + 1)), torch.ones(3)]
        reducer.all_reduce(ts).wait()
        planned = reducer._recent
        ts[0].fill_(rank + 1)
        ts[1].fill_(1.0)
        reducer.all_reduce(ts).wait()
        assert reducer._recent is planned, "the same list was planned again"
        ts[1].data = torch.full((7,), 2.0)        # same object, new memory and shape
        ts[0].fill_(rank + 1)
        reducer.all_reduce(ts).wait()
        assert reducer._recent is not planned, "a tensor in new memory was not noticed"
        assert ts[0].tolist() == [p * (p + 1) / 2] * 5 and ts[1].tolist() == [2.0 * p] * 7, \
            (ts[0].tolist(), ts[1].tolist())

    _check(results, "compressed bound", compressed_within_bound)
    _check(results, "overflow", overflow_falls_back_to_float32)
    _check(results, "bind", bind_copies_nothing)
    _check(results, "repeated list", repeated_list_reuses_its_plan_until_its_memory_changes)
    _check(results, "training loop", lambda: _training_loop(torch.device("cpu")))
    _check(results, "mis-ordered", lambda: _mis_ordered_reducers_are_caught(rank))
    return results


def _training_loop(device):
    """A standard loop: zero_grad() (set_to_none=True, the default), backward, all-reduce,
    step. Returns, per step, whether the bound reducer recognised the list. (The model's
    zero_grad() does what the optimizer's does; the update is SGD written out, because
    constructing a torch.optim optimizer imports the compiler: seconds per rank.)"""
    from collectives import fused

    rank, p = dist.get_rank(), dist.get_world_size()
    rtol, atol = verify.tolerance(torch.float32, p)
    data = torch.Generator().manual_seed(rank)

    def make_model():
        torch.manual_seed(0)                      # the same model on every rank
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)).to(device)

    def step(model, reducer, what):
        loss = model(torch.randn(4, 8, generator=data).to(device)).square().mean()
        loss.backward()
        grads = [q.grad for q in model.parameters()]
        expected = [verify.reference_all_reduce(g) for g in grads]
        reducer.all_reduce(grads).wait()
        for i, (e, g) in enumerate(zip(expected, grads)):
            problem = verify.compare(e, g, exact=False, rtol=rtol, atol=atol)
            assert problem is None, f"{what}, gradient {i}: {problem}"
        with torch.no_grad():
            for q in model.parameters():
                q -= 0.1 * q.grad
        return [weakref.ref(g) for g in grads]

    # Passing the gradients as they come: the reducer keeps none of them alive.
    model = make_model()
    reducer = fused.FastFusedAllReducer(THRESHOLD, BUFFER, device)
    last = []
    for k in range(4):
        model.zero_grad()
        held = sum(r() is not None for r in last)
        assert held == 0, f"step {k + 1}: {held} gradients freed by zero_grad() are still alive"
        last = step(model, reducer, f"as they come, step {k + 1}")

    # Bound: the list is recognised, and autograd's own gradients are freed at once.
    model = make_model()
    made = []                                     # registered first: sees autograd's tensor
    for q in model.parameters():
        q.register_post_accumulate_grad_hook(lambda q: made.append(weakref.ref(q.grad)))
    reducer = fused.FastFusedAllReducer(THRESHOLD, BUFFER, device)
    reducer.bind_grads(model.parameters())
    recognised = []
    for k in range(4):
        model.zero_grad()
        step(model, reducer, f"bound, step {k + 1}")
        recognised.append(reducer._known is not None and reducer._known is reducer._bound)
        held = sum(r() is not None for r in made)
        assert held == 0, f"bound, step {k + 1}: {held} of autograd's gradients still alive"
        made.clear()
    return recognised


def _mis_ordered_reducers_are_caught(rank):
    """The reference reducer with one wait taken out, under streams.checking(): what is reported."""
    from collectives import streams
    from collectives.fused import FusedAllReducer

    def without(stream_name):
        with streams.checking(raise_errors=False) as checker:
            reducer = FusedAllReducer(THRESHOLD, BUFFER, torch.device("cpu"))
            stream = {"copy-in": reducer._copy_in, "comm": reducer._comm}[stream_name]
            stream.wait_event = lambda event: None          # the mistake: this stream waits on nothing
            tensors = [_values((400,), torch.float32, ReduceOp.SUM, rank, k) for k in range(6)]
            expected = [verify.reference_all_reduce(t) for t in tensors]
            reducer.all_reduce(tensors)
            reducer.wait()
            _compare_all(expected, tensors, "on CPU the values still come out right")
        return checker.violations

    def never_recorded():
        with streams.checking(raise_errors=False) as checker:
            side = streams.new_stream(torch.device("cpu"), name="side")
            side.wait_event(streams.new_event(torch.device("cpu"), name="done"))
        return checker.violations

    return {"free": without("copy-in"), "filled": without("comm"), "never recorded": never_recorded()}


@pytest.fixture(scope="module")
def reference_extras():
    return launch.run(_reference_checks, WORLD, timeout=60)


def test_a_mis_ordered_reducer_fails_on_cpu(reference_extras):
    for rank, r in enumerate(reference_extras):
        found = r["mis-ordered"]
        assert isinstance(found, dict), f"rank {rank}: {found}"
        # copy-in not waiting for "buffer free": the third flush packs buffer A while the
        # copy-back of the first may still read it
        assert any(v.startswith("cat on copy-in writes memory that _foreach_copy_ on copy-back read")
                   for v in found["free"]), found["free"]
        # comm not waiting for "filled": the all-reduce reads the buffer before the copy is done
        assert any("(issued on comm) reduces memory that cat on copy-in wrote" in v
                   for v in found["filled"]), found["filled"]
        assert found["never recorded"] == [
            "side waits on event done, which was never recorded: the wait orders nothing"]


def test_checking_raises_at_the_end_of_the_block_and_leaves_the_stand_ins_as_they_were():
    from collectives import streams

    cpu = torch.device("cpu")
    with pytest.raises(streams.OrderingError, match="never recorded"):
        with streams.checking():
            streams.new_stream(cpu).wait_event(streams.new_event(cpu))
    assert type(streams.new_stream(cpu)) is streams.NullStream
    assert type(streams.current_stream(cpu)) is streams.NullStream


def test_float16_on_the_wire_stays_within_the_stated_error_bound(reference_extras):
    for rank, r in enumerate(reference_extras):
        worst = r["compressed bound"]
        assert isinstance(worst, float), f"rank {rank}: {worst}"
        assert 0 < worst <= 1, f"rank {rank}: error / bound = {worst}"


def test_float16_overflow_is_all_reduced_again_in_float32(reference_extras):
    for rank, r in enumerate(reference_extras):
        calls = r["overflow"]
        assert isinstance(calls, list), f"rank {rank}: {calls}"
        # the direct tensor (1500 elements, issued first: it comes before the end of the list)
        # and the flush (20) both overflow and are sent again in float32: every rank saw the
        # same inf, so every rank did the same
        assert calls == [("float16", 1500), ("float16", 20), ("float32", 1500), ("float32", 20)], calls


def test_bound_tensors_are_reduced_in_place_without_copies(reference_extras):
    _assert_ok(reference_extras, "bind")


def test_a_repeated_list_reuses_its_plan_and_is_replanned_when_its_memory_changes(reference_extras):
    _assert_ok(reference_extras, "repeated list")


def test_a_training_loop_with_default_zero_grad_gets_the_fast_path_and_frees_its_gradients(
        reference_extras):
    # zero_grad() sets every .grad to None: the reducer must not keep the old ones alive,
    # and with bind_grads the list is the bound one on every step from the second on
    for rank, r in enumerate(reference_extras):
        recognised = r["training loop"]
        assert isinstance(recognised, list), f"rank {rank}: {recognised}"
        assert recognised[1:] == [True, True, True], f"rank {rank}: recognised per step {recognised}"


def _host_rows_round_trip(shapes, dtype):
    """HostRows.of over tensors with guard elements on both sides: gather, then scatter,
    each checked, and nothing beside the tensors written."""
    from collectives.fused.layout import slot_views
    from collectives.fused.reuse import HostRows

    bases = [torch.full((math.prod(s) + 2,), -7).to(dtype) for s in shapes]
    tensors = [b[1:-1].view(s) for b, s in zip(bases, shapes)]    # contiguous, guarded
    for i, t in enumerate(tensors):
        t.copy_(torch.arange(t.numel()).view(t.shape) + 1000 * i)
    numel = sum(t.numel() for t in tensors)
    region = torch.zeros(numel + 5).to(dtype)[2: 2 + numel]
    rows = HostRows.of(tensors, region, slot_views(region, [t.shape for t in tensors]))
    assert rows is not None
    rows.gather()
    assert torch.equal(region, torch.cat([t.reshape(-1) for t in tensors]))
    region.copy_(-torch.arange(numel))
    expected = list(torch.split(region.clone(), [t.numel() for t in tensors]))
    rows.scatter()
    for i, (t, e, b) in enumerate(zip(tensors, expected, bases)):
        assert torch.equal(t.reshape(-1), e), f"tensor {i} not written back"
        assert b[0].item() == -7 and b[-1].item() == -7, f"tensor {i}: bytes beside it were written"


def test_host_rows_copy_mixed_interleaved_sizes_in_and_back_touching_nothing_else():
    # sizes that repeat apart (copied through scratch), 2-D, empty, and one of 1.2 MB that
    # the allocator maps far from the small ones: the rows span both
    shapes = [(10,), (3, 4), (0,), (300_000,), (10,), (7,), (3, 4), (1,)] * 5
    _host_rows_round_trip(shapes, torch.float32)
    _host_rows_round_trip([(1000,)] * 300, torch.float32)      # one length, slots in order
    _host_rows_round_trip([(5,), (2, 3)] * 20, torch.bfloat16)  # no NumPy dtype: bytes all the same
    _host_rows_round_trip([(5,), (2, 3)] * 20, torch.complex64)


def test_host_rows_refuse_what_is_not_a_plain_byte_copy():
    from collectives.fused.layout import slot_views
    from collectives.fused.reuse import HostRows

    for what, ts, region in [
            ("a cast", [torch.ones(4, dtype=torch.float64)], torch.zeros(64)),
            ("a transposed view", [torch.ones(2, 3).t()], torch.zeros(64)),
            ("a conjugate view", [torch.ones(4, dtype=torch.complex64).conj()],
             torch.zeros(8, dtype=torch.complex64))]:
        assert HostRows.of(ts, region, slot_views(region, [t.shape for t in ts])) is None, what


def test_compression_cannot_be_combined_with_bind():
    from collectives.fused import FastFusedAllReducer

    with pytest.raises(ValueError, match="compress"):
        FastFusedAllReducer(compress_fp16=True).bind([torch.zeros(3)])


def test_tour_entry_names_the_runner():
    from collectives.course.tour import entries

    assert [(e.name, e.runner) for e in entries() if e.lesson == 5] == [
        ("fused", "collectives.course.fused_bench:tour_runner")]


# ---------------------------------------------------------------------------------------
# GPU: the streams really order the work.

def _gpu_producer_is_waited_for(spec):
    mod = resolve(spec)
    problems = []
    # the plain reducer, and the reference's fast one (graphs) where there is one
    for name in ("FusedAllReducer", "FastFusedAllReducer"):
        if hasattr(mod, name):
            problems += [f"{name}: {p}" for p in _gpu_steps(getattr(mod, name))]
    return problems


def _gpu_steps(Reducer):
    rank, p = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    reducer = Reducer(64 << 10, 256 << 10, device)
    # 300 small tensors (several flushes, both buffers) and two over the threshold
    sizes = [257 + (i * 37) % 1000 for i in range(300)] + [40_000, 70_001]
    grads = [torch.zeros(n, device=device) for n in sizes]
    others = [torch.zeros(n, device=device) for n in sizes[::-1]]   # another list, same buffers
    problems = []

    def step(tensors, value, what):
        # The producer: a long kernel, then the gradients written, all on the current stream.
        # A copy-in that did not wait for this stream would read the old values.
        torch.cuda._sleep(200_000_000)
        # Each tensor gets a value of its own, so a copy to the wrong place shows.
        torch._foreach_zero_(tensors)
        torch._foreach_add_(tensors, [float(value * (rank + 1) + i) for i in range(len(tensors))])
        reducer.all_reduce(tensors)
        reducer.wait()
        # Read on the current stream right after wait(): it must see the reduced values.
        seen = torch.cat([g.reshape(-1) for g in tensors])
        want = torch.cat([torch.full((g.numel(),), value * p * (p + 1) / 2 + p * i, device=device)
                          for i, g in enumerate(tensors)])
        torch.cuda.synchronize()
        if not torch.equal(seen, want):
            bad = int((seen != want).sum())
            problems.append(f"{what}: {bad} elements differ from what dist.all_reduce gives")

    # The reference's fast reducer records the list's second call as a CUDA graph and replays it
    # from then on: steps 2-4 replay; then a different list reuses the same buffers right
    # behind a replay; then the first list again (planned, recorded and replayed anew).
    for k in range(1, 5):
        step(grads, k, f"step {k}")
    step(others, 5, "another list after a replay")
    for k in range(6, 9):
        step(grads, k, f"first list again, step {k}")
    grads[7].data = torch.zeros_like(grads[7])     # same objects, one in new memory: re-planned
    step(grads, 10, "after one tensor was given new memory")
    step(grads, 11, "after one tensor was given new memory, again")
    with trace.recording() as t:                   # watched: issued for real, not replayed
        step(grads, 9, "while a trace records")
    if not any(e.kind == "all_reduce" for e in t.collectives()):
        problems.append("no all_reduce recorded while tracing a known list")
    return problems


@pytest.mark.gpu
def test_streams_wait_for_the_producer_and_the_caller_waits_for_the_results(impl):
    results = launch.run(_gpu_producer_is_waited_for, 2, args=(impl,), backend="nccl", timeout=120)
    assert results == [[], []], results


def _gpu_training_loop():
    # the same loop on a GPU: the bound list is known from its first call, recorded as a
    # CUDA graph then and replayed on steps 2-4, while the hook copies autograd's gradients in
    return _training_loop(torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.gpu
def test_a_training_loop_with_default_zero_grad_on_gpus():
    results = launch.run(_gpu_training_loop, 2, backend="nccl", timeout=120)
    assert results == [[True] * 4, [True] * 4], results
