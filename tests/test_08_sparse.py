"""Lesson 8: a sparse all-reduce is dist.all_reduce of what each rank sent; nothing is lost.

Every check runs inside one world per world size (1-4 gloo ranks) and returns plain data;
the tests assert on it. What is checked, for every transport (all-gather, split, dense) and
both modes (top-k, threshold):

* **exact when everything is kept** -- threshold 0 / density 1 is ``dist.all_reduce``, bit
  for bit, on every case of the equivalence harness with SUM or AVG (every dtype, sizes,
  views, subgroups);
* **equal to dist.all_reduce of what each rank sent**, with the sent elements rebuilt here
  from the inputs (inputs have distinct magnitudes, so the k largest are unambiguous), and
  to gloo's own sparse all-reduce of a ``torch.sparse_coo_tensor`` of them;
* **the residual identity** ``tensor_in + residual_in == sent + residual_out``, exactly;
* counts that differ across ranks, zero on some, zero on all; ties at the threshold;
  NaN and inf; a subgroup; int32 indices (2^31 elements refused);
* **the bytes** the trace sees equal what ``collectives.cost`` says each variant sends.

Inputs are integer-valued (magnitudes a permutation of 1..n, n = 241: exact in every dtype,
bfloat16 included), so float32/64 and integer results must match bit for bit; float16 and
bfloat16 sums of several such values round, and are compared within the harness's tolerance.
"""

from __future__ import annotations

import copy
import datetime
import math

import pytest
import torch
import torch._dynamo  # noqa: F401 - DDP imports it on first use (seconds): once, before the worlds fork
import torch.distributed as dist
import torch.nn.functional as F

from collectives import cost, launch, trace, verify
from collectives.course.impl import resolve
from collectives.course.sparse_bench import event_bytes

from . import workers

LESSON = 8
N = 241                       # elements per test tensor: odd, not divisible by 2, 3 or 4
BYTES_N = 2003                # for the byte counts: a prime, and magnitudes below 2048 (exact in float16)
DENSITY = 0.1                 # k = 25 of 241
THRESHOLD = 200.0             # keeps about 1/6 of magnitudes 1..241
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
VARIANTS = ("allgather", "split", "dense")
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


# ---- inputs and the independent rebuild of what was sent ----------------------------------

def _input(rank: int, dtype, seed: int = 0, n: int = N) -> torch.Tensor:
    """Distinct magnitudes 1..n in a rank-dependent order, random signs: exact in every dtype."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    mags = torch.randperm(n, generator=g) + 1
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return (mags * signs).to(dtype)


def _with_residual(rank: int, dtype, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tensor_in, residual_in)`` whose sum is exactly :func:`_input`: integers within
    [-244, 244], exact in every dtype, so what is sent is still unambiguous."""
    g = torch.Generator().manual_seed(7 + rank)
    r = torch.randint(-3, 4, (n,), generator=g)
    x = _input(rank, torch.int64, n=n)
    return (x - r).to(dtype), r.to(dtype)


def _expected_sent(x: torch.Tensor, mode: dict) -> torch.Tensor:
    """What the contract says this rank sends, computed here in float64."""
    mag = x.double().abs()
    if "threshold" in mode:
        keep = ~(mag < mode["threshold"])
    else:
        k = min(x.numel(), max(1, math.ceil(mode["density"] * x.numel())))
        keep = torch.zeros(x.numel(), dtype=torch.bool)
        keep[torch.sort(torch.nan_to_num(mag, nan=float("inf")), descending=True, stable=True).indices[:k]] = True
    return torch.where(keep, x, torch.zeros_like(x))


def _close(expected: torch.Tensor, got: torch.Tensor, p: int) -> str | None:
    if expected.dtype in (torch.float16, torch.bfloat16):
        rtol, atol = verify.tolerance(expected.dtype, p)
        return verify.compare(expected, got, exact=False, rtol=rtol, atol=atol)
    return verify.compare(expected, got)


def _mode_name(mode: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in mode.items())


MODES = ({"density": DENSITY}, {"threshold": THRESHOLD})


# ---- task 1: selection ---------------------------------------------------------------------

