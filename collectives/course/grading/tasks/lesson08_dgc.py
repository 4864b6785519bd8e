"""Lesson 8, task 6: DGC's corrections, judged outside the ranks.

``topk_per_segment`` on tensors and segment sizes drawn from the rank's secret (an empty
segment among them; three selections, "reuse" called twice with its state): the top
⌈density·size⌉ magnitudes of each segment, shifted to where the segment starts.

``DGCState.start_`` in training: in a world of 2 (or torchrun's), the model and batches of
:mod:`.lesson08_hook`, three SGD steps (no optimizer momentum) with the exercise's
``dgc_hook`` -- momentum correction without masking at density 1, and with factor masking
and per-parameter selection at density 0.2. The judge runs DGC itself, rank after rank:
``u <- m·u + g/p``, the residual accumulating ``u``, the top ⌈0.2·size⌉ of each parameter
sent, ``u`` zeroed where it was; the sent values added in rank order. Bit for bit.
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F

from .lesson08_hook import LR, STEPS, batches, make_model, sgd_step
from .lesson08_inputs import draw
from .world import Grading, Outcome, Probe, Verdict, outcome_problem, same

HERE = __name__
MOMENTUM = 0.9
SETTINGS = (("momentum correction, density 1", dict(density=1.0, momentum=MOMENTUM, factor_masking=False)),
            ("masking, per parameter, density 0.2",
             dict(density=0.2, momentum=MOMENTUM, factor_masking=True, per_parameter=True)))


def _segments(seed: int) -> tuple[torch.Tensor, list[int], float]:
    g = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.randint(1, 60, (5,), generator=g)]
    sizes.insert(int(torch.randint(0, 5, (1,), generator=g)), 0)
    x, r = draw(seed, sum(sizes), torch.float32)
    density = (0.1, 0.25, 0.5)[int(torch.randint(0, 3, (1,), generator=g))]
    return x + r, sizes, density


def probe_segments(probe: Probe) -> dict:
    fn = probe.student("topk_per_segment")
    x, sizes, density = _segments(probe.seed("segments"))
    out = {}
    for selection in ("topk", "sample", "reuse"):
        state: dict = {}
        out[selection] = [probe.call(f"{selection}, call {i + 1}", fn, x, sizes, density, selection, state)
                          for i in range(2)]
    return out


def probe_dgc(probe: Probe) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    hook = probe.student("dgc_hook")
    state_cls = probe.student("DGCState")
    register = probe.student("register_sparse_hook")
    out = {}
    for key, settings in SETTINGS:
        model = make_model(probe.seed("model"))
        ddp = DistributedDataParallel(model)
        stub = []

        def recording(state, bucket, stub=stub):
            try:
                return hook(state, bucket)
            except NotImplementedError as exc:
                stub.append(str(exc) or "DGCState.start_")
                raise
        recording.__annotations__ = {"state": state_cls, "bucket": dist.GradBucket,
                                     "return": torch.futures.Future[torch.Tensor]}
        register(ddp, state_cls(**settings), recording)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)

        def train(ddp=ddp, opt=opt, model=model):
            for x, y in batches(probe.seed("data")):
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                opt.step()
            return [q.detach().clone() for q in model.parameters()]
        outcome = probe.call(key, train)
        out[key] = Outcome(None, "", stub[0]) if stub else outcome
    return out


def simulate(seed_of, p: int, settings: dict) -> list[torch.Tensor]:
    """DDP with DGC's hook, the p ranks one after another in this process."""
    models = [make_model(seed_of(0, "model")) for _ in range(p)]
    data = [batches(seed_of(r, "data")) for r in range(p)]
    sizes = [q.numel() for q in models[0].parameters()]
    n = sum(sizes)
    velocity = [torch.zeros(n, dtype=torch.float64) for _ in range(p)]
    residual = [torch.zeros(n, dtype=torch.float64) for _ in range(p)]
    density, masking = settings["density"], settings["factor_masking"]
    for step in range(STEPS):
        total = torch.zeros(n, dtype=torch.float64)
        for r, model in enumerate(models):
            model.zero_grad()
            x, y = data[r][step]
            F.mse_loss(model(x), y).backward()
            g = torch.cat([q.grad.reshape(-1) for q in model.parameters()]) / p
            velocity[r] = velocity[r] * MOMENTUM + g
            v = residual[r] + velocity[r]
            keep = torch.ones(n, dtype=torch.bool) if density >= 1.0 else torch.zeros(n, dtype=torch.bool)
            if density < 1.0:
                start = 0
                for size in sizes:
                    k = min(size, max(1, math.ceil(density * size)))
                    keep[start + torch.topk(v[start:start + size].abs(), k).indices] = True
                    start += size
            total += torch.where(keep, v, torch.zeros_like(v))
            residual[r] = torch.where(keep, torch.zeros_like(v), v)
            if masking:
                velocity[r] = torch.where(keep, torch.zeros_like(v), velocity[r])
        for model in models:
            sgd_step(model, total)
    return [q.detach() for q in models[0].parameters()]


def _magnitudes(x: torch.Tensor) -> torch.Tensor:
    return x.double().abs()


def judge_dgc(grading: Grading) -> Verdict:
    verdict = Verdict()
    run = grading.world(f"{HERE}:probe_segments", 1)
    x, sizes, density = _segments(run.seed(0, "segments"))
    expected, start = [], 0
    for size in sizes:
        k = min(size, max(1, math.ceil(density * size))) if size else 0
        expected += (torch.topk(_magnitudes(x[start:start + size]), k).indices + start).tolist()
        start += size
    truth = torch.tensor(sorted(expected), dtype=torch.int64)
    for selection, outcomes in run.results[0].items():
        for i, outcome in enumerate(outcomes):
            where = (f"topk_per_segment, world of 1, rank 0, case segments {sizes} at density {density} "
                     f"({selection}, call {i + 1})")
            if outcome_problem(where, outcome, verdict):
                break
            got = outcome.value
            if not isinstance(got, torch.Tensor):
                verdict.add(f"{where}: returned {type(got).__name__}, expected a tensor of indices")
            else:
                verdict.add((problem := same(truth, torch.sort(got).values)) and f"{where}: {problem}")
    if not verdict.ok:
        return verdict
    importlib.import_module("torch._dynamo")   # DDP imports it on first use (seconds): once, before the ranks fork
    size = grading.sizes(2)[0]
    run = grading.world(f"{HERE}:probe_dgc", size)
    for key, settings in SETTINGS:
        expected = simulate(run.seed, size, settings)
        for r in range(size):
            where = f"DGCState.start_, world of {size}, rank {r}, case {key}"
            outcome = run.results[r][key]
            if outcome_problem(where, outcome, verdict):
                continue
            exact = size <= 2 or settings["density"] < 1.0
            if len(outcome.value) != len(expected) or not all(
                    torch.equal(a, b) if exact else torch.allclose(a, b, rtol=0, atol=1e-12)
                    for a, b in zip(expected, outcome.value)):
                gap = max(float((a - b).abs().max()) for a, b in zip(expected, outcome.value))
                verdict.add(f"{where}: after {STEPS} steps the parameters differ from DGC simulated step by "
                            f"step (largest gap {gap:.3g})")
    return verdict
