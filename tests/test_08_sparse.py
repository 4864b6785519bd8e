"""Lesson 8: what the task table does not judge.

The graded contract -- selection, the all-gather of pairs, every transport's sums and
residuals, refusals, the asynchronous all-reduce and hook -- is judged outside the
student's process by collectives/course/grading/tasks/lesson08*.py (run by tests/test_grader.py on
the reference, the stubs and every partial solution). Here, in one world per world size:

* **the bytes** the trace sees equal what ``collectives.sparse.cost`` says each transport sends;
* a rank outside the group is a no-op; ranks that disagree are named (check mode); split
  with sizes that differ raises without it; Ok-Topk's balanced pieces give the same sum;
  |INT_MIN| ranked largest; thresholds compared exactly in the tensor's dtype;
* **in training**: residuals follow their parameters through DDP's bucket rebuild; the hook
  reduces over the group the state carries; lesson 6's reducer with sparse buckets at density
  1 is DDP; the asynchronous all-reduce returns in flight; DGC's corrections do what they say;
* the cost model's crossovers, ``auto``'s profile, convergence with and without error
  feedback, bench-sparse-train's arithmetic, and the exercise's names and defaults.

Inputs are integer-valued (magnitudes a permutation of 1..n, n = 241: exact in every dtype,
bfloat16 included), so float32/64 and integer results must match bit for bit.
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

from collectives import launch, trace, verify
from collectives.course.benchmarks.sparse import event_bytes
from collectives.course.impl import resolve
from collectives.sparse import cost

from . import workers

LESSON = 8
N = 241                       # elements per test tensor: odd, not divisible by 2, 3 or 4
BYTES_N = 2003                # for the byte counts: a prime, and magnitudes below 2048 (exact in float16)
DENSITY = 0.1                 # k = 25 of 241
THRESHOLD = 200.0             # keeps about 1/6 of magnitudes 1..241
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
TRANSPORTS = ("allgather", "split", "dense")
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


# ---- the transports: what the graded tasks (collectives/course/grading/tasks/lesson08*.py) do not cover --

def _fixed_profile(impl, link=None, compute=None):
    """Give the world a profile for transport="auto" instead of measuring one: the same on
    every rank, and no time spent (the exercise's "auto" reads the course's profiles too)."""
    from collectives.sparse.profile import set_profile
    set_profile(cost.SparseProfile(link or cost.GIGABIT, compute or cost.SparseCompute()))


@check
def split_with_balanced_pieces(impl, group):
    """Ok-Topk's balanced partition: with every rank's pairs crowded into the first tenth of
    the range, equal ranges hand rank 0 nearly all of them; the balanced cuts share them
    out, and the sum is the same (dense pieces of unequal lengths gathered too)."""
    from collectives import ops
    from collectives.sparse.split import balanced_bounds, split_sum_
    rank, p = dist.get_rank(), dist.get_world_size()
    n = 3000
    problems = []
    for kept, span in ((40, n // 10), (2500, n)):     # crowded pairs; then nearly every index, pieces fill
        g = torch.Generator().manual_seed(rank)
        idx = torch.randperm(span, generator=g)[:kept].sort().values
        vals = torch.randint(-50, 50, (kept,), generator=g).double()
        bounds = balanced_bounds(idx, n, group=group, bins=300)
        every = [torch.empty_like(idx) for _ in range(p)]
        with trace.paused():
            dist.all_gather(every, idx, group=group)
        landing = [sum(int(((e >= a) & (e < b)).sum()) for e in every) for a, b in bounds]
        if max(landing) > 1.5 * sum(landing) / p:
            problems.append(f"{kept} pairs: balanced pieces still uneven: {landing}")
        out = torch.empty(n, dtype=torch.float64)
        info = split_sum_(out, idx, vals, group=group, bounds=bounds)
        sent = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, vals)
        bad = verify.compare(verify.reference_all_reduce(sent, group=group), out)
        if bad:
            problems.append(f"{kept} pairs (densified {info.densified}): {bad}")
        if info.densified != (kept == 2500) or (kept == 2500 and bounds == ops.chunk_bounds(n, p)):
            problems.append(f"{kept} pairs: densified {info.densified} with pieces {bounds}")
    return problems


@check
def outside_the_group_is_a_no_op(impl, group):
    """A rank outside ``group`` returns at once and touches nothing, as dist.all_reduce does
    (before: it changed its residual and crashed, or at density 1 with AVG negated the tensor)."""
    sparse_all_reduce = resolve(impl + ":sparse_all_reduce")
    rank = dist.get_rank()
    sub = dist.new_group([0], timeout=datetime.timedelta(seconds=30))
    problems = []
    for kwargs in (dict(density=1.0, op=dist.ReduceOp.AVG), dict(density=0.5), dict(threshold=2.0),
                   dict(density=0.5, transport="split")):
        t, r = torch.arange(1.0, 9.0), torch.full((8,), 0.25)
        t_in, r_in = t.clone(), r.clone()
        sparse_all_reduce(t, r, group=sub, **kwargs)
        if rank != 0 and not (torch.equal(t, t_in) and torch.equal(r, r_in)):
            problems.append(f"{kwargs}: rank {rank} is not in the group, and its tensor or residual changed")
    return problems


@check
def split_with_sizes_that_differ_raises(impl, group):
    """Ranks that pass different sizes to the split transport get an error on every rank,
    check mode off (before: garbage without an error, or one rank raising and the others
    waiting)."""
    sparse_all_reduce = resolve(impl + ":sparse_all_reduce")
    rank = dist.get_rank()
    x = _input(rank, torch.float32, n=N + rank)
    try:
        sparse_all_reduce(x, density=DENSITY, transport="split", group=group)
        return "no error"
    except ValueError as exc:
        return str(exc)


@check
def int_min_is_the_largest_magnitude(impl, group):
    """|INT_MIN| does not fit its dtype; it is still the largest magnitude: sent, not left in
    the residual while a small value goes."""
    sparse_all_reduce = resolve(impl + ":sparse_all_reduce")
    rank = dist.get_rank()
    problems = []
    for dtype in (torch.int8, torch.int32, torch.int64):
        low = torch.iinfo(dtype).min
        x = torch.tensor([low, -7, 3], dtype=dtype) if rank == 0 else torch.tensor([2, -1, 1], dtype=dtype)
        t, r = x.clone(), torch.zeros_like(x)
        sparse_all_reduce(t, r, density=0.3, group=group)          # k = 1 of 3
        sent = torch.where(torch.arange(3) == 0, x, torch.zeros_like(x))
        if not torch.equal(r, x - sent):
            problems.append(f"{dtype}: residual {r.tolist()}, expected {(x - sent).tolist()}")
        if not torch.equal(t, verify.reference_all_reduce(sent, group=group)):
            problems.append(f"{dtype}: result {t.tolist()}")
    return problems


@check
def bytes_on_the_wire(impl, group):
    sparse_all_reduce = resolve(impl + ":sparse_all_reduce")
    rank, p = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in (torch.float32, torch.float16):
        e = torch.empty((), dtype=dtype).element_size()
        for variant in TRANSPORTS:
            for mode in MODES:
                x = _input(rank, dtype, n=BYTES_N)
                with trace.recording() as t:
                    sparse_all_reduce(x.clone(), transport=variant, **mode)
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


def _steps(models, steps=4, lr=0.1, momentum=0.0):
    """Train each of ``models`` (DDP-wrapped SmallMLPs) on the same rank-dependent batches."""
    g = torch.Generator().manual_seed(dist.get_rank())
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in models]
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        y = torch.randn(4, 4, generator=g, dtype=torch.float64)
        for m, opt in zip(models, opts):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()


def _largest_gap(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _same(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@check
def async_returns_while_the_pairs_travel(impl, group):
    """sparse_all_reduce_async returns before a late peer has sent anything: its future is not
    done; once it is, the result is the plain call's."""
    import time
    start_async = resolve(impl + ":sparse_all_reduce_async")
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(0.3)                       # rank 0's all-gather cannot complete before this
    x = _input(rank, torch.float32)
    t, r = x.clone(), torch.zeros_like(x)
    work = start_async(t, r, density=DENSITY, group=group)
    in_flight = not work.get_future().done()
    work.wait()
    sent = _expected_sent(x, {"density": DENSITY})
    expected = verify.reference_all_reduce(sent, group=group)
    return dict(in_flight=in_flight, result=verify.compare(expected, t), residual=torch.equal(x - r, sent))


