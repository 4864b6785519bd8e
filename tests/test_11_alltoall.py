"""Lesson 11, all-to-all and MoE dispatch: the reference against ``dist.all_to_all_single``.

The graded tasks (pairwise, Bruck, the sizes' exchange, the uneven all-to-all, the MoE
dispatch and combine) are judged by :mod:`collectives.course.grading.tasks.lesson11`
outside the ranks; ``tests/test_grader.py`` runs those judges on the reference, the stubs,
every partial solution and the cheat. Here, each in one world: every algorithm equal to
the library bit for bit on every dtype and world size 1-6, their messages as the design
says, the hierarchy's one message per machine pair, the MoE layer equal to its
single-process twin in output and every gradient, bad input refused before any message,
and the judges failing the designs they exist to tell apart.
"""

import math

import pytest
import torch
import torch.distributed as dist

from collectives import launch, trace
from collectives.core.cluster import unavailable_reason as cluster_reason
from collectives.course.catalog import world_timeout
from collectives.course.grading.tasks import Grading, lesson11

LESSON = 11
WORLD_TIMEOUT = world_timeout()
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.int8, torch.uint8, torch.bool, torch.complex64)
ALGORITHMS = ("linear_all_to_all", "pairwise_all_to_all", "bruck_all_to_all")


