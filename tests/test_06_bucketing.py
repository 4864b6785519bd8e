"""Lesson 6: the bucketed reducer trains exactly like torch DDP and like one process.

Every check runs inside one world per world size (2 and 4 gloo ranks); the tests assert
on what the ranks returned. Each check gets its own process group with a short timeout,
so an implementation that leaves one check half-way cannot hang the next one.

Models are float64 and tiny. A step reduces float64 gradients: at 2 ranks the reducer and
torch DDP give bit-identical parameters (the same two numbers are added); at 4 ranks gloo
may add the four contributions in another order when the bucket layouts differ, and the
single-process run computes the mean over the full batch directly -- so parameters are
compared within TOL, a few hundred ulps of values of order 1.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo  # noqa: F401 - torch DDP imports it on first use (3 s): once, before the worlds fork
import torch.distributed as dist
import torch.nn.functional as F

from collectives import bucketing as reference
from collectives import launch, trace
from collectives.bucketing.models import BranchNet, SmallMLP, TiedNet, TwoBranchNet
from collectives.course.catalog import world_timeout
from collectives.course.impl import resolve

from . import workers

LESSON = 6
TOL = 1e-12
MiB = 1 << 20
# SmallMLP in float64, backward order (last registered first): fc3.bias 32 B, fc3.weight
# 512 B, fc2.bias 128 B, fc2.weight 2048 B, fc1.bias 128 B, fc1.weight 1024 B = 3872 B.
ONE_BUCKET = 1.0              # 1 MiB >> 3872 B: everything fits in one bucket
TWO_BUCKETS = 2720 / MiB      # 32+512+128+2048 = 2720 closes bucket 0; the last 1152 B stay open
THREE_BUCKETS = 544 / MiB     # 32+512 = 544, 128+2048 >= 544, 128+1024 >= 544
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


# ---- helpers that run inside the ranks ------------------------------------------------

def _ddp(model, group, **kwargs):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, process_group=group, **kwargs)


def _batches(steps: int, rows_per_rank: int, seed: int = 0, d_in: int = 8, d_out: int = 4):
    """Per step: this rank's shard and the full global batch (the same on every rank)."""
    p, r = dist.get_world_size(), dist.get_rank()
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(seed + s)
        x = torch.randn(p * rows_per_rank, d_in, generator=g, dtype=torch.float64)
        y = torch.randn(p * rows_per_rank, d_out, generator=g, dtype=torch.float64)
        rows = slice(r * rows_per_rank, (r + 1) * rows_per_rank)
        out.append(((x[rows], y[rows]), (x, y)))
    return out


def _train(model, batches, lr=0.1, set_to_none=True, **fwd):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad(set_to_none=set_to_none)
        F.mse_loss(model(x, **fwd), y).backward()
        opt.step()


def _max_diff(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _grad_diff(a, b) -> float:
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters()):
        if (p.grad is None) != (q.grad is None):
            return float("inf")
        if p.grad is not None:
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst


def _three(model_cls, seed=0):
    torch.manual_seed(seed)
    m = model_cls().double()
    return m, copy.deepcopy(m), copy.deepcopy(m)


def _events(t):
    return [dict(kind=e.kind, label=e.label, nbytes=e.nbytes, t0=e.t0) for e in t.collectives()]


# ---- task 1: bucket assignment ------------------------------------------------------------

@check
def reducer_layouts(impl, group):
    Reducer = resolve(impl + ":BucketedReducer")
    out = {}
    for name, cap in (("one", ONE_BUCKET), ("two", TWO_BUCKETS), ("three", THREE_BUCKETS)):
        r = Reducer(SmallMLP().double(), bucket_cap_mb=cap, first_bucket_cap_mb=cap, group=group)
        out[name] = r.bucket_indices
        r.close()
    frozen = SmallMLP().double()
    frozen.fc1.requires_grad_(False)
    r = Reducer(frozen, bucket_cap_mb=THREE_BUCKETS, first_bucket_cap_mb=THREE_BUCKETS, group=group)
    out["frozen"] = (len(r.params), r.bucket_indices)
    r.close()
    r = Reducer(TiedNet().double(), bucket_cap_mb=ONE_BUCKET, group=group)
    out["tied"] = (len(r.params), r.bucket_indices)
    r.close()
    try:
        Reducer(SmallMLP(), bucket_cap_mb=0, group=group)
        out["bad_cap"] = "accepted"
    except ValueError:
        out["bad_cap"] = "ValueError"
    return out


