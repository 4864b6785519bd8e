"""Lesson 2, the collectives built from send/recv: each against its ``dist.*`` twin.

For every function one world of 4 ranks runs the whole case list -- every root, six
dtypes, sizes 0, 1 and odd, the subgroup {1, 2, 3} (group ranks differ from global
ranks there), strided and transposed views -- comparing bit for bit with the twin on the
same integer-valued inputs, then records one traced call (root 1) for the pattern tests
and the answers to bad input, each rank in a group of its own (so that a rank refusing
its input leaves no peer waiting).
"""

import math

import pytest
import torch
import torch.distributed as dist

from collectives import basics, cost, launch, trace, verify  # basics registers its cost model
from collectives.course.catalog import world_timeout
from collectives.course.impl import resolve
from collectives.core.ops import ReduceOp

LESSON = 2
P = 4
SUBGROUP = (1, 2, 3)
ODD = 1001               # not divisible by 2, 3 or 4; 7 * 11 * 13, so it also transposes
PATTERN_ROOT = 1         # not rank 0: a root hard-wired to 0 shows up
WORLD_TIMEOUT = world_timeout(20)       # seconds; every world here finishes in a few


def _cases(ops_for=None):
    """(numel, dtype, root, group ranks or None, layout, op)."""
    cases = []
    ops_ = ops_for or (lambda dtype: [ReduceOp.SUM])
    for root in range(P):
        for dtype in verify.ALL_DTYPES:
            cases += [(ODD, dtype, root, None, "contiguous", op) for op in ops_(dtype)]
        for n in (0, 1):
            cases += [(n, torch.float32, root, None, "contiguous", ReduceOp.SUM),
                      (n, torch.int64, root, None, "contiguous", ReduceOp.MAX)]
    for root in SUBGROUP:
        cases += [(7, torch.float32, root, SUBGROUP, "contiguous", ReduceOp.SUM),
                  (7, torch.int32, root, SUBGROUP, "contiguous", ReduceOp.PRODUCT)]
    for root in (0, 2):
        cases += [(ODD, torch.float32, root, None, "strided", ReduceOp.SUM),
                  (ODD, torch.int64, root, None, "transposed", ReduceOp.MIN)]
    return cases


def _reduce_ops(dtype):
    ops_ = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
    return ops_ + ([ReduceOp.AVG] if dtype.is_floating_point else [])


def _inputs(case, seed):
    numel, dtype, _, _, layout, op = case
    return verify.make_input(verify.Case(numel, dtype, op, layout=layout), seed)


def _gaps_intact(base, layout):
    return base is None or layout != "strided" or bool((base[1::2] == verify.SENTINEL).all())


def _compare(name, expected, got, base=None, layout="contiguous"):
    problem = verify.compare(expected, got)
    if problem is None and not _gaps_intact(base, layout):
        problem = "wrote between the elements of a strided view"
    return None if problem is None else f"{name}: {problem}"


# ---- one case of each function against its twin, on this rank; returns a problem or None

def _case_broadcast(fn, case, group, me, grank, p):
    x, base = _inputs(case, grank)
    expected = x.contiguous().clone()
    with trace.paused():
        dist.broadcast(expected, src=case[2], group=group)
    fn(x, case[2], group=group)
    return _compare("broadcast", expected, x, base, case[4])


def _case_reduce(fn, case, group, me, grank, p):
    x, base = _inputs(case, grank)
    op = case[5]
    expected = x.contiguous().clone()
    with trace.paused():   # AVG: the sum, divided once (what ops.finish_ does)
        dist.reduce(expected, dst=case[2], op=ReduceOp.SUM if op == ReduceOp.AVG else op, group=group)
    if op == ReduceOp.AVG:
        expected.div_(p)
    fn(x, case[2], op, group=group)
    return _compare("reduce", expected, x, base, case[4]) if me == case[2] else None


