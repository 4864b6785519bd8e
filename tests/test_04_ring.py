"""Lesson 4, the ring and its rivals: equal to ``dist.*``, and sending the pattern they claim.

One world per world size (1 to 4; 3 is not a power of two) checks everything inside it:
the reduce-scatter and all-gather against ``dist.reduce_scatter`` / ``dist.all_gather``,
every all-reduce through the harness's whole case list, and one traced call of each for
the pattern tests, which hold every algorithm to its design (message count, peers,
sizes, bytes), so that a correct but naive answer does not pass. Expanded tensors are
checked one algorithm per world of 2: an implementation that hands one to gloo crashes.
"""

import math

import pytest
import torch
import torch.distributed as dist

from collectives import cost, launch, ops, trace, verify
from collectives.core.ops import ReduceOp
from collectives.course import audit
from collectives.course.catalog import world_timeout
from collectives.course.impl import resolve

LESSON = 4
WORLD_SIZES = (1, 2, 3, 4)
WORLD_TIMEOUT = world_timeout()   # seconds; a world that overruns it is reported as hung
ALL_REDUCES = ("ring_all_reduce", "pipelined_ring_all_reduce", "recursive_doubling_all_reduce",
               "halving_doubling_all_reduce", "tree_all_reduce")
RING_N = audit.RING_N            # not divisible by 3: chunks of 334 and 333 at p = 3
PIPELINE_N = audit.PIPELINE_N    # chunks of 1000 at p = 4, cut into PIECES messages of 250
PIECES = audit.PIECES
POW2_N = 1024            # halves exactly down to p = 4: halving-doubling's bytes are exact
SCATTER_EXTRA = 1        # 100·p + 1 elements: one chunk longer than the others


# ---- reduce-scatter and all-gather cases, run on every rank --------------------------

def _scatter_cases(p, with_ops=True):
    """(numel, dtype, op, input layout, output layout, subgroup or None): every dtype, and
    (for the reduce-scatter) every op on a float and an integer dtype."""
    divisible = 13 * p
    cases = [(divisible, dtype, ReduceOp.SUM, "contiguous", "contiguous", None) for dtype in verify.ALL_DTYPES]
    if with_ops:
        cases += [(divisible, dtype, op, "contiguous", "contiguous", None)
                  for dtype in (torch.float32, torch.int64) for op in verify.ALL_OPS
                  if op != ReduceOp.SUM and not (op == ReduceOp.AVG and dtype == torch.int64)]
    cases += [(1001, torch.float32, ReduceOp.SUM, "contiguous", "contiguous", None),
              (1001, torch.int64, ReduceOp.MAX, "contiguous", "contiguous", None),
              (max(p - 1, 1), torch.float32, ReduceOp.SUM, "contiguous", "contiguous", None),
              (0, torch.float32, ReduceOp.SUM, "contiguous", "contiguous", None),
              (1001, torch.int32, ReduceOp.SUM, "transposed", "strided", None)]
    if p >= 3:
        cases.append((1001, torch.int64, ReduceOp.SUM, "contiguous", "contiguous", tuple(range(p - 1))))
    return cases


def _view_of(values, layout):
    """``values`` laid out as asked: (tensor, buffer it lives in or None)."""
    if layout == "contiguous":
        return values, None
    case = verify.Case(values.numel(), values.dtype, layout=layout)
    tensor, base = verify.make_input(case, 0)
    tensor.copy_(values.view(tensor.shape) if layout == "transposed" else values)
    return tensor, base


def _gaps_problem(base, layout):
    if base is not None and layout == "strided" and bool((base[1::2] != verify.SENTINEL).any()):
        return "wrote between the elements of a strided output"
    return None


def _reduce_scatter_case(fn, case, group):
    numel, dtype, op, in_layout, out_layout, _ = case
    grank, p = ops.group_rank_and_size(group)
    values = verify.make_values(verify.Case(numel, dtype, op), grank)
    lo, hi = ops.chunk_bounds(numel, p)[grank]
    with trace.paused():
        if numel and numel % p == 0:
            expected = torch.empty(hi - lo, dtype=dtype)
            rs_op = ReduceOp.SUM if op == ReduceOp.AVG else op
            dist.reduce_scatter(expected, [c.clone() for c in values.chunk(p)], op=rs_op, group=group)
            ops.finish_(expected, op, p)
        else:
            expected = verify.reference_all_reduce(values, op, group)[lo:hi]
    source, _ = _view_of(values.clone(), in_layout)
    out, base = _view_of(torch.full((hi - lo,), 55, dtype=dtype), out_layout)
    fn(out, source, op=op, group=group)
    problem = verify.compare(expected, out) or _gaps_problem(base, out_layout)
    if problem is None and not torch.equal(source.reshape(-1), values):
        problem = "modified its input"
    return problem