# ---- task 2: hooks, mark ready, launch in bucket order --------------------------------------

@check
def launches_in_order_during_backward(impl, group):
    Reducer = resolve(impl + ":BucketedReducer")
    torch.manual_seed(0)
    r = Reducer(SmallMLP().double(), bucket_cap_mb=THREE_BUCKETS, first_bucket_cap_mb=THREE_BUCKETS,
                group=group)
    (x, y), _ = _batches(1, 4)[0]
    with trace.recording() as t:
        try:
            F.mse_loss(r(x), y).backward()
        except NotImplementedError:
            pass       # the end-of-backward step is task 3: the launches are already in the trace
    return dict(events=_events(t), last_hook=max(r.stats.param_ready.values()))


@check
def launches_in_order_when_hooks_are_not(impl, group):
    Reducer = resolve(impl + ":BucketedReducer")
    torch.manual_seed(0)
    # One parameter per bucket (1-byte caps), in reversed registration order: head, g2, g1,
    # f2, f1. Forward computes g, then f: backward produces f's gradients before g's.
    r = Reducer(TwoBranchNet().double(), bucket_cap_mb=1 / MiB, first_bucket_cap_mb=1 / MiB, group=group)
    x = torch.randn(4, 8, dtype=torch.float64)
    with trace.recording() as t:
        try:
            r(x, f_first=False).sum().backward()
        except NotImplementedError:
            pass
    return dict(events=_events(t), layout=r.bucket_indices, ready=r.stats.param_ready)


# ---- task 3: finalize, write back -------------------------------------------------------------

def _trains_like_ddp_and_one_process(impl, group, steps):
    Reducer = resolve(impl + ":BucketedReducer")
    out = {}
    for name, cap, view in (("3 buckets", THREE_BUCKETS, False), ("1 bucket", ONE_BUCKET, False),
                            ("2 buckets, gradient_as_bucket_view", TWO_BUCKETS, True)):
        ours, theirs, single = _three(SmallMLP)
        batches = _batches(steps, 4)
        shards = [b for b, _ in batches]
        r = Reducer(ours, bucket_cap_mb=cap, first_bucket_cap_mb=cap, gradient_as_bucket_view=view,
                    group=group)
        d = _ddp(theirs, group, bucket_cap_mb=cap, gradient_as_bucket_view=view)
        for model in (r, d):
            # zero_grad(set_to_none=False) keeps a bucket-view .grad; True drops it: both must work
            _train(model, shards[:3], set_to_none=False)
            _train(model, shards[3:], set_to_none=True)     # (steps 4 and 5, when there are)
        _train(single, [full for _, full in batches])
        out[name] = dict(vs_ddp=_max_diff(ours, theirs), vs_single=_max_diff(ours, single),
                         grads_vs_ddp=_grad_diff(ours, theirs),
                         storages=len({q.grad.untyped_storage().data_ptr() for q in r.params}),
                         buckets=len(r.bucket_indices))
        r.close()
    return out


