"""Lesson 3, the naive ring: equal to ``dist.all_reduce``, and shaped like a ring.

One world per world size (1 to 4) runs the harness's whole case list against
``naive_ring_all_reduce`` -- split three ways, one per task -- and records one traced
call for the pattern tests. The expanded-tensor check runs in a world of its own: an
implementation that hands such a tensor to gloo crashes its process.
"""

import pytest
import torch
import torch.distributed as dist

from collectives import cost, launch, trace, verify
from collectives.course.catalog import world_timeout
from collectives.course.impl import resolve
from collectives.core.ops import ReduceOp

LESSON = 3
WORLD_SIZES = (1, 2, 3, 4)
PATTERN_NUMEL = 1000     # any size: the naive ring never cuts the tensor
WORLD_TIMEOUT = world_timeout(60)


def _plain(case, p):
    return case.group is None and case.layout == "contiguous" and case.numel >= p


def _task_cases(p):
    """The harness's cases, split by task: 1 the loop, 2 ops and dtypes, 3 the rest of the contract."""
    cases = verify.default_cases(p)
    loop = [c for c in cases if _plain(c, p) and c.op == ReduceOp.SUM
            and c.dtype in (torch.float32, torch.int64)]
    return {1: loop,
            2: [c for c in cases if _plain(c, p) and c not in loop],
            3: [c for c in cases if not _plain(c, p)]}


def _world_checks(impl):
    """On every rank: each task's report, then one traced call on PATTERN_NUMEL floats."""
    fn = resolve(impl + ":naive_ring_all_reduce")
    p = dist.get_world_size()
    # identical_bits=False: each rank adds the p terms in its own order (documented)
    reports = {task: verify.check_all_reduce(fn, cases, identical_bits=False)
               for task, cases in _task_cases(p).items()}
    x = torch.full((PATTERN_NUMEL,), float(dist.get_rank()))
    try:
        with trace.recording() as t:
            fn(x)
        events, error = t.to_dicts(), None
    except Exception as exc:  # noqa: BLE001 - a stub: reported by the pattern tests
        events, error = [], f"{type(exc).__name__}: {exc}"
    return reports, events, error, x.tolist()


def _expanded_check(impl):
    return verify.check_expanded_rejected(resolve(impl + ":naive_ring_all_reduce"))


@pytest.fixture(scope="module")
def worlds(impl):
    """{p: per-rank results of _world_checks}, one world per world size."""
    return {p: launch.run(_world_checks, p, args=(impl,), timeout=WORLD_TIMEOUT) for p in WORLD_SIZES}


def _assert_task(worlds, task):
    for p, ranks in worlds.items():
        report = verify.Report()
        for reports, *_ in ranks:
            report = report.merge(reports[task])
        assert report.ok, f"world size {p}: {report.summary()}"


@pytest.mark.task(lesson=3, task=1, points=4, title="the ring loop (SUM, contiguous tensors)")
def test_sum_matches_dist_all_reduce_on_world_sizes_1_to_4(worlds):
    _assert_task(worlds, 1)


@pytest.mark.task(lesson=3, task=1, points=4, title="the ring loop (SUM, contiguous tensors)")
@pytest.mark.parametrize("p", [2, 3, 4])
def test_each_rank_sends_p_minus_1_whole_tensors_to_its_right_neighbour(worlds, p):
    for rank, (_, events, error, _) in enumerate(worlds[p]):
        assert error is None, f"rank {rank}: {error}"
        sends = trace.Trace.from_dicts(rank, events).sends()
        assert len(sends) == p - 1, f"rank {rank} sent {len(sends)} messages, expected {p - 1}"
        assert {e.peer for e in sends} == {(rank + 1) % p}, f"rank {rank} sent to {[e.peer for e in sends]}"
        assert all(e.numel == PATTERN_NUMEL for e in sends), [e.numel for e in sends]


@pytest.mark.task(lesson=3, task=1, points=4, title="the ring loop (SUM, contiguous tensors)")
@pytest.mark.parametrize("p", [2, 3, 4])
def test_bytes_sent_per_rank_are_p_minus_1_times_n(worlds, p):
    nbytes = PATTERN_NUMEL * 4
    expected = cost.cost("naive_ring", nbytes, p).bytes_per_rank
    assert expected == (p - 1) * nbytes
    for rank, (_, events, error, _) in enumerate(worlds[p]):
        assert error is None, f"rank {rank}: {error}"
        t = trace.Trace.from_dicts(rank, events)
        assert t.bytes_sent() == expected, f"rank {rank} sent {t.bytes_sent()} bytes, expected {expected}"
        assert not t.collectives(), f"rank {rank} called {[e.kind for e in t.collectives()]}: " \
                                    "build the all-reduce from point-to-point messages"


@pytest.mark.task(lesson=3, task=1, points=4, title="the ring loop (SUM, contiguous tensors)")
def test_every_rank_ends_with_the_sum_of_the_ranks(worlds):
    for p, ranks in worlds.items():
        total = sum(range(p))
        for rank, (*_, error, values) in enumerate(ranks):
            assert error is None, f"world size {p}, rank {rank}: {error}"
            assert values == [float(total)] * PATTERN_NUMEL, f"world size {p}, rank {rank}"


@pytest.mark.task(lesson=3, task=2, points=3, title="every op and dtype")
def test_every_op_and_dtype_matches_dist_all_reduce(worlds):
    _assert_task(worlds, 2)


@pytest.mark.task(lesson=3, task=3, points=3, title="views, subgroups, tiny tensors, bad input")
def test_views_subgroups_and_tiny_tensors_match_dist_all_reduce(worlds):
    _assert_task(worlds, 3)


@pytest.mark.task(lesson=3, task=3, points=3, title="views, subgroups, tiny tensors, bad input")
def test_an_expanded_tensor_is_rejected_with_a_value_error(impl):
    try:
        results = launch.run(_expanded_check, 2, args=(impl,), timeout=WORLD_TIMEOUT)
    except launch.RankError as exc:
        pytest.fail(f"an expanded tensor crashed rank {exc.rank}: {exc.summary}")
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.detail}"


# ---- the tutorial's version, kept in collectives.naive_ring: what the lesson page says of it

def _tutorial_behaviour():
    from collectives.naive_ring import tutorial_all_reduce
    rank = dist.get_rank()
    out = {}
    x = torch.arange(6.0) + rank
    result = torch.empty(6)
    tutorial_all_reduce(x, result)
    out["contiguous sum"] = torch.equal(result, 2 * torch.arange(6.0) + 1)
    out["input untouched"] = torch.equal(x, torch.arange(6.0) + rank)
    try:
        view = (torch.arange(6.0).view(2, 3) + rank).t()
        tutorial_all_reduce(view, torch.empty(3, 2))
        out["transposed view"] = "ran"
    except RuntimeError as exc:
        out["transposed view"] = str(exc)
    return out


def test_the_tutorial_version_sums_out_of_place_and_rejects_a_transposed_view():
    for out in launch.run(_tutorial_behaviour, 2, timeout=WORLD_TIMEOUT):
        assert out["contiguous sum"] and out["input untouched"]
        assert "contiguous" in out["transposed view"], out["transposed view"]