@check
def selection(impl, group):
    topk_indices = resolve(impl + ":topk_indices")
    threshold_indices = resolve(impl + ":threshold_indices")
    out = {}
    g = torch.Generator().manual_seed(3)
    small = torch.rand(1000, generator=g) * 2 - 1                # every |g| < 1, as gradients are
    truth = set(torch.topk(small.abs(), 10).indices.tolist())
    for method in ("topk", "sort", "kthvalue", "reuse"):
        state = {}
        picks = []
        for step in range(3):                                    # "reuse" filters from step 2 on
            x = small * (1 + 0.01 * step)
            picks.append(sorted(topk_indices(x, 10, method, state).tolist()))
        ties = torch.tensor([3.0, -1.0, 2.0, -2.0, 2.0, 0.5])
        nan = torch.tensor([0.1, float("nan"), -5.0, float("inf"), 0.3])
        out[method] = dict(picks=picks, ties=sorted(topk_indices(ties, 3, method, {}).tolist()),
                           nan=sorted(topk_indices(nan, 2, method, {}).tolist()),
                           k0=topk_indices(small, 0, method, {}).numel(),
                           kn=sorted(topk_indices(small[:7], 7, method, {}).tolist()))
    out["truth"] = sorted(truth)
    out["singa"] = sorted(resolve("collectives.sparse:truncated_magnitude_topk")(small, 10).tolist())
    x = torch.tensor([0.5, -2.0, 2.0, 1.999, float("nan"), -float("inf"), 0.0])
    out["threshold"] = threshold_indices(x, 2.0).tolist()
    out["threshold_zero"] = threshold_indices(x, 0.0).tolist()
    return out


# ---- task 2: SINGA's transport -------------------------------------------------------------

@check
def allgather_direct(impl, group):
    """allgather_sum_ on given pairs: equal counts (top-k), differing, zero on some, zero on all."""
    allgather_sum_ = resolve(impl + ":allgather_sum_")
    exchange_counts = resolve(impl + ":exchange_counts")
    rank, p = dist.get_rank(), dist.get_world_size()
    problems = []
    for dtype in DTYPES:
        x = _input(rank, dtype)
        for case, count in (("equal", 20), ("differ, zero on rank 0", 7 * rank), ("zero on all", 0)):
            g = torch.Generator().manual_seed(rank)
            idx = torch.randperm(N, generator=g)[:count]
            out = torch.full((N,), 99, dtype=dtype)              # must be overwritten, not added to
            counts = None if case == "equal" else exchange_counts(count, group)
            with trace.recording() as t:
                allgather_sum_(out, idx, x[idx], counts=counts, group=group)
            sent = torch.zeros_like(x)
            sent[idx] = x[idx]
            bad = _close(verify.reference_all_reduce(sent), out, p)
            if bad:
                problems.append(f"{dtype} {case}: {bad}")
            gathers = t.of_kind("all_gather", "all_gather_into_tensor")
            width = count if counts is None else max(counts)
            pair = 4 + x.element_size()
            if width and [ev.nbytes for ev in gathers] != [width * pair]:
                problems.append(f"{dtype} {case}: expected one all-gather of {width} pairs "
                                f"({width * pair} bytes: indices and values in one buffer), got "
                                f"{[ev.nbytes for ev in gathers]}")
    return problems


# ---- task 3 (and 4): the contract, every transport, every mode, every dtype ------------------

def _contract(impl, group, variants=VARIANTS, dtypes=DTYPES, modes=MODES):
    """For each configuration: the result against dist.all_reduce of the rebuilt sent
    tensor, gloo's sparse all-reduce of it, and the residual identity."""
    sparse_all_reduce = resolve(impl + ":sparse_all_reduce")
    rank = dist.get_rank(group)
    p = dist.get_world_size(group)
    problems = []
    for variant in variants:
        for mode in modes:
            for dtype in dtypes:
                for with_residual in (False, True):
                    name = f"{variant} {_mode_name(mode)} {str(dtype)[6:]} residual={with_residual}"
                    if with_residual:
                        x_in, r_in = _with_residual(rank, dtype)
                    else:
                        x_in, r_in = _input(rank, dtype), None
                    t, r = x_in.clone(), (r_in.clone() if with_residual else None)
                    try:
                        sparse_all_reduce(t, r, method=variant, group=group, **mode)
                    except NotImplementedError as exc:
                        problems.append(f"{name}: not implemented ({exc})")
                        continue
                    x = x_in + r_in if with_residual else x_in
                    sent = _expected_sent(x, mode)
                    expected = verify.reference_all_reduce(sent, group=group)
                    bad = _close(expected, t, p)
                    if bad:
                        problems.append(f"{name}: vs dist.all_reduce of what was sent: {bad}")
                    if with_residual:
                        if not torch.equal(sent + r, x):
                            problems.append(f"{name}: tensor_in + residual_in != sent + residual_out")
                    if dtype != torch.float16:                  # gloo has no sparse add for float16
                        idx = torch.nonzero(sent).view(1, -1)
                        coo = torch.sparse_coo_tensor(idx, sent[idx[0]], (N,), check_invariants=True)
                        with trace.paused():
                            dist.all_reduce(coo, group=group)
                        bad = _close(coo.to_dense(), t, p)
                        if bad:
                            problems.append(f"{name}: vs gloo's sparse all-reduce: {bad}")
    return problems


@check
def contract_allgather(impl, group):
    return _contract(impl, group, variants=("allgather",))