def _case_scatter(fn, case, group, me, grank, p):
    x, base = _inputs(case, grank)
    pieces = None
    if me == case[2]:
        pieces = [_inputs(case[:4] + ("contiguous", case[5]), 10 + i)[0].reshape(x.shape) for i in range(p)]
    expected = torch.zeros(x.shape, dtype=x.dtype)
    with trace.paused():
        dist.scatter(expected, [t.clone() for t in pieces] if pieces else None, src=case[2], group=group)
    fn(x, pieces, case[2], group=group)
    return _compare("scatter", expected, x, base, case[4])


def _case_gather(fn, case, group, me, grank, p):
    x, _ = _inputs(case, grank)
    root = me == case[2]
    outs = [_inputs(case, 50 + i) for i in range(p)] if root else None
    expected = [torch.zeros(x.shape, dtype=x.dtype) for _ in range(p)] if root else None
    with trace.paused():
        dist.gather(x.contiguous().clone(), expected, dst=case[2], group=group)
    fn(x, [o for o, _ in outs] if root else None, case[2], group=group)
    if not root:
        return None
    for i, (out, base) in enumerate(outs):
        problem = _compare(f"gather_list[{i}]", expected[i], out, base, case[4])
        if problem:
            return problem
    return None


def _case_all_gather(fn, case, group, me, grank, p):
    x, _ = _inputs(case, grank)
    outs = [_inputs(case, 50 + i) for i in range(p)]
    expected = [torch.zeros(x.shape, dtype=x.dtype) for _ in range(p)]
    with trace.paused():
        dist.all_gather(expected, x.contiguous().clone(), group=group)
    fn([o for o, _ in outs], x, group=group)
    for i, (out, base) in enumerate(outs):
        problem = _compare(f"tensor_list[{i}]", expected[i], out, base, case[4])
        if problem:
            return problem
    return None


CASES = {
    "broadcast": (_case_broadcast, _cases()),
    "tree_broadcast": (_case_broadcast, _cases()),
    "reduce": (_case_reduce, _cases(_reduce_ops)),
    "scatter": (_case_scatter, _cases()),
    "gather": (_case_gather, _cases()),
    "all_gather": (_case_all_gather, _cases()),
}


def _pattern_call(name, fn, me, p, numel=ODD):
    """One traced call on float32 data, rooted at PATTERN_ROOT."""
    x = torch.full((numel,), float(me))
    root = PATTERN_ROOT
    with trace.recording() as t:
        if name in ("broadcast", "tree_broadcast"):
            fn(x, root)
        elif name == "reduce":
            fn(x, root, ReduceOp.SUM)
        elif name == "scatter":
            fn(x, [torch.full((numel,), float(i)) for i in range(p)] if me == root else None, root)
        elif name == "gather":
            fn(x, [torch.zeros(numel) for _ in range(p)] if me == root else None, root)
        elif name == "all_gather":
            fn([torch.zeros(numel) for _ in range(p)], x)
        else:
            fn(x)
    return [(e.kind, e.peer, e.nbytes) for e in t]


def _bad_input(name, fn, me, solo):
    """What ``fn`` says to bad input, each rank alone in its group: 'ValueError' or what happened."""
    other = (me + 1) % P
    x = torch.ones(3)
    tries = {
        "broadcast": {"root outside the group": lambda: fn(x, other, group=solo),
                      "expanded tensor": lambda: fn(torch.ones(1).expand(3), me, group=solo)},
        "reduce": {"unsupported op": lambda: fn(x, me, ReduceOp.BAND, group=solo),
                   "AVG on integers": lambda: fn(torch.ones(3, dtype=torch.int64), me, ReduceOp.AVG, group=solo),
                   "root outside the group": lambda: fn(x, other, ReduceOp.SUM, group=solo)},
        "scatter": {"scatter_list of the wrong length": lambda: fn(x, [x, x], me, group=solo),
                    "scatter_list missing on the root": lambda: fn(x, None, me, group=solo)},
        "gather": {"gather_list of the wrong length": lambda: fn(x, [], me, group=solo),
                   "gather_list of the wrong size": lambda: fn(x, [torch.ones(4)], me, group=solo)},
        "all_gather": {"tensor_list of the wrong length": lambda: fn([x, x], x, group=solo)},
    }
    tries["tree_broadcast"] = tries["broadcast"]
    out = {}
    for what, call in tries.get(name, {}).items():
        try:
            call()
            out[what] = "accepted"
        except ValueError:
            out[what] = "ValueError"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[what] = f"{type(exc).__name__}: {exc}"
    return out