def _values(rank, n, dtype, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(-60, 60, (n,), generator=g).to(dtype)


def _library(output, input, out_splits=None, in_splits=None):
    dist.all_to_all_single(output, input, out_splits, in_splits)
    return output


def _equality_checks():
    """(algorithm, case) pairs whose output differs from dist.all_to_all_single's."""
    import collectives.alltoall as a2a
    r, p = dist.get_rank(), dist.get_world_size()
    wrong = []
    shapes = [(dtype, 3 * p, 2) for dtype in DTYPES]                       # every dtype
    shapes += [(torch.int64, 0, 3), (torch.int64, p, 1), (torch.int32, 2 * p, 7)]   # 7: blocks of odd size
    for dtype, rows, width in shapes:
        x = _values(r, rows * width, dtype, salt=rows).view(rows, width)
        expected = _library(torch.empty_like(x), x)
        for name in ALGORITHMS:
            got = torch.full_like(x, 1)
            getattr(a2a, name)(got, x)
            if not torch.equal(got, expected):
                wrong.append((name, str(dtype), rows, width))
    # uneven splits that do not divide, empty blocks among them, rows of two dimensions
    in_splits = [(3 * r + 5 * d) % 4 for d in range(p)]
    out_splits = [(3 * s + 5 * r) % 4 for s in range(p)]
    x = _values(r, sum(in_splits) * 6, torch.int64).view(-1, 2, 3)
    expected = _library(torch.empty(sum(out_splits), 2, 3, dtype=torch.int64), x, out_splits, in_splits)
    for name in ALGORITHMS:
        got = torch.zeros_like(expected)
        getattr(a2a, name)(got, x, out_splits, in_splits)
        if not torch.equal(got, expected):
            wrong.append((name, "uneven"))
    if a2a.exchange_splits(in_splits) != out_splits:
        wrong.append(("exchange_splits", in_splits))
    got, sizes = a2a.all_to_all_uneven(x, in_splits)
    if not torch.equal(got, expected) or sizes != out_splits:
        wrong.append(("all_to_all_uneven", sizes))
    # a strided input and a strided output
    x = _values(r, 4 * p * 3, torch.float32).view(3, 4 * p).t()
    expected = _library(torch.empty(4 * p, 3), x.contiguous())
    for name in ALGORITHMS:
        got = torch.zeros(3, 4 * p).t()
        getattr(a2a, name)(got, x)
        if not torch.equal(got, expected):
            wrong.append((name, "strided"))
    # every machine layout of p ranks
    x = _values(r, 2 * p * 3, torch.int32).view(2 * p, 3)
    expected = _library(torch.empty_like(x), x)
    for D in (d for d in range(1, p + 1) if p % d == 0):
        got = torch.zeros_like(x)
        a2a.hierarchical_all_to_all(got, x, layout=(D, p // D))
        if not torch.equal(got, expected):
            wrong.append(("hierarchical", D))
    return wrong


def test_every_all_to_all_equals_the_library_bit_for_bit_on_1_to_6_ranks():
    for p in range(1, 7):
        results = launch.run(_equality_checks, p, timeout=WORLD_TIMEOUT)
        assert results == [[]] * p, f"world of {p}: {results}"


def _patterns():
    import collectives.alltoall as a2a
    p = dist.get_world_size()
    x = torch.arange(p * 4, dtype=torch.float32).view(p * 4, 1)
    out = {}
    for name in ALGORITHMS + ("hierarchical_all_to_all",):
        kwargs = {"layout": (2, p // 2)} if name == "hierarchical_all_to_all" else {}
        with trace.recording() as t:
            getattr(a2a, name)(torch.empty_like(x), x, **kwargs)
        out[name] = [(e.kind, e.peer, e.numel) for e in t if e.kind in ("isend", "irecv", "send", "recv")]
    return out


@pytest.mark.parametrize("p", [4, 6])
def test_each_algorithm_sends_the_messages_its_design_says(p):
    from collectives.alltoall import cost
    from collectives.alltoall.flat import pairwise_schedule
    for r, seen in enumerate(launch.run(_patterns, p, timeout=WORLD_TIMEOUT)):
        block = 4
        sends = {name: [(peer, n) for kind, peer, n in msgs if kind.endswith("send")] for name, msgs in seen.items()}
        # linear: all p − 1 receives posted before the first send
        kinds = [kind for kind, _, _ in seen["linear_all_to_all"]]
        assert kinds == ["irecv"] * (p - 1) + ["isend"] * (p - 1)
        # pairwise: one round at a time, the schedule's partner each way (xor at p = 4)
        schedule = pairwise_schedule(r, p)
        assert [peer for peer, _ in sends["pairwise_all_to_all"]] == [to for to, _ in schedule]
        if p == 4:
            assert schedule == [(r ^ k, r ^ k) for k in (1, 2, 3)]
        # all three send (p − 1)/p of the input, Bruck more, in ⌈log2 p⌉ messages to rank + 2^k
        for name in ("linear_all_to_all", "pairwise_all_to_all"):
            assert sum(n for _, n in sends[name]) == (p - 1) * block == cost.pairwise(4 * p * 4, p).bytes_per_rank / 4
        bruck = sends["bruck_all_to_all"]
        assert [peer for peer, _ in bruck] == [(r + (1 << k)) % p for k in range(math.ceil(math.log2(p)))]
        assert sum(n for _, n in bruck) * 4 == cost.bruck(4 * p * 4, p).bytes_per_rank
        # the hierarchy on (2, p/2): across machines, one message per machine pair this rank carries
        machine = r // 2
        across = [peer for peer, _ in sends["hierarchical_all_to_all"] if peer // 2 != machine]
        carried = [m for m in range(p // 2) if m != machine and m % 2 == r % 2]
        assert sorted(across) == sorted(m * 2 + machine % 2 for m in carried)
        assert all(n == 2 * 2 * block for peer, n in sends["hierarchical_all_to_all"] if peer // 2 != machine)


def _bad_calls():
    import collectives.alltoall as a2a
    p = dist.get_world_size()
    x = torch.zeros(2 * p + 1, 3)
    errors = []
    for call in (lambda: a2a.pairwise_all_to_all(torch.empty_like(x), x),                  # rows do not divide
                 lambda: a2a.linear_all_to_all(torch.empty(p, 3), torch.zeros(p, 3, dtype=torch.int64)),
                 lambda: a2a.bruck_all_to_all(torch.empty(p, 2), torch.zeros(p, 3)),
                 lambda: a2a.pairwise_all_to_all(torch.empty(2, 3), torch.zeros(2, 3), [2] + [0] * (p - 1),
                                                 [1] * p),                                   # sizes add up wrong
                 lambda: a2a.pairwise_all_to_all(torch.empty(2, 3), torch.zeros(2, 3), [2], [2]),
                 lambda: a2a.exchange_splits([1.5] * p),
                 lambda: a2a.hierarchical_all_to_all(torch.empty(p, 1), torch.zeros(p, 1), layout=(3, 3)),
                 lambda: a2a.MoELayer(4, 4, num_experts=p + 1 if p > 1 else 0)):
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    # and the world still works: nothing was half-sent
    y = torch.empty(p, 1)
    a2a.pairwise_all_to_all(y, torch.full((p, 1), float(dist.get_rank())))
    return errors, y.view(-1).tolist()


def test_bad_input_is_refused_before_any_message_and_the_world_goes_on():
    p = 3
    for errors, after in launch.run(_bad_calls, p, timeout=WORLD_TIMEOUT):
        assert all(errors), errors
        assert "7 rows do not split into 3 equal blocks; pass output_split_sizes" in errors[0]
        assert "output is torch.float32 but its input is torch.int64" in errors[1]
        assert "input rows (3,) and output rows (2,) differ" in errors[2]
        assert "add up to 2 rows" in errors[3] or "add up to 3 rows" in errors[3]
        assert "must be 3 non-negative integers" in errors[4] and "must be 3 non-negative" in errors[5]
        assert "layout (D=3, M=3) has 9 ranks" in errors[6]
        assert "must split evenly over 3 ranks" in errors[7]
        assert after == [0.0, 1.0, 2.0]


def _plans():
    """Calls that find their plan: the same buffers with new data, strided buffers, uneven
    splits whose relayed sizes change, then the buffers freed (the plan goes with them)."""
    import gc

    import collectives.alltoall as a2a
    from collectives.alltoall import plan as plans
    r, p = dist.get_rank(), dist.get_world_size()
    wrong = []
    plans.clear_plans()
    names = ALGORITHMS + ("hierarchical_all_to_all",)
    x = torch.zeros(3 * p, 2, dtype=torch.int64)
    outs = {name: torch.empty_like(x) for name in names}
    strided_in, strided_out = torch.zeros(2, 4 * p, dtype=torch.int64).t(), torch.zeros(2, 4 * p, dtype=torch.int64).t()
    for call in range(3):                              # 1st call makes the plans, 2nd and 3rd find them
        x.copy_(_values(r, x.numel(), torch.int64, salt=call).view_as(x))
        expected = _library(torch.empty_like(x), x)
        for name in names:
            kwargs = {"layout": (2, p // 2)} if name == "hierarchical_all_to_all" else {}
            with trace.recording() as t:
                getattr(a2a, name)(outs[name], x, **kwargs)
            if not torch.equal(outs[name], expected):
                wrong.append((name, call))
            messages = [(e.kind, e.peer, e.numel, e.label) for e in t if e.kind in ("isend", "irecv")]
            if call == 0:
                outs[name + " trace"] = messages
            elif messages != outs[name + " trace"]:
                wrong.append((name, call, "trace differs"))
        strided_in.copy_(_values(r, strided_in.numel(), torch.int64, salt=call).view_as(strided_in))
        expected = _library(torch.empty(4 * p, 2, dtype=torch.int64), strided_in.contiguous())
        for name in ALGORITHMS:
            strided_out.zero_()
            getattr(a2a, name)(strided_out, strided_in)
            if not torch.equal(strided_out, expected):
                wrong.append((name, "strided", call))
    hits = plans.cached_plans()
    # Bruck relays the block from rank 0 to rank 3 through rank 1: rank 1 calls with the same
    # buffers and splits each time while the size it relays changes
    buffers = {}
    for call, far in enumerate((1, 3, 0)):
        ins = [1, 2, 1, far] if r == 0 else [2, 1, 1, 2]
        outs_ = a2a.exchange_splits(ins)
        x = buffers.setdefault(("in", sum(ins)), torch.zeros(sum(ins), 1, dtype=torch.int64))
        got = buffers.setdefault(("out", sum(outs_)), torch.zeros(sum(outs_), 1, dtype=torch.int64))
        x.copy_(_values(r, sum(ins), torch.int64, salt=call).view(-1, 1))
        expected = _library(torch.empty(sum(outs_), 1, dtype=torch.int64), x, outs_, ins)
        got.zero_()
        a2a.bruck_all_to_all(got, x, outs_, ins)
        if not torch.equal(got, expected):
            wrong.append(("bruck relayed sizes", call))
    # a call that does not match its plan is checked again
    try:
        a2a.linear_all_to_all(outs["linear_all_to_all"], torch.zeros(3 * p, 2, dtype=torch.int32))
        wrong.append("a changed dtype passed")
    except TypeError as exc:
        if "int64 but its input is torch.int32" not in str(exc):
            wrong.append(str(exc))
    before = plans.cached_plans()
    del x, outs, strided_in, strided_out, expected, got, buffers
    gc.collect()
    return wrong, hits, before, plans.cached_plans()


def test_plans_are_reused_exactly_and_go_with_their_buffers():
    for wrong, hits, before, after in launch.run(_plans, 4, timeout=WORLD_TIMEOUT):
        assert wrong == []
        assert hits == 4 + 3                   # one plan per algorithm and buffers, the strided ones too
        assert before > after == 0, (before, after)


def _moe_twin(k: int, factor: float, skew: float):
    from collectives.alltoall import MoELayer, make_expert, make_router, moe_reference
    r, p = dist.get_rank(), dist.get_world_size()
    H, F, E, T = 8, 12, 2 * p, 10
    xs = [torch.randn(T, H, generator=torch.Generator().manual_seed(50 + s)) for s in range(p)]
    targets = [torch.randn(T, H, generator=torch.Generator().manual_seed(90 + s)) for s in range(p)]
    bias = torch.linspace(skew, 0, E)
    layer = MoELayer(H, F, E, k=k, capacity_factor=factor, seed=7)
    layer.logit_bias.copy_(bias)
    x = xs[r].clone().requires_grad_()
    out = layer(x)
    (out * targets[r]).sum().backward()
    # the same layer in one process: every rank's tokens, one router copy per rank, every expert
    twin_x = [t.clone().requires_grad_() for t in xs]
    routers = [make_router(7, H, E).requires_grad_() for _ in range(p)]
    experts = [tuple(w.requires_grad_() for w in make_expert(7, e, H, F)) for e in range(E)]
    outs, dropped = moe_reference(twin_x, routers, experts, k, factor, bias)
    sum((o * t).sum() for o, t in zip(outs, targets)).backward()
    mine = range(layer.first, layer.first + layer.local)
    same = {"output": torch.equal(out, outs[r]), "input grad": torch.equal(x.grad, twin_x[r].grad),
            "router grad": torch.equal(layer.router.grad, routers[r].grad),
            "expert grads": all(torch.equal(layer.w1[i].grad, experts[e][0].grad)
                                and torch.equal(layer.w2[i].grad, experts[e][1].grad) for i, e in enumerate(mine))}
    return same, layer.stats["dropped"], dropped[r], layer.stats["received"], float(out.abs().sum())


@pytest.mark.parametrize("k,factor,skew", [(2, 1.0, 0.0), (1, 0.5, 3.0)])
def test_the_moe_layer_equals_its_single_process_twin_bit_for_bit_with_its_gradients(k, factor, skew):
    # top-2 at capacity 1.0, and top-1 at half capacity with routing skewed to expert 0: drops
    results = launch.run(_moe_twin, 3, args=(k, factor, skew), timeout=WORLD_TIMEOUT)
    for rank, (same, dropped, twin_dropped, received, magnitude) in enumerate(results):
        assert all(same.values()), (rank, same)
        assert dropped == twin_dropped and magnitude > 0
    kept = sum(r[3] for r in results)
    dropped = sum(r[1] for r in results)
    assert kept + dropped == 3 * 10 * k                 # every (token, choice) either sent or counted
    if factor < 1:
        assert dropped > 0


def test_the_cost_model_counts_bruck_blocks_and_a_finite_crossover():
    from collectives.alltoall import cost
    from collectives.core.cost import AlphaBeta, TwoTier
    assert [cost.bruck_blocks(p) for p in (1, 2, 3, 4, 8)] == [0, 1, 2, 4, 12]
    link = AlphaBeta(alpha=20e-6, beta=1e-9)
    crossover = cost.bruck_crossover(8, link)
    assert 0 < crossover < float("inf")
    assert cost.predict("bruck", crossover / 4, 8, link) < cost.predict("pairwise", crossover / 4, 8, link)
    assert cost.predict("bruck", crossover * 4, 8, link) > cost.predict("pairwise", crossover * 4, 8, link)
    cluster = TwoTier(inside=AlphaBeta(5e-6, 1e-10), across=AlphaBeta(1e-3, 8e-9), machines=2, ranks_per_machine=2)
    assert cost.hierarchical_seconds(4 << 10, cluster) < cost.flat_seconds(4 << 10, cluster)   # α-bound: fewer msgs


def test_the_judges_tell_linear_from_pairwise_and_pairwise_from_bruck():
    grading = Grading("collectives.alltoall", timeout=WORLD_TIMEOUT, world_size=3)
    linear = lesson11._judge_flat(grading, "linear_all_to_all", True, lesson11.pairwise_pattern)
    assert linear.problems and "round 1" in linear.problems[0], linear.problems
    # at p = 3 Bruck's two messages are pairwise's (one block to rank + 1, one to rank + 2): four tells them apart
    grading = Grading("collectives.alltoall", timeout=WORLD_TIMEOUT, world_size=4)
    pairwise = lesson11._judge_flat(grading, "pairwise_all_to_all", False, lesson11.bruck_pattern)
    assert pairwise.problems and "round k sends the blocks whose bit k" in pairwise.problems[0], pairwise.problems


def _on_gpus():
    """Every all-to-all on GPU tensors under NCCL, against the library, and the MoE layer's dispatch."""
    import collectives.alltoall as a2a
    from collectives import ops
    r, p = dist.get_rank(), dist.get_world_size()
    dev = ops.rank_device()
    x = (torch.arange(p * 6, device=dev) + 100 * r).view(p * 3, 2)
    want = torch.empty_like(x)
    dist.all_to_all_single(want, x)
    wrong = []
    for name in ALGORITHMS:
        got = torch.zeros_like(x)
        getattr(a2a, name)(got, x)
        wrong += [] if torch.equal(got, want) else [name]
    got = torch.zeros_like(x)
    a2a.hierarchical_all_to_all(got, x, layout=(1, p))
    wrong += [] if torch.equal(got, want) else ["hierarchical"]
    ins = [(r + d) % 3 for d in range(p)]
    out, sizes = a2a.all_to_all_uneven(torch.ones(sum(ins), 4, device=dev) * r, ins)
    wrong += [] if sizes == [(s + r) % 3 for s in range(p)] and out.shape[0] == sum(sizes) else ["uneven"]
    return wrong


@pytest.mark.gpu
def test_every_all_to_all_on_nccl_with_gpu_tensors():
    assert launch.run(_on_gpus, 2, backend="nccl", timeout=120) == [[], []]


def test_the_host_suite_replays_each_calls_messages_and_compares_with_a_record(tmp_path):
    import json

    from collectives.course.benchmarks import alltoall as bench
    argv = ["host", "--ranks", "2", "--calls", "3", "--repeats", "1", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    first = json.loads((tmp_path / "bench-alltoall-host.json").read_text())
    rows = {r["name"]: r for r in first["rows"]}
    assert all(r["verified"] for r in first["rows"]) and set(rows) == {"dist.all_to_all_single", "linear",
                                                                        "pairwise", "bruck"}
    assert rows["linear"]["messages"] == 1 and rows["bruck"]["messages"] == 1      # p = 2: one block each way
    assert rows["dist.all_to_all_single"]["floor_seconds"] is None                 # its messages are its C++'s
    assert all(rows[n]["floor_seconds"] > 0 and rows[n]["untraced_floor_seconds"] > 0 for n in ("linear", "bruck"))
    assert {r["name"] for r in first["alone"]} == set(rows) | {"hierarchical"}      # one rank: nothing sent
    assert all(r["messages"] == 0 and r["verified"] for r in first["alone"])
    assert rows["linear"]["python_calls"]["lesson"] > 0 and rows["linear"]["python_calls"]["core"] > 0
    (tmp_path / "before.json").write_text(json.dumps(first))
    assert bench.main(argv + ["--before", str(tmp_path / "before.json")]) == 0
    again = json.loads((tmp_path / "bench-alltoall-host.json").read_text())
    assert again["before"]["rows"] == first["rows"]
    for name in ("linear", "pairwise", "bruck"):
        ratio = again["ratios"][name]
        now = {r["name"]: r for r in again["rows"]}[name]
        assert ratio["host"] == pytest.approx(rows[name]["host_seconds"] / now["host_seconds"])


def _moved_away(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A buffer whose storage then moves (``share_memory_`` gives it new memory, as a
    ``resize_`` may) and a new tensor at the address it had: the case where an address alone
    names the wrong memory. The old memory stays valid (numpy owns it), so the case is exact."""
    array = values.numpy().copy()
    planned = torch.from_numpy(array)
    return planned, array


def _no_silent_wrong_answers():
    """Each call once gave a wrong answer and no error; each must now be right or raise."""
    import collectives.alltoall as a2a
    from collectives.alltoall import plan as plans
    r, p = dist.get_rank(), dist.get_world_size()
    plans.clear_plans()
    wrong = []
    rows = 2 * p
    for name in ALGORITHMS + ("hierarchical_all_to_all",):
        fn = getattr(a2a, name)
        call = (lambda o, i, fn=fn: fn(o, i, layout=(2, p // 2))) if name.startswith("hier") else fn
        # a planned input whose storage moved, a new tensor at its old address: the new one's data must go
        x, array = _moved_away(_values(r, rows * 3, torch.int64).view(rows, 3))
        out = torch.zeros(rows, 3, dtype=torch.int64)
        call(out, x)
        x.share_memory_()
        array[:] = _values(r, rows * 3, torch.int64, salt=9).view(rows, 3).numpy()
        fresh = torch.from_numpy(array)
        call(out, fresh)
        if not torch.equal(out, _library(torch.empty_like(fresh), fresh)):
            wrong.append((name, "moved input"))
        # the same with the output: the new tensor at its old address must be written
        y, array = _moved_away(torch.zeros(rows, 3, dtype=torch.int64))
        call(y, fresh)
        y.share_memory_()
        target = torch.from_numpy(array)
        target.fill_(-1)
        call(target, fresh)
        if not torch.equal(target, _library(torch.empty_like(fresh), fresh)):
            wrong.append((name, "moved output"))
        # a lazily conjugated input, alone and after its unconjugated twin (the same addresses)
        z = torch.complex(_values(r, 2 * p, torch.float32), _values(r, 2 * p, torch.float32, salt=3)).view(p, 2)
        for given in (z.conj(), z, z.conj(), -z.conj()):
            got = torch.zeros(p, 2, dtype=torch.complex64)
            call(got, given)
            if not torch.equal(got, _library(torch.empty(p, 2, dtype=torch.complex64), given.resolve_conj()
                                             .resolve_neg())):
                wrong.append((name, "conj", given.is_conj(), given.is_neg()))
        into = torch.zeros(p, 2, dtype=torch.complex64).conj()             # a conjugated output reads back right
        call(into, z)
        if not torch.equal(into.resolve_conj(), _library(torch.empty(p, 2, dtype=torch.complex64), z)):
            wrong.append((name, "conj output"))
    errors = []
    # Bruck given an output of the wrong size (equal blocks): an error, as the others give
    for out_rows in (p, 4 * p):
        try:
            a2a.bruck_all_to_all(torch.empty(out_rows, 3), torch.zeros(2 * p, 3))
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    # Bruck with rank 0 sending rank 1 five rows where rank 1 expects three: every rank raises
    ins = [5 if (r, d) == (0, 1) else 3 for d in range(p)]
    outs = [3] * p
    try:
        a2a.bruck_all_to_all(torch.empty(sum(outs), 2), torch.zeros(sum(ins), 2), outs, ins)
        errors.append(None)
    except ValueError as exc:
        errors.append(str(exc))
    after = torch.empty(p, 1)
    a2a.bruck_all_to_all(after, torch.full((p, 1), float(r)))
    return wrong, errors, after.view(-1).tolist()


def test_moved_buffers_conjugates_wrong_sizes_and_mismatched_pairs_are_never_silent():
    for wrong, errors, after in launch.run(_no_silent_wrong_answers, 4, timeout=WORLD_TIMEOUT):
        assert wrong == []
        assert all(errors), errors
        assert "equal blocks need as many output rows as input rows, got 4 and 8" in errors[0]
        assert "got 16 and 8" in errors[1]
        assert "group rank 0 sends group rank 1 5 rows but rank 1 expects 3" in errors[2]
        assert after == [0.0, 1.0, 2.0, 3.0]


def _checked_mismatches():
    """Check mode on: calls whose ranks disagree raise ArgumentMismatch on every rank."""
    import collectives.alltoall as a2a
    from collectives.core.checkmode import ArgumentMismatch
    r, p = dist.get_rank(), dist.get_world_size()
    calls = []
    for name in ALGORITHMS:
        fn = getattr(a2a, name)
        ins = [5 if (r, d) == (0, 1) else 3 for d in range(p)]          # rank 1 expects 3 from rank 0
        calls.append(lambda fn=fn, ins=ins: fn(torch.empty(3 * p, 2), torch.zeros(sum(ins), 2), [3] * p, ins))
        dtype = torch.int32 if r == 2 else torch.float32                 # splits given, dtypes differ
        calls.append(lambda fn=fn, dtype=dtype: fn(torch.empty(p, 2, dtype=dtype), torch.zeros(p, 2, dtype=dtype),
                                                   [1] * p, [1] * p))
        width = 3 if r == 1 else 2                                        # rows of different shapes
        calls.append(lambda fn=fn, width=width: fn(torch.empty(p, width), torch.zeros(p, width), [1] * p, [1] * p))
    layout = (2, 2) if r < 2 else (4, 1)
    calls.append(lambda: a2a.hierarchical_all_to_all(torch.empty(p, 1), torch.zeros(p, 1), layout=layout))
    errors = []
    for call in calls:
        try:
            call()
            errors.append(None)
        except ArgumentMismatch as exc:
            errors.append(str(exc))
    after = torch.empty(p, 1)
    a2a.pairwise_all_to_all(after, torch.full((p, 1), float(r)), [1] * p, [1] * p)
    return errors, after.view(-1).tolist()


def test_check_mode_compares_every_pair_dtype_row_shape_and_layout():
    for errors, after in launch.run(_checked_mismatches, 4, check=True, timeout=WORLD_TIMEOUT):
        assert all(errors), errors
        for i in range(len(ALGORITHMS)):
            pairs, dtypes, shapes = errors[3 * i: 3 * i + 3]
            assert "rank 0 sends rank 1 5 rows but rank 1 expects 3 from rank 0" in pairs
            assert "dtype float32 on ranks 0, 1, 3 vs int32 on rank 2" in dtypes
            assert "rows of (2,) on ranks 0, 2, 3 vs (3,) on rank 1" in shapes
        assert "layout (D=2, M=2) on ranks 0, 1 vs (D=4, M=1) on ranks 2, 3" in errors[-1]
        assert after == [0.0, 1.0, 2.0, 3.0]


def _dedup_against_flat(factor):
    """Top-4 over 8 experts on 2 machines × 2: the deduplicating dispatch hands every expert
    the flat dispatch's batch row for row, and the combines agree to rounding -- streamed
    (4 pieces; 16, more than some peers have rows: empty pieces) and stage by stage."""
    from collectives.alltoall import dedup, flat_combine, flat_dispatch, make_expert, make_router, route, run_experts
    from collectives.alltoall.moe import capacity_for
    r = dist.get_rank()
    H, F, E, T, k = 6, 5, 8, 12, 4
    router = make_router(3, H, E).requires_grad_()
    experts = [make_expert(3, r * 2 + e, H, F) for e in range(2)]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(r)).requires_grad_()
    target = torch.randn(T, H, generator=torch.Generator().manual_seed(10 + r))
    capacity = T * k if factor is None else capacity_for(T, E, k, factor)
    out, grads, batches, across = {}, {}, {}, {}
    chunks = {"dedup": 4, "staged": None, "many": 16}
    for name in ("flat", "dedup", "staged", "many"):
        routing = route(x, router, k, capacity)
        with trace.recording() as t:                  # the dispatch's messages
            if name == "flat":
                rows, counts, state = flat_dispatch(x, routing, E)
            else:
                rows, counts, state = dedup.dedup_dispatch(x, routing, E, (2, 2), r, chunks[name])
        y = run_experts(rows, counts, *zip(*experts))
        result = flat_combine(y, routing, state, T) if name == "flat" else dedup.dedup_combine(y, state)
        batches[name] = (rows.detach().clone(), counts)
        # across: the other machine's ranks; the counts (1 or E/p = 2 integers per pair) left out
        across[name] = [(e.peer, e.numel) for e in t if e.kind == "isend" and e.peer // 2 != r // 2 and e.numel > 2]
        (result * target).sum().backward()
        out[name] = result.detach()
        grads[name] = (x.grad.clone(), router.grad.clone())
        x.grad = router.grad = None
    where = dedup.machines_needed(routing, 2, 2)
    choices_across = int(((where >= 0) & (where != r // 2)).sum())
    tokens_across = int(((where == 1 - r // 2).any(1)).sum())
    try:
        dedup.dedup_dispatch(x, routing, E, (2, 2), r, 0)
        refused = ""
    except ValueError as e:
        refused = str(e)
    ways = list(chunks)
    return dict(batches=all(torch.equal(batches["flat"][0], batches[n][0]) and batches["flat"][1] == batches[n][1]
                            for n in ways),
                out=all(torch.allclose(out["flat"], out[n], rtol=1e-5, atol=1e-6) for n in ways),
                # two machines: each output adds the same two sums either way, so streamed equals staged exactly
                same=all(torch.equal(out["staged"], out[n]) for n in ways),
                grads=all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for n in ways
                          for a, b in zip(grads["flat"], grads[n])),
                rail=all(peer % 2 == r % 2 for n in ways for peer, _ in across[n]), refused=refused,
                rows_across={name: sum(n for _, n in msgs) for name, msgs in across.items()},
                choices_across=choices_across, tokens_across=tokens_across, dropped=routing.dropped)


def _dedup_cases():
    return [_dedup_against_flat(factor) for factor in (None, 0.75)]


def test_the_deduplicating_dispatch_hands_experts_the_flat_batches_and_sends_each_token_across_once():
    H, k = 6, 4
    worlds = launch.run(_dedup_cases, 4, timeout=WORLD_TIMEOUT)                  # dropless, then capacity 0.75
    for case, factor in enumerate((None, 0.75)):
        results = [world[case] for world in worlds]
        for r, res in enumerate(results):
            assert res["batches"] and res["out"] and res["same"] and res["grads"] and res["rail"], (factor, r, res)
            assert "chunks must be at least 1" in res["refused"]
            # flat: a row per choice on the other machine; dedup: a row, its k gates and 2k integers per token
            assert res["rows_across"]["flat"] == res["choices_across"] * H
            assert res["rows_across"]["dedup"] == res["rows_across"]["staged"] == res["rows_across"]["many"] \
                == res["tokens_across"] * (H + k + 2 * k)
            assert res["tokens_across"] < res["choices_across"]
        assert (sum(r["dropped"] for r in results) > 0) == (factor is not None)


def _dedup_layouts():
    """Six ranks as 2 × 3, 3 × 2, 1 × 6 and 6 × 1 (ranks per machine × machines), float64 (small
    integers ride in the rows' columns) and bfloat16 (they travel apart): streamed in 3 and 50
    pieces (more than a peer has rows), stage by stage, each against the flat dispatch:
    batches, outputs and gradients."""
    from collectives.alltoall import dedup, flat_combine, flat_dispatch, make_expert, make_router, route, run_experts
    r, out = dist.get_rank(), []
    H, E, T, k = 5, 12, 30, 3
    for layout, dtype in (((2, 3), torch.float64), ((3, 2), torch.float64), ((1, 6), torch.bfloat16),
                          ((6, 1), torch.float64)):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(r)).to(dtype).requires_grad_()
        router = make_router(3, H, E).to(dtype).requires_grad_()
        experts = [[w.to(dtype) for w in make_expert(3, r * 2 + e, H, 4)] for e in range(2)]
        got = {}
        for name, chunks in (("flat", 0), ("staged", None), ("three", 3), ("fifty", 50)):
            routing = route(x, router, k, T * k)
            if name == "flat":
                rows, counts, state = flat_dispatch(x, routing, E)
            else:
                rows, counts, state = dedup.dedup_dispatch(x, routing, E, layout, r, chunks)
            y = run_experts(rows, counts, *zip(*experts))
            result = flat_combine(y, routing, state, T) if name == "flat" else dedup.dedup_combine(y, state)
            result.float().pow(2).sum().backward()
            got[name] = (rows.detach(), result.detach(), x.grad.clone(), router.grad.clone())
            x.grad = router.grad = None
        tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
        flat = got.pop("flat")
        out.append((layout, all(torch.equal(flat[0], v[0]) for v in got.values()),
                    all(torch.allclose(a, b, **tol) for v in got.values() for a, b in zip(flat[1:], v[1:]))))
    return out


def test_the_streamed_dedup_equals_the_flat_dispatch_on_every_layout_and_piece_count():
    for world in launch.run(_dedup_layouts, 6, timeout=WORLD_TIMEOUT):
        for layout, batches, close in world:
            assert batches and close, layout


def _train_ep(steps: int):
    """A small MoE model (a dense layer, then the MoE layer) trained by expert parallelism:
    dropless, the balancing loss, the balancing bias, node-limited routing, deduplicated
    dispatch. Returns the losses, this rank's experts and the shared weights after training."""
    from collectives.alltoall import MoELayer, balance
    from collectives.ring import ring_all_reduce
    r = dist.get_rank()
    H, F, E, T = 6, 8, 8, 10
    torch.manual_seed(0)
    dense = torch.nn.Linear(H, H).double()
    layer = MoELayer(H, F, E, k=2, capacity_factor=None, seed=5, dedup=(2, 2), node_limit=1).double()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
    target = torch.randn(T, H, generator=torch.Generator().manual_seed(20 + r), dtype=torch.float64)
    shared = [dense.weight, dense.bias, layer.router]
    losses = []
    for _ in range(steps):
        h = dense(x)
        out = layer(h)
        loss = ((out - target) ** 2).mean() + 0.01 * balance.load_balancing_loss(h, layer.router, layer.routing)
        loss.backward()
        for w in shared:                       # data parallel: the replicated weights' gradients summed
            ring_all_reduce(w.grad)
        with torch.no_grad():
            for w in [*shared, *layer.w1, *layer.w2]:
                w -= 0.1 * w.grad
                w.grad = None
        balance.update_bias(layer.logit_bias, balance.expert_load(layer.routing, E), 0.05)
        losses.append(float(loss))
    return (losses, [w.detach() for w in (*layer.w1, *layer.w2)], [w.detach() for w in shared],
            layer.logit_bias.clone(), layer.first)


def _train_twin(steps: int, p: int = 4):
    from collectives.alltoall import balance, make_expert, make_router, moe_reference
    H, F, E, T = 6, 8, 8, 10
    torch.manual_seed(0)
    dense = torch.nn.Linear(H, H).double()
    router = make_router(5, H, E).double().requires_grad_()
    experts = [tuple(w.double().requires_grad_() for w in make_expert(5, e, H, F)) for e in range(E)]
    bias = torch.zeros(E, dtype=torch.float64)
    xs = [torch.randn(T, H, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in range(p)]
    targets = [torch.randn(T, H, generator=torch.Generator().manual_seed(20 + s), dtype=torch.float64)
               for s in range(p)]
    losses = [[] for _ in range(p)]
    for _ in range(steps):
        hs = [dense(x) for x in xs]
        routings = []
        outs, _ = moe_reference(hs, [router] * p, experts, 2, None, bias, node_limit=1, machines=2,
                                routings_out=routings)
        per = [((o - t) ** 2).mean() + 0.01 * balance.load_balancing_loss(h, router, rt)
               for o, t, h, rt in zip(outs, targets, hs, routings)]
        sum(per).backward()
        with torch.no_grad():
            for w in [dense.weight, dense.bias, router, *[w for pair in experts for w in pair]]:
                w -= 0.1 * w.grad
                w.grad = None
        load = sum(torch.bincount(rt.expert.reshape(-1), minlength=E) for rt in routings)
        balance.update_bias(bias, load, 0.05)
        for s in range(p):
            losses[s].append(float(per[s].detach()))
    return losses, experts, [dense.weight.detach(), dense.bias.detach(), router.detach()], bias


def test_expert_parallel_training_equals_its_one_process_twin():
    steps = 3
    results = launch.run(_train_ep, 4, args=(steps,), timeout=WORLD_TIMEOUT)
    losses, experts, shared, bias = _train_twin(steps)
    close = lambda a, b: torch.allclose(a, b, rtol=1e-10, atol=1e-12)   # noqa: E731 - float64, sums reordered
    for r, (my_losses, my_experts, my_shared, my_bias, first) in enumerate(results):
        assert my_losses == pytest.approx(losses[r], rel=1e-10)
        assert torch.equal(my_bias, bias) and bias.abs().sum() > 0          # the bias moved, alike everywhere
        assert all(close(a, b) for a, b in zip(my_shared, shared))
        twin = [experts[first + e][0] for e in range(2)] + [experts[first + e][1] for e in range(2)]
        assert all(close(a, b.detach()) for a, b in zip(my_experts, twin))
    assert losses[0][-1] != losses[0][0]


def test_the_cost_model_says_when_deduplication_wins_and_that_top_1_cannot():
    from collectives.alltoall import cost
    from collectives.core.cost import AlphaBeta, TwoTier
    assert cost.dedup_rows(1, 8, 2) == (0.5, 0.5)                       # one expert: one machine, nothing to share
    flat, dedup = cost.dedup_rows(4, 8, 2)
    assert flat == 2 and dedup == pytest.approx(1 - 1 / 70)              # C(4, 4)/C(8, 4): all four on the own machine
    cluster = TwoTier(inside=AlphaBeta(5e-5, 1e-10), across=AlphaBeta(1e-4, 8e-9), machines=2, ranks_per_machine=2)
    assert cost.moe_seconds(2048, 4096, 4, 8, cluster, True) < cost.moe_seconds(2048, 4096, 4, 8, cluster, False) / 1.5
    assert cost.moe_seconds(2048, 4096, 1, 8, cluster, True) > cost.moe_seconds(2048, 4096, 1, 8, cluster, False)
    # streamed, the inside hides behind the crossing but for the last chunk's share; the
    # small parts' own messages cost α's, which is all that counts for tiny rows
    staged, streamed = (cost.moe_seconds(2048, 4096, 4, 8, cluster, True, 48, c) for c in (None, 4))
    inside = 2048 * 4 * 4096 * 1e-10 + 5e-5
    assert streamed == pytest.approx(staged - 2 * inside + 2 * (1e-4 + 5e-5 + (inside - 5e-5) / 2 / 4))
    assert cost.moe_seconds(32, 32, 4, 8, cluster, True, 48, 4) > cost.moe_seconds(32, 32, 4, 8, cluster, True, 48)
    # the flat all-to-all's α's across: D·(M − 1) per rank in series, its ranks at once
    assert cost.flat_seconds(0, cluster) == pytest.approx(2 * 1e-4)


@pytest.mark.skipif(cluster_reason() is not None, reason=cluster_reason() or "")
def test_the_dedup_benchmark_on_the_simulated_cluster_writes_its_record(tmp_path):
    import json
    import os

    from collectives.core.netns import our_namespaces
    from collectives.course.benchmarks import alltoall as bench
    assert bench.main(["dedup", "--tokens", "32", "--hidden", "8", "--iters", "1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "bench-alltoall-dedup.json").read_text())
    rows = {r["name"]: r for r in record["rows"]}
    assert set(rows) == {"flat", "flat, linear", "dedup, stage by stage", "dedup"}
    assert all(r["verified"] for r in rows.values())
    assert rows["dedup"]["elements_across"] == rows["dedup, stage by stage"]["elements_across"] \
        < rows["flat"]["elements_across"]
    assert all(r["model_seconds"] > 0 and r["seconds"] > 0 for r in rows.values())
    assert record["layout"] == [2, 2] and record["k"] == 4 and record["experts"] == 8
    assert record["meta"]["command"].startswith(".venv/bin/python -m collectives bench-alltoall dedup")
    page = json.loads((tmp_path / "11-alltoall-dedup.json").read_text())          # the site's record
    assert [row[0] for row in page["table"]["rows"]] == ["flat", "flat, linear", "dedup, stage by stage", "dedup"]
    assert page["meta"] == record["meta"]
    assert {c["id"] for c in page["comparisons"]} == {"measured", "model"}
    assert not [name for name in our_namespaces() if f"-{os.getpid()}-" in name]      # this run's, torn down


def _syncs_per_forward():
    """The MoE layer's forward on GPUs under the sync debug mode: the host waits once (the counts)."""
    import warnings

    from collectives import ops
    from collectives.alltoall import MoELayer
    p = dist.get_world_size()
    device = ops.rank_device()
    layer = MoELayer(16, 32, 2 * p, k=2, seed=1).to(device)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    with torch.no_grad():
        layer(x)                                         # the first call makes its plans and connections
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                layer(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    return len(syncs), sorted(layer.timings), all(v > 0 for v in layer.timings.values())


def _phases():
    from collectives.alltoall import MoELayer
    layer = MoELayer(6, 8, 4, k=2)
    layer(torch.randn(5, 6))
    return layer.timings


def test_the_moe_layer_times_its_phases_without_stopping_the_host():
    for timings in launch.run(_phases, 2, timeout=WORLD_TIMEOUT):
        assert sorted(timings) == ["combine", "dispatch", "experts"] and all(v > 0 for v in timings.values())


@pytest.mark.gpu
def test_the_moe_layer_waits_for_the_gpu_once_per_forward():
    for syncs, phases, positive in launch.run(_syncs_per_forward, 2, backend="nccl", timeout=120):
        assert syncs == 1 and phases == ["combine", "dispatch", "experts"] and positive