@check
def contract_every_variant(impl, group):
    return _contract(impl, group, variants=("split", "dense", "auto"))


@check
def contract_in_a_subgroup(impl, group):
    p = dist.get_world_size()
    members = list(range(0, p, 2)) if p >= 3 else [0]
    sub = dist.new_group(members, timeout=datetime.timedelta(seconds=30))
    if dist.get_rank() not in members:
        return []
    return _contract(impl, sub, dtypes=(torch.float32, torch.int64))


@check
def everything_kept_is_all_reduce(impl, group):
    """threshold 0 and density 1 through the harness: every case with SUM or AVG, bit for bit."""
    sparse_all_reduce = resolve(impl + ":sparse_all_reduce")
    p = dist.get_world_size()
    cases = [c for c in verify.default_cases(p, large=False)
             if c.op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)]
    out = {}
    for name, mode in (("threshold=0", dict(threshold=0.0)), ("density=1", dict(density=1.0))):
        report = verify.check_all_reduce(lambda t, op=dist.ReduceOp.SUM, group=None:
                                         sparse_all_reduce(t, op=op, group=group, **mode), cases)
        out[name] = [f"[{r.case}] {r.detail}" for r in report.failures]
        # random floats too must match bit for bit: keeping everything is the dense all-reduce
        for dtype in DTYPES:
            g = torch.Generator().manual_seed(dist.get_rank())
            x = (torch.rand(N, generator=g, dtype=torch.float64) * 200 - 100).to(dtype)
            res = (torch.rand(N, generator=g, dtype=torch.float64) - 0.5).to(dtype)
            expected = verify.reference_all_reduce(x + res)
            t, r = x.clone(), res.clone()
            sparse_all_reduce(t, r, **mode)
            if not torch.equal(t, expected) or bool(r.any()):
                out[name].append(f"{dtype} random with residual: not bit for bit dist.all_reduce "
                                 "of tensor + residual, or the residual is not zero")
    return out


@check
def counts_ties_and_nonfinite(impl, group):
    sparse_all_reduce = resolve(impl + ":sparse_all_reduce")
    rank, p = dist.get_rank(), dist.get_world_size()
    out = {}
    for variant in VARIANTS:
        # counts differ: rank r keeps exactly r elements (rank 0 none) -- and nobody keeps any
        x = torch.zeros(N)
        x[: rank] = 10.0 + torch.arange(rank, dtype=torch.float32)
        x[rank: rank + 5] = 0.5
        t, r = x.clone(), torch.zeros(N)
        sparse_all_reduce(t, r, threshold=10.0, method=variant)
        sent = torch.where(x >= 10.0, x, torch.zeros_like(x))
        out[f"{variant} counts 0..p-1"] = (verify.compare(verify.reference_all_reduce(sent), t),
                                           torch.equal(sent + r, x))
        t, r = x.clone(), torch.zeros(N)
        sparse_all_reduce(t, r, threshold=1e6, method=variant)
        out[f"{variant} zero on all"] = (None if not t.any() else "not all zeros", torch.equal(r, x))
        # ties at the threshold: |x| == threshold is sent, on both signs
        x = torch.tensor([2.0, -2.0, 1.9999, 2.0001, -1.0, 0.0, 2.0] * 5)
        t, r = x.clone(), torch.zeros_like(x)
        sparse_all_reduce(t, r, threshold=2.0, method=variant)
        sent = torch.where(x.abs() >= 2.0, x, torch.zeros_like(x))
        out[f"{variant} ties"] = (verify.compare(verify.reference_all_reduce(sent), t), torch.equal(sent + r, x))
        # NaN and inf on some ranks propagate as in dist.all_reduce (NaN: the largest magnitude)
        x = _input(rank, torch.float32)
        if rank == p - 1:
            x[5], x[7] = float("nan"), float("inf")
        if rank == 0:
            x[7] = -float("inf") if p > 1 else x[7]
            x[9] = float("inf")
        for mode in MODES:
            t = x.clone()
            sparse_all_reduce(t, method=variant, **mode)
            expected = verify.reference_all_reduce(_expected_sent(x, mode))
            out[f"{variant} non-finite {_mode_name(mode)}"] = (verify.compare(expected, t), True)
    return out


@check
def refuses_bad_input(impl, group):
    sparse_all_reduce = resolve(impl + ":sparse_all_reduce")
    out = {}
    huge = torch.zeros(1, dtype=torch.int8).expand(2**31)      # 2^31 elements, no memory
    for name, call in (
            ("2^31 elements", lambda: sparse_all_reduce(huge, density=0.01)),
            ("MAX", lambda: sparse_all_reduce(torch.ones(4), density=0.5, op=dist.ReduceOp.MAX)),
            ("both modes", lambda: sparse_all_reduce(torch.ones(4), density=0.5, threshold=1.0)),
            ("residual shape", lambda: sparse_all_reduce(torch.ones(4), torch.zeros(3), density=0.5))):
        try:
            call()
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = "ValueError: " + str(exc)
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