class _RegisteredBackwards(torch.nn.Module):
    """DigitsMLP with its output layer registered first. Lesson 6's reducer starts from the
    reversed registration order -- DDP's usual guess -- which this model's backward then
    contradicts, so its rebuild moves every parameter (DigitsMLP itself already agrees)."""

    def __init__(self):
        super().__init__()
        self.fc2 = torch.nn.Linear(64, 10)
        self.fc1 = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _gradient_sums(impl, make_reducer, steps=3, model=None):
    """Each parameter's raw gradients summed over ``steps`` against what the reducer delivered
    plus the residual it holds for that parameter (one rank: delivered = sent). Parameters
    stay fixed (no optimizer), so a plain copy of the model gives the raw gradients."""
    from collectives.sparse.lab import DigitsMLP
    torch.manual_seed(0)
    net = (model or DigitsMLP)().double()
    plain = copy.deepcopy(net)
    reducer, state, layouts = make_reducer(net)
    names = {id(q): n for n, q in net.named_parameters()}
    raw = [torch.zeros_like(q) for q in net.parameters()]
    delivered = [torch.zeros_like(q) for q in net.parameters()]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.rand(16, 64, generator=g, dtype=torch.float64)
        y = torch.randint(0, 10, (16,), generator=g)
        for model, into in ((plain, raw), (reducer, delivered)):
            for q in model.parameters():
                q.grad = None
            F.cross_entropy(model(x), y).backward()
            for acc, q in zip(into, net.parameters() if model is reducer else plain.parameters()):
                acc += q.grad
    gaps = {names[id(q)]: (a - (d + state.residuals.of(q))).abs().max().item()
            for q, a, d in zip(net.parameters(), raw, delivered)}
    return dict(gaps=gaps, layouts=[[names[i] for i in layout] for layout in layouts])


def _ddp_with_hook(impl, hook_name):
    def make(net):
        state = resolve(impl + ":SparseHookState")(density=0.05)
        hook = resolve(impl + ":" + hook_name)
        layouts = []

        def recording(st, bucket):
            layouts.append([id(q) for q in bucket.parameters()])
            return hook(st, bucket)
        recording.__annotations__ = hook.__annotations__
        ddp = _ddp(net)
        resolve(impl + ":register_sparse_hook")(ddp, state, recording)
        return ddp, state, layouts
    return make


@check
def residuals_follow_their_parameters(impl, group):
    """DDP rebuilds its buckets after the first step; DigitsMLP's one bucket goes from
    [fc1.w, fc1.b, fc2.w, fc2.b] to [fc2.b, fc2.w, fc1.b, fc1.w], same size. Each parameter's
    residual must stay its own: sum of raw gradients == delivered + residual, per parameter."""
    from collectives.sparse.hooks import SparseBucketedReducer

    def lesson6(net):
        reducer = SparseBucketedReducer(net, density=0.05)
        layouts = []
        launch_one = reducer._launch

        def recording(b):
            layouts.append([id(reducer.params[i]) for i in reducer.buckets[b].params])
            launch_one(b)
        reducer._launch = recording
        return reducer, reducer.sparse, layouts
    return {"sparse_hook": _gradient_sums(impl, _ddp_with_hook(impl, "sparse_hook")),
            "sparse_hook_async": _gradient_sums(impl, _ddp_with_hook(impl, "sparse_hook_async")),
            "SparseBucketedReducer": _gradient_sums(impl, lesson6, model=_RegisteredBackwards)}


@check
def hook_reduces_over_the_state_group(impl, group):
    """DDP on a subgroup does not tell the hook its group: the state carries it. Each rank is
    a group of its own here; at density 1 the hook must then train exactly like DDP on that
    group (before: it reduced over the whole world)."""
    from collectives.bucketing import SmallMLP
    state_cls = resolve(impl + ":SparseHookState")
    register = resolve(impl + ":register_sparse_hook")
    rank, p = dist.get_rank(), dist.get_world_size()
    mine = [dist.new_group([r], timeout=datetime.timedelta(seconds=30)) for r in range(p)][rank]
    torch.manual_seed(rank)
    base = SmallMLP().double()
    dense, hooked = copy.deepcopy(base), copy.deepcopy(base)
    d_dense, d_hooked = _ddp(dense, process_group=mine), _ddp(hooked, process_group=mine)
    register(d_hooked, state_cls(density=1.0), resolve(impl + ":sparse_hook_async"))
    _steps((d_dense, d_hooked))
    try:
        register(_ddp(copy.deepcopy(base), process_group=mine), state_cls(density=1.0, group=group))
        refused = "accepted"
    except ValueError as exc:
        refused = str(exc)
    return dict(same=_same(dense, hooked), refused=refused)