def _world(spec, name):
    fn = resolve(f"{spec}:{name}")
    me, p = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group(list(SUBGROUP))
    solo = [dist.new_group([r]) for r in range(P)]
    out = {"problems": [], "pattern": None, "bad": {}, "cases": 0}
    if name == "all_reduce_via_reduce_broadcast":
        report = verify.check_all_reduce(fn, quick=False)
        out["problems"] = [f"[{r.case}] {r.detail}" for r in report.failures]
        out["cases"] = report.cases
        result = verify.check_expanded_rejected(fn)
        out["bad"]["expanded tensor"] = "ValueError" if result.ok else result.detail
    else:
        run_case, cases = CASES[name]
        for case in cases:
            ranks = case[3]
            if ranks is not None and me not in ranks:
                continue
            grank = ranks.index(me) if ranks else me
            size = len(ranks) if ranks else p
            problem = run_case(fn, case, sub if ranks else None, me, grank, size)
            if problem:
                out["problems"].append(f"[n={case[0]} {case[1]} root={case[2]} group={ranks} "
                                       f"{case[4]} {case[5]}] {problem}")
            out["cases"] += 1
        out["bad"] = _bad_input(name, fn, me, solo[me])
    out["pattern"] = _pattern_call(name, fn, me, p)
    if name == "tree_broadcast" and me in SUBGROUP:   # an odd group: 3 ranks, root = global 3
        x = torch.zeros(5)
        with trace.recording() as t:
            fn(x, 3, group=sub)
        out["pattern_sub"] = [(e.kind, e.peer, e.nbytes) for e in t]
    return out


def _world_fixture(name):
    @pytest.fixture(scope="module")
    def fixture(impl):
        try:
            return launch.run(_world, P, args=(impl, name), timeout=WORLD_TIMEOUT)
        except (launch.RankError, launch.WorldTimeout) as exc:
            return exc
    return fixture


broadcast_world = _world_fixture("broadcast")
reduce_world = _world_fixture("reduce")
scatter_world = _world_fixture("scatter")
gather_world = _world_fixture("gather")
all_gather_world = _world_fixture("all_gather")
all_reduce_world = _world_fixture("all_reduce_via_reduce_broadcast")
tree_world = _world_fixture("tree_broadcast")


def _results(world):
    if isinstance(world, Exception):
        pytest.fail(str(world).splitlines()[0] + "\n" + str(world)[-1500:], pytrace=False)
    return world


def _assert_matches_twin(world):
    results = _results(world)
    problems = [f"rank {r}: {p}" for r, out in enumerate(results) for p in out["problems"]]
    assert not problems, f"{len(problems)} mismatches with the dist twin, first ones:\n" + "\n".join(problems[:6])
    assert all(out["cases"] > 0 for out in results)


def _assert_rejects_bad_input(world):
    for rank, out in enumerate(_results(world)):
        wrong = {what: got for what, got in out["bad"].items() if got != "ValueError"}
        assert not wrong, f"rank {rank}: expected ValueError for {wrong}"


def _sends(events):
    return [(peer, n) for kind, peer, n in events if kind in trace.SENDS]


def _recvs(events):
    return [(peer, n) for kind, peer, n in events if kind in trace.RECVS]


def _assert_point_to_point_only(results):
    for rank, out in enumerate(results):
        used = {kind for kind, _, _ in out["pattern"] if kind in trace.COLLECTIVES}
        assert not used, f"rank {rank} called {used}: build it from send/recv, not from the twin"


ALL = set(range(P))
FULL = ODD * 4           # bytes of one float32 tensor of the pattern call


# --------------------------------------------------------------------------- task 1: broadcast

@pytest.mark.task(lesson=2, task=1, points=2, title="broadcast (linear)")
def test_broadcast_matches_dist_broadcast_for_every_root_dtype_size_group_and_view(broadcast_world):
    _assert_matches_twin(broadcast_world)