@check
def average(impl, group):
    sparse_all_reduce = resolve(impl + ":sparse_all_reduce")
    rank, p = dist.get_rank(), dist.get_world_size()
    out = []
    for variant in VARIANTS:
        x = _input(rank, torch.float64)
        t = x.clone()
        sparse_all_reduce(t, density=DENSITY, method=variant, op=dist.ReduceOp.AVG)
        expected = verify.reference_all_reduce(_expected_sent(x, {"density": DENSITY})) / p
        out.append(verify.compare(expected, t))
    return out


# ---- the bytes on the wire -----------------------------------------------------------------

@check
def bytes_on_the_wire(impl, group):
    sparse_all_reduce = resolve(impl + ":sparse_all_reduce")
    rank, p = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in (torch.float32, torch.float16):
        e = torch.empty((), dtype=dtype).element_size()
        for variant in VARIANTS:
            for mode in MODES:
                x = _input(rank, dtype, n=BYTES_N)
                with trace.recording() as t:
                    sparse_all_reduce(x.clone(), method=variant, **mode)
                events = [dict(kind=ev.kind, nbytes=ev.nbytes, label=ev.label) for ev in t.events
                          if ev.is_send or ev.kind in trace.COLLECTIVES]
                kept = int(_expected_sent(x, mode).count_nonzero())
                every = torch.tensor([kept])
                with trace.paused():
                    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(p)]
                    dist.all_gather(counts, every)
                out[(str(dtype), variant, _mode_name(mode))] = dict(
                    events=events, e=e, kept=kept, counts=[int(c) for c in counts],
                    pieces=_pieces(x, mode, p, rank))
    return out


def _pieces(x, mode, p, rank):
    """Pairs this rank sends to each other rank's piece, and its own piece's distinct indices
    after the reduce (rebuilt from every rank's inputs: all inputs are known here)."""
    from collectives import ops
    bounds = ops.chunk_bounds(x.numel(), p)
    mine = torch.nonzero(_expected_sent(x, mode)).view(-1)
    to_each = [int(((mine >= a) & (mine < b)).sum()) for a, b in bounds]
    union = torch.zeros(x.numel(), dtype=torch.bool)
    for r in range(p):
        union |= _expected_sent(_input(r, x.dtype, n=x.numel()), mode) != 0
    per_piece = [int(union[a:b].sum()) for a, b in bounds]
    return dict(to_each=to_each, union=per_piece, longest=max(b - a for a, b in bounds))


# ---- task 5: in training --------------------------------------------------------------------

def _ddp(model, **kwargs):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, **kwargs)


@check
def ddp_hook(impl, group):
    from collectives.bucketing import SmallMLP
    state_cls = resolve(impl + ":SparseHookState")
    hook = resolve(impl + ":sparse_hook")
    torch.manual_seed(0)
    base = SmallMLP().double()
    dense, full, sparse = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    cap = 2720 / (1 << 20)                                       # two buckets
    d_dense = _ddp(dense, bucket_cap_mb=cap)
    d_full = _ddp(full, bucket_cap_mb=cap)
    d_full.register_comm_hook(state_cls(density=1.0), hook)
    sparse_state = state_cls(density=0.05)
    d_sparse = _ddp(sparse, bucket_cap_mb=cap)
    d_sparse.register_comm_hook(sparse_state, hook)
    g = torch.Generator().manual_seed(dist.get_rank())
    models = (d_dense, d_full, d_sparse)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(4):
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        y = torch.randn(4, 4, generator=g, dtype=torch.float64)
        for m, opt in zip(models, opts):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    flat = torch.cat([q.detach().reshape(-1) for q in sparse.parameters()])
    same = flat.clone()
    with trace.paused():
        dist.broadcast(same, 0)
    return dict(vs_dense=max((a - b).abs().max().item() for a, b in zip(dense.parameters(), full.parameters())),
                sparse_moved=max((a - b).abs().max().item() for a, b in zip(base.parameters(), sparse.parameters())),
                sparse_same_on_every_rank=torch.equal(flat, same),
                residual_sizes=sorted(r.numel() for r in sparse_state.residuals.values()),
                params=sum(q.numel() for q in base.parameters()))


@check
def sparse_reducer(impl, group):
    from collectives.bucketing import SmallMLP
    from collectives.sparse.hooks import SparseBucketedReducer
    torch.manual_seed(0)
    base = SmallMLP().double()
    dense, full = copy.deepcopy(base), copy.deepcopy(base)
    d_dense = _ddp(dense, bucket_cap_mb=544 / (1 << 20))
    ours = SparseBucketedReducer(full, density=1.0, bucket_cap_mb=544 / (1 << 20),
                                 first_bucket_cap_mb=544 / (1 << 20))
    g = torch.Generator().manual_seed(dist.get_rank())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (d_dense, ours)]
    for step in range(3):
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        y = torch.randn(4, 4, generator=g, dtype=torch.float64)
        for m, opt in zip((d_dense, ours), opts):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    return dict(vs_dense=max((a - b).abs().max().item() for a, b in zip(dense.parameters(), full.parameters())))