@check
def bucket_view_steps_bit_for_bit_like_ddp(impl, group):
    """float32, gradient_as_bucket_view, 3 steps keeping .grad (zero_grad(set_to_none=False)):
    from the second step on each gradient is accumulated inside its bucket and must be
    divided by p there exactly as DDP does (div_, not mul_ by 1/p: they differ at p = 3).

    One weight, so that both reducers hold it in one bucket of the same size from the first
    step (torch DDP's first bucket layout differs from ours, see the lesson page): gloo then
    adds the p contributions in the same order for both, and any difference is arithmetic."""
    Reducer = resolve(impl + ":BucketedReducer")
    torch.manual_seed(0)
    ours = torch.nn.Linear(8, 4, bias=False)
    theirs = copy.deepcopy(ours)
    r = Reducer(ours, bucket_cap_mb=4096 / MiB, first_bucket_cap_mb=2048 / MiB,
                gradient_as_bucket_view=True, group=group)
    d = _ddp(theirs, group, bucket_cap_mb=4096 / MiB, gradient_as_bucket_view=True)
    batches = [tuple(t.float() for t in b) for b, _ in _batches(3, 4)]
    grads = []
    for model in (r, d):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        per_step = []
        for x, y in batches:
            opt.zero_grad(set_to_none=False)
            F.mse_loss(model(x), y).backward()
            per_step.append(model.module.weight.grad.clone())
            opt.step()
        grads.append(per_step)
    r.close()
    return dict(grad_elements_differing=[int((a != b).sum()) for a, b in zip(*grads)],
                param_elements_differing=int((ours.weight != theirs.weight).sum()))


