"""Lesson 7, hierarchical all-reduce: equal to ``dist.all_reduce``, and sending the two-tier pattern.

Three worlds (4, 2 and 6 gloo ranks), each pretending to be several machines with
``layout=(D, M)`` and running every check inside it: the harness's cases for each layout
(every op and dtype, views, 0 and 1 element, fewer than D·M, over 1 Mi), the sizes that
exercise the padding slot (D·M − 1, D·M, D·M + 1, a prime), pipelined slices with more
slices in flight than slots, two calls on one tensor, and traced calls whose collectives
are counted by tier (:func:`collectives.hierarchical.layout.tier_bytes`):

    across machines, per rank   2(M − 1)/M · n/D       (the flat ring: 2(p − 1)/p · n at a machine's edge)
    inside a machine, per rank  2(D − 1)/D · n
    off the rail                0

A flat all-reduce passes the equivalence and fails the pattern. On the simulated cluster
(tests at the end) the layout comes from the environment, as under torchrun.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from collectives import cost, launch, trace, verify
from collectives.hierarchical.layout import Layout, resolve, stage_groups, tier_bytes
from collectives.course.impl import resolve as load
from collectives.core.ops import ReduceOp

LESSON = 7
TIMEOUT = 150
FNS = ("root_based_all_reduce", "rail_all_reduce", "one_slice_all_reduce", "hierarchical_all_reduce")
PRIME = 1009
PATTERN_N = 960            # divisible by every D·M here (4, 2, 6): the byte counts are exact
SLICE_N = 96               # pipelined: PATTERN_N / SLICE_N = 10 slices, more than the 2 slots
WORLDS = {4: [(2, 2), (1, 4), (4, 1)], 2: [(2, 1), (1, 2)], 6: [(3, 2), (2, 3)]}


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


def _overlapped(events) -> bool:
    """True when two operations of different stages (another group, or another kind of
    collective on a group of the same ranks) were in flight at the same time."""
    calls = [e for e in events if e["t1"] is not None and e["group"]]
    return any((a["group"], a["kind"]) != (b["group"], b["kind"]) and a["t0"] < b["t1"] and b["t0"] < a["t1"]
               for i, a in enumerate(calls) for b in calls[i + 1:])


def _world_checks(impl, layouts, full_harness):
    """Everything this file checks, on one rank of one world."""
    fns = {name: load(f"{impl}:{name}") for name in FNS}
    ring = load("collectives.ring:ring_all_reduce")
    out = {}
    for layout in layouts:
        D, M = layout
        res = out[layout] = {}
        harness = verify.default_cases(D * M) if layout in full_harness else \
            verify.default_cases(D * M, quick=True, large=False)
        cases = [c for c in harness if c.group is None] + _size_cases(D, M)
        for name in FNS:
            fn = functools.partial(fns[name], layout=layout)
            res[name] = verify.check_all_reduce(fn, cases if name != "root_based_all_reduce" else
                                                _size_cases(D, M))
        # pipelined: 10 slices of 96 (more than the slots), a tail through the padding slot
        piped = functools.partial(fns["hierarchical_all_reduce"], layout=layout, slice_numel=SLICE_N)
        res["pipelined"] = verify.check_all_reduce(piped, [
            verify.Case(PATTERN_N), verify.Case(PATTERN_N + D * M - 1), verify.Case(PRIME, torch.int32, ReduceOp.MAX),
            verify.Case(PRIME, torch.float64, ReduceOp.AVG), verify.Case(PRIME, layout="transposed")])
        # twice on the same tensor: the slots are reused, nothing of the first call leaks in
        x = torch.full((PRIME,), float(dist.get_rank() + 1))
        try:
            piped(x)
            piped(x)
            p = D * M
            res["twice"] = verify.compare(torch.full((PRIME,), float((p * (p + 1) // 2) * p)), x)
        except Exception as exc:  # noqa: BLE001
            res["twice"] = f"{type(exc).__name__}: {exc}"
        # a leaf that requires grad is reduced through .detach(), like dist.all_reduce
        leaf = torch.ones(PRIME, requires_grad=True)
        try:
            fns["one_slice_all_reduce"](leaf, layout=layout)
            res["leaf"] = verify.compare(torch.full((PRIME,), float(D * M)), leaf.detach())
        except Exception as exc:  # noqa: BLE001
            res["leaf"] = f"{type(exc).__name__}: {exc}"
        res["traces"] = {name: _traced(fns[name], PATTERN_N, layout=layout) for name in FNS}
        res["traces"]["pipelined"] = _traced(fns["hierarchical_all_reduce"], PATTERN_N, layout=layout,
                                             slice_numel=SLICE_N)
        res["traces"]["padded"] = _traced(fns["one_slice_all_reduce"], PATTERN_N + 1, layout=layout)
        res["tiers"] = {name: _tiers(ev, layout) if err is None else None
                        for name, (ev, err) in res["traces"].items()}
        res["traces"]["flat ring"] = _traced(ring, PATTERN_N)
        res["tiers"]["flat ring"] = _tiers(res["traces"]["flat ring"][0], layout)
        try:
            fns["one_slice_all_reduce"](torch.ones(4), layout=(D * M + 1, 1))
            res["bad layout"] = "accepted"
        except ValueError as exc:
            res["bad layout"] = str(exc)
        except Exception as exc:  # noqa: BLE001
            res["bad layout"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def worlds(impl):
    """{layout: [per-rank results]}: one world per world size, every layout of that size in it."""
    out = {}
    for p, layouts in WORLDS.items():
        full = {layouts[0]} if p != 6 else set()   # the whole harness once per world size (not at 6)
        for rank_results in [launch.run(_world_checks, p, args=(impl, layouts, full), timeout=TIMEOUT)]:
            for layout in layouts:
                out[layout] = [r[layout] for r in rank_results]
    return out


ALL_LAYOUTS = [layout for layouts in WORLDS.values() for layout in layouts]
CROSSING = [layout for layout in ALL_LAYOUTS if layout[1] > 1]


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
        assert got["across"] == pytest.approx(across), \
            f"{name}, layout {layout}, rank {rank}: {got['across']:.0f} bytes across machines, expected 2(M-1)/M·n/D = {across:.0f}"
        assert got["inside"] == pytest.approx(inside), \
            f"{name}, layout {layout}, rank {rank}: {got['inside']:.0f} bytes inside, expected 2(D-1)/D·n = {inside:.0f}"


# ---- task 1: root-based ----------------------------------------------------------------

@pytest.mark.task(lesson=7, task=1, points=2, title="root-based hierarchy")
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_root_based_matches_dist_all_reduce(worlds, layout):
    _assert_report(worlds, layout, "root_based_all_reduce")


@pytest.mark.task(lesson=7, task=1, points=2, title="root-based hierarchy")
@pytest.mark.parametrize("layout", CROSSING)
def test_root_based_sends_across_only_from_each_machines_root(worlds, layout):
    D, M = layout
    n = PATTERN_N * 4
    for rank, got in enumerate(_tiers_of(worlds, layout, "root_based_all_reduce")):
        expected = 2 * (M - 1) / M * n if rank % D == 0 else 0.0
        assert got["mixed"] == 0 and got["across"] == pytest.approx(expected), \
            f"layout {layout}, rank {rank}: {got} (across expected {expected:.0f})"


# ---- task 2: reduce-scatter, all-reduce on the rails, all-gather --------------------------

@pytest.mark.task(lesson=7, task=2, points=3, title="rail all-reduce")
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_rail_all_reduce_matches_dist_all_reduce(worlds, layout):
    _assert_report(worlds, layout, "rail_all_reduce")


@pytest.mark.task(lesson=7, task=2, points=3, title="rail all-reduce")
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_rail_all_reduce_sends_n_over_D_across_on_the_rail(worlds, layout):
    _assert_fairring_bytes(worlds, layout, "rail_all_reduce")


# ---- task 3: five stages on one slice --------------------------------------------------

@pytest.mark.task(lesson=7, task=3, points=5, title="five stages on one slice")
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_one_slice_matches_dist_all_reduce(worlds, layout):
    _assert_report(worlds, layout, "one_slice_all_reduce")


@pytest.mark.task(lesson=7, task=3, points=5, title="five stages on one slice")
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_one_slice_sends_two_M_minus_1_over_M_n_over_D_across_and_stays_on_the_rail(worlds, layout):
    _assert_fairring_bytes(worlds, layout, "one_slice_all_reduce")


@pytest.mark.task(lesson=7, task=3, points=5, title="five stages on one slice")
@pytest.mark.parametrize("layout", CROSSING)
def test_one_slice_sends_less_across_than_the_flat_ring(worlds, layout):
    # The flat ring over all ranks sends 2(p-1)/p·n from each rank at a machine's edge.
    D, M = layout
    ring = max(t["across"] for t in _tiers_of(worlds, layout, "flat ring") if t)
    assert ring == pytest.approx(cost.cross_bytes_per_rank("flat_ring", PATTERN_N * 4, D, M))
    ours = max(t["across"] for t in _tiers_of(worlds, layout, "one_slice_all_reduce"))
    assert ours == pytest.approx(cost.cross_bytes_per_rank("hierarchical", PATTERN_N * 4, D, M))
    assert ours <= ring        # per rank: equal when D = 1; per machine link D times less
    if D > 1:
        assert ours < ring


@pytest.mark.task(lesson=7, task=3, points=5, title="five stages on one slice")
@pytest.mark.parametrize("layout", CROSSING)
def test_the_padding_slot_adds_one_element_per_block(worlds, layout):
    # n = 960 + 1: the tail travels in a padding slot of D·M elements, one per block.
    D, M = layout
    for rank, got in enumerate(_tiers_of(worlds, layout, "padded")):
        base = 2 * (M - 1) / M * PATTERN_N * 4 / D
        padding = 2 * (M - 1) / M * D * M * 4 / D
        assert base < got["across"] <= base + padding + 1e-6, f"layout {layout}, rank {rank}: {got}"


@pytest.mark.task(lesson=7, task=3, points=5, title="five stages on one slice")
@pytest.mark.parametrize("layout", [(2, 2), (1, 2)])
def test_one_slice_reduces_a_leaf_and_rejects_a_layout_that_does_not_fit(worlds, layout):
    for rank, r in enumerate(worlds[layout]):
        assert r["leaf"] is None, f"rank {rank}: {r['leaf']}"
        assert "layout" in r["bad layout"] and "rank" in r["bad layout"], \
            f"rank {rank}: a layout of D·M + 1 ranks should raise a ValueError naming it, got {r['bad layout']!r}"


# ---- task 4: pipelined slices ----------------------------------------------------------

@pytest.mark.task(lesson=7, task=4, points=5, title="pipelined slices")
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_pipelined_matches_dist_all_reduce(worlds, layout):
    _assert_report(worlds, layout, "hierarchical_all_reduce")
    _assert_report(worlds, layout, "pipelined")
    for rank, r in enumerate(worlds[layout]):
        assert r["twice"] is None, f"two calls on one tensor, rank {rank}: {r['twice']}"


@pytest.mark.task(lesson=7, task=4, points=5, title="pipelined slices")
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_pipelined_slices_send_the_one_slice_bytes(worlds, layout):
    _assert_fairring_bytes(worlds, layout, "pipelined")


@pytest.mark.task(lesson=7, task=4, points=5, title="pipelined slices")
@pytest.mark.parametrize("layout", [(2, 2), (1, 4), (3, 2)])
def test_pipelined_slices_are_in_flight_together(worlds, layout):
    # Ten slices: a stage of one slice runs while another stage of another slice does, on
    # another group -- the point of a group per stage.
    for rank, r in enumerate(worlds[layout]):
        events, error = r["traces"]["pipelined"]
        assert error is None, error
        assert _overlapped(events), f"layout {layout}, rank {rank}: no two stages were ever in flight at once"


# ---- not graded: the reference's own promises ------------------------------------------

def test_cost_model_counts_what_the_trace_counts():
    for D, M in ALL_LAYOUTS:
        for name in ("hierarchical", "rail_all_reduce"):
            stages = cost.tiered(name, 1000.0, D, M)
            assert sum(s.bytes_per_rank for s in stages if s.tier == "across") == \
                pytest.approx(2 * (M - 1) / M * 1000 / D)
            assert sum(s.bytes_per_rank for s in stages if s.tier == "inside") == \
                pytest.approx(2 * (D - 1) / D * 1000)
    tiers = cost.Tiers(cost.AlphaBeta(1e-5, 1 / 2e9), cost.AlphaBeta(1e-4, 8 / 1e9))
    n = 64 << 20
    flat = cost.predict_tiered("flat_ring", n, 2, 2, tiers)
    hier = cost.predict_tiered("hierarchical", n, 2, 2, tiers)
    assert flat / hier == pytest.approx(1.5, rel=0.08)       # 1.5·n across against n
    rails = cost.Tiers(tiers.inside, tiers.across, rails=True)
    assert cost.predict_tiered("flat_ring", n, 2, 2, rails) / cost.predict_tiered("hierarchical", n, 2, 2, rails) \
        > 2.5
    fitted = cost.TwoTier(tiers.inside, tiers.across, machines=2, ranks_per_machine=2)
    assert cost.predict_tiered("flat_ring", n, 2, 2, fitted) == pytest.approx(cost.predict_flat("ring", n, fitted))
    best = cost.best_slice_bytes(n, 2, 2, tiers)
    assert 0 < best < n
    assert cost.predict_tiered("hierarchical", n, 2, 2, tiers, slices=round(n / best)) < hier


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


@pytest.mark.parametrize("layout", [l for l in CROSSING if l[0] > 1])
def test_a_flat_ring_handed_in_for_the_hierarchy_fails_the_pattern(worlds, layout):
    # Lesson 4's ring gives the right values; its bytes cross machines at the machines'
    # edges only, 2(p-1)/p·n from one rank and none from the others: no pattern points.
    with pytest.raises(AssertionError, match="bytes across machines|bytes inside"):
        _assert_fairring_bytes(worlds, layout, "flat ring")


# ---- on the simulated cluster: 2 machines × 2 ranks, the layout from the environment -------

def _cluster_checks(impl):
    out = {"layout": (resolve().D, resolve().M)}
    p = dist.get_world_size()
    cases = [c for c in verify.default_cases(p, quick=True, large=False) if c.group is None]
    cases += _size_cases(2, 2) + [verify.Case(PRIME, group=(0, 2)), verify.Case(PRIME, group=(0, 1))]
    for name in FNS:
        out[name] = verify.check_all_reduce(load(f"{impl}:{name}"), cases)
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
        for name in FNS:
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
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [(1, 2), (2, 1)])
def test_on_two_gpus_with_nccl(layout):
    results = launch.run(_gpu_checks, 2, args=(layout, 64 << 20), backend="nccl", timeout=300)
    for rank, r in enumerate(results):
        for name in ("hierarchical_all_reduce", "one_slice_all_reduce", "rail_all_reduce"):
            assert r[name].ok, f"{name}, layout {layout}, rank {rank}: {r[name].summary()}"
        assert r["256 MiB"] is None, f"256 MiB, layout {layout}, rank {rank}: {r['256 MiB']}"