# ---- the world --------------------------------------------------------------------------

def _run_checks(impl: str, names: list[str]) -> dict:
    return workers.run_named_checks(CHECKS, impl, names)


# Which checks run in which world: the contract everywhere; bytes, DDP where they say most.
PLAN = {
    1: ["selection", "allgather_direct", "contract_allgather", "contract_every_variant",
        "everything_kept_is_all_reduce", "counts_ties_and_nonfinite"],
    2: ["allgather_direct", "contract_allgather", "contract_every_variant", "contract_in_a_subgroup",
        "counts_ties_and_nonfinite", "bytes_on_the_wire", "ddp_hook", "sparse_reducer", "average",
        "refuses_bad_input"],
    3: ["contract_allgather", "contract_every_variant", "contract_in_a_subgroup",
        "everything_kept_is_all_reduce", "bytes_on_the_wire"],
    4: ["allgather_direct", "contract_allgather", "contract_every_variant", "contract_in_a_subgroup",
        "everything_kept_is_all_reduce", "counts_ties_and_nonfinite", "bytes_on_the_wire", "average"],
}


@pytest.fixture(scope="module")
def worlds(impl):
    """``worlds(p)``: every rank's results of the checks planned for ``p`` ranks, from one world.

    If that world dies, each check is run again in a world of its own, so a crash costs only
    the checks it hit.
    """
    cache = {}

    def get(p):
        if p not in cache:
            names = PLAN[p]
            try:
                cache[p] = launch.run(_run_checks, p, args=(impl, names), timeout=120)
            except (launch.RankError, launch.WorldTimeout):
                per_rank = [{} for _ in range(p)]
                for name in names:
                    try:
                        for rank, res in enumerate(launch.run(_run_checks, p, args=(impl, [name]), timeout=60)):
                            per_rank[rank].update(res)
                    except (launch.RankError, launch.WorldTimeout) as exc:
                        for res in per_rank:
                            res[name] = dict(error=str(exc))
                cache[p] = per_rank
        return cache[p]
    return get


def _ok(per_rank: list, name: str) -> list:
    for rank, res in enumerate(per_rank):
        assert name in res, f"rank {rank} did not run {name}"
        assert not (isinstance(res[name], dict) and "error" in res[name]), f"rank {rank}: {res[name].get('error')}"
    return [res[name] for res in per_rank]


# ---- the tests ----------------------------------------------------------------------------

@pytest.mark.task(lesson=8, task=1, points=4, title="selection: threshold and top-k")
def test_top_k_picks_the_true_largest_magnitudes_where_singas_integer_comparator_ties(worlds):
    res = _ok(worlds(1), "selection")[0]
    truth = res["truth"]
    for method in ("topk", "sort", "kthvalue", "reuse"):
        r = res[method]
        assert r["picks"][0] == truth, f"{method}: not the 10 largest |g| (all |g| < 1)"
        assert all(len(pick) == 10 for pick in r["picks"]), f"{method}: must return exactly k"
        assert r["picks"][2] == r["picks"][0], f"{method}: the same largest after a uniform rescale"
        assert r["ties"] in ([0, 2, 3], [0, 2, 4], [0, 3, 4]), \
            f"{method}: k=3 of |3|,|-1|,|2|,|-2|,|2|,|0.5|: 3 and two of the 2s, got {r['ties']}"
        assert r["nan"] == [1, 3], f"{method}: NaN and inf are the largest magnitudes, got {r['nan']}"
        assert r["k0"] == 0 and r["kn"] == list(range(7))
    # the integer comparator sees every |g| < 1 as 0: its "top 10" are the first 10 indices
    assert res["singa"] == list(range(10)) and res["singa"] != truth


@pytest.mark.task(lesson=8, task=1, points=4, title="selection: threshold and top-k")
def test_threshold_keeps_ties_and_nan(worlds):
    res = _ok(worlds(1), "selection")[0]
    assert res["threshold"] == [1, 2, 4, 5], "|x| >= 2 keeps -2, 2, NaN and -inf (not 1.999)"
    assert res["threshold_zero"] == list(range(7)), "threshold 0 keeps everything, 0 and NaN included"