def _all_gather_case(fn, case, group):
    numel, dtype, _, in_layout, out_layout, _ = case
    grank, p = ops.group_rank_and_size(group)
    values = verify.make_values(verify.Case(numel, dtype), grank)
    lo, hi = ops.chunk_bounds(numel, p)[grank]
    mine = values[lo:hi].clone()
    with trace.paused():
        if numel and numel % p == 0:
            parts = [torch.empty(hi - lo, dtype=dtype) for _ in range(p)]
            dist.all_gather(parts, mine, group=group)
            expected = torch.cat(parts)
        else:   # gloo's all_gather needs equal sizes: place each chunk, sum the zeros away
            placed = torch.zeros(numel, dtype=dtype)
            placed[lo:hi] = mine
            expected = verify.reference_all_reduce(placed, ReduceOp.SUM, group)
    source = mine
    if in_layout != "contiguous":   # a strided input chunk
        holder = torch.zeros(2 * mine.numel(), dtype=dtype)
        source = holder[::2]
        source.copy_(mine)
    out, base = _view_of(torch.full((numel,), 55, dtype=dtype), out_layout)
    fn(out, source, group=group)
    return verify.compare(expected, out.reshape(-1)) or _gaps_problem(base, out_layout)


def _run_cases(fn, runner, cases):
    groups = verify._make_groups([verify.Case(1, group=c[5]) for c in cases if c[5]])
    rank, problems = dist.get_rank(), []
    for case in cases:
        if case[5] is not None and rank not in case[5]:
            continue
        try:
            problem = runner(fn, case, groups.get(case[5]))
        except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
            problem = f"raised {type(exc).__name__}: {exc}"
        if problem:
            numel, dtype, op, in_layout, out_layout, group = case
            problems.append(f"n={numel} {dtype} {ops.op_name(op)} input {in_layout}, output {out_layout}"
                            f"{'' if group is None else f', group {group}'}: {problem}")
    return problems


# ---- traced calls, for the pattern tests ----------------------------------------------

def _traced(call):
    try:
        with trace.recording() as t:
            call()
        return t.to_dicts(), None
    except Exception as exc:  # noqa: BLE001 - a stub: reported by the pattern tests
        return [], f"{type(exc).__name__}: {exc}"


# What each task's world runs: a world of its own per task and world size, so that a
# task that hangs or crashes costs its own points and nothing else.
TASK_PARTS = {
    1: ("reduce_scatter", ["reduce_scatter"]),
    2: ("all_gather", ["all_gather"]),
    4: (None, ["pipelined"]),
    5: (None, ["recursive doubling"]),
    6: (None, ["halving-doubling"]),
    7: (None, ["tree"]),
}
# Every all-reduce's values are judged by collectives.course.audit: inputs drawn per run in
# each rank, messages recorded at the process group, the verdict computed in this process;
# the ring's (tasks 3 and 4) on worlds of 1 to 6 ranks, messages of every call included.
AUDITED = {3: "ring_all_reduce", 4: "pipelined_ring_all_reduce", 5: "recursive_doubling_all_reduce",
           6: "halving_doubling_all_reduce", 7: "tree_all_reduce"}
AUDITED_SIZES = (1, 2, 3, 4, 5, 6)


def _world_checks(impl, task):
    """What ``task`` checks on one rank of one world (harness cases and traced calls)."""
    p = dist.get_world_size()
    fns = {name: resolve(f"{impl}:{name}") for name in ALL_REDUCES + ("ring_reduce_scatter", "ring_all_gather")}
    harness, traced = TASK_PARTS[task]
    out = {}
    if harness == "reduce_scatter":
        out[harness] = _run_cases(fns["ring_reduce_scatter"], _reduce_scatter_case, _scatter_cases(p))
    elif harness == "all_gather":
        out[harness] = _run_cases(fns["ring_all_gather"], _all_gather_case, _scatter_cases(p, with_ops=False))
    elif harness is not None:
        out[harness] = verify.check_all_reduce(fns[harness])
    out["traces"] = _traced_calls(fns, traced)
    return out