@check
def hook_on_a_thread(impl, group):
    """``on_a_thread(hook)``: several buckets in flight, each selected on the hook's own
    thread, and the model trains to the hook's bits on backward's thread; an exception in
    the hook reaches backward (no hang)."""
    from collectives.bucketing import SmallMLP
    from collectives.sparse import on_a_thread
    state_cls, register = resolve(impl + ":SparseHookState"), resolve(impl + ":register_sparse_hook")
    hook = resolve(impl + ":sparse_hook_async")
    torch.manual_seed(3)
    base = SmallMLP().double()
    plain, threaded = copy.deepcopy(base), copy.deepcopy(base)
    cap = 544 / (1 << 20)
    d_plain, d_thread = (_ddp(m, bucket_cap_mb=cap) for m in (plain, threaded))
    calls = []

    def counted(state, bucket):
        calls.append(bucket.index())
        return hook(state, bucket)
    counted.__annotations__ = hook.__annotations__
    register(d_plain, state_cls(density=0.3), hook)
    register(d_thread, state_cls(density=0.3), on_a_thread(counted))
    _steps((d_plain, d_thread), momentum=0.9)

    def broken(state, bucket):
        raise ValueError("a broken hook")
    d_broken = _ddp(copy.deepcopy(base), bucket_cap_mb=cap)
    register(d_broken, state_cls(density=0.3), on_a_thread(broken))
    try:
        F.mse_loss(d_broken(torch.rand(4, 8, dtype=torch.float64)), torch.rand(4, 4, dtype=torch.float64)).backward()
        raised = "nothing raised"
    except Exception as exc:            # noqa: BLE001 - DDP re-raises what the future holds
        raised = str(exc)
    return dict(same=_same(plain, threaded), moved=not _same(base, threaded), buckets=len(set(calls)),
                raised=raised)


@check
def sparse_reducer(impl, group):
    from collectives.bucketing import SmallMLP
    from collectives.sparse.hooks import SparseBucketedReducer
    torch.manual_seed(0)
    base = SmallMLP().double()
    dense, full = copy.deepcopy(base), copy.deepcopy(base)
    cap = 544 / (1 << 20)
    ours = SparseBucketedReducer(full, density=1.0, bucket_cap_mb=cap, first_bucket_cap_mb=cap)
    _steps((_ddp(dense, bucket_cap_mb=cap), ours), steps=3)
    return dict(vs_dense=_largest_gap(dense, full))


# ---- task 6: DGC's corrections ------------------------------------------------------------------

@check
def dgc_corrections(impl, group):
    """Per-parameter selection sends ⌈d·size⌉ of each parameter; momentum correction without
    masking at density 1 is momentum SGD; with masking, a sent entry's velocity restarts."""
    from collectives.bucketing import SmallMLP
    dgc_state, dgc_hook = resolve(impl + ":DGCState"), resolve(impl + ":dgc_hook")
    register = resolve(impl + ":register_sparse_hook")
    sparse_all_reduce = resolve(impl + ":sparse_all_reduce")
    rank = dist.get_rank()
    out = {}
    # per parameter: sizes 5, 100, 136 at density 0.1 -> 1 + 10 + 14 sent, the largest of each
    x = _input(rank, torch.float32)
    sizes = [5, 100, 136]
    r = torch.zeros_like(x)
    info = sparse_all_reduce(x.clone(), r, density=0.1, segments=sizes, group=group)
    sent = x - r
    per_piece, expected, start = [], [], 0
    for size in sizes:
        piece = x[start:start + size]
        per_piece.append(int(sent[start:start + size].count_nonzero()))
        expected.append(sorted(torch.topk(piece.abs(), math.ceil(0.1 * size)).indices.add(start).tolist()))
        start += size
    out["per_parameter"] = dict(counts=per_piece, kept=info.kept,
                                largest=sorted(torch.nonzero(sent).view(-1).tolist()) == sorted(sum(expected, [])))
    # momentum correction, no masking, density 1: momentum SGD (to rounding: sums in another order)
    torch.manual_seed(0)
    base = SmallMLP().double()
    reference, corrected, masked = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    cap = 2720 / (1 << 20)
    d_ref, d_cor, d_mask = (_ddp(m, bucket_cap_mb=cap) for m in (reference, corrected, masked))
    register(d_cor, dgc_state(density=1.0, momentum=0.9, factor_masking=False), dgc_hook)
    mask_state = dgc_state(density=0.2, momentum=0.9, factor_masking=True, per_parameter=True)
    register(d_mask, mask_state, dgc_hook)
    g = torch.Generator().manual_seed(rank)
    opts = [torch.optim.SGD(d_ref.parameters(), lr=0.1, momentum=0.9),
            torch.optim.SGD(d_cor.parameters(), lr=0.1), torch.optim.SGD(d_mask.parameters(), lr=0.1)]
    for _ in range(4):
        xb = torch.randn(4, 8, generator=g, dtype=torch.float64)
        yb = torch.randn(4, 4, generator=g, dtype=torch.float64)
        for m, opt in zip((d_ref, d_cor, d_mask), opts):
            opt.zero_grad()
            F.mse_loss(m(xb), yb).backward()
            opt.step()
    out["momentum_sgd_gap"] = _largest_gap(reference, corrected)
    # masking: wherever this rank's residual was just sent (zero), its velocity is zero too
    velocity = torch.cat([mask_state.velocities.of(q).reshape(-1) for q in masked.parameters()])
    residual = torch.cat([mask_state.residuals.of(q).reshape(-1) for q in masked.parameters()])
    out["masked"] = bool((velocity[residual == 0] == 0).all()) and bool(velocity.any())
    out["steps"] = mask_state.step
    return out


# ---- the world --------------------------------------------------------------------------

def _run_checks(impl: str, names: list[str]) -> dict:
    return workers.run_named_checks(CHECKS, impl, names)