def test_sampled_threshold_selection_is_the_exact_top_k():
    """``sample`` (the default): a threshold from an evenly spaced sample filters, top-k of
    the candidates; where the sample misleads it (too few pass) it falls back to a full top-k."""
    from collectives.sparse.select import SAMPLE, topk_indices

    n, k = 5 * SAMPLE, 400                          # above 4·SAMPLE: the filter is used
    g = torch.Generator().manual_seed(5)
    spiky = torch.randn(n, generator=g) ** 3
    spiky[1::997] = 1e6                             # 329 spikes, none of them sampled
    specials = torch.randn(n, generator=g)
    specials[[7, 11, 13]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    misled = torch.rand(n, generator=g) * 1e-3
    misled[::5][:300] = 10.0                        # the sample sees 300 big ones; k is 400
    for name, x in (("normal", torch.randn(n, generator=g)), ("spiky", spiky), ("specials", specials),
                    ("misled", misled)):
        picked = topk_indices(x, k, "sample")
        assert picked.numel() == k and picked.unique().numel() == k, name
        assert set(picked.tolist()) == set(torch.topk(x.abs(), k).indices.tolist()), name
    assert {7, 11, 13} <= set(topk_indices(specials, k, "sample").tolist())


def test_the_chunked_filter_finds_what_the_one_line_filter_finds():
    """On a CPU ``at_least`` compares a chunk at a time (no tensor the size of the input is
    made): across chunk boundaries, with NaN and ±inf at them, it returns what the plain
    ``nonzero(not |x| < t)`` returns, ascending; and the filters built on it (``sample``,
    ``reuse``) still pick the exact top-k of a tensor several chunks long."""
    from collectives.sparse.select import CHUNK, at_least, topk_indices

    n = 2 * CHUNK + 12345
    g = torch.Generator().manual_seed(8)
    x = torch.randn(n, generator=g)
    x[[0, CHUNK - 1, CHUNK, 2 * CHUNK, n - 1]] = torch.tensor([float("nan"), 5.0, -float("inf"), float("nan"), -3.0])
    for t in (0.0, 2.5, 4.0, float("inf")):
        plain = torch.nonzero(x.abs().lt(t).logical_not_()).view(-1)
        assert torch.equal(at_least(x, t), plain), f"threshold {t}"
    k = n // 100
    # compared as magnitudes: of two equal magnitudes at the k-th place, either is right
    finite = torch.nan_to_num(x.abs(), nan=float("inf"))
    truth = torch.sort(torch.topk(finite, k).values).values
    state: dict = {}
    for method in ("sample", "reuse", "reuse"):     # reuse: cold (a full top-k), then filtered
        picked = topk_indices(x, k, method, state)
        assert picked.unique().numel() == k, method
        assert torch.equal(torch.sort(finite[picked]).values, truth), method
    assert "threshold" in state


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.task(lesson=8, task=2, points=5, title="all-gather of (index, value) pairs")
def test_allgather_sums_every_ranks_pairs_with_counts_differing_or_zero(worlds, p):
    for rank, problems in enumerate(_ok(worlds(p), "allgather_direct")):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems[:6])


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.task(lesson=8, task=3, points=5, title="sparse_all_reduce: the contract")
def test_allgather_variant_is_all_reduce_of_what_each_rank_sent(worlds, p):
    for rank, problems in enumerate(_ok(worlds(p), "contract_allgather")):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems[:6])


@pytest.mark.parametrize("p", [1, 3, 4])
@pytest.mark.task(lesson=8, task=3, points=5, title="sparse_all_reduce: the contract")
def test_everything_kept_is_exactly_dist_all_reduce(worlds, p):
    for rank, res in enumerate(_ok(worlds(p), "everything_kept_is_all_reduce")):
        for mode, problems in res.items():
            assert not problems, f"rank {rank}, {mode}:\n" + "\n".join(problems[:6])


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.task(lesson=8, task=3, points=5, title="sparse_all_reduce: the contract")
def test_counts_differ_zero_on_some_and_all_ties_and_nan(worlds, p):
    for rank, res in enumerate(_ok(worlds(p), "counts_ties_and_nonfinite")):
        for name, (problem, identity) in res.items():
            assert problem is None, f"rank {rank}, {name}: {problem}"
            assert identity, f"rank {rank}, {name}: tensor_in + residual_in != sent + residual_out"


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.task(lesson=8, task=3, points=5, title="sparse_all_reduce: the contract")
def test_average_and_bad_input(worlds, p):
    for rank, problems in enumerate(_ok(worlds(p), "average")):
        assert problems == [None] * 3, f"rank {rank}: {problems}"
    if p == 2:
        res = _ok(worlds(2), "refuses_bad_input")[0]
        assert res["2^31 elements"].startswith("ValueError") and "2^31" in res["2^31 elements"]
        for name in ("MAX", "both modes", "residual shape"):
            assert res[name].startswith("ValueError"), f"{name}: {res[name]}"


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.task(lesson=8, task=4, points=6, title="split: sparse reduce-scatter, densify")
def test_split_and_dense_variants_are_all_reduce_of_what_each_rank_sent(worlds, p):
    for rank, problems in enumerate(_ok(worlds(p), "contract_every_variant")):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems[:6])


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.task(lesson=8, task=4, points=6, title="split: sparse reduce-scatter, densify")
def test_every_variant_in_a_subgroup(worlds, p):
    for rank, problems in enumerate(_ok(worlds(p), "contract_in_a_subgroup")):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems[:6])