def _traced_calls(fns, keys):
    """One traced call of each of ``keys``, on this rank: {key: (events, error)}."""
    p = dist.get_world_size()
    scatter_n = 100 * p + SCATTER_EXTRA
    lo, hi = ops.chunk_bounds(scatter_n, p)[dist.get_rank()]
    calls = {
        "reduce_scatter": lambda: fns["ring_reduce_scatter"](torch.zeros(hi - lo), torch.ones(scatter_n)),
        "all_gather": lambda: fns["ring_all_gather"](torch.zeros(scatter_n), torch.ones(hi - lo)),
        "pipelined": lambda: fns["pipelined_ring_all_reduce"](torch.ones(PIPELINE_N), pieces=PIECES),
        "recursive doubling": lambda: fns["recursive_doubling_all_reduce"](torch.ones(POW2_N)),
        "halving-doubling": lambda: fns["halving_doubling_all_reduce"](torch.ones(POW2_N)),
        "tree": lambda: fns["tree_all_reduce"](torch.ones(RING_N)),
    }
    out = {}
    for key in keys:
        with trace.context(f"the traced call of {key} (world of {p})"):
            out[key] = _traced(calls[key])
    return out


class NotRun(Exception):
    """A task's world hung or died: its tests fail with this, and no other task's do."""


def _run_world(fn, p, args, what):
    try:
        # check=False: these worlds are audited at the process group, where check mode's own
        # all-gather would count as a collective the ring must not call
        return launch.run(fn, p, args=args, timeout=WORLD_TIMEOUT, check=False)
    except launch.WorldTimeout as exc:
        return NotRun(f"not run: the world hung in {exc.where or f'{what} (world of {p})'} "
                      f"after {exc.seconds:g} s\n{exc}")
    except launch.RankError as exc:
        return NotRun(f"not run: rank {exc.rank} of a world of {p} died in {what}: {exc.summary}\n{exc}")


@pytest.fixture(scope="module")
def task_worlds(impl, audited):
    """``task_worlds(task)`` -> {p: per-rank results}, one world per world size, made once.
    Tasks 4-7 take theirs from the audited worlds, which make the traced calls too."""
    cache = {}

    def get(task):
        if task in AUDITED:
            sizes = WORLD_SIZES if task != 4 else (3, 4)   # task 4 here: the overlap of pieces
            return {p: audited.raw(task, p) for p in sizes}
        if task not in cache:
            cache[task] = {}
            for p in WORLD_SIZES:
                result = _run_world(_world_checks, p, (impl, task), f"lesson 4 task {task}")
                cache[task][p] = result
                if isinstance(result, NotRun):
                    break        # the next world would hang the same way: don't pay for it
        for p, result in cache[task].items():
            if isinstance(result, NotRun):
                pytest.fail(str(result), pytrace=False)
        return cache[task]
    return get


def _audited_cases(p, task):
    if task > 4:   # the whole covering set (1 Mi elements included) on 4 ranks, the quick one below
        return verify.default_cases(p, large=p == 4, quick=p != 4)
    return audit.ring_task_cases(p, pipelined=task == 4)


def _audited_rank(impl, task, cases):
    """The graded calls of ``task``'s function (records judged in this process), then its
    traced pattern call, if it has one."""
    name = AUDITED[task]
    records = audit._graded_rank(f"{impl}:{name}", cases, name, {"pieces": PIECES} if task == 4 else None)
    fns = {n: resolve(f"{impl}:{n}") for n in ALL_REDUCES}
    return {"records": records, "traces": _traced_calls(fns, TASK_PARTS.get(task, (None, []))[1])}


@pytest.fixture(scope="module")
def audited(impl):
    """``audited(task, p)`` -> every rank's :class:`audit.CaseRecord` list for that task's
    function; ``audited.raw(task, p)`` -> every rank's whole result (records and traces)."""
    cache = {}

    def raw(task, p):
        hung = cache.get(task)     # an earlier world of this task hung: the next would too
        if hung is not None:
            pytest.fail(str(hung), pytrace=False)
        if (task, p) not in cache:
            cache[(task, p)] = _run_world(_audited_rank, p, (impl, task, _audited_cases(p, task)), AUDITED[task])
        result = cache[(task, p)]
        if isinstance(result, NotRun):
            cache[task] = result
            pytest.fail(str(result), pytrace=False)
        return result

    def get(task, p):
        return [r["records"] for r in raw(task, p)]

    get.raw = raw
    return get


