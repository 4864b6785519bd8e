"""Lesson 7, hierarchical all-reduce: what the reference promises beyond the graded tasks.

The six graded tasks (the hierarchies' values and their messages by tier, the stages, the
pipelined slices, the asynchronous call, the DDP hook) are judged by the task table
(:mod:`collectives.course.grading.tasks.lesson07`, run on the reference, the stubs and partial
solutions by tests/test_grader.py). Here, in two worlds (4 and 6 gloo ranks) pretending
to be several machines with ``layout=(D, M)``: the in-flight reducer's own promises
(several buckets in flight inside the memory budget, a failing stage naming its rank),
lesson 6's reducer on it against torch DDP bit for bit, the flat ring over every rail,
NCCL's in-place inside stages (run on gloo), the event chain of the slots under
``streams.checking`` with many slices in flight, the slice plan computed once, and the
argument checks (float layouts, a list, ranks that disagree on the layout in check mode);
then the cost model, the layout from the environment, the simulated cluster, two GPUs and
the benchmarks' records. Bytes by tier are counted as
:func:`collectives.hierarchical.layout.tier_bytes` counts them:

    across machines, per rank   2(M − 1)/M · n/D       (the flat ring: 2(p − 1)/p · n at a machine's edge)
    inside a machine, per rank  2(D − 1)/D · n
    off the rail                0
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch._dynamo  # noqa: F401 - torch DDP imports it on first use (3 s): once, before the worlds fork
import torch.distributed as dist

from collectives import cost, launch, streams, trace, verify
from collectives.core.ops import ReduceOp
from collectives.course.impl import resolve as load
from collectives.hierarchical import cost as hcost
from collectives.hierarchical.layout import Layout, resolve, stage_groups, tier_bytes

LESSON = 7
TIMEOUT = 150
FNS = ("root_based_all_reduce", "rail_all_reduce", "one_slice_all_reduce", "hierarchical_all_reduce")
PRIME = 1009
PATTERN_N = 960            # divisible by every D·M here (4, 2, 6): the byte counts are exact
SLICE_N = 96               # pipelined: PATTERN_N / SLICE_N = 10 slices, more than the 2 slots
WORLDS = {4: [(2, 2), (1, 4), (4, 1)], 6: [(3, 2)]}
EXTRAS = {(2, 2), (1, 4), (3, 2)}   # the asynchronous call, the slots under streams.checking, the plan
TWO_TIERS_INSIDE = sorted(layout for layout in EXTRAS if layout[0] > 1)   # the rail ring, NCCL's inside stages
TRAINED = [(2, 2)]         # DDP with the hook and lesson 6's reducer: p = 4 divides exactly
CHECKED = [(1, 4), (2, 2)]  # streams.checking and the in-flight reducer's own promises: D = 1 and D > 1
CHECKED_IN_FLIGHT = CHECKED + [(4, 1)]    # the in-flight lanes under streams.checking: M = 1 too


def _sizes(D, M):
    dm = D * M
    return sorted({0, 1, max(dm - 1, 1), dm, dm + 1, PRIME})


def _size_cases(D, M):
    """The sizes around D·M (the padding slot), integer-valued, with every op once."""
    cases = [verify.Case(n, torch.float32, ReduceOp.SUM) for n in _sizes(D, M)]
    cases += [verify.Case(PRIME, torch.int64, op) for op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)]
    cases += [verify.Case(D * M + 1, torch.float64, ReduceOp.AVG), verify.Case(PRIME, layout="strided")]
    return cases


def _traced(fn, numel, **kwargs):
    x = torch.arange(numel, dtype=torch.float32)
    try:
        with trace.recording() as t:
            fn(x, **kwargs)
        return t.to_dicts(), None
    except Exception as exc:  # noqa: BLE001 - a stub: reported by the pattern tests
        return [], f"{type(exc).__name__}: {exc}"


def _tiers(events, layout):
    """Bytes by tier of one traced call, on this rank."""
    t = trace.Trace.from_dicts(dist.get_rank(), events)
    return tier_bytes(t.events, stage_groups(resolve(layout)), dist.get_world_size())


def _world_checks(impl, layouts):
    """Everything this file checks, on one rank of one world."""
    fns = {name: load(f"{impl}:{name}") for name in FNS}
    out = {}
    for layout in layouts:
        res = out[layout] = {"traces": {}, "tiers": {}}
        res["refused"] = _refusals(fns, layout)
        if layout in CHECKED_IN_FLIGHT:     # the lanes' event chain: D = 1, M = 1 and both tiers
            res["checked in flight"] = _checked(functools.partial(_buckets_through_streams, layout))
        if layout in EXTRAS:
            extra = _extra_checks(impl, layout)
            traces = extra.pop("traces")
            res["traces"].update(traces)
            res["tiers"].update({name: _tiers(ev, layout) if err is None else None
                                 for name, (ev, err) in traces.items()})
            res.update(extra)
    return out


def _raised(call) -> str:
    """"TypeError: ..." for what ``call`` raised, "returned" when it did not raise."""
    try:
        call()
        return "returned"
    except Exception as exc:  # noqa: BLE001 - the test reads the kind and the message
        return f"{type(exc).__name__}: {exc}"


def _refusals(fns, layout):
    """Arguments that must be refused on every rank before anything is sent."""
    D, M = layout
    out = {}
    if D * M == 4:   # (2.5, 1.6): D·M == 4 on 4 ranks, truncated it would be (2, 1)
        for name, fn in fns.items():
            out[f"{name} float layout"] = _raised(lambda fn=fn: fn(torch.ones(8), layout=(2.5, 1.6)))
    for name, fn in fns.items():
        out[f"{name} list"] = _raised(lambda fn=fn: fn([1.0, 2.0], layout=layout))
    return out


REFERENCE = "collectives.hierarchical"


def _extra_checks(impl, layout):
    """What came after the blocking call, on one layout (see the module docstring)."""
    D, M = layout
    out = {}
    ref = functools.partial(load(f"{REFERENCE}:hierarchical_all_reduce"), layout=layout)
    # the slice plan: computed once per (elements, dtype, layout, tiers), then looked up
    before = hcost.slice_plan.cache_info().misses
    x = torch.ones(5003)
    for _ in range(3):
        ref(x)
    out["plan misses"] = hcost.slice_plan.cache_info().misses - before
    out["traces"] = {}
    if layout in TWO_TIERS_INSIDE:      # with D = 1 both are something tested already: no inside stage, a flat ring
        cases = _size_cases(D, M) + [verify.Case(PRIME, dtype) for dtype in (torch.float16, torch.bfloat16,
                                                                                torch.int32)]
        # NCCL's in-place reduce-scatter and all-gather inside (run here on gloo)
        collectives_inside = functools.partial(ref, inside="collectives", slice_numel=SLICE_N)
        out["inside collectives"] = verify.check_all_reduce(collectives_inside, cases)
        out["traces"]["inside collectives"] = _traced(collectives_inside, PATTERN_N)
        # the in-flight reducer on NCCL's path (streams, every stage a collective), here on gloo
        prepared = _prepared_checks(layout, cases)
        out["traces"].update(prepared.pop("traces"))
        out.update(prepared)
        # the flat ring over every rail
        rail_ring = functools.partial(load(f"{REFERENCE}:rail_ring_all_reduce"), layout=layout)
        out["rail ring"] = verify.check_all_reduce(rail_ring, cases)
        out["traces"]["rail ring"] = _traced(rail_ring, PATTERN_N)
    if layout in CHECKED:
        # the event chain of the slots, many slices in flight, verified without a GPU
        out["checked pipeline"] = _checked(lambda x: ref(x, slice_numel=SLICE_N))
        out["broken pool"] = _checked(lambda x: _with_a_pool_that_does_not_wait(ref, x))
        out["in flight"] = _in_flight_checks(layout)
    if layout in TRAINED:
        out["training"] = _training_checks(impl, layout)
    return out


def _prepared_checks(layout, cases):
    """The in-flight reducer with every stage a collective (NCCL's path, run on gloo), with
    streams and with threads for lanes: exact on every case; the same tensor handed over
    again and again reuses its prepared slices; its bytes by tier; and the host's own Python
    per bucket (torch.distributed's calls stubbed), counted."""
    from collectives.course.benchmarks.hierarchical_hostcost import _python_calls, c10d_stubbed
    from collectives.hierarchical import HierarchicalAllReducer

    out = {}
    reducers = {progress: HierarchicalAllReducer(layout=layout, progress=progress, inside="collectives",
                                                 slice_bytes=512, memory_bytes=8192)
                for progress in ("streams", "threads")}
    for progress, reducer in reducers.items():
        def call(tensor, op=ReduceOp.SUM, group=None, reducer=reducer):
            reducer.all_reduce(tensor, op).wait()
        out[f"in flight collectives, {progress}"] = verify.check_all_reduce(call, cases)
    reducer = reducers["streams"]
    x = torch.randint(-8, 9, (PRIME - 1,), generator=torch.Generator().manual_seed(dist.get_rank())).float()
    want = x.clone()
    dist.all_reduce(want)
    y, rounds = x.clone(), []
    for _ in range(3):                  # the same tensor: prepared on the first call, reused after
        y.copy_(x)
        reducer.all_reduce(y).wait()
        rounds.append((torch.equal(y, want), id(reducer._programs[id(y)][2])))
    out["prepared rounds"] = rounds
    D, M = layout
    bucket = torch.ones(D * M * (128 // (D * M)))       # one slice of at most 512 bytes, no padding tail
    reducer.all_reduce(bucket).wait()
    with c10d_stubbed():
        out["python calls per bucket"] = _python_calls(lambda: reducer.all_reduce(bucket).wait())
    out["traces"] = {"in flight collectives": _traced(lambda t: reducer.all_reduce(t).wait(), PATTERN_N)}
    for r in reducers.values():
        r.close()
    return out


def _checked(call) -> list[str]:
    """``streams.checking`` violations of ``call(x)`` on this rank (every rank calls it)."""
    x = torch.arange(PATTERN_N + 7, dtype=torch.float32)
    try:
        with streams.checking(raise_errors=False) as checker:
            call(x)
        return checker.violations
    except Exception as exc:  # noqa: BLE001
        return [f"raised {type(exc).__name__}: {exc}"]


def _buckets_through_streams(layout, x):
    """The asynchronous reducer with streams for lanes (the GPU's path, here on CPU): seven
    buckets, 19 slices of at most 256 bytes, two or three slots (1000 bytes of staging), all
    issued before any handle is waited on."""
    from collectives.hierarchical import HierarchicalAllReducer

    reducer = HierarchicalAllReducer(layout=layout, memory_bytes=1000, slice_bytes=256, progress="streams")
    handles = [reducer.all_reduce(piece) for piece in x.split(PATTERN_N // 6)]
    for h in handles:
        h.wait()
    return reducer


def _with_a_pool_that_does_not_wait(fn, x):
    """The pipeline with its slot pools' events forgotten: ``streams.checking`` must see the
    irecv that overwrites a slot another stream is still reading."""
    from collectives.hierarchical import slice as slices

    original = slices.SlotPool.acquire

    def acquire(self, numel, dtype, device, stream):
        self.events[self.next % self.size] = None          # the bug: nothing to wait for
        return original(self, numel, dtype, device, stream)
    slices.SlotPool.acquire = acquire
    try:
        fn(x, slice_numel=SLICE_N)
    finally:
        slices.SlotPool.acquire = original


def _in_flight_checks(layout):
    """The reference's own promises: several buckets in flight at once, in bounded memory."""
    from collectives.hierarchical import HierarchicalAllReducer

    memory = 4 * 2048
    reducer = HierarchicalAllReducer(layout=layout, memory_bytes=memory, slice_bytes=2048, record=True)
    buckets = [torch.full((n,), float(dist.get_rank() + 1)) for n in (4099, 1009, 6007, 97, 4099)]
    handles = [reducer.all_reduce(b) for b in buckets]
    issued_without_waiting = sum(not h.is_completed() for h in handles)
    for h in handles:
        h.wait()
    reducer.close()
    p = dist.get_world_size()
    exact = all(bool((b == p * (p + 1) / 2).all()) for b in buckets)
    rows = reducer.timeline
    spans = {}
    for r in rows:        # each bucket's span: its first stage issued -> its last stage done
        lo, hi = spans.get(r["bucket"], (r["issued"], r["done"]))
        spans[r["bucket"]] = (min(lo, r["issued"]), max(hi, r["done"]))
    overlapping = sum(1 for b in spans if b + 1 in spans and spans[b + 1][0] < spans[b][1])
    # a stage that raises on this rank fails every bucket in flight, naming the rank: no hang
    from collectives.hierarchical import slice as slices

    def broken_add(self):
        raise ArithmeticError("an add that fails")
    failing = HierarchicalAllReducer(layout=layout)
    original, slices.Slice.add = slices.Slice.add, broken_add
    try:
        doomed = [failing.all_reduce(torch.ones(n)) for n in (1009, 97)]
        failure = [_raised(h.wait) for h in doomed]
    finally:
        slices.Slice.add = original
    return dict(exact=exact, staging=reducer.staging_bytes, memory=memory, failure=failure,
                peak=reducer.peak_in_flight, overlapping=overlapping, not_done_at_return=issued_without_waiting,
                stages=len(rows))


def _training_checks(impl, layout):
    """Three SGD steps of a small float64 model with integer-valued gradients: torch DDP with
    its default hook, and lesson 6's reducer on the hierarchy (the hook is task 6's)."""
    import copy

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)
    # weights in {-1, 0, 1}, inputs and loss weights in [-2, 2], lr 1/16: every gradient and
    # every partial sum of them stays a short dyadic number, exact in any order
    base = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 8)).double()
    with torch.no_grad():
        for w in base.parameters():
            w.copy_(torch.randint(-1, 2, w.shape, generator=torch.Generator().manual_seed(w.numel())))
    x = torch.randint(-2, 3, (4, 16), generator=torch.Generator().manual_seed(rank)).double()
    c = torch.randint(-2, 3, (4, 8), generator=torch.Generator().manual_seed(100 + rank)).double()
    cap = 1e-3          # MiB: about 1 KiB, so every variant reduces three buckets
    out = {}
    for variant in ("torch DDP", "lesson 6 reducer + hierarchy"):
        model = copy.deepcopy(base)
        try:
            if variant == "lesson 6 reducer + hierarchy":
                from collectives.hierarchical import HierarchicalBucketedReducer
                wrapped = HierarchicalBucketedReducer(model, layout=layout, bucket_cap_mb=cap, first_bucket_cap_mb=cap)
            else:
                wrapped = DistributedDataParallel(model, bucket_cap_mb=cap)
            opt = torch.optim.SGD(wrapped.parameters(), lr=1 / 16)
            for _ in range(3):
                opt.zero_grad()
                (wrapped(x) * c).sum().backward()
                opt.step()
            out[variant] = [w.detach().clone() for w in model.parameters()]
        except Exception as exc:  # noqa: BLE001
            out[variant] = f"raised {type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def worlds(impl):
    """{layout: [per-rank results]}: one world per world size, every layout of that size in it."""
    out = {}
    for p, layouts in WORLDS.items():
        for rank_results in [launch.run(_world_checks, p, args=(impl, layouts), timeout=TIMEOUT)]:
            for layout in layouts:
                out[layout] = [r[layout] for r in rank_results]
    return out


ALL_LAYOUTS = [(2, 2), (1, 4), (4, 1), (2, 1), (1, 2), (3, 2), (2, 3)]     # the cost model's


def _assert_report(worlds, layout, key):
    report = verify.Report(reference="dist.all_reduce")
    for r in worlds[layout]:
        report = report.merge(r[key])
    assert report.ok, f"{key}, layout {layout}: {report.summary()}"


def _tiers_of(worlds, layout, name):
    out = []
    for rank, r in enumerate(worlds[layout]):
        events, error = r["traces"][name]
        assert error is None, f"layout {layout}, rank {rank}: {error}"
        out.append(r["tiers"][name])
    return out


def _assert_fairring_bytes(worlds, layout, name, numel=PATTERN_N):
    D, M = layout
    n = numel * 4
    across, inside = 2 * (M - 1) / M * n / D, 2 * (D - 1) / D * n
    for rank, got in enumerate(_tiers_of(worlds, layout, name)):
        assert got["mixed"] == 0, (f"{name}, layout {layout}, rank {rank}: {got['mixed']:.0f} bytes in "
                                   "collectives that span several ranks of several machines -- a flat all-reduce")
        assert got["off_rail"] == 0, f"{name}, layout {layout}, rank {rank}: {got['off_rail']:.0f} bytes off the rail"
        where = f"{name}, layout {layout}, rank {rank}"
        assert got["across"] == pytest.approx(across), \
            f"{where}: {got['across']:.0f} bytes across machines, expected 2(M-1)/M·n/D = {across:.0f}"
        assert got["inside"] == pytest.approx(inside), \
            f"{where}: {got['inside']:.0f} bytes inside, expected 2(D-1)/D·n = {inside:.0f}"


@pytest.mark.parametrize("layout", CHECKED)
def test_several_buckets_are_in_flight_at_once_inside_the_memory_budget(worlds, layout):
    # Five buckets (4099, 1009, 6007, 97, 4099 elements), slices of at most 2 KiB, 8 KiB of
    # staging: the slices in flight never hold more than the budget (a ring of 8 KiB reused
    # many times over), and the next bucket's first stage starts before the previous
    # bucket's last one ends.
    for rank, r in enumerate(worlds[layout]):
        f = r["in flight"]
        where = f"layout {layout}, rank {rank}: {f}"
        assert f["exact"], where
        assert f["stages"] == 5 * sum(_slices_in_flight(n, *layout) for n in (4099, 1009, 6007, 97, 4099)), where
        assert 0 < f["staging"] <= f["memory"], where
        assert f["not_done_at_return"] >= 2 and f["peak"] >= 2, where
        assert f["overlapping"] >= 1, where
        assert all(got.startswith("RuntimeError") and f"rank {rank}" in got and "an add that fails" in got
                   for got in f["failure"]), where


def _slices_in_flight(numel, D, M, slice_bytes=2048):
    """How many slices the in-flight reducer cuts a float32 bucket into: the plan's slices,
    never larger than ``slice_bytes``, a multiple of D·M elements."""
    plan = hcost.slice_plan(numel, 4, D, M, hcost.DEFAULT_TIERS)
    step = max(D * M, min(plan, slice_bytes // 4) // (D * M) * (D * M))
    return -(-numel // step)


@pytest.mark.parametrize("layout", TRAINED)
def test_lesson_6_reducer_on_the_hierarchy_trains_bit_for_bit_like_ddp(worlds, layout):
    for rank, r in enumerate(worlds[layout]):
        runs = r["training"]
        for variant, params in runs.items():
            assert not isinstance(params, str), f"{variant}, layout {layout}, rank {rank}: {params}"
        for variant in ("lesson 6 reducer + hierarchy",):
            for i, (got, want) in enumerate(zip(runs[variant], runs["torch DDP"])):
                assert torch.equal(got, want), (f"{variant}, layout {layout}, rank {rank}: parameter {i} differs "
                                                f"from torch DDP's after three steps by {(got - want).abs().max()}")


# ---- the flat ring over the rails, NCCL's inside stages, the checks ----------------------

@pytest.mark.parametrize("layout", TWO_TIERS_INSIDE)
def test_the_rail_ring_matches_and_crosses_machines_only_into_the_next_rail(worlds, layout):
    # Ring c enters every machine at local rank c: rank (d, m) sends across only to local
    # rank d + 1 (mod D) of machine m + 1, 2(p-1)/p · n/D bytes -- each rail carries 1/D.
    _assert_report(worlds, layout, "rail ring")
    D, M = layout
    p, n = D * M, PATTERN_N * 4
    for rank, r in enumerate(worlds[layout]):
        events, error = r["traces"]["rail ring"]
        assert error is None, error
        d, m = rank % D, rank // D
        across = [e for e in events if e["kind"] == "isend" and e["peer"] // D != m]
        assert {(e["peer"] % D, e["peer"] // D) for e in across} == {((d + 1) % D, (m + 1) % M)}, across[:3]
        uneven = 2 * (p - 1) * 4          # chunks of n/(D·p) elements, rounded: an element a message
        assert sum(e["nbytes"] for e in across) == pytest.approx(2 * (p - 1) / p * n / D, abs=uneven)
        assert hcost.cross_bytes_per_rank("rail_ring", n, D, M) == pytest.approx(2 * (p - 1) / p * n / D)


@pytest.mark.parametrize("layout", TWO_TIERS_INSIDE)
def test_inside_stages_as_nccls_in_place_collectives_match_and_keep_the_pattern(worlds, layout):
    _assert_report(worlds, layout, "inside collectives")
    _assert_fairring_bytes(worlds, layout, "inside collectives")


@pytest.mark.parametrize("layout", CHECKED)
def test_the_slots_event_chain_holds_under_streams_checking_with_many_slices_in_flight(worlds, layout):
    for rank, r in enumerate(worlds[layout]):
        assert r["checked pipeline"] == [], f"layout {layout}, rank {rank}: {r['checked pipeline'][:2]}"
        # and it is a check: forget the slots' events, and an irecv overwrites a slot unordered
        assert any("irecv" in v and "without waiting" in v for v in r["broken pool"]), \
            f"layout {layout}, rank {rank}: a pool that does not wait was not caught: {r['broken pool'][:2]}"


@pytest.mark.parametrize("layout", CHECKED_IN_FLIGHT)
def test_buckets_in_flight_on_streams_keep_their_event_chain_when_a_tier_leaves_lanes_out(worlds, layout):
    # with D = 1 or M = 1 a slice skips the lanes of the empty tier: the hand-offs left must
    # still order every read after its write (seven buckets, 19 slices, all issued at once)
    for rank, r in enumerate(worlds[layout]):
        assert r["checked in flight"] == [], f"layout {layout}, rank {rank}: {r['checked in flight'][:2]}"


@pytest.mark.parametrize("layout", sorted(EXTRAS))
def test_the_slice_plan_is_computed_once_per_size(worlds, layout):
    # best_slice_bytes costs a few hundred microseconds of Python; three calls of one size
    # compute it at most once (none when an earlier check already asked for that size).
    for rank, r in enumerate(worlds[layout]):
        assert r["plan misses"] <= 1, f"layout {layout}, rank {rank}: planned {r['plan misses']} times"


@pytest.mark.parametrize("layout", [(2, 2), (1, 4), (4, 1)])
def test_float_layouts_and_non_tensors_are_refused_on_every_rank(worlds, layout):
    for rank, r in enumerate(worlds[layout]):
        for what, got in r["refused"].items():
            assert got.startswith("TypeError"), f"{what}, layout {layout}, rank {rank}: {got}"
            assert ("layout" in got) == what.endswith("float layout"), f"{what}: {got}"


def _disagree(fn_name):
    """Rank 0 says layout (2, 1), rank 1 (1, 2): both fit 2 ranks, and without check mode
    each would wait for messages of the other layout's stages."""
    from collectives import ops

    fn = load(f"{REFERENCE}:{fn_name}")
    layout = (2, 1) if dist.get_rank() == 0 else (1, 2)
    try:
        out = fn(torch.ones(6), layout=layout)
        if hasattr(out, "wait"):
            out.wait()
        return "returned"
    except ops.ArgumentMismatch as exc:
        return str(exc)


DISAGREEING = ("hierarchical_all_reduce", "one_slice_all_reduce", "root_based_all_reduce", "rail_all_reduce",
               "rail_ring_all_reduce", "hierarchical_all_reduce_async")


def test_check_mode_names_ranks_that_disagree_on_the_layout():
    results = launch.run(_disagree_on_every_function, 2, check=True, timeout=60)
    for rank, per_function in enumerate(results):
        for name, got in per_function.items():
            assert "layout" in got and "(2, 1) on rank 0" in got and "(1, 2) on rank 1" in got, \
                f"{name}, rank {rank}: {got}"


def _disagree_on_every_function():
    return {name: _disagree(name) for name in DISAGREEING}


# ---- not graded: the reference's own promises ------------------------------------------

def test_cost_model_counts_what_the_trace_counts():
    for D, M in ALL_LAYOUTS:
        for name in ("hierarchical", "rail_all_reduce"):
            stages = hcost.tiered(name, 1000.0, D, M)
            assert sum(s.bytes_per_rank for s in stages if s.tier == "across") == \
                pytest.approx(2 * (M - 1) / M * 1000 / D)
            assert sum(s.bytes_per_rank for s in stages if s.tier == "inside") == \
                pytest.approx(2 * (D - 1) / D * 1000)
    tiers = hcost.Tiers(cost.AlphaBeta(1e-5, 1 / 2e9), cost.AlphaBeta(1e-4, 8 / 1e9))
    n = 64 << 20
    flat = hcost.predict_tiered("flat_ring", n, 2, 2, tiers)
    hier = hcost.predict_tiered("hierarchical", n, 2, 2, tiers)
    assert flat / hier == pytest.approx(1.5, rel=0.08)       # 1.5·n across against n
    rails = hcost.Tiers(tiers.inside, tiers.across, rails=True)
    assert hcost.predict_tiered("flat_ring", n, 2, 2, rails) / hcost.predict_tiered("hierarchical", n, 2, 2, rails) \
        > 2.5
    # ... but against the flat ring over every rail only the byte count is left: 1.5x, not 3x
    # (pipelined, so that the inside stages hide under the link, as the benchmark runs it)
    slices = round(n / hcost.best_slice_bytes(n, 2, 2, rails))
    assert hcost.predict_tiered("rail_ring", n, 2, 2, rails) / \
        hcost.predict_tiered("hierarchical", n, 2, 2, rails, slices) == pytest.approx(1.5, rel=0.08)
    assert hcost.predict_tiered("rail_ring", n, 2, 2, tiers) == pytest.approx(flat, rel=0.01)   # one link: flat
    fitted = cost.TwoTier(tiers.inside, tiers.across, machines=2, ranks_per_machine=2)
    assert hcost.predict_tiered("flat_ring", n, 2, 2, fitted) == pytest.approx(cost.predict_flat("ring", n, fitted))
    best = hcost.best_slice_bytes(n, 2, 2, tiers)
    assert 0 < best < n
    assert hcost.predict_tiered("hierarchical", n, 2, 2, tiers, slices=round(n / best)) < hier


def test_every_message_pays_its_alpha_so_more_machines_cost_more_rounds():
    # The collect and the diffuse are M - 1 messages each (an all-to-all and an all-gather
    # on the rail), not one: on a latency-bound tensor the hierarchy's time grows with M.
    for D, M in ALL_LAYOUTS:
        stages = {s.name: s for s in hcost.tiered("hierarchical", 1000.0, D, M)}
        if M > 1:
            assert stages["collect"].messages == M - 1 and stages["diffuse"].messages == M - 1
        if D > 1:
            assert stages["reduce-scatter"].messages == D - 1 and stages["all-gather"].messages == D - 1
    alpha_only = hcost.Tiers(cost.AlphaBeta(1e-5, 1e-15), cost.AlphaBeta(1e-4, 1e-15))
    times = [hcost.predict_tiered("hierarchical", 4096, 2, M, alpha_only) for M in (2, 4, 8)]
    assert times == pytest.approx([(2 * 1e-5 + 2 * (M - 1) * 1e-4) for M in (2, 4, 8)])
    assert times[0] < times[1] < times[2]


def test_the_plan_is_computed_once_per_key_and_the_tiers_come_from_the_backend():
    hcost.slice_plan.cache_clear()
    layout = Layout(2, 2)
    from collectives.hierarchical import default_slice_numel

    first = [default_slice_numel(1 << 20, 4, layout, hcost.DEFAULT_TIERS) for _ in range(5)]
    assert len(set(first)) == 1
    info = hcost.slice_plan.cache_info()
    assert (info.misses, info.hits) == (1, 4)
    assert hcost.tiers_for("nccl", "cuda") != hcost.tiers_for("gloo", "cpu")
    assert hcost.tiers_for("gloo", "cpu") == hcost.DEFAULT_TIERS
    # one tier (D = 1 or M = 1): nothing to hide under the other, so one slice
    for D, M in ((1, 2), (2, 1)):
        for tiers in (hcost.tiers_for("nccl", "cuda"), hcost.DEFAULT_TIERS):
            assert hcost.slice_plan(64 << 20, 4, D, M, tiers) == 64 << 20


def test_buckets_in_flight_model_one_pipeline_instead_of_one_per_bucket():
    tiers = hcost.DEFAULT_TIERS
    one = hcost.predict_buckets("hierarchical", 4 << 20, 16, 1, 2, 2, tiers, slices=4)
    many = hcost.predict_buckets("hierarchical", 4 << 20, 16, 4, 2, 2, tiers, slices=4)
    flat = hcost.predict_buckets("flat_ring", 4 << 20, 16, 4, 2, 2, tiers)
    assert one == pytest.approx(16 * hcost.predict_tiered("hierarchical", 4 << 20, 2, 2, tiers, 4))
    assert many < one < flat


def test_the_layout_comes_from_the_environment_or_is_refused():
    assert Layout(2, 3).size == 6 and Layout(2, 3).machine(3) == 1 and Layout(2, 3).local(3) == 1
    results = launch.run(_layout_from_env, 4, local_world_size=2, timeout=60)
    for rank, r in enumerate(results):
        assert r["layout"] == (2, 2)
        assert rank == 3 or r["odd"].startswith("the group's ranks [0, 1, 2]"), r["odd"]
        assert r["bad"].startswith("layout (D=3, M=1) has 3 ranks")


def _layout_from_env():
    out = {"layout": (resolve().D, resolve().M)}
    g = dist.new_group([0, 1, 2])
    out["odd"] = out["bad"] = ""
    if dist.get_rank() < 3:
        try:
            resolve(None, g)
        except ValueError as exc:
            out["odd"] = str(exc)
    try:
        resolve((3, 1))
    except ValueError as exc:
        out["bad"] = str(exc)
    dist.barrier()      # rank 3 stays until the others are done with the group it is not in
    return out


# ---- on the simulated cluster: 2 machines × 2 ranks, the layout from the environment -------

def _cluster_checks(impl):
    out = {"layout": (resolve().D, resolve().M)}
    p = dist.get_world_size()
    cases = [c for c in verify.default_cases(p, quick=True, large=False) if c.group is None]
    cases += _size_cases(2, 2) + [verify.Case(PRIME, group=(0, 2)), verify.Case(PRIME, group=(0, 1))]
    for name in FNS:
        out[name] = verify.check_all_reduce(load(f"{impl}:{name}"), cases)
    # the ring over every rail and the asynchronous call, on real links, layout from the environment
    world_cases = [c for c in cases if c.group is None]
    out["rail ring"] = verify.check_all_reduce(load(f"{REFERENCE}:rail_ring_all_reduce"), world_cases)
    asynchronous = load(f"{impl}:hierarchical_all_reduce_async")
    out["async"] = verify.check_all_reduce(lambda x, op=ReduceOp.SUM: asynchronous(x, op).wait(), world_cases)
    events, error = _traced(load(f"{impl}:one_slice_all_reduce"), PATTERN_N)
    out["tiers"] = error or _tiers(events, None)
    return out


def test_on_the_simulated_cluster_with_the_layout_from_the_environment(impl):
    from collectives.core import cluster

    reason = cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    results = launch.run(_cluster_checks, 4, args=(impl,), machines=2, link="1gbit", timeout=TIMEOUT)
    n = PATTERN_N * 4
    for rank, r in enumerate(results):
        assert r["layout"] == (2, 2), f"rank {rank} read the layout {r['layout']} from its environment"
        for name in FNS + ("rail ring", "async"):
            assert r[name].ok, f"{name} on the cluster, rank {rank}: {r[name].summary()}"
        assert r["tiers"]["across"] == pytest.approx(n / 2) and r["tiers"]["inside"] == pytest.approx(n), r["tiers"]


# ---- on GPUs: NCCL, one stream and one communicator per stage for real -----------------------

def _gpu_checks(layout, big_numel):
    from collectives import ops

    device = ops.rank_device()
    out = {}
    for name in ("hierarchical_all_reduce", "one_slice_all_reduce", "rail_all_reduce"):
        fn = functools.partial(load(f"collectives.hierarchical:{name}"), layout=layout)
        cases = [c for c in verify.default_cases(2, quick=True) if c.group is None] + _size_cases(*layout)
        out[name] = verify.check_all_reduce(fn, cases)
    x = torch.randint(-8, 9, (big_numel,), device=device).float()      # 256 MiB, exact sums
    expected = verify.reference_all_reduce(x)
    load("collectives.hierarchical:hierarchical_all_reduce")(x, layout=layout)
    out["256 MiB"] = verify.compare(expected, x)
    # buckets in flight on streams: many slices, a small ring of staging, NCCL's inside stages
    from collectives.hierarchical import HierarchicalAllReducer
    reducer = HierarchicalAllReducer(layout=layout, memory_bytes=1 << 20, slice_bytes=1 << 18)
    buckets = [torch.randint(-8, 9, (n,), device=device).float() for n in (4099, 1 << 20, 97, 3 << 18)]
    wants = [verify.reference_all_reduce(b) for b in buckets]
    handles = [reducer.all_reduce(b) for b in buckets]
    out["in flight"] = [verify.compare(w, h.wait()) for w, h in zip(wants, handles)]
    # what tools/gpu_hierarchical.py times: 16 buckets of 4 MiB, all in flight, the default budget
    reducer = HierarchicalAllReducer(layout=layout)
    buckets = [torch.randint(-8, 9, (1 << 20,), device=device).float() for _ in range(16)]
    wants = [verify.reference_all_reduce(b) for b in buckets]
    handles = [reducer.all_reduce(b) for b in buckets]
    out["16 in flight"] = [verify.compare(w, h.wait()) for w, h in zip(wants, handles)]
    # captured once in a CUDA graph (slices, uneven sizes), replayed on fresh copies: exact
    from collectives.core import timing
    pristine = [torch.randint(-8, 9, (n,), device=device).float() for n in (4099, 1 << 20, 97)]
    wants = [verify.reference_all_reduce(b) for b in pristine]
    buckets = [b.clone() for b in pristine]

    def issue():
        for b in buckets:
            load("collectives.hierarchical:hierarchical_all_reduce")(b, layout=layout, slice_numel=1 << 18)
    graph = timing.capture_graph(issue, warm=2, device=device)
    for b, fresh in zip(buckets, pristine):
        b.copy_(fresh)
    graph.replay()
    out["replayed"] = [verify.compare(w, b) for w, b in zip(wants, buckets)]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [(1, 2), (2, 1)])
def test_on_two_gpus_with_nccl(layout):
    from collectives.core import timing
    results = launch.run(_gpu_checks, 2, args=(layout, 64 << 20), backend="nccl", timeout=300,
                         env=timing.graph_env())
    for rank, r in enumerate(results):
        for name in ("hierarchical_all_reduce", "one_slice_all_reduce", "rail_all_reduce"):
            assert r[name].ok, f"{name}, layout {layout}, rank {rank}: {r[name].summary()}"
        assert r["256 MiB"] is None, f"256 MiB, layout {layout}, rank {rank}: {r['256 MiB']}"
        assert r["in flight"] == [None] * 4, f"buckets in flight, layout {layout}, rank {rank}: {r['in flight']}"
        assert r["16 in flight"] == [None] * 16, \
            f"16 buckets of 4 MiB in flight, layout {layout}, rank {rank}: {r['16 in flight']}"
        assert r["replayed"] == [None] * 3, f"replayed from a CUDA graph, layout {layout}, rank {rank}: {r['replayed']}"


# ---- the benchmarks' records (no world: what a record holds and how it compares) -----------

def test_a_bench_record_holds_machine_versions_date_command_and_its_comparisons(tmp_path):
    import json

    from collectives.course.benchmarks import hierarchical_record as record
    from collectives.course.benchmarks.hierarchical import crossover

    rows = [dict(name=name, nbytes=n, seconds=s, verified=True)
            for name, n, s in [("dist.all_reduce", 1 << 16, 0.002), ("hierarchical, pipelined", 1 << 16, 0.005),
                               ("dist.all_reduce", 1 << 20, 0.013), ("hierarchical, pipelined", 1 << 20, 0.015),
                               ("dist.all_reduce", 4 << 20, 0.051), ("hierarchical, pipelined", 4 << 20, 0.036),
                               ("dist.all_reduce", 16 << 20, 0.21), ("hierarchical, pipelined", 16 << 20, 0.14)]]
    assert crossover(rows, "hierarchical, pipelined", "dist.all_reduce") == 4 << 20
    assert crossover(rows, "dist.all_reduce", "hierarchical, pipelined") is None    # loses at the largest size
    one = record.compare("16 MiB", "hierarchical", 0.14, "dist.all_reduce", 0.21)
    assert one["faster"] == "hierarchical" and one["by"] == pytest.approx(1.5)
    path = record.write("crossover", ["--quick"], {"rows": rows, "comparisons": [one]}, None, tmp_path)
    saved = json.loads(path.read_text())
    assert saved["command"] == ".venv/bin/python -m collectives bench-hier crossover --quick"
    assert {"cpu", "cores"} <= set(saved["machine"]) and saved["versions"]["torch"] == torch.__version__
    assert saved["date"][:4].isdigit() and saved["comparisons"][0]["by"] == pytest.approx(1.5)


# ---- the check on several machines, and bench-hier --impl exercise ------------------------

def _timing_lines():
    from collectives.course.catalog import ROOT
    from collectives.course.grading.tasks import lesson07

    spec = str(ROOT / "tests" / "solutions" / "lesson07_library.py")
    return lesson07.in_world_timing(spec, {4: True}), lesson07.in_world_timing(spec, {4: False})


def test_the_check_on_several_machines_times_yours_beside_the_flat_ring_and_the_reference(monkeypatch):
    from collectives.course.grading.tasks import lesson07

    monkeypatch.setattr(lesson07, "TIMED_BYTES", 64 << 10)      # the ranks are forked: they see it
    passed, unwritten = launch.run(_timing_lines, 4, local_world_size=2, timeout=TIMEOUT)[0]
    assert passed.startswith("timing, 2 machines × 2 ranks, 64 KiB: yours "), passed
    assert "the flat ring (dist.all_reduce) " in passed and "the reference " in passed, passed
    assert "yours" not in unwritten.split(":", 1)[1].split("(")[0] and "once task 4 passes" in unwritten, unwritten
    # one machine: no slow tier, nothing to time
    assert launch.run(_timing_lines, 2, timeout=TIMEOUT)[0] == (None, None)


def test_an_unwritten_function_is_named_and_not_timed_by_bench_hier():
    from collectives.course.benchmarks.hierarchical import why_not_timed

    stub = verify.Report([verify.CaseResult("n=0 float32 SUM", 0, False,
                                            "raised NotImplementedError: Lesson 7, task 4: hierarchical_all_reduce")])
    assert why_not_timed(stub) == "not written yet (Lesson 7, task 4: hierarchical_all_reduce)"
    wrong = verify.Report([verify.CaseResult("n=7 float32 SUM", 1, False, "3 of 7 elements differ")])
    assert "n=7 float32 SUM" in why_not_timed(wrong) and "3 of 7" in why_not_timed(wrong)


def test_the_planner_pays_the_hosts_time_to_issue_each_slice():
    # NVLink-class links at 256 MiB: a stage takes about a millisecond, and issuing a slice
    # takes the host about as long. Every slice pays it again: one slice is the plan.
    import dataclasses

    n = 256 << 20
    nvlink = cost.AlphaBeta(10e-6, 1 / 300e9)
    busy_host = hcost.Tiers(nvlink, nvlink, rails=True, issue=1.3e-3)
    free_host = dataclasses.replace(busy_host, issue=0.0)
    assert hcost.best_slice_bytes(n, 2, 2, busy_host) >= n
    assert n / hcost.best_slice_bytes(n, 2, 2, free_host) >= 2          # the same links, a free host: slices
    one = hcost.predict_tiered("hierarchical", n, 2, 2, free_host)
    assert hcost.predict_tiered("hierarchical", n, 2, 2, busy_host) == pytest.approx(one + 1.3e-3)
    # four slices: the host issues one per 1.3 ms, slower than either link's share of a slice
    assert hcost.predict_tiered("hierarchical", n, 2, 2, busy_host, 4) == pytest.approx(
        hcost.predict_tiered("hierarchical", n, 2, 2, free_host, 4) + 1.3e-3 + 3 * (1.3e-3 - max(
            sum(s.seconds(free_host) for s in hcost.tiered("hierarchical", n / 4, 2, 2, True) if s.tier == t)
            for t in ("inside", "across"))))
    # a slow tier across (1 Gbit/s): still pipelined, with or without the host's time
    slow = hcost.Tiers(cost.AlphaBeta(50e-6, 1 / 1e9), cost.AlphaBeta(100e-6, 8 / 1e9))
    for tiers in (slow, dataclasses.replace(slow, issue=1e-4), hcost.DEFAULT_TIERS):
        assert (64 << 20) / hcost.best_slice_bytes(64 << 20, 2, 2, tiers) >= 4
    # the defaults: NCCL's GPUs on one host plan one slice of 256 MiB on every layout of 4
    one_host = hcost.tiers_for("nccl", "cuda", one_host=True)
    assert one_host.issue > 0 and one_host != hcost.tiers_for("nccl", "cuda")
    for D, M in ((2, 2), (1, 4), (4, 1)):
        assert hcost.slice_plan(n // 4, 4, D, M, one_host) == n // 4


@pytest.mark.parametrize("layout", TWO_TIERS_INSIDE)
def test_the_in_flight_reducer_on_nccls_path_is_exact_prepares_once_and_keeps_the_host_light(worlds, layout):
    # Streams for lanes and every stage a collective (an all-to-all and an all-gather on the
    # rail): exact, lanes as streams or threads; a bucket handed over again reuses the slices
    # prepared on its first call; Fairring's bytes by tier; and the host's own work per bucket
    # stays small: Python calls counted with torch.distributed's calls stubbed (at (2, 2), 328
    # before the slices were prepared once, about 100 after: bench-hier host-cost's records).
    for progress in ("streams", "threads"):
        _assert_report(worlds, layout, f"in flight collectives, {progress}")
    _assert_fairring_bytes(worlds, layout, "in flight collectives")
    for rank, r in enumerate(worlds[layout]):
        where = f"layout {layout}, rank {rank}"
        assert all(exact for exact, _ in r["prepared rounds"]), where
        assert len({program for _, program in r["prepared rounds"]}) == 1, f"{where}: prepared again"
        assert r["python calls per bucket"] <= 150, f"{where}: {r['python calls per bucket']} Python calls per bucket"