@pytest.mark.task(lesson=2, task=1, points=2, title="broadcast (linear)")
def test_broadcast_root_sends_p_minus_1_full_messages_and_others_receive_one(broadcast_world):
    results = _results(broadcast_world)
    _assert_point_to_point_only(results)
    root = results[PATTERN_ROOT]["pattern"]
    assert sorted(_sends(root)) == sorted((r, FULL) for r in ALL - {PATTERN_ROOT}) and not _recvs(root)
    for rank in ALL - {PATTERN_ROOT}:
        events = results[rank]["pattern"]
        assert _recvs(events) == [(PATTERN_ROOT, FULL)] and not _sends(events), f"rank {rank}"


@pytest.mark.task(lesson=2, task=1, points=2, title="broadcast (linear)")
def test_broadcast_rejects_a_root_outside_the_group_and_expanded_tensors(broadcast_world):
    _assert_rejects_bad_input(broadcast_world)


# --------------------------------------------------------------------------- task 2: reduce

@pytest.mark.task(lesson=2, task=2, points=3, title="reduce (linear, five ops)")
def test_reduce_matches_dist_reduce_on_the_root_for_every_op_root_dtype_and_view(reduce_world):
    _assert_matches_twin(reduce_world)


@pytest.mark.task(lesson=2, task=2, points=3, title="reduce (linear, five ops)")
def test_reduce_root_receives_one_message_from_every_other_rank(reduce_world):
    results = _results(reduce_world)
    _assert_point_to_point_only(results)
    root = results[PATTERN_ROOT]["pattern"]
    assert sorted(_recvs(root)) == sorted((r, FULL) for r in ALL - {PATTERN_ROOT}) and not _sends(root)
    for rank in ALL - {PATTERN_ROOT}:
        events = results[rank]["pattern"]
        assert _sends(events) == [(PATTERN_ROOT, FULL)] and not _recvs(events), f"rank {rank}"


@pytest.mark.task(lesson=2, task=2, points=3, title="reduce (linear, five ops)")
def test_reduce_rejects_bad_ops_avg_on_integers_and_foreign_roots(reduce_world):
    _assert_rejects_bad_input(reduce_world)


# --------------------------------------------------------------------------- task 3: scatter

@pytest.mark.task(lesson=2, task=3, points=2, title="scatter")
def test_scatter_matches_dist_scatter_for_every_root_dtype_size_group_and_view(scatter_world):
    _assert_matches_twin(scatter_world)


@pytest.mark.task(lesson=2, task=3, points=2, title="scatter")
def test_scatter_root_sends_each_other_rank_its_piece_once(scatter_world):
    results = _results(scatter_world)
    _assert_point_to_point_only(results)
    root = results[PATTERN_ROOT]["pattern"]
    assert sorted(_sends(root)) == sorted((r, FULL) for r in ALL - {PATTERN_ROOT}) and not _recvs(root)
    for rank in ALL - {PATTERN_ROOT}:
        assert _recvs(results[rank]["pattern"]) == [(PATTERN_ROOT, FULL)], f"rank {rank}"


@pytest.mark.task(lesson=2, task=3, points=2, title="scatter")
def test_scatter_rejects_a_wrong_or_missing_scatter_list_on_the_root(scatter_world):
    _assert_rejects_bad_input(scatter_world)


# --------------------------------------------------------------------------- task 4: gather

@pytest.mark.task(lesson=2, task=4, points=2, title="gather")
def test_gather_matches_dist_gather_for_every_root_dtype_size_group_and_view(gather_world):
    _assert_matches_twin(gather_world)


@pytest.mark.task(lesson=2, task=4, points=2, title="gather")
def test_gather_root_receives_one_message_from_every_other_rank(gather_world):
    results = _results(gather_world)
    _assert_point_to_point_only(results)
    root = results[PATTERN_ROOT]["pattern"]
    assert sorted(_recvs(root)) == sorted((r, FULL) for r in ALL - {PATTERN_ROOT}) and not _sends(root)
    for rank in ALL - {PATTERN_ROOT}:
        assert _sends(results[rank]["pattern"]) == [(PATTERN_ROOT, FULL)], f"rank {rank}"