def _frozen_and_tied_parameters(impl, group, steps):
    Reducer = resolve(impl + ":BucketedReducer")
    out = {}
    ours, theirs, _ = _three(SmallMLP)
    for m in (ours, theirs):
        m.fc1.requires_grad_(False)
    before = ours.fc1.weight.detach().clone()
    batches = [b for b, _ in _batches(steps, 4)]
    _train(Reducer(ours, bucket_cap_mb=THREE_BUCKETS, group=group), batches)
    _train(_ddp(theirs, group, bucket_cap_mb=THREE_BUCKETS), batches)
    out["frozen"] = dict(vs_ddp=_max_diff(ours, theirs), grads_vs_ddp=_grad_diff(ours, theirs),
                         frozen_moved=(ours.fc1.weight - before).abs().max().item(),
                         frozen_grad_is_none=ours.fc1.weight.grad is None)
    ours, theirs, _ = _three(TiedNet)
    g = torch.Generator().manual_seed(dist.get_rank())
    for model in (Reducer(ours, bucket_cap_mb=ONE_BUCKET, group=group), _ddp(theirs, group)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            g.manual_seed(100 * step + dist.get_rank())
            tokens = torch.randint(10, (5,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(tokens), tokens).backward()
            opt.step()
    out["tied"] = dict(vs_ddp=_max_diff(ours, theirs), grads_vs_ddp=_grad_diff(ours, theirs),
                       still_tied=ours.out.weight is ours.embed.weight)
    return out


# Task 3 is checked on one step (gradients and parameters after it); several steps need the
# rebuild before the second forward, so they are task 4's.

@check
def one_step_like_ddp_and_one_process(impl, group):
    return _trains_like_ddp_and_one_process(impl, group, steps=1)


@check
def one_step_frozen_and_tied(impl, group):
    return _frozen_and_tied_parameters(impl, group, steps=1)


# ---- task 4: rebuild from the observed order, then train on -----------------------------------

@check
def several_steps_like_ddp_and_one_process(impl, group):
    return _trains_like_ddp_and_one_process(impl, group, steps=5)


@check
def several_steps_frozen_and_tied(impl, group):
    return _frozen_and_tied_parameters(impl, group, steps=3)


@check
def rebuild_follows_rank0_order(impl, group):
    Reducer = resolve(impl + ":BucketedReducer")
    ours, theirs, _ = _three(TwoBranchNet)
    # Even and odd ranks see different orders; rank 0's (f's gradients first) is not the
    # reversed registration order the reducer starts from.
    f_first = dist.get_rank() % 2 == 1
    seen = []
    index = {id(p): i for i, p in enumerate(ours.parameters())}
    handles = [p.register_post_accumulate_grad_hook(lambda p: seen.append(index[id(p)]))
               for p in ours.parameters()]
    # 136 B closes a bucket at a weight (512 B) and its bias (64 B), or head's (128 + 16 B):
    # about two tensors per bucket, so the layout shows the order they arrived in.
    cap = 136 / MiB
    r = Reducer(ours, bucket_cap_mb=cap, first_bucket_cap_mb=cap, group=group)
    layouts = [r.bucket_indices]
    x, y = _batches(4, 4, d_out=2)[0][0]
    opt = torch.optim.SGD(r.parameters(), lr=0.1)
    broadcasts = []
    for step in range(4):
        opt.zero_grad()
        with trace.recording() as t:
            F.mse_loss(r(x, f_first=f_first), y).backward()
        broadcasts.append(len(t.of_kind("broadcast")))
        opt.step()
        layouts.append(r.bucket_indices)
        if step == 0:
            for h in handles:
                h.remove()
    d = _ddp(theirs, group, bucket_cap_mb=cap)
    opt = torch.optim.SGD(d.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        F.mse_loss(d(x, f_first=f_first), y).backward()
        opt.step()
    expected = reference.assign_buckets(list(ours.parameters()), int(cap * MiB), int(cap * MiB), seen)
    return dict(seen=seen, layouts=layouts, broadcasts=broadcasts, vs_ddp=_max_diff(ours, theirs),
                layout_from_my_order=expected)


# ---- task 5: unused parameters --------------------------------------------------------------

@check
def unused_parameters(impl, group):
    Reducer = resolve(impl + ":BucketedReducer")
    ours, theirs, _ = _three(BranchNet)
    use_b = dist.get_rank() == 0     # branch_b: used on rank 0 only; `never`: used nowhere
    batches = [b for b, _ in _batches(3, 4)]
    # 288 B = never.bias (32 B) + never.weight (256 B): bucket 0 holds exactly the unused layer.
    cap = 288 / MiB
    r = Reducer(ours, bucket_cap_mb=cap, first_bucket_cap_mb=cap, find_unused_parameters=True, group=group)
    d = _ddp(theirs, group, bucket_cap_mb=cap, find_unused_parameters=True)
    names = [n for n, _ in ours.named_parameters()]
    grads, events, last_hook = [], [], None
    layouts = []
    for model, opt in ((r, torch.optim.SGD(r.parameters(), lr=0.1)), (d, torch.optim.SGD(d.parameters(), lr=0.1))):
        for step, (x, y) in enumerate(batches):
            opt.zero_grad()
            with trace.recording() as t:
                F.mse_loss(model(x, use_b=use_b), y).backward()
            if model is r:
                layouts.append((r.bucket_indices, len(t.of_kind("broadcast"))))
            if step == 0:
                grads.append({n: None if p.grad is None else p.grad.clone()
                              for n, p in zip(names, model.module.parameters())})
                if model is r:
                    events, last_hook = _events(t), max(r.stats.param_ready.values())
                    layout = r.bucket_indices
            opt.step()
    none_in_ours = sorted(n for n, g in grads[0].items() if g is None)
    none_in_ddp = sorted(n for n, g in grads[1].items() if g is None)
    grad_diff = max((grads[0][n] - grads[1][n]).abs().max().item()
                    for n in names if grads[0][n] is not None and grads[1][n] is not None)
    # Without find_unused_parameters, a parameter without a gradient is an error, on every rank.
    strict = Reducer(BranchNet().double(), bucket_cap_mb=THREE_BUCKETS, group=group)
    x, y = batches[0]
    try:
        F.mse_loss(strict(x), y).backward()
        strict_error = ""
    except RuntimeError as exc:
        strict_error = str(exc)
    return dict(none_in_ours=none_in_ours, none_in_ddp=none_in_ddp, grad_diff=grad_diff,
                vs_ddp=_max_diff(ours, theirs), events=events, last_hook=last_hook,
                layout=layout, names=[n for n, p in ours.named_parameters()],
                strict_error=strict_error, layouts=layouts)


# ---- task 6: no_sync -----------------------------------------------------------------------

@check
def no_sync_accumulates_then_reduces_the_sum(impl, group):
    Reducer = resolve(impl + ":BucketedReducer")
    ours, theirs, single = _three(SmallMLP)
    r = Reducer(ours, bucket_cap_mb=THREE_BUCKETS, first_bucket_cap_mb=THREE_BUCKETS, group=group)
    d = _ddp(theirs, group, bucket_cap_mb=THREE_BUCKETS)
    batches = _batches(6, 3)
    reduced_inside = 0
    for model, plain in ((r, False), (d, False), (single, True)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for round_ in range(2):                        # 2 rounds of 3 micro-batches
            opt.zero_grad()
            for micro in range(3):
                (x, y), full = batches[3 * round_ + micro]
                if plain:
                    F.mse_loss(model(full[0]), full[1]).backward()
                elif micro < 2:
                    with model.no_sync(), trace.recording() as t:
                        F.mse_loss(model(x), y).backward()
                    if model is r:
                        reduced_inside += len(t.of_kind("all_reduce"))
                else:
                    F.mse_loss(model(x), y).backward()
            opt.step()
    # A parameter used only inside no_sync() (branch_b, on rank 0) is still reduced at the
    # synced step; one used nowhere keeps grad None.
    unused = Reducer(BranchNet().double(), bucket_cap_mb=THREE_BUCKETS, find_unused_parameters=True,
                     group=group)
    (x, y), _ = batches[0]
    with unused.no_sync():
        F.mse_loss(unused(x, use_b=dist.get_rank() == 0), y).backward()
    F.mse_loss(unused(x, use_b=False), y).backward()
    m = unused.module
    return dict(vs_ddp=_max_diff(ours, theirs), vs_single=_max_diff(ours, single),
                reduced_inside=reduced_inside,
                branch_b_reduced=m.branch_b.weight.grad is not None,
                never_none=m.never.weight.grad is None)


# ---- beyond gradients: buffers, sparse gradients --------------------------------------------

class _NormNet(torch.nn.Module):
    """A BatchNorm between two layers: running statistics are buffers, updated by forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


@check
def buffers_follow_rank0_like_ddp(impl, group):
    Reducer = resolve(impl + ":BucketedReducer")
    ours, theirs, _ = _three(_NormNet)
    batches = [b for b, _ in _batches(3, 4)]
    r = Reducer(ours, bucket_cap_mb=ONE_BUCKET, group=group)
    _train(r, batches)
    _train(_ddp(theirs, group), batches)
    buffers = [(name, (a - b).abs().max().item()) for (name, a), b in zip(ours.named_buffers(), theirs.buffers())]
    r.close()
    try:
        Reducer(torch.nn.Embedding(10, 4, sparse=True).double(), group=group)
        sparse = "accepted"
    except ValueError as exc:
        sparse = str(exc)
    return dict(buffers=buffers, vs_ddp=_max_diff(ours, theirs), sparse=sparse)


# ---- the world --------------------------------------------------------------------------

def _run_checks(impl: str, names: list[str]) -> dict:
    return workers.run_named_checks(CHECKS, impl, names)


@pytest.fixture(scope="module")
def worlds(impl):
    """``worlds(p)``: every rank's results of every check, from one world of ``p`` ranks.

    If that world dies -- gloo aborts a process whose all-reduces do not match its peers' --
    each check is run again in a world of its own, so a crash costs only the checks it hit.
    """
    cache = {}

    def get(p):
        if p not in cache:
            names = [fn.__name__ for fn in CHECKS]
            try:
                cache[p] = launch.run(_run_checks, p, args=(impl, names), timeout=world_timeout(120))
            except (launch.RankError, launch.WorldTimeout):
                per_rank = [{} for _ in range(p)]
                for name in names:
                    try:
                        results = launch.run(_run_checks, p, args=(impl, [name]), timeout=world_timeout(60))
                        for rank, res in enumerate(results):
                            per_rank[rank].update(res)
                    except (launch.RankError, launch.WorldTimeout) as exc:
                        for res in per_rank:
                            res[name] = dict(error=str(exc))
                cache[p] = per_rank
        return cache[p]
    return get


def _ok(per_rank: list[dict], name: str) -> list[dict]:
    for rank, res in enumerate(per_rank):
        assert "error" not in res[name], f"rank {rank}: {res[name].get('error')}"
    return [res[name] for res in per_rank]


WORLDS = pytest.mark.parametrize("p", [2, 3, 4])


# ---- the tests ----------------------------------------------------------------------------

@pytest.mark.task(lesson=6, task=1, points=4, title="assign_buckets")
def test_buckets_fill_in_reverse_registration_order_up_to_the_cap(impl):
    assign = resolve(impl + ":assign_buckets")
    params = list(SmallMLP().double().parameters())   # indices 0..5: fc1.w fc1.b fc2.w fc2.b fc3.w fc3.b
    assert assign(params, MiB, MiB) == [[5, 4, 3, 2, 1, 0]]
    assert assign(params, 2720, 2720) == [[5, 4, 3, 2], [1, 0]]
    assert assign(params, 544, 544) == [[5, 4], [3, 2], [1, 0]]
    # a 32-byte first bucket holds fc3.bias alone, the rest fit under 1 MiB
    assert assign(params, MiB, 32) == [[5], [4, 3, 2, 1, 0]]
    # an explicit order (forward order here): fc1.w is 1024 B >= 544 on its own
    assert assign(params, 544, 544, order=[0, 1, 2, 3, 4, 5]) == [[0], [1, 2], [3, 4], [5]]


@pytest.mark.task(lesson=6, task=1, points=4, title="assign_buckets")
def test_each_dtype_gets_its_own_buckets(impl):
    assign = resolve(impl + ":assign_buckets")
    tensors = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4),
               torch.zeros(4, dtype=torch.float64)]
    # reversed order meets index 3 (float64) first, so the float64 bucket is bucket 0
    assert assign(tensors, MiB, MiB) == [[3, 1], [2, 0]]


@WORLDS
@pytest.mark.task(lesson=6, task=1, points=4, title="assign_buckets")
def test_reducer_bucket_counts_frozen_and_tied(worlds, p):
    for res in _ok(worlds(p), "reducer_layouts"):
        assert res["one"] == [[5, 4, 3, 2, 1, 0]]
        assert res["two"] == [[5, 4, 3, 2], [1, 0]]
        assert res["three"] == [[5, 4], [3, 2], [1, 0]]
        n_frozen, layout = res["frozen"]
        assert n_frozen == 4 and sorted(i for b in layout for i in b) == [0, 1, 2, 3], \
            "fc1 is frozen: only fc2 and fc3 (4 tensors) are bucketed"
        n_tied, layout = res["tied"]
        assert n_tied == 3 and sorted(i for b in layout for i in b) == [0, 1, 2], \
            "TiedNet has 3 distinct trainable tensors: the tied weight is bucketed once"
        assert res["bad_cap"] == "ValueError"


@WORLDS
@pytest.mark.task(lesson=6, task=2, points=5, title="mark ready, launch in order")
def test_bucket_all_reduces_start_during_backward_in_bucket_order(worlds, p):
    for res in _ok(worlds(p), "launches_in_order_during_backward"):
        buckets = [e for e in res["events"] if e["kind"] == "all_reduce"]
        assert [e["label"] for e in buckets] == ["bucket 0", "bucket 1", "bucket 2"]
        assert [e["nbytes"] for e in buckets] == [544, 2176, 1152]
        assert buckets[0]["t0"] < res["last_hook"], "bucket 0 must be launched before backward ends"


@WORLDS
@pytest.mark.task(lesson=6, task=2, points=5, title="mark ready, launch in order")
def test_buckets_launch_in_index_order_even_when_hooks_fire_out_of_order(worlds, p):
    for res in _ok(worlds(p), "launches_in_order_when_hooks_are_not"):
        layout, ready = res["layout"], res["ready"]
        bucket_ready = [max(ready[i] for i in b) for b in layout]
        assert bucket_ready != sorted(bucket_ready), "the model should make hooks fire out of order"
        labels = [e["label"] for e in res["events"] if e["kind"] == "all_reduce"]
        assert labels == [f"bucket {b}" for b in range(len(layout))]


def _assert_like_ddp_and_one_process(per_case: dict) -> None:
    for case, r in per_case.items():
        assert r["grads_vs_ddp"] <= TOL, f"{case}: gradients differ from torch DDP's by {r['grads_vs_ddp']:.2e}"
        assert r["vs_ddp"] <= TOL, f"{case}: parameters differ from torch DDP's by {r['vs_ddp']:.2e}"
        assert r["vs_single"] <= TOL, f"{case}: differs from one process on the full batch by {r['vs_single']:.2e}"


def _assert_frozen_and_tied(res: dict) -> None:
    assert res["frozen"]["grads_vs_ddp"] <= TOL and res["frozen"]["vs_ddp"] <= TOL
    assert res["frozen"]["frozen_moved"] == 0 and res["frozen"]["frozen_grad_is_none"]
    assert res["tied"]["grads_vs_ddp"] <= TOL and res["tied"]["vs_ddp"] <= TOL
    assert res["tied"]["still_tied"]


@WORLDS
@pytest.mark.task(lesson=6, task=3, points=5, title="finalize and write back")
def test_one_step_averages_gradients_like_torch_ddp_and_a_single_process(worlds, p):
    for res in _ok(worlds(p), "one_step_like_ddp_and_one_process"):
        _assert_like_ddp_and_one_process(res)


@WORLDS
@pytest.mark.task(lesson=6, task=3, points=5, title="finalize and write back")
def test_gradient_as_bucket_view_leaves_grads_inside_the_buckets(worlds, p):
    for res in _ok(worlds(p), "one_step_like_ddp_and_one_process"):
        r = res["2 buckets, gradient_as_bucket_view"]
        assert r["storages"] == r["buckets"] == 2, "each .grad should be a view into one of the 2 buckets"


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.task(lesson=6, task=3, points=5, title="finalize and write back")
def test_gradients_in_their_buckets_are_divided_by_p_bit_for_bit_like_ddp(worlds, p):
    # p = 3: 1/3 is not exact, so multiplying by it and dividing by 3 differ in the last bit
    for res in _ok(worlds(p), "bucket_view_steps_bit_for_bit_like_ddp"):
        assert res["grad_elements_differing"] == [0, 0, 0], \
            f"gradient elements differing from torch DDP's, per step: {res['grad_elements_differing']}"
        assert res["param_elements_differing"] == 0


@WORLDS
@pytest.mark.task(lesson=6, task=3, points=5, title="finalize and write back")
def test_frozen_parameters_are_skipped_and_tied_weights_reduced_once(worlds, p):
    for res in _ok(worlds(p), "one_step_frozen_and_tied"):
        _assert_frozen_and_tied(res)


@WORLDS
@pytest.mark.task(lesson=6, task=4, points=4, title="rebuild buckets, train on")
def test_several_sgd_steps_match_torch_ddp_and_a_single_process(worlds, p):
    for res in _ok(worlds(p), "several_steps_like_ddp_and_one_process"):
        _assert_like_ddp_and_one_process(res)
        r = res["2 buckets, gradient_as_bucket_view"]
        assert r["storages"] == r["buckets"] == 2, "after zero_grad(set_to_none=True) too"
    for res in _ok(worlds(p), "several_steps_frozen_and_tied"):
        _assert_frozen_and_tied(res)


@WORLDS
@pytest.mark.task(lesson=6, task=4, points=4, title="rebuild buckets, train on")
def test_buckets_are_rebuilt_once_from_rank0s_gradient_order(worlds, p):
    per_rank = _ok(worlds(p), "rebuild_follows_rank0_order")
    assert per_rank[0]["seen"] != per_rank[1]["seen"], "ranks 0 and 1 should see different orders"
    rank0_layout = per_rank[0]["layout_from_my_order"]
    for rank, res in enumerate(per_rank):
        first, *after = res["layouts"]
        assert after[0] == first, "the first backward uses the initial layout"
        assert after[1] == rank0_layout, f"rank {rank}: rebuilt layout is not rank 0's order"
        assert after[1] == after[2] == after[3], "rebuilt once only"
        assert res["broadcasts"] == [0, 1, 0, 0], "one broadcast of rank 0's order, at the second step"
        assert res["vs_ddp"] <= TOL


@WORLDS
@pytest.mark.task(lesson=6, task=5, points=4, title="unused parameters")
def test_globally_unused_keep_none_and_locally_unused_are_reduced(worlds, p):
    for rank, res in enumerate(_ok(worlds(p), "unused_parameters")):
        assert res["none_in_ours"] == res["none_in_ddp"] == ["never.bias", "never.weight"]
        assert res["grad_diff"] <= TOL, "branch_b (used on rank 0 only) must be reduced like DDP"
        assert res["vs_ddp"] <= TOL


@WORLDS
@pytest.mark.task(lesson=6, task=5, points=4, title="unused parameters")
def test_a_bucket_of_unused_parameters_does_not_hold_back_the_others(worlds, p):
    for res in _ok(worlds(p), "unused_parameters"):
        names, layout = res["names"], res["layout"]
        assert {names[i] for i in layout[0]} == {"never.weight", "never.bias"}, \
            "registered last, `never` fills bucket 0"
        buckets = [e for e in res["events"] if e["kind"] == "all_reduce" and e["label"].startswith("bucket")]
        assert [e["label"] for e in buckets][:1] == ["bucket 0"]
        assert buckets[0]["t0"] < res["last_hook"], "found unused in forward: launched as backward starts"


@WORLDS
@pytest.mark.task(lesson=6, task=5, points=4, title="unused parameters")
def test_without_find_unused_parameters_an_unused_parameter_is_an_error(worlds, p):
    for res in _ok(worlds(p), "unused_parameters"):
        assert "find_unused_parameters" in res["strict_error"]


@WORLDS
@pytest.mark.task(lesson=6, task=6, points=3, title="no_sync")
def test_no_sync_accumulates_locally_and_the_next_step_reduces_the_sum(worlds, p):
    for res in _ok(worlds(p), "no_sync_accumulates_then_reduces_the_sum"):
        assert res["reduced_inside"] == 0, "no all-reduce inside no_sync()"
        assert res["vs_ddp"] <= TOL and res["vs_single"] <= TOL
        assert res["branch_b_reduced"] and res["never_none"]


@WORLDS
@pytest.mark.task(lesson=6, task=5, points=4, title="unused parameters")
def test_with_find_unused_parameters_the_buckets_are_never_rebuilt_as_in_ddp(worlds, p):
    for res in _ok(worlds(p), "unused_parameters"):
        first = res["layouts"][0][0]
        assert all(layout == first for layout, _ in res["layouts"]), "DDP does not rebuild then"
        assert [n for _, n in res["layouts"]] == [0, 0, 0], "no broadcast of a gradient order"


@pytest.mark.parametrize("p", [2, 3])
def test_buffers_are_broadcast_from_rank0_before_each_forward_like_ddp(worlds, p):
    for rank, res in enumerate(_ok(worlds(p), "buffers_follow_rank0_like_ddp")):
        for name, diff in res["buffers"]:
            assert diff <= TOL, f"rank {rank}: buffer {name} differs from torch DDP's by {diff:.2e}"
        assert res["vs_ddp"] <= TOL


@pytest.mark.parametrize("p", [2])
def test_sparse_gradients_are_refused_at_construction(worlds, p):
    for res in _ok(worlds(p), "buffers_follow_rank0_like_ddp"):
        assert "sparse" in res["sparse"], res["sparse"]


@pytest.mark.gpu
def test_nccl_reducer_matches_torch_ddp_on_two_gpus():
    from collectives.course import bucketing_bench
    cfg = dict(world=2, backend="nccl", bucket_cap_mb=1.0, first_bucket_cap_mb=1.0, steps=2, warmup=2,
               model="transformer", sizes=dict(vocab=512, d_model=64, nhead=4, ff=128, layers=2, seq=16),
               batch=4)
    result = launch.run(bucketing_bench.run_rank, 2, args=(cfg,), backend="nccl", timeout=300)[0]
    assert result["device"].startswith("cuda")
    assert result["diff"]["bucketed reducer"] <= 1e-4