@pytest.mark.parametrize("p", [2, 3, 4])
def test_trace_bytes_match_the_cost_model(worlds, p):
    """The bytes each rank hands to each collective, against collectives.cost.sparse_cost."""
    for rank, res in enumerate(_ok(worlds(p), "bytes_on_the_wire")):
        for (dtype, variant, mode), r in res.items():
            e, kept, counts, ev = r["e"], r["kept"], r["counts"], r["events"]
            pair = 4 + e
            threshold = mode.startswith("threshold")
            width = max(counts)
            where = f"rank {rank}, {dtype} {variant} {mode}"
            if variant == "allgather":
                expected = ([("all_gather", 8)] if threshold else []) + [("all_gather", width * pair)]
                assert [(x["kind"], x["nbytes"]) for x in ev] == expected, where
                model = cost.sparse_cost("allgather", BYTES_N, width, p, e, counts=threshold)
                assert model.bytes_per_rank == (p - 1) * sum(x["nbytes"] for x in ev), where
            elif variant == "dense":
                extra = [("all_gather", 8)] if threshold else []
                assert [(x["kind"], x["nbytes"]) for x in ev] == extra + [("all_reduce", BYTES_N * e)], where
            else:
                pieces = r["pieces"]
                to_others = [c for j, c in enumerate(pieces["to_each"]) if j != rank]
                union, longest = max(pieces["union"]), pieces["longest"]
                dense = union * pair >= longest * e
                gather = longest * e if dense else union * pair
                # Pairs go to their owners (one all-to-all, or a message each); the reduced
                # pieces come back by an all-gather (of pairs; of dense pieces once they fill,
                # which a ring all-gather in place sends as p-1 chunks, one element shorter
                # each where p does not divide n). Small count exchanges come on top.
                sent = sum(event_bytes(x["kind"], x["nbytes"], p) for x in ev)
                least = sum(to_others) * pair + (p - 1) * (gather - (e if dense else 0))
                most = sum(to_others) * pair + (p - 1) * gather + 2 * 8 * p + (8 * p if threshold else 0)
                assert least <= sent <= most, f"{where}: {sent} bytes on the wire, expected {least}..{most}"
                assert sum(to_others) <= kept, where
                # the model's gather term, given the fullest piece, is what the trace saw
                model = cost.sparse_cost("split", BYTES_N, width, p, e, union=union)
                scatter = (p - 1) / p * width * pair
                assert model.bytes_per_rank == pytest.approx(scatter + (p - 1) * gather + 2 * (p - 1) * 8), where


@pytest.mark.task(lesson=8, task=5, points=5, title="DDP communication hook")
def test_ddp_hook_at_density_one_trains_exactly_like_dense_ddp(worlds):
    for rank, res in enumerate(_ok(worlds(2), "ddp_hook")):
        assert res["vs_dense"] == 0.0, f"rank {rank}: differs from dense DDP by {res['vs_dense']:.2e}"
        assert res["sparse_moved"] > 0 and res["sparse_same_on_every_rank"], \
            f"rank {rank}: at density 0.05 the replicas must move and stay identical"
        assert sum(res["residual_sizes"]) == res["params"] and len(res["residual_sizes"]) == 2, \
            f"rank {rank}: one residual per bucket (2 buckets), covering every parameter"


def test_lesson6_reducer_with_sparse_buckets_at_density_one_is_dense_ddp(worlds):
    for rank, res in enumerate(_ok(worlds(2), "sparse_reducer")):
        assert res["vs_dense"] <= 1e-12, f"rank {rank}: differs from torch DDP by {res['vs_dense']:.2e}"


def test_cost_model_crossovers():
    link = cost.AlphaBeta(alpha=0.0, beta=1e-9)
    n = 16 << 20
    for p in (2, 4, 8):
        # all-gather of float32 pairs against the dense ring: density 1/p
        assert abs(cost.sparse_crossover(n, p, link) - 1 / p) < 1e-3 / p
        # 16-bit values: 6-byte pairs for 2 bytes of payload -> (2/3)/p
        assert abs(cost.sparse_crossover(n, p, link, value_bytes=2) - 2 / 3 / p) < 1e-3 / p
    # the split variant beats all-gather above about 1/p, and the dense ring below 1/2 (fp32)
    assert cost.choose_sparse_variant(n, 0.01 * n, 4, link) == "allgather"
    assert cost.choose_sparse_variant(n, 0.35 * n, 4, link) == "split"
    assert cost.choose_sparse_variant(n, 0.8 * n, 4, link) == "dense"