# Which checks run in which world (the contract itself is the task table's: collectives/course/grading/tasks).
PLAN = {
    1: ["residuals_follow_their_parameters"],
    2: ["bytes_on_the_wire", "sparse_reducer", "outside_the_group_is_a_no_op", "split_with_sizes_that_differ_raises",
        "int_min_is_the_largest_magnitude", "async_returns_while_the_pairs_travel",
        "hook_reduces_over_the_state_group", "dgc_corrections", "hook_on_a_thread"],
    3: ["bytes_on_the_wire", "split_with_balanced_pieces"],
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

def test_singas_integer_comparator_ties_every_gradient_below_one():
    """SINGA ranks int(|g|): gradients below 1 all tie at 0, and its "top 10" are the first
    10 indices; the course's selection ranks the magnitudes themselves."""
    from collectives.sparse import topk_indices, truncated_magnitude_topk
    small = torch.rand(1000, generator=torch.Generator().manual_seed(3)) * 2 - 1
    truth = sorted(torch.topk(small.abs(), 10).indices.tolist())
    assert sorted(truncated_magnitude_topk(small, 10).tolist()) == list(range(10)) != truth
    assert sorted(topk_indices(small, 10, "topk").tolist()) == truth


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64])
def test_int_min_is_the_largest_magnitude_for_every_selection(impl, dtype):
    """|INT_MIN| overflows its own dtype (torch.abs(int32 -2^31) is -2^31): it must still rank
    above every other magnitude, with every selection, and pass every threshold up to 2^(b-1)."""
    topk_indices, threshold_indices = resolve(impl + ":topk_indices"), resolve(impl + ":threshold_indices")
    low = torch.iinfo(dtype).min
    x = torch.tensor([3, low, -7, torch.iinfo(dtype).max, 0], dtype=dtype)
    for selection in ("topk", "sort", "kthvalue", "reuse", "sample", "auto"):
        assert topk_indices(x, 1, selection, {}).tolist() == [1], f"{selection}: INT_MIN is the largest |x|"
        assert sorted(topk_indices(x, 2, selection, {}).tolist()) == [1, 3], selection
    assert threshold_indices(x, float(-low)).tolist() == [1], "|INT_MIN| = 2^(b-1) reaches 2^(b-1)"
    assert threshold_indices(x, 7.0).tolist() == [1, 2, 3]


def test_threshold_is_compared_exactly_in_the_tensors_dtype(impl):
    """The threshold is not rounded to the tensor's dtype first (200.3 is 200 in bfloat16), and
    integers are compared as integers, not in float32 (where 2^24 + 1 is 2^24)."""
    threshold_indices = resolve(impl + ":threshold_indices")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.tensor([200.0, -200.0, 201.0, -float("inf")], dtype=dtype)
        assert threshold_indices(x, 200.3).tolist() == [2, 3], f"{dtype}: |200| < 200.3"
        assert threshold_indices(x, 200.0).tolist() == [0, 1, 2, 3], f"{dtype}: |200| >= 200"
    big = torch.tensor([2**24 + 1, -(2**24 + 1), 2**24, 5], dtype=torch.int32)
    assert threshold_indices(big, 2**24 + 0.5).tolist() == [0, 1], "int32 compared as int32"
    huge = torch.tensor([2**62 + 1, 2**62, -(2**62 + 1)], dtype=torch.int64)
    assert threshold_indices(huge, float(2**62)).tolist() == [0, 1, 2]
    assert threshold_indices(huge, float(2**62) * (1 + 2**-52)).tolist() == []


