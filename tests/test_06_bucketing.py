"""Lesson 6: the reference's bucketed reducer trains exactly like torch DDP and like one process.

The graded tasks are judged outside the student's process by
:mod:`collectives.course.grading.tasks.lesson06`, against a rank-by-rank simulation of what DDP
promises; the checks here hold the reference to torch DDP itself, which is what that
simulation stands in for: several SGD steps, the division of a gradient inside its bucket
bit for bit, buffers broadcast from rank 0, sparse gradients refused.

Every check runs inside one world per world size (2 and 3 gloo ranks); the tests assert
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

from collectives import launch
from collectives.bucketing.models import SmallMLP
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


# ---- the reference trains like torch DDP (what the graded tasks' simulation stands in for) ----

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
def several_steps_like_ddp_and_one_process(impl, group):
    return _trains_like_ddp_and_one_process(impl, group, steps=5)


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


def _assert_like_ddp_and_one_process(per_case: dict) -> None:
    for case, r in per_case.items():
        assert r["grads_vs_ddp"] <= TOL, f"{case}: gradients differ from torch DDP's by {r['grads_vs_ddp']:.2e}"
        assert r["vs_ddp"] <= TOL, f"{case}: parameters differ from torch DDP's by {r['vs_ddp']:.2e}"
        assert r["vs_single"] <= TOL, f"{case}: differs from one process on the full batch by {r['vs_single']:.2e}"


WORLDS = pytest.mark.parametrize("p", [2, 3])


@WORLDS
def test_the_reference_trains_like_torch_ddp_and_a_single_process(worlds, p):
    # what the graded tasks' simulation (collectives.course.grading.tasks.lesson06) stands in for
    for res in _ok(worlds(p), "several_steps_like_ddp_and_one_process"):
        _assert_like_ddp_and_one_process(res)
        r = res["2 buckets, gradient_as_bucket_view"]
        assert r["storages"] == r["buckets"] == 2, "each .grad should be a view into one of the 2 buckets"


@WORLDS
def test_gradients_in_their_buckets_are_divided_by_p_bit_for_bit_like_ddp(worlds, p):
    # p = 3: 1/3 is not exact, so multiplying by it and dividing by 3 differ in the last bit
    for res in _ok(worlds(p), "bucket_view_steps_bit_for_bit_like_ddp"):
        assert res["grad_elements_differing"] == [0, 0, 0], \
            f"gradient elements differing from torch DDP's, per step: {res['grad_elements_differing']}"
        assert res["param_elements_differing"] == 0


@WORLDS
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
    from collectives.course.benchmarks import bucketing as bucketing_bench
    cfg = dict(world=2, backend="nccl", bucket_cap_mb=1.0, first_bucket_cap_mb=1.0, steps=2, warmup=2,
               model="transformer", sizes=dict(vocab=512, d_model=64, nhead=4, ff=128, layers=2, seq=16),
               batch=4)
    result = launch.run(bucketing_bench.run_rank, 2, args=(cfg,), backend="nccl", timeout=300)[0]
    assert result["device"].startswith("cuda")
    assert result["diff"]["bucketed reducer"] <= 1e-4