def test_processor_time_moves_the_crossover_down_by_what_it_costs():
    """The processor's part of the model (collectives.cost.SparseCompute): with work per
    element and per pair, sparse stops paying at a lower density than the bytes alone say,
    and by as much as the arithmetic predicts."""
    link = cost.AlphaBeta(alpha=0.0, beta=1e-9)
    n, p = 16 << 20, 4
    wire_only = cost.sparse_crossover(n, p, link)
    assert cost.SparseCompute().seconds("allgather", n, n / 100, p) == 0.0
    compute = cost.SparseCompute(scan=0.1e-9, pick=1e-9, pair=1e-9)
    # all-gather at k: k picked, k + p·k pairs packed/added, n scanned
    k = n / 100
    assert compute.seconds("allgather", n, k, p) == pytest.approx(0.1e-9 * n + 1e-9 * k + 1e-9 * (k + p * k))
    assert cost.sparse_seconds("allgather", n, k, p, link, compute) == pytest.approx(
        cost.sparse_cost("allgather", n, k, p).seconds(link) + compute.seconds("allgather", n, k, p))
    with_cpu = cost.sparse_crossover(n, p, link, compute=compute)
    assert with_cpu < wire_only
    # at the crossover the model's sparse time equals the dense ring's
    dense = cost.sparse_cost("dense", n, n, p).seconds(link)
    assert cost.sparse_seconds("allgather", n, with_cpu * n, p, link, compute) == pytest.approx(dense, rel=1e-6)
    # "best": the faster of all-gather and split at each density; split carries it past 1/p
    assert cost.sparse_crossover(n, p, link, variant="best") > cost.sparse_crossover(n, p, link)
    # against a measured time instead of the dense model
    assert cost.sparse_crossover(n, p, link, against_seconds=dense / 2) < wire_only

# ---- convergence: what error feedback buys, on real data ------------------------------------

# Measured with these settings (4 ranks, seeds fixed, 25 epochs of plain SGD, lr 0.5, 64
# examples per rank per step -- dense has converged): mean test accuracy of the last three
# epochs, dense 0.960, top-k 1 % with error feedback 0.958, without 0.857. The assertions
# keep the measured gaps with margins: within 1 point with feedback, at least 5 points
# worse without.
CONVERGENCE = dict(epochs=25, lr=0.5, batch=64, seed=0)


def test_top_k_with_error_feedback_converges_like_dense_and_without_it_does_not():
    pytest.importorskip("sklearn", reason="the lab extra: pip install -e '.[lab]' (make test installs it)")
    from collectives.sparse import lab
    res = lab.compare(runs=("dense", "topk_ef", "topk_no_ef"), **CONVERGENCE)
    dense, ef, no_ef = (res[r]["final"] for r in ("dense", "topk_ef", "topk_no_ef"))
    assert dense >= 0.94, f"dense should converge on load_digits: {dense:.3f}"
    assert ef >= dense - 0.01, f"top-k 1% with error feedback {ef:.3f} vs dense {dense:.3f}"
    assert no_ef <= dense - 0.05, f"top-k 1% without error feedback {no_ef:.3f} vs dense {dense:.3f}"
    # bytes the hook hands to collectives per step: one all-gather of k = 49 pairs of 8 bytes
    assert res["topk_ef"]["bytes_per_step"] == 49 * 8 and res["dense"]["params"] == 4810


# ---- GPUs (NCCL): the same contract on device tensors -----------------------------------------

@pytest.mark.gpu
def test_every_variant_on_nccl_is_all_reduce_of_what_each_rank_sent(impl):
    """On 2 GPUs: selection, packing and every transport on device tensors, NCCL underneath."""
    results = launch.run(_gpu_rank, 2, args=(impl,), backend="nccl", timeout=180)
    for rank, problems in enumerate(results):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems[:6])


def _gpu_rank(impl):
    sparse_all_reduce = resolve(impl + ":sparse_all_reduce")
    rank, p = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    problems = []
    for variant in VARIANTS:
        for mode in MODES:
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                x_in, r_in = _with_residual(rank, dtype)
                t, r = x_in.to(device), r_in.to(device)
                sparse_all_reduce(t, r, method=variant, **mode)
                x = x_in + r_in
                sent = _expected_sent(x, mode)
                expected = sent.to(device)
                with trace.paused():
                    dist.all_reduce(expected)
                bad = _close(expected.cpu(), t.cpu(), p)
                if bad:
                    problems.append(f"{variant} {_mode_name(mode)} {dtype}: {bad}")
                if not torch.equal(sent.to(device) + r, x.to(device)):
                    problems.append(f"{variant} {_mode_name(mode)} {dtype}: residual identity")
    return problems
