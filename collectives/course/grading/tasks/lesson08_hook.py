"""Lesson 8, task 5: the asynchronous all-reduce (its future pending while a peer is late),
then the asynchronous DDP hook, judged against DDP simulated rank by rank in the grading
process.

The all-reduce: rank 1 starts late, so rank 0's future must still be pending when
``sparse_all_reduce_async`` returns; the sums, residuals and messages are task 3's.

The hook: in a world of 2 (or torchrun's), each rank trains a copy of a small float64 model
(drawn from rank 0's secret; DDP broadcasts rank 0's) for three SGD steps on batches drawn
from its own secret, with the student's ``sparse_hook_async`` registered through the
exercise's given ``SparseHookState`` and ``register_sparse_hook``: at density 1 (DDP's
average) and at density 0.05 (top-k of the bucket's ``gradient / p + residual``, the
residual keeping the rest). The judge runs the same steps itself, rank after rank: plain
autograd, the sent values added in rank order as the all-gather adds them, the same
selection -- bit for bit. Rank 1 joins the first backward late, so rank 0's first future
must still be pending when the hook returns; each step's messages are one all-gather of
``p·k`` packed pairs at density 0.05 (never a dense all-reduce of the masked bucket), one
all-reduce at density 1.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import time

import torch
import torch.nn.functional as F

from .lesson08_inputs import compare_sum, draw, pairs_pattern, residual_problem, sent_of
from .world import Grading, Outcome, Probe, Verdict, outcome_problem

HERE = __name__
STEPS = 3
LR = 0.1
DENSITIES = (1.0, 0.05)


# ---- task 5: the asynchronous all-reduce, in flight -----------------------------------------------

ASYNC_CASES = (("allgather density", {"density": 0.1}, "allgather", torch.float32),
               ("allgather threshold", {"threshold": 150.0}, "allgather", torch.float64),
               ("dense", {"density": 0.1}, "dense", torch.float32),
               ("everything kept", {"density": 1.0}, "allgather", torch.float32))


@contextlib.contextmanager
def no_check_mode():
    """Check mode off on this rank (every rank of the world does the same, so its count of
    checked calls stays in step): its comparison meets the other ranks through the store
    *before* the collective starts, so a late peer would be waited for there, and the
    collective might finish before the function returns -- nothing left in flight to see."""
    from ....core import checkmode
    before = checkmode.enabled()
    checkmode._enabled = False
    try:
        yield
    finally:
        checkmode._enabled = before


def probe_async(probe: Probe) -> dict:
    fn = probe.student("sparse_all_reduce_async")
    out = {}
    for i, (key, mode, transport, dtype) in enumerate(ASYNC_CASES):
        t, r = draw(probe.seed(key), 241, dtype)
        if probe.rank == 1 and i == 0:
            time.sleep(0.3)                 # rank 0's collective cannot complete before rank 1 joins
        with no_check_mode() if i == 0 else contextlib.nullcontext():
            started = probe.call(key, fn, t, r, transport=transport, **mode)
        done = None
        if started.value is not None:
            try:
                done = bool(started.value.get_future().done())
                started.value.wait()
                started.value = None        # the work object stays here: only the tensors go back
            except Exception as exc:  # noqa: BLE001 - judged as this case's failure
                started.error = f"its work failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        out[key] = (started, t, r, done)
    return out


def judge_async(grading: Grading) -> Verdict:
    verdict = Verdict()
    size = grading.sizes(2)[0]
    run = grading.world(f"{HERE}:probe_async", size)
    for i, (key, mode, transport, dtype) in enumerate(ASYNC_CASES):
        xs = [sum(a.double() for a in draw(run.seed(r, key), 241, dtype)) for r in range(size)]
        sents = [sent_of(x, mode) for x in xs]
        counts = [int(s.count_nonzero()) for s in sents]
        e = torch.empty((), dtype=dtype).element_size()
        for r in range(size):
            where = f"sparse_all_reduce_async, world of {size}, rank {r}, case {key}"
            outcome, t_out, r_out, done = run.results[r][key]
            if outcome_problem(where, outcome, verdict):
                continue
            problem = compare_sum(sum(sents), t_out, dtype, size, False)
            if problem is None:
                problem = residual_problem(xs[r], mode, dtype, r_out)
            if problem is None:
                problem = pairs_pattern(run.of(r, key), size, 241, max(counts), e, transport, "threshold" in mode,
                                        mode.get("density") == 1.0, str(dtype)[6:])
            if problem is None and i == 0 and r == 0 and size > 1 and done:
                problem = ("its future was complete when it returned, though rank 1 had not joined yet: "
                           "return while the collective is in flight (async_op=True, then .then)")
            verdict.add(problem and f"{where}: {problem}")
    if verdict.ok:
        judge_hook(grading, verdict, size)
    return verdict


# ---- the hook in training ---------------------------------------------------------------------

def make_model(seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    with torch.no_grad():
        for q in model.parameters():
            q.copy_(torch.randn(q.shape, generator=g, dtype=torch.float64) * 0.5)
    return model


def batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64))
            for _ in range(STEPS)]


def probe_hook(probe: Probe) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    hook = probe.student("sparse_hook_async")
    state_cls = probe.student("SparseHookState")
    register = probe.student("register_sparse_hook")
    out = {}
    for density in DENSITIES:
        key = f"density {density}"
        model = make_model(probe.seed("model"))
        ddp = DistributedDataParallel(model)
        seen = {"pending": [], "stub": ""}

        def recording(state, bucket, seen=seen):
            try:
                fut = hook(state, bucket)
            except NotImplementedError as exc:
                seen["stub"] = str(exc) or "sparse_hook_async"
                raise
            seen["pending"].append(not fut.done())
            return fut
        recording.__annotations__ = {"state": state_cls, "bucket": dist.GradBucket,
                                     "return": torch.futures.Future[torch.Tensor]}
        register(ddp, state_cls(density=density), recording)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)

        def train(ddp=ddp, opt=opt, first=density == DENSITIES[0]):
            for step, (x, y) in enumerate(batches(probe.seed("data"))):
                opt.zero_grad()
                loss = F.mse_loss(ddp(x), y)
                if first and step == 0 and probe.rank == 1:
                    time.sleep(0.3)          # rank 0's first bucket cannot arrive before this
                loss.backward()
                opt.step()
            return [q.detach().clone() for q in model.parameters()]
        with no_check_mode():
            outcome = probe.call(key, train)
        if seen["stub"]:
            outcome = Outcome(None, "", seen["stub"])
        out[key] = (outcome, seen["pending"])
    return out


def simulate(secrets_seed, p: int, density: float) -> list[torch.Tensor]:
    """DDP with the sparse hook, the p ranks run one after another in this process."""
    models = [make_model(secrets_seed(0, "model")) for _ in range(p)]
    data = [batches(secrets_seed(r, "data")) for r in range(p)]
    residuals = [torch.zeros(sum(q.numel() for q in models[0].parameters()), dtype=torch.float64)
                 for _ in range(p)]
    for step in range(STEPS):
        flats = []
        for r, model in enumerate(models):
            model.zero_grad()
            x, y = data[r][step]
            F.mse_loss(model(x), y).backward()
            flats.append(torch.cat([q.grad.reshape(-1) for q in model.parameters()]) / p)
        total = torch.zeros_like(flats[0])
        for r in range(p):
            x = flats[r] + residuals[r]
            if density >= 1.0:
                sent = x
            else:
                k = max(1, math.ceil(density * x.numel()))
                keep = torch.zeros(x.numel(), dtype=torch.bool)
                keep[torch.topk(x.abs(), k).indices] = True
                sent = torch.where(keep, x, torch.zeros_like(x))
            residuals[r] = x - sent
            total += sent
        for model in models:
            sgd_step(model, total)
    return [q.detach() for q in models[0].parameters()]


def sgd_step(model, flat_update: torch.Tensor) -> None:
    """Plain SGD on every parameter of ``model`` from one flat update (the ranks' sum)."""
    start = 0
    with torch.no_grad():
        for q in model.parameters():
            q.add_(flat_update[start:start + q.numel()].view_as(q), alpha=-LR)
            start += q.numel()


def judge_hook(grading: Grading, verdict: Verdict, size: int = 2) -> None:
    # DDP imports torch._dynamo on first use (seconds): once here, before the ranks fork
    importlib.import_module("torch._dynamo")
    importlib.import_module("torch.nn.parallel")
    run = grading.world(f"{HERE}:probe_hook", size)
    for density in DENSITIES:
        key = f"density {density}"
        expected = simulate(run.seed, size, density)
        n = sum(q.numel() for q in expected)
        k = max(1, math.ceil(density * n))
        for r in range(size):
            where = f"sparse_hook_async, world of {size}, rank {r}, case {key}"
            outcome, pending = run.results[r][key]
            if outcome.not_written:
                verdict.not_written = verdict.not_written or outcome.not_written
                continue
            if outcome.error:
                verdict.add(f"{where}: {outcome.error}")
                continue
            # two ranks: every sum has two terms, bit for bit; more: gloo's dense sum may
            # add in another order than rank order (density 1 only), equal to rounding
            exact = size <= 2 or density < 1.0
            if len(outcome.value) != len(expected) or not all(
                    torch.equal(a, b) if exact else torch.allclose(a, b, rtol=0, atol=1e-12)
                    for a, b in zip(expected, outcome.value)):
                gap = max(float((a - b).abs().max()) for a, b in zip(expected, outcome.value))
                verdict.add(f"{where}: after {STEPS} steps the parameters differ from DDP with this hook "
                            f"simulated step by step (largest gap {gap:.3g})")
                continue
            calls = [(c.kind, c.numel) for c in run.of(r, key) if not c.kind.startswith("store.")
                     and c.kind != "broadcast"]
            want = [("allreduce", n)] if density >= 1.0 else [("allgather", size * k * 12)]
            if calls != want * STEPS:
                verdict.add(f"{where}: made {calls[:4]}{' ...' if len(calls) > 4 else ''}; expected per step "
                            + ("one all-reduce of the bucket" if density >= 1.0 else
                               f"one all-gather of p·k = {size}·{k} packed pairs ({size * k * 12} bytes), "
                               "not a dense all-reduce of the masked bucket"))
            elif r == 0 and size > 1 and density == DENSITIES[0] and pending[:1] != [True]:
                verdict.add(f"{where}: the hook's future was complete when it returned, though rank 1 had "
                            "not joined yet: return the future of the collective in flight")