_JUDGED = {}


def _assert_audited(audited, task, p, pattern):
    key = (id(audited), task, p, pattern)
    if key not in _JUDGED:
        _JUDGED[key] = audit.judge(audited(task, p), pattern=audit.ring_task_pattern(task == 4) if pattern else None)
    report = _JUDGED[key]
    if not report.ok:
        first = report.failures[0]
        pytest.fail(f"{AUDITED[task]}, world size {p}, [{first.case}] rank {first.rank}: {first.detail}\n"
                    + report.summary(4), pytrace=False)


def _expanded_check(target):
    return verify.check_expanded_rejected(resolve(target))


def _traces(worlds, p, name):
    """The per-rank traces of one traced call; fails the test if a rank raised."""
    out = []
    for rank, result in enumerate(worlds[p]):
        events, error = result["traces"][name]
        assert error is None, f"world size {p}, rank {rank}: {error}"
        t = trace.Trace.from_dicts(rank, events)
        assert not t.collectives(), (f"rank {rank} called {sorted({e.kind for e in t.collectives()})}: "
                                     "build it from point-to-point messages")
        out.append(t)
    return out


def _assert_expanded_rejected(impl, name):
    try:
        results = launch.run(_expanded_check, 2, args=(f"{impl}:{name}",), timeout=WORLD_TIMEOUT)
    except launch.RankError as exc:
        pytest.fail(f"{name} crashed on an expanded tensor, rank {exc.rank}: {exc.summary}")
    except launch.WorldTimeout as exc:
        pytest.fail(f"not run: the world hung in {exc.where or name} on an expanded tensor")
    for r in results:
        assert r.ok, f"{name}, rank {r.rank}: {r.detail}"