@pytest.mark.task(lesson=2, task=4, points=2, title="gather")
def test_gather_rejects_a_wrong_gather_list_on_the_root(gather_world):
    _assert_rejects_bad_input(gather_world)


# --------------------------------------------------------------------------- task 5: all_gather

@pytest.mark.task(lesson=2, task=5, points=2, title="all_gather")
def test_all_gather_matches_dist_all_gather_for_every_dtype_size_group_and_view(all_gather_world):
    _assert_matches_twin(all_gather_world)


@pytest.mark.task(lesson=2, task=5, points=2, title="all_gather")
def test_all_gather_sends_one_message_to_and_receives_one_from_every_other_rank(all_gather_world):
    results = _results(all_gather_world)
    _assert_point_to_point_only(results)
    for rank, out in enumerate(results):
        others = sorted((r, FULL) for r in ALL - {rank})
        assert sorted(_sends(out["pattern"])) == others, f"rank {rank} sent {_sends(out['pattern'])}"
        assert sorted(_recvs(out["pattern"])) == others, f"rank {rank}"


@pytest.mark.task(lesson=2, task=5, points=2, title="all_gather")
def test_all_gather_rejects_a_tensor_list_of_the_wrong_length(all_gather_world):
    _assert_rejects_bad_input(all_gather_world)


# --------------------------------------------------------------------------- task 6: reduce + broadcast

@pytest.mark.task(lesson=2, task=6, points=2, title="all-reduce = reduce + broadcast")
def test_reduce_broadcast_all_reduce_passes_the_equivalence_harness(all_reduce_world):
    _assert_matches_twin(all_reduce_world)
    _assert_rejects_bad_input(all_reduce_world)


@pytest.mark.task(lesson=2, task=6, points=2, title="all-reduce = reduce + broadcast")
def test_reduce_broadcast_goes_through_rank_0_in_2_p_minus_1_messages(all_reduce_world):
    results = _results(all_reduce_world)
    _assert_point_to_point_only(results)
    zero = results[0]["pattern"]
    assert sorted(_recvs(zero)) == sorted(_sends(zero)) == [(r, FULL) for r in range(1, P)]
    for rank in range(1, P):
        events = results[rank]["pattern"]
        assert _sends(events) == _recvs(events) == [(0, FULL)], f"rank {rank}"
    sent = max(sum(n for _, n in _sends(out["pattern"])) for out in results)
    assert sent == cost.cost("reduce_broadcast", FULL, P).bytes_per_rank


# --------------------------------------------------------------------------- task 7: tree broadcast

@pytest.mark.task(lesson=2, task=7, points=2, title="broadcast along a binomial tree")
def test_tree_broadcast_matches_dist_broadcast_for_every_root_dtype_size_group_and_view(tree_world):
    _assert_matches_twin(tree_world)
    _assert_rejects_bad_input(tree_world)


@pytest.mark.task(lesson=2, task=7, points=2, title="broadcast along a binomial tree")
def test_tree_broadcast_root_sends_log2_p_messages_and_everyone_else_receives_once(tree_world):
    results = _results(tree_world)
    _assert_point_to_point_only(results)
    for pattern, ranks, root in (("pattern", range(P), PATTERN_ROOT), ("pattern_sub", SUBGROUP, 3)):
        events = {r: results[r][pattern] for r in ranks}
        assert len(_sends(events[root])) == math.ceil(math.log2(len(ranks))) and not _recvs(events[root])
        for rank in set(ranks) - {root}:
            assert len(_recvs(events[rank])) == 1, f"rank {rank} must receive exactly once"
        assert sum(len(_sends(e)) for e in events.values()) == len(ranks) - 1


@pytest.mark.task(lesson=2, task=7, points=2, title="broadcast along a binomial tree")
def test_tree_broadcast_follows_the_binomial_tree(tree_world):
    # relative rank v receives from v minus its highest bit; root 1 of 4: 1->2, then 1->3, 2->0
    results = _results(tree_world)
    edges = {(rank, peer) for rank in range(P) for peer, _ in _sends(results[rank]["pattern"])}
    assert edges == {(1, 2), (1, 3), (2, 0)}