def test_sampled_threshold_selection_is_the_exact_top_k():
    """``sample`` (the default): a threshold from a sample at random positions filters, top-k
    of the candidates; where the sample misleads it (too few pass) it falls back to a full top-k."""
    from collectives.sparse.select import SAMPLE, _sample_positions, topk_indices

    n, k = 5 * SAMPLE, 400                          # above 4·SAMPLE: the filter is used
    g = torch.Generator().manual_seed(5)
    spiky = torch.randn(n, generator=g) ** 3
    spiky[1::997] = 1e6                             # 329 spikes, none of them sampled
    specials = torch.randn(n, generator=g)
    specials[[7, 11, 13]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    misled = torch.rand(n, generator=g) * 1e-3
    seen = _sample_positions(n, SAMPLE, misled.device).unique()
    misled[seen[::len(seen) // 300][:300]] = 10.0  # the sample sees 300 big ones, all there are; k is 400
    for name, x in (("normal", torch.randn(n, generator=g)), ("spiky", spiky), ("specials", specials),
                    ("misled", misled)):
        picked = topk_indices(x, k, "sample")
        assert picked.numel() == k and picked.unique().numel() == k, name
        assert set(picked.tolist()) == set(torch.topk(x.abs(), k).indices.tolist()), name
    assert {7, 11, 13} <= set(topk_indices(specials, k, "sample").tolist())


def test_the_sample_is_not_fooled_by_a_layer_s_rows():
    """A first layer of 64 inputs whose every 8th input is blank (the digits' left edge) has
    every 8th gradient zero. Evenly spaced every 8th element, a sample saw only those zeros:
    a threshold of 0, every element a candidate. At random positions it sees the layer as
    it is: a few more than k candidates."""
    from collectives.sparse.select import at_least, sample_threshold

    g = torch.Generator().manual_seed(11)
    grad = torch.randn(512, 64, generator=g)
    grad[:, ::8] = 0.0
    x, k = grad.view(-1), 328
    t = sample_threshold(x, k)
    assert t is not None and t > 0
    assert k <= at_least(x, t).numel() <= 2 * k


def _on_threads(check):
    """Run ``check()`` on one intra-op thread (NumPy finds the flags) and on two (torch does)."""
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            check(threads)
    finally:
        torch.set_num_threads(before)


def test_the_chunked_filter_finds_what_the_one_line_filter_finds():
    """On a CPU ``at_least`` compares a chunk at a time (no tensor the size of the input is
    made), in NumPy on one thread and in torch on several: across chunk boundaries, with NaN
    and ±inf at them, it returns what the plain ``nonzero(not |x| < t)`` returns, ascending;
    and the filters built on it (``sample``, ``reuse``) still pick the exact top-k of a
    tensor several chunks long."""
    from collectives.sparse.select import CHUNK, at_least, topk_indices

    n = 2 * CHUNK + 12345
    g = torch.Generator().manual_seed(8)
    x = torch.randn(n, generator=g)
    x[[0, CHUNK - 1, CHUNK, 2 * CHUNK, n - 1]] = torch.tensor([float("nan"), 5.0, -float("inf"), float("nan"), -3.0])
    k = n // 100
    # compared as magnitudes: of two equal magnitudes at the k-th place, either is right
    finite = torch.nan_to_num(x.abs(), nan=float("inf"))
    truth = torch.sort(torch.topk(finite, k).values).values

    def check(threads):
        for t in (0.0, 2.5, 4.0, float("inf")):
            plain = torch.nonzero(x.abs().lt(t).logical_not_()).view(-1)
            assert torch.equal(at_least(x, t), plain), f"threshold {t}, {threads} threads"
            assert torch.equal(at_least(x[:4093].half(), t), plain[plain < 4093]), f"half, {t}, {threads} threads"
        state: dict = {}
        for method in ("sample", "reuse", "reuse"):     # reuse: cold (a full top-k), then filtered
            picked = topk_indices(x, k, method, state)
            assert picked.unique().numel() == k, (method, threads)
            assert torch.equal(torch.sort(finite[picked]).values, truth), (method, threads)
        assert "threshold" in state
    _on_threads(check)


def test_the_flag_finder_finds_what_nonzero_finds():
    """``true_indices`` -- NumPy's ``flatnonzero`` on one thread, eight flags as one int64
    word on several -- must return exactly ``nonzero``'s ascending int64 indices: few flags
    or many, a length that is no multiple of 8, a view that does not start on a word,
    nothing set, all set."""
    from collectives.sparse.select import true_indices

    def check(threads):
        g = torch.Generator().manual_seed(9)
        for n in (0, 1, 7, 8, 9, 4093, 262144, 262151):
            for share in (0.0, 0.001, 0.01, 0.3, 1.0):
                mask = torch.rand(n, generator=g) < share
                if n:
                    mask[-1] = share > 0.2                  # the tail's last element, set or not
                assert torch.equal(true_indices(mask), torch.nonzero(mask).view(-1)), (n, share, threads)
                if n > 3:                                   # a view starting off a word boundary
                    assert torch.equal(true_indices(mask[3:]), torch.nonzero(mask[3:]).view(-1)), (n, share)
    _on_threads(check)


def test_a_bucket_sized_tensor_is_filtered_by_a_sample():
    """A DDP bucket of 1 MiB (262,144 floats) is below 4 × 64 Ki: ``sample`` estimates its
    threshold from every 8th element and still picks the exact top-k -- and a tensor below
    8 Ki elements gets no estimate (a plain top-k)."""
    from collectives.sparse.select import sample_threshold, topk_indices

    g = torch.Generator().manual_seed(10)
    x = torch.randn(262144, generator=g)
    k = 2622
    t = sample_threshold(x, k)
    assert t is not None and k <= int((x.abs() >= t).sum()) <= 2 * k
    picked = topk_indices(x, k, "sample")
    assert set(picked.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())
    assert sample_threshold(torch.randn(8191, generator=g), 82) is None


def test_a_rank_outside_the_group_touches_nothing(worlds):
    for rank, problems in enumerate(_ok(worlds(2), "outside_the_group_is_a_no_op")):
        assert not problems, f"rank {rank}: {problems}"


def test_int_min_is_sent_and_the_small_value_waits(worlds):
    for rank, problems in enumerate(_ok(worlds(2), "int_min_is_the_largest_magnitude")):
        assert not problems, f"rank {rank}: {problems}"


def test_split_with_ok_topk_balanced_pieces_is_the_same_sum(worlds):
    for rank, problems in enumerate(_ok(worlds(3), "split_with_balanced_pieces")):
        assert not problems, f"rank {rank}: {problems}"


def test_split_refuses_ranks_whose_sizes_differ_on_every_rank(worlds):
    for rank, message in enumerate(_ok(worlds(2), "split_with_sizes_that_differ_raises")):
        assert "different sizes" in message and "241" in message and "242" in message, f"rank {rank}: {message}"


@pytest.mark.parametrize("p", [2, 3])
def test_trace_bytes_match_the_cost_model(worlds, p):
    """The bytes each rank hands to each collective, against collectives.sparse.cost.sparse_cost."""
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
                # Pairs go to their owners (a message each); the reduced pieces come back by an
                # all-gather (of pairs; of dense pieces once they fill, which a ring all-gather in
                # place sends as p-1 chunks, one element shorter each where p does not divide n).
                # Small exchanges come on top: (count, n) to each peer, then one count gathered,
                # and threshold mode's count.
                sent = sum(event_bytes(x["kind"], x["nbytes"], p) for x in ev)
                small = p * cost.SPLIT_HEADER_BYTES + (p - 1) * 8 + ((p - 1) * 8 if threshold else 0)
                least = sum(to_others) * pair + (p - 1) * (gather - (e if dense else 0))
                most = sum(to_others) * pair + (p - 1) * gather + small
                assert least <= sent <= most, f"{where}: {sent} bytes on the wire, expected {least}..{most}"
                assert sum(to_others) <= kept, where
                # the model's gather term, given the fullest piece, is what the trace saw
                model = cost.sparse_cost("split", BYTES_N, width, p, e, union=union)
                scatter = (p - 1) / p * width * pair
                assert model.bytes_per_rank == pytest.approx(
                    scatter + (p - 1) * gather + (p - 1) * (cost.SPLIT_HEADER_BYTES + 8)), where


def test_async_all_reduce_returns_with_the_pairs_in_flight(worlds):
    for rank, res in enumerate(_ok(worlds(2), "async_returns_while_the_pairs_travel")):
        assert res["result"] is None and res["residual"], f"rank {rank}: {res}"
    assert _ok(worlds(2), "async_returns_while_the_pairs_travel")[0]["in_flight"], \
        "rank 0 started before rank 1 joined: its future cannot be done at return"


def test_residuals_follow_their_parameters_through_the_bucket_rebuild(worlds):
    res = _ok(worlds(1), "residuals_follow_their_parameters")[0]
    for reducer, r in res.items():
        first, later = r["layouts"][0], r["layouts"][-1]
        assert sorted(first) == sorted(later) and first != later, \
            f"{reducer}: the rebuild must change the bucket's order here, got {first} then {later}"
        for name, gap in r["gaps"].items():
            assert gap < 1e-12, f"{reducer}, {name}: raw gradients != delivered + its residual (off by {gap:.2e})"
    assert res["sparse_hook"]["layouts"][0] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert res["sparse_hook"]["layouts"][1] == ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]


def test_the_hook_reduces_over_the_group_its_state_carries(worlds):
    for rank, res in enumerate(_ok(worlds(2), "hook_reduces_over_the_state_group")):
        assert res["same"], f"rank {rank}: DDP on a group of one must train as if alone"
        assert "process group" in res["refused"], f"rank {rank}: {res['refused']}"


def test_a_hook_on_a_thread_of_its_own_trains_to_the_same_bits(worlds):
    for rank, res in enumerate(_ok(worlds(2), "hook_on_a_thread")):
        assert res["buckets"] > 1, f"rank {rank}: several buckets in flight were meant, got {res['buckets']}"
        assert res["same"] and res["moved"], f"rank {rank}: on a thread the model must train to the same bits"
        assert "a broken hook" in res["raised"], f"rank {rank}: the hook's exception must reach backward: " \
                                                 f"{res['raised']}"


def test_lesson6_reducer_with_sparse_buckets_at_density_one_is_dense_ddp(worlds):
    for rank, res in enumerate(_ok(worlds(2), "sparse_reducer")):
        assert res["vs_dense"] <= 1e-12, f"rank {rank}: differs from torch DDP by {res['vs_dense']:.2e}"


def test_dgc_selects_per_parameter_corrects_momentum_and_masks_it(worlds):
    for rank, res in enumerate(_ok(worlds(2), "dgc_corrections")):
        per = res["per_parameter"]
        assert per["counts"] == [1, 10, 14] and per["kept"] == 25 and per["largest"], f"rank {rank}: {per}"
        assert res["momentum_sgd_gap"] < 1e-12, f"rank {rank}: momentum correction at density 1 is momentum SGD"
        assert res["masked"], f"rank {rank}: a sent entry's velocity must be zero"
        assert res["steps"] == 4


def test_dgc_density_warms_up_geometrically():
    from collectives.sparse.dgc import DGCState
    state = DGCState(density=0.01, warmup_steps=4, warmup_density=0.25)
    seen = []
    for step in range(6):
        state.step = step
        seen.append(state.density_now())
    assert seen[0] == 0.25 and seen[4:] == [0.01, 0.01]
    assert seen[2] == pytest.approx((0.25 * 0.01) ** 0.5)       # halfway: the geometric mean


def check_mode_names_the_disagreement():
    """Ranks that disagree on the transport, the density, the threshold or the selection."""
    from collectives import ops
    from collectives.sparse import sparse_all_reduce
    rank = dist.get_rank()
    out = {}
    for name, mine in (("transport", dict(density=0.1, transport="split" if rank else "allgather")),
                       ("density", dict(density=0.1 if rank else 0.2)),
                       ("threshold", dict(threshold=1.0 if rank else 2.0)),
                       ("selection", dict(density=0.1, selection="sort" if rank else "topk"))):
        try:
            sparse_all_reduce(torch.ones(N), **mine)
            out[name] = "no error"
        except ops.ArgumentMismatch as exc:
            out[name] = str(exc)
    return out


def test_check_mode_names_ranks_that_disagree_on_transport_density_or_selection():
    for rank, res in enumerate(launch.run(check_mode_names_the_disagreement, 2, check=True, timeout=60)):
        for name, message in res.items():
            assert name in message and "disagree" in message, f"rank {rank}, {name}: {message}"


def test_auto_prices_the_processor_and_the_groups_own_link():
    """On 1 Gbit/s with pairs that cost 50 ns each to pack and add, the all-gather at 25 % loses
    to the dense ring (the wire alone says it ties); on NVLink-class links dense wins even at
    1 %; on the slow link at 1 % the all-gather wins."""
    nvlink = cost.AlphaBeta(alpha=10e-6, beta=1 / 150e9)
    compute = cost.SparseCompute(scan=1e-9, pick=5e-9, pair=50e-9)
    n, p = 16 << 20, 4
    assert cost.choose_transport(n, 0.25 * n, p, cost.GIGABIT, compute=compute) == "dense"
    assert cost.choose_transport(n, 0.01 * n, p, cost.GIGABIT, compute=compute) == "allgather"
    assert cost.choose_transport(n, 0.01 * n, p, nvlink, compute=compute) == "dense"
    assert cost.choose_transport(n, 0.25 * n, p, cost.GIGABIT) != "dense"      # the wire alone


def auto_follows_the_profile():
    from collectives.sparse import SparseProfile, measure_profile, sparse_all_reduce
    compute = cost.SparseCompute(scan=1e-9, pick=5e-9, pair=50e-9)
    slow, fast = SparseProfile(cost.GIGABIT, compute), SparseProfile(cost.AlphaBeta(10e-6, 1 / 150e9), compute)
    x = torch.randn(1 << 16)                  # large enough that bytes, not α, decide
    chosen = [sparse_all_reduce(x.clone(), density=d, transport="auto", profile=prof).transport
              for d, prof in ((0.01, slow), (0.25, slow), (0.01, fast))]
    measured = measure_profile()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, measured)
    return chosen, all(m == measured for m in every)


def test_auto_uses_the_given_profile_and_ranks_measure_the_same_one():
    for rank, (chosen, agreed) in enumerate(launch.run(auto_follows_the_profile, 2, timeout=60)):
        assert chosen == ["allgather", "dense", "dense"], f"rank {rank}: {chosen}"
        assert agreed, f"rank {rank}: a measured profile must be the same on every rank"


def test_cost_model_crossovers():
    link = cost.AlphaBeta(alpha=0.0, beta=1e-9)
    n = 16 << 20
    for p in (2, 4, 8):
        # all-gather of float32 pairs against the dense ring: density 1/p
        assert abs(cost.sparse_crossover(n, p, link) - 1 / p) < 1e-3 / p
        # 16-bit values: 6-byte pairs for 2 bytes of payload -> (2/3)/p
        assert abs(cost.sparse_crossover(n, p, link, value_bytes=2) - 2 / 3 / p) < 1e-3 / p
    # the split variant beats all-gather above about 1/p, and the dense ring below 1/2 (fp32)
    assert cost.choose_transport(n, 0.01 * n, 4, link) == "allgather"
    assert cost.choose_transport(n, 0.35 * n, 4, link) == "split"
    assert cost.choose_transport(n, 0.8 * n, 4, link) == "dense"


def test_processor_time_moves_the_crossover_down_by_what_it_costs():
    """The processor's part of the model (collectives.sparse.cost.SparseCompute): with work per
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
    assert cost.sparse_crossover(n, p, link, transport="best") > cost.sparse_crossover(n, p, link)
    # against a measured time instead of the dense model
    assert cost.sparse_crossover(n, p, link, against_seconds=dense / 2) < wire_only

# ---- convergence: what error feedback buys, on real data ------------------------------------

# Measured with these settings (4 ranks, seed 0, the lab's MLP, 12 epochs of plain SGD at lr
# 0.5, 64 examples per rank per step, an evaluation after every step): the mean test accuracy
# of the last epoch's evaluations, dense 0.918, top-k 1 % with error feedback 0.917, without
# it 0.665. The assertions keep the measured gaps with margins: within 1.5 points with
# feedback, at least 10 points worse without. (Five seeds, both models and every run of the
# lab are bench-sparse-train's, not a test's.)
CONVERGENCE = dict(model="mlp", optimizer="sgd", momentum=0.0, lr=0.5, batch=64, epochs=12, evals_per_epoch=5,
                   seed=0)


def test_top_k_with_error_feedback_converges_like_dense_and_without_it_does_not():
    pytest.importorskip("sklearn", reason="the lab extra: pip install -e '.[lab]' (make test installs it)")
    from collectives.sparse import lab
    res = lab.compare(runs=("dense", "topk_ef", "topk_no_ef"), **CONVERGENCE)
    dense, ef, no_ef = (res[r]["final"] for r in ("dense", "topk_ef", "topk_no_ef"))
    assert dense >= 0.9, f"dense should learn load_digits: {dense:.3f}"
    assert ef >= dense - 0.015, f"top-k 1% with error feedback {ef:.3f} vs dense {dense:.3f}"
    assert no_ef <= dense - 0.10, f"top-k 1% without error feedback {no_ef:.3f} vs dense {dense:.3f}"
    # bytes on the wire per step and rank: its k = 49 pairs of 8 bytes, passed on 3 times by a ring all-gather
    assert res["topk_ef"]["bytes_per_step"] == 3 * 49 * 8 and res["dense"]["params"] == 4810


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
    for variant in TRANSPORTS:
        for mode in MODES:
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                x_in, r_in = _with_residual(rank, dtype)
                t, r = x_in.to(device), r_in.to(device)
                sparse_all_reduce(t, r, transport=variant, **mode)
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


# ---- bench-sparse-train's arithmetic (no world: a record made up here) -----------------------------

def test_time_to_accuracy_targets_and_the_winner_from_a_record():
    """The target is dense's final accuracy (mean of seeds) less one point; time to accuracy is
    the training time at the first evaluation that reaches it, averaged over the seeds that
    do; the winner is the fastest run every seed of which reaches it."""
    from collectives.course.benchmarks import sparse_train as stb

    def run(name, seed, curve, steps=30):
        return dict(run=name, model="wide", optimizer="sgd", seed=seed, curve=curve, steps=steps,
                    seconds=curve[-1][1], final=curve[-1][2], bytes_per_step=1000.0, complete=True)
    runs = [run("dense", 0, [(10, 1.0, 0.80), (20, 2.0, 0.95), (30, 3.0, 0.97)]),
            run("dense", 1, [(10, 1.2, 0.85), (20, 2.4, 0.96), (30, 3.6, 0.95)]),
            run("bf16", 0, [(10, 0.6, 0.80), (20, 1.2, 0.955), (30, 1.8, 0.97)]),
            run("bf16", 1, [(10, 0.6, 0.96), (20, 1.2, 0.96), (30, 1.8, 0.96)]),
            run("dgc", 0, [(10, 0.2, 0.70), (20, 0.4, 0.90), (30, 0.6, 0.951)]),
            run("dgc", 1, [(10, 0.2, 0.70), (20, 0.4, 0.96), (30, 0.6, 0.96)]),
            run("topk_ef", 0, [(10, 0.1, 0.96), (20, 0.2, 0.97), (30, 0.3, 0.97)]),
            run("topk_ef", 1, [(10, 0.1, 0.70), (20, 0.2, 0.80), (30, 0.3, 0.90)])]
    targets = stb.targets_from(runs)
    assert targets["wide/sgd"] == pytest.approx((0.97 + 0.95) / 2 - 0.01)          # 0.95
    assert stb.time_to(runs[0]["curve"], 0.95) == 2.0 and stb.time_to(runs[7]["curve"], 0.95) is None
    rows = stb.summarize(runs, targets)["wide/sgd"]["runs"]
    assert rows["dense"]["time_mean"] == pytest.approx(2.2) and rows["dense"]["vs_dense"] == pytest.approx(1.0)
    assert rows["bf16"]["time_mean"] == pytest.approx(0.9) and rows["dgc"]["time_mean"] == pytest.approx(0.5)
    assert rows["topk_ef"]["reached"] == 1 and "vs_dense" not in rows["topk_ef"]      # one seed never gets there
    assert rows["dgc"]["final_mean"] == pytest.approx(0.9555)
    w = stb.winner(stb.summarize(runs, targets))
    assert w["fastest"] == "dgc" and w["best_sparse"] == "dgc"
    assert w["best_sparse_vs_dense"] == pytest.approx(0.5 / 2.2)
    assert w["best_sparse_vs_bf16"] == pytest.approx(0.5 / 0.9)
    record = dict(command="python -m collectives bench-sparse-train", device="a CPU", torch="2.x", date="today",
                  settings=dict(stb.SETTINGS, seeds=2), links={"1gbit": dict(runs=runs)}, targets=targets,
                  summary={"1gbit": stb.summarize(runs, targets)}, winner={"1gbit": w})
    text = stb.snippet(record)
    assert "Fastest to the target at 1gbit (wide, sgd): **dgc**" in text and "0.23× dense's time" in text
    assert "| topk_ef | 0.10 ± 0.00 s | 1 of 2 | -- |" in text


def test_the_exercise_names_its_arguments_and_defaults_as_the_reference_does():
    """``transport`` and ``selection`` mean one thing each, with the same defaults, in the
    stubs and in the reference (and so on the page and in the lab, which call them)."""
    import dataclasses
    import inspect

    from collectives.course.impl import load_module
    reference = load_module("collectives.sparse")
    exercise = load_module("lessons/08_sparse/exercise.py")
    for name in ("threshold_indices", "topk_indices", "pack_pairs", "allgather_sum_", "sparse_all_reduce",
                 "sparse_all_reduce_async", "split_sum_", "sparse_hook", "sparse_hook_async",
                 "register_sparse_hook", "topk_per_segment", "dgc_hook", "keep_count", "unpack_pairs"):
        ours, theirs = inspect.signature(getattr(exercise, name)), inspect.signature(getattr(reference, name))
        def default(value):             # a function default (the hook) compared by its name
            return getattr(value, "__name__", value) if callable(value) else value
        mine = {k: default(p.default) for k, p in ours.parameters.items()}
        ref = {k: default(p.default) for k, p in theirs.parameters.items()}
        extra = {k for k in ref if k not in mine}
        assert extra <= {"bounds"}, f"{name}: the exercise lacks {extra}"
        assert {k: v for k, v in ref.items() if k in mine} == {k: v for k, v in mine.items() if k in ref}, name
    for cls in ("SparseHookState", "DGCState"):
        fields = [(f.name, f.default) for f in dataclasses.fields(getattr(exercise, cls))]
        assert fields == [(f.name, f.default) for f in dataclasses.fields(getattr(reference, cls))], cls
    assert inspect.signature(reference.sparse_all_reduce).parameters["transport"].default == "allgather"
    assert inspect.signature(reference.sparse_all_reduce).parameters["selection"].default == "auto"


def test_the_labs_switch_runs_the_exercises_hooks_and_names_an_unwritten_task():
    """With IMPL = "exercise" the lab trains with the exercise's hooks (``hooks=``), and a cell
    that needs a stub stops naming its task (``Lab.target``) instead of running the reference."""
    from types import SimpleNamespace

    from collectives.course.impl import Lab, TaskNotWritten
    from collectives.sparse import lab

    class Mine:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    def my_hook(state, bucket):
        raise AssertionError("not called here")
    state, hook, _ = lab.hook_for("topk_ef", hooks=SimpleNamespace(SparseHookState=Mine, sparse_hook_async=my_hook))
    assert isinstance(state, Mine) and hook is my_hook and state.kwargs["error_feedback"]
    state, hook, momentum = lab.hook_for("dgc", hooks=SimpleNamespace(DGCState=Mine, dgc_hook=my_hook))
    assert isinstance(state, Mine) and hook is my_hook and momentum == 0.0
    assert state.kwargs["factor_masking"] and state.kwargs["momentum"] == 0.9
    state, _, momentum = lab.hook_for("dgc_no_mask", hooks=SimpleNamespace(DGCState=Mine, dgc_hook=my_hook))
    assert not state.kwargs["factor_masking"] and state.kwargs["momentum"] == 0.9 and momentum == 0.0
    exercise = Lab(8, "exercise")                      # the pristine stubs
    for name, task in (("sparse_hook_async", 5), ("split_sum_", 4)):
        with pytest.raises(TaskNotWritten, match=f"{name} is not written yet .Lesson 8, task {task}"):
            exercise.target(name)
    assert exercise.target("unpack_pairs").endswith(":unpack_pairs")      # given: the reference's


def _train_to_targets():
    from collectives.sparse import lab
    data = lab.load_digits_split(0)
    common = dict(run="dense", model="mlp", epochs=1, batch=64, evals_per_epoch=2, data=data)
    return dict(unreached=lab.train(target=2.0, max_epochs=2, **common),
                stopped=lab.train(target=0.0, stop_at_target=True, max_epochs=2, **common),
                plain=lab.train(**common))


def test_a_time_to_accuracy_run_trains_past_its_epochs_and_stops_at_its_target():
    """bench-sparse-train's runs: one that has not reached its target when its epochs are over
    trains on, up to ``max_epochs`` (its final accuracy still epoch ``epochs``'s); with
    ``stop_at_target`` it stops at the first evaluation that reaches it (no final accuracy)."""
    pytest.importorskip("sklearn", reason="the lab extra: pip install -e '.[lab]' (make test installs it)")
    res = launch.run(_train_to_targets, 1, timeout=120)[0]
    plain, unreached, stopped = res["plain"], res["unreached"], res["stopped"]
    assert unreached["steps"] == 2 * plain["steps"] and unreached["final"] == plain["final"] is not None
    assert stopped["steps"] == plain["steps_per_epoch"] // 2 and stopped["final"] is None


def test_bench_sparse_train_records_say_what_the_json_says(tmp_path):
    """The figures' records are made from a bench-sparse-train JSON: the measurement's meta,
    each link's times with their winner, the ratios to dense, the Measured table; and a
    sentence that compares the runs the other way round is caught."""
    import matplotlib
    matplotlib.use("Agg")
    from collectives.course.benchmarks import sparse_record
    from collectives.course.benchmarks import sparse_train as stb
    from collectives.course.site import claims

    def run(name, seed, curve):
        return dict(run=name, model="wide", optimizer="sgd", seed=seed, curve=curve, steps=30, steps_per_epoch=10,
                    seconds=curve[-1][1], final=curve[-1][2], bytes_per_step=1000.0, complete=True)
    runs = [run("dense", s, [(10, 1.0, 0.80), (20, 2.0, 0.95), (30, 3.0, 0.97)]) for s in (0, 1)]
    runs += [run("topk_ef", s, [(10, 0.5, 0.80), (20, 1.0, 0.90), (30, 1.5, 0.96)]) for s in (0, 1)]
    targets = stb.targets_from(runs)
    summary = stb.summarize(runs, targets)
    record = dict(command=".venv/bin/python -m collectives bench-sparse-train", device="Some CPU, 16 cores",
                  torch="2.x", date="2026-01-01T00:00+00:00", settings=dict(stb.SETTINGS, seeds=2),
                  links={"1gbit": dict(runs=runs)}, targets=targets, summary={"1gbit": summary},
                  winner={"1gbit": stb.winner(summary)})
    sparse_record.train_figures(record, tmp_path, "draw")
    made = claims.load("08-time-to-accuracy", tmp_path)
    assert made["meta"]["device"] == "16-core x86 host (Some CPU)" and made["meta"]["command"] == record["command"]
    assert not claims.record_problems(made) and (tmp_path / made["image"]).exists()
    one = next(c for c in made["comparisons"] if c["id"] == "1gbit")
    assert one["values"] == {"dense": pytest.approx(3.0), "topk_ef": pytest.approx(1.5)}
    assert one["order"][0] == "topk_ef"
    assert "top-k with error feedback 2.00×" not in one["text"] and "ran 2.00× as fast as dense fp32" in one["text"]
    ratios = next(c for c in made["comparisons"] if c["id"] == "1gbit-ratios")["text"]
    assert ratios.endswith("top-k with error feedback 0.50×.")
    assert made["table"]["rows"][1][:4] == ["top-k with error feedback", "1 kB", "1.5 s", "0.50×"]
    assert claims.contradictions("Dense fp32 is faster than top-k with error feedback.", [made])
    assert not claims.contradictions("Top-k with error feedback is faster than dense.", [made])
    final = claims.load("08-convergence", tmp_path)["comparisons"][0]
    assert final["accuracy"]["topk_ef"] == pytest.approx(0.96) and "dense fp32 0.970" in final["text"]


def test_a_final_accuracy_comes_only_from_runs_trained_to_the_end():
    """On a later link a run stops at the target; one seed that needed more than the epochs
    to get there also has a final accuracy. The summary must not let that one seed stand for
    the runs trained to the end (the published tables once did: ``± 0.000`` from one seed)."""
    from collectives.course.benchmarks import sparse_train as stb

    def run(seed, final, complete):
        return dict(run="topk_ef", model="cnn", optimizer="sgd", seed=seed, curve=[(10, 1.0, 0.6)], steps=10,
                    steps_per_epoch=10, seconds=1.0, final=final, bytes_per_step=1.0, complete=complete)
    full = [run(0, 0.90, True), run(1, 0.94, True)]
    stopped = [run(0, None, False), run(1, 0.99, False)]       # seed 1 ran past the epochs to its target
    record = dict(links={"1gbit": dict(runs=full), "10gbit": dict(runs=stopped)}, targets={"cnn/sgd": 0.5},
                  summary={}, winner={}, headline="cnn/sgd", settings=dict(stb.SETTINGS, seeds=2),
                  command="x", device="d", torch="t", date="2026-01-01")
    stb.refresh(record)
    assert record["summary"]["1gbit"]["cnn/sgd"]["runs"]["topk_ef"]["final_mean"] == pytest.approx(0.92)
    assert "final_mean" not in record["summary"]["10gbit"]["cnn/sgd"]["runs"]["topk_ef"]
    assert "| topk_ef | 0.920 ± 0.028 |" in stb.snippet(record)