def _chunk_sizes(n, p):
    return {n // p, -(-n // p)}


def _assert_p_minus_1_chunks_to_the_right(worlds, p, key):
    """Each rank sends p − 1 chunks of ⌊n/p⌋ or ⌈n/p⌉ elements, all to rank + 1: (p − 1)·n in all."""
    n = 100 * p + SCATTER_EXTRA
    traces = _traces(worlds, p, key)
    for t in traces:
        sends = t.sends()
        assert len(sends) == p - 1, f"rank {t.rank} sent {len(sends)} messages, expected {p - 1}"
        assert {e.peer for e in sends} == {(t.rank + 1) % p}
        assert {e.numel for e in sends} <= _chunk_sizes(n, p)
    assert sum(e.numel for t in traces for e in t.sends()) == (p - 1) * n


# ---- task 1: reduce-scatter -----------------------------------------------------------

@pytest.mark.task(lesson=4, task=1, points=3, title="ring reduce-scatter")
def test_reduce_scatter_matches_dist_reduce_scatter(task_worlds):
    worlds = task_worlds(1)
    for p, ranks in worlds.items():
        for rank, result in enumerate(ranks):
            assert not result["reduce_scatter"], \
                f"world size {p}, rank {rank}: " + "; ".join(result["reduce_scatter"][:4])


@pytest.mark.task(lesson=4, task=1, points=3, title="ring reduce-scatter")
@pytest.mark.parametrize("p", [2, 3, 4])
def test_reduce_scatter_sends_p_minus_1_chunks_to_the_right(task_worlds, p):
    worlds = task_worlds(1)
    _assert_p_minus_1_chunks_to_the_right(worlds, p, "reduce_scatter")


# ---- task 2: all-gather ---------------------------------------------------------------

@pytest.mark.task(lesson=4, task=2, points=3, title="ring all-gather")
def test_all_gather_matches_dist_all_gather(task_worlds):
    worlds = task_worlds(2)
    for p, ranks in worlds.items():
        for rank, result in enumerate(ranks):
            assert not result["all_gather"], f"world size {p}, rank {rank}: " + "; ".join(result["all_gather"][:4])


@pytest.mark.task(lesson=4, task=2, points=3, title="ring all-gather")
@pytest.mark.parametrize("p", [2, 3, 4])
def test_all_gather_forwards_p_minus_1_chunks_to_the_right(task_worlds, p):
    worlds = task_worlds(2)
    _assert_p_minus_1_chunks_to_the_right(worlds, p, "all_gather")


# ---- task 3: ring all-reduce ----------------------------------------------------------

@pytest.mark.task(lesson=4, task=3, points=5, title="ring all-reduce")
@pytest.mark.parametrize("p", AUDITED_SIZES)
def test_ring_matches_dist_all_reduce_and_every_call_sends_the_ring_pattern(audited, p):
    # values: against the inputs each rank drew this run, judged here; messages, of every
    # graded call (subgroups and tiny tensors included), recorded at the process group where
    # trace.paused() does not reach: no collective, messages only to the right neighbour,
    # chunks of ⌊n/p⌋ or ⌈n/p⌉, 2(p-1)/p·n elements per rank, 2(p-1) messages for n = RING_N
    _assert_audited(audited, 3, p, pattern=True)


@pytest.mark.task(lesson=4, task=3, points=5, title="ring all-reduce")
@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_sends_2_p_minus_1_over_p_of_the_tensor_per_rank(audited, p):
    theory = cost.cost("ring", RING_N * 4, p).bytes_per_rank      # 2(p-1)/p · n · itemsize
    total = 0
    for rank, records in enumerate(audited(3, p)):
        call = next(r for r in records if r.case == verify.Case(RING_N))
        sent = 4 * sum(e[2] for e in call.events if e[0] == "send")
        assert abs(sent - theory) <= 2 * 4, f"rank {rank} sent {sent} bytes, theory {theory:.0f}"
        total += sent
    assert total == 2 * (p - 1) * RING_N * 4


@pytest.mark.task(lesson=4, task=3, points=5, title="ring all-reduce")
def test_ring_rejects_an_expanded_tensor(impl):
    _assert_expanded_rejected(impl, "ring_all_reduce")


# ---- task 4: pipelined ring -----------------------------------------------------------

@pytest.mark.task(lesson=4, task=4, points=4, title="pipelined ring")
@pytest.mark.parametrize("p", AUDITED_SIZES)
def test_pipelined_ring_matches_dist_all_reduce_and_sends_pieces_to_the_right(audited, p):
    # as task 3's test; exactly 2(p-1)·pieces messages for n = PIPELINE_N
    _assert_audited(audited, 4, p, pattern=True)


@pytest.mark.task(lesson=4, task=4, points=4, title="pipelined ring")
@pytest.mark.parametrize("p", [3, 4])   # two reduce-scatter steps at least: one can overlap the other
def test_pipelined_ring_sends_a_piece_on_before_the_step_has_fully_arrived(task_worlds, p):
    worlds = task_worlds(4)
    for t in _traces(worlds, p, "pipelined"):
        sends, recvs = t.sends(), t.recvs()
        k = PIECES
        overlapped = [s for s in range(1, p - 1)
                      if min(e.t0 for e in sends[s * k:(s + 1) * k])
                      < max(e.t1 or math.inf for e in recvs[(s - 1) * k:s * k])]
        assert overlapped, (f"rank {t.rank}: every reduce-scatter step waited for all its pieces "
                            "before sending the first piece on: nothing is pipelined")


@pytest.mark.task(lesson=4, task=4, points=4, title="pipelined ring")
def test_pipelined_ring_rejects_an_expanded_tensor(impl):
    _assert_expanded_rejected(impl, "pipelined_ring_all_reduce")


# ---- task 5: recursive doubling -------------------------------------------------------

@pytest.mark.task(lesson=4, task=5, points=3, title="recursive doubling")
def test_recursive_doubling_matches_dist_all_reduce(audited):
    for p in WORLD_SIZES:
        _assert_audited(audited, 5, p, pattern=False)


@pytest.mark.task(lesson=4, task=5, points=3, title="recursive doubling")
@pytest.mark.parametrize("p", [2, 4])
def test_recursive_doubling_swaps_whole_tensors_with_rank_xor_2_to_the_k(task_worlds, p):
    worlds = task_worlds(5)
    for t in _traces(worlds, p, "recursive doubling"):
        peers = sorted(e.peer for e in t.sends())
        assert peers == sorted(t.rank ^ (1 << k) for k in range(int(math.log2(p)))), f"rank {t.rank}: {peers}"
        assert all(e.numel == POW2_N for e in t.sends())


@pytest.mark.task(lesson=4, task=5, points=3, title="recursive doubling")
def test_recursive_doubling_rejects_an_expanded_tensor(impl):
    _assert_expanded_rejected(impl, "recursive_doubling_all_reduce")


# ---- task 6: halving-doubling ---------------------------------------------------------

@pytest.mark.task(lesson=4, task=6, points=4, title="halving-doubling")
def test_halving_doubling_matches_dist_all_reduce_including_world_size_3(audited):
    for p in WORLD_SIZES:
        _assert_audited(audited, 6, p, pattern=False)


@pytest.mark.task(lesson=4, task=6, points=4, title="halving-doubling")
@pytest.mark.parametrize("p", [2, 4])
def test_halving_doubling_takes_2_log_p_steps_with_rank_xor_2_to_the_k(task_worlds, p):
    worlds = task_worlds(6)
    steps = int(math.log2(p))
    for t in _traces(worlds, p, "halving-doubling"):
        sends = t.sends()
        assert len(sends) == 2 * steps, f"rank {t.rank} sent {len(sends)} messages, expected 2·log2 p"
        assert sorted(e.peer for e in sends) == sorted(t.rank ^ (1 << k) for k in range(steps) for _ in (0, 1))
        # halving sends n/2, n/4, ...; doubling sends them back: the ring's bytes
        assert sorted(e.numel for e in sends) == sorted(POW2_N >> k for k in range(1, steps + 1) for _ in (0, 1))
        assert t.bytes_sent() == cost.cost("halving_doubling", POW2_N * 4, p).bytes_per_rank


@pytest.mark.task(lesson=4, task=6, points=4, title="halving-doubling")
def test_halving_doubling_rejects_an_expanded_tensor(impl):
    _assert_expanded_rejected(impl, "halving_doubling_all_reduce")


# ---- task 7: tree ---------------------------------------------------------------------

@pytest.mark.task(lesson=4, task=7, points=3, title="binary tree")
def test_tree_matches_dist_all_reduce(audited):
    for p in WORLD_SIZES:
        _assert_audited(audited, 7, p, pattern=False)


@pytest.mark.task(lesson=4, task=7, points=3, title="binary tree")
@pytest.mark.parametrize("p", [2, 3, 4])
def test_tree_sends_the_whole_tensor_once_up_and_once_down_each_edge(task_worlds, p):
    worlds = task_worlds(7)
    traces = _traces(worlds, p, "tree")
    edges = sorted([(c, (c - 1) // 2) for c in range(1, p)] + [((c - 1) // 2, c) for c in range(1, p)])
    assert sorted((e.rank, e.peer) for t in traces for e in t.sends()) == edges
    assert all(e.numel == RING_N for t in traces for e in t.sends())


@pytest.mark.task(lesson=4, task=7, points=3, title="binary tree")
def test_tree_rejects_an_expanded_tensor(impl):
    _assert_expanded_rejected(impl, "tree_all_reduce")


# ---- the reference's multi-ring (not an exercise task) --------------------------------

def _multi_ring_checks():
    from collectives.ring import multi_ring_all_reduce
    report = verify.check_all_reduce(multi_ring_all_reduce, verify.default_cases(dist.get_world_size(), quick=True))
    with trace.recording() as t:
        multi_ring_all_reduce(torch.ones(RING_N), channels=2)
    return report, t.to_dicts()


def test_multi_ring_matches_dist_all_reduce_and_uses_both_neighbours():
    p = 4
    results = launch.run(_multi_ring_checks, p, timeout=WORLD_TIMEOUT)
    for rank, (report, events) in enumerate(results):
        assert report.ok, report.summary()
        sends = trace.Trace.from_dicts(rank, events).sends()
        assert {e.peer for e in sends} == {(rank + 1) % p, (rank - 1) % p}   # one ring each way
        assert len(sends) == 2 * 2 * (p - 1)                                    # 2 channels × 2(p-1)


def test_an_avg_that_divides_the_whole_tensor_fails_the_ring_pattern():
    # lesson 4 asks for the own chunk to be divided (n/p divisions); the values of a whole
    # division are the same, so the graded pattern counts the divided elements
    target = "tests/cheats/avg_divides_the_whole_tensor.py:ring_all_reduce"
    cases = [verify.Case(1001, torch.float32, ReduceOp.AVG), verify.Case(1001, torch.float32, ReduceOp.SUM)]
    report = audit.check_graded(target, 3, cases, pattern=audit.ring_task_pattern(), timeout=WORLD_TIMEOUT)
    assert [r.case for r in report.failures] == ["n=1001 float32 AVG"] * 3, report.summary()
    assert "divided 1001 elements for AVG" in report.failures[0].detail