# --------------------------------------------------------------------------- the tour and the cost model

def test_tour_of_collectives_shows_each_collective_on_every_rank():
    rows = launch.run(basics.tour_of_collectives, P, timeout=WORLD_TIMEOUT)
    by_name = [{row["collective"]: row for row in rank_rows} for rank_rows in rows]
    names = {"broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather",
             "reduce_scatter", "all_to_all", "barrier", "subgroups", "async_op"}
    assert names <= set(by_name[0])
    assert all(r["broadcast"]["after"] == [0, 0] for r in by_name)
    assert by_name[0]["reduce"]["after"] == [10, 10]
    # chunk j of rank i lands as chunk i of rank j: rank j's chunk 1 is rank 1's chunk j = 10 + j
    assert [r["all_to_all"]["after"][1] for r in by_name] == [[10, 10], [11, 11], [12, 12], [13, 13]]
    assert [r["subgroups"]["after"] for r in by_name] == [[4, 4], [6, 6], [4, 4], [6, 6]]


def test_reduce_broadcast_cost_model_is_registered_for_the_tour():
    c = cost.cost("reduce_broadcast", 1000, 4)
    assert (c.steps, c.bytes_on_path, c.bytes_per_rank) == (6, 6000, 3000)
    assert cost.cost("reduce_broadcast", 1000, 1).steps == 0
    from collectives.course.tour import entries
    assert [e.model for e in entries() if e.lesson == 2] == ["reduce_broadcast"]
    linear, tree = basics.broadcast_cost(1000, 8), basics.broadcast_cost(1000, 8, tree=True)
    assert (linear.steps, tree.steps) == (7, 3)


# --------------------------------------------------------------------------- on GPUs (NCCL)

def _nccl_world():
    me, p = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    problems = []

    def same(name, ours, theirs):
        if not torch.equal(ours, theirs):
            problems.append(f"rank {me} {name}: {ours.tolist()} != {theirs.tolist()}")

    for root in range(p):
        for dtype in (torch.float32, torch.int64):
            x = (torch.arange(5, device=device) + 10 * me).to(dtype)
            for name, ours in (("broadcast", basics.broadcast), ("tree_broadcast", basics.tree_broadcast)):
                a, b = x.clone(), x.clone()
                ours(a, root)
                dist.broadcast(b, root)
                same(name, a, b)
            a, b = x.clone(), x.clone()
            basics.reduce(a, root, ReduceOp.MAX)
            dist.reduce(b, root, op=ReduceOp.MAX)
            if me == root:
                same("reduce", a, b)
            pieces = [torch.full((5,), 100 * i + root, dtype=dtype, device=device) for i in range(p)]
            a, b = torch.zeros_like(x), torch.zeros_like(x)
            basics.scatter(a, pieces if me == root else None, root)
            dist.scatter(b, [t.clone() for t in pieces] if me == root else None, src=root)
            same("scatter", a, b)
            outs = [[torch.zeros_like(x) for _ in range(p)] for _ in range(2)]
            basics.gather(x, outs[0] if me == root else None, root)
            dist.gather(x.clone(), outs[1] if me == root else None, dst=root)
            if me == root:
                same("gather", torch.stack(outs[0]), torch.stack(outs[1]))
            outs = [[torch.zeros_like(x) for _ in range(p)] for _ in range(2)]
            basics.all_gather(outs[0], x)
            dist.all_gather(outs[1], x.clone())
            same("all_gather", torch.stack(outs[0]), torch.stack(outs[1]))
    report = verify.check_all_reduce(basics.all_reduce_via_reduce_broadcast, quick=True)
    problems += [f"rank {me} reduce+broadcast [{r.case}] {r.detail}" for r in report.failures]
    rows = basics.tour_of_collectives()
    return problems, [row["collective"] for row in rows]


@pytest.mark.gpu
def test_hand_built_collectives_match_their_twins_on_nccl():
    results = launch.run(_nccl_world, 2, backend="nccl", timeout=150)
    problems = [p for rank_problems, _ in results for p in rank_problems]
    assert not problems, "\n".join(problems[:10])
    assert "all_to_all" in results[0][1]
