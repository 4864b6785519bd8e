"""Lesson 7, tasks 5 and 6: the asynchronous call (buckets in flight) and the DDP hook on it.

Task 5 hands every bucket over before waiting for any -- the harness's covering set and
buckets of odd sizes, every op and dtype, drawn from the ranks' secrets -- and judges the
values here, the order the buckets completed in, that ``wait()`` returns the tensor, the
bytes by tier of a few buckets of known sizes (every call the lanes' threads made is on
the tap's record too), and that a call returns before the other ranks have called.

Task 6 trains a small float64 model three SGD steps with torch's DDP and the student's
hook, on integer-valued gradients (weights in {−1, 0, 1}, inputs in [−2, 2], drawn from
the secrets), and compares every parameter bit for bit with DDP's promise computed here
without a process group: each rank's gradient on its own batch, averaged, one step after
another. No all-reduce may cross machines flat: the buckets go the hierarchy's way.
"""

from __future__ import annotations

import re
import time

import torch

from ....core.ops import ReduceOp
from ... import verify
from ...verify import Case
from .allreduce import compare_case, expected_output
from .lesson07_tiers import (
    PATTERN_N,
    PRIME,
    fairring_problem,
    flat_problem,
    harness,
    layout_name,
    layouts_for,
    shape,
    staged_problem,
    tiers_of,
    unique,
)
from .world import Grading, Probe, Verdict, outcome_problem, same

HERE = __name__
ASYNC_MEMORY = 24 << 10       # bytes of staging: buckets wait for the bytes of earlier ones
ODD_SIZES = (1, 3, 97, 1009, 4099, 6007)
COUNTED = (PATTERN_N, 2 * PATTERN_N, PATTERN_N // 2)
PEER_DELAY = 1.0              # seconds the other ranks wait before they call (task 5)
RETURNED_WITHIN = 0.7         # ... and rank 0's three calls must have returned well before
STEPS, LR, CAP_MB = 3, 1 / 16, 1e-3      # about 1 KiB buckets: the model's gradients make several
DDP_OWN, DDP_OWN_BYTES = ("broadcast", "allgather"), 2048
STUB = re.compile(r"Lesson \d+, task \d+: [A-Za-z_.]+")


def _layouts(p: int):
    return layouts_for(p)[:2]


def async_cases(D: int, M: int) -> list[Case]:
    cases = harness(D, M) + [Case(PRIME, torch.int64, ReduceOp.PRODUCT), Case(PRIME, torch.int32, ReduceOp.MIN),
                             Case(PRIME, torch.float64, ReduceOp.AVG)]
    cases += [Case(n, dtype, op) for n in ODD_SIZES
              for dtype, op in ((torch.float32, ReduceOp.SUM), (torch.int64, ReduceOp.MAX))]
    return unique(cases)


def _all_at_once(fn, tensors, ops, layout):
    """Every bucket handed over, then each waited for: (completion order, wait() returned it)."""
    handles, order = [], []
    for k, (t, op) in enumerate(zip(tensors, ops)):
        handles.append(fn(t, op=op, layout=layout, memory_bytes=ASYNC_MEMORY))
        handles[-1].get_future().add_done_callback(lambda _, k=k: order.append(k))
    returned = [h.wait() is t for h, t in zip(handles, tensors)]
    return order, returned


def _before_the_peers(fn, xs, layout, rank):
    """Rank 0 calls three times while the others wait; then they call. Check mode is off
    for these calls on every rank: its comparison of arguments waits for the peers."""
    from ....core import checkmode

    saved, checkmode._enabled = checkmode._enabled, False
    try:
        if rank != 0:
            time.sleep(PEER_DELAY)
        started = time.perf_counter()
        handles = [fn(x, layout=layout, memory_bytes=ASYNC_MEMORY) for x in xs]
        took = time.perf_counter() - started
        done = [h.get_future().done() for h in handles]
        for h in handles:
            h.wait()
    finally:
        checkmode._enabled = saved
    return took, done


def probe_async(probe: Probe) -> dict:
    fn = probe.student("hierarchical_all_reduce_async")
    out = {}
    for i, layout in enumerate(_layouts(probe.size)):
        D, M = shape(layout, probe.size)
        name = layout_name(layout, probe.size)
        cases = async_cases(D, M) if i == 0 else async_cases(D, M)[-len(ODD_SIZES) * 2:]
        inputs = [verify.make_input(c, probe.rank, probe.secret, verify.rank_device())[0] for c in cases]
        outcome = probe.call(f"buckets, {name}", _all_at_once, fn, inputs, [c.op for c in cases], layout)
        out[f"buckets {name}"] = (outcome, [t.detach().cpu().clone(memory_format=torch.contiguous_format)
                                            for t in inputs])
        counted = [verify.make_values(Case(n), probe.rank, probe.seed(f"counted {n} {name}")) for n in COUNTED]
        outcome = probe.call(f"counted, {name}", _all_at_once, fn, counted, [ReduceOp.SUM] * len(COUNTED), layout)
        out[f"counted {name}"] = (outcome, [t.clone() for t in counted])
        if i == 0 and probe.size > 1 and not outcome.error and not outcome.not_written:
            xs = [verify.make_values(Case(n), probe.rank, probe.seed(f"early {n} {name}")) for n in (PRIME, 97, 4099)]
            outcome = probe.call(f"before the peers, {name}", _before_the_peers, fn, xs, layout, probe.rank)
            out[f"early {name}"] = (outcome, [x.clone() for x in xs])
    return out


def judge_async(grading: Grading) -> Verdict:
    verdict = Verdict()
    what = "hierarchical_all_reduce_async"
    for size in grading.sizes(4):
        run = grading.world(f"{HERE}:probe_async", size)
        for i, layout in enumerate(_layouts(size)):
            D, M = shape(layout, size)
            name = layout_name(layout, size)
            cases = async_cases(D, M) if i == 0 else async_cases(D, M)[-len(ODD_SIZES) * 2:]
            for r in range(size):
                where = f"{what}, world of {size}, rank {r}, {name}"
                results = run.results[r]
                outcome, got = results[f"buckets {name}"]
                if outcome_problem(f"{where}, {len(cases)} buckets in flight", outcome, verdict):
                    continue
                for case, tensor in zip(cases, got):
                    inputs = [verify.make_values(case, q, run.secrets[q]) for q in range(size)]
                    problem = compare_case(case, expected_output(case, inputs), tensor, size)
                    verdict.add(problem and f"{where}, bucket {case.name}: {problem}")
                order, returned = outcome.value
                if order != list(range(len(cases))):
                    verdict.add(f"{where}: the buckets completed in the order {order[:12]}, not the order they "
                                "were handed over")
                if not all(returned):
                    verdict.add(f"{where}: wait() did not return the bucket's tensor")
                outcome, got = results[f"counted {name}"]
                if outcome_problem(f"{where}, buckets of {list(COUNTED)} elements", outcome, verdict):
                    continue
                for n, tensor in zip(COUNTED, got):
                    want = expected_output(Case(n), [verify.make_values(Case(n), q, run.seed(q, f"counted {n} {name}"))
                                                     for q in range(size)])
                    problem = same(want, tensor)
                    verdict.add(problem and f"{where}, a bucket of {n}: {problem}")
                tiers = tiers_of(run.of(r, f"counted, {name}"), r, D, M)
                problem = fairring_problem(tiers, sum(COUNTED) * 4, D, M) or staged_problem(tiers, r, D, M)
                verdict.add(problem and f"{where}, buckets of {list(COUNTED)} elements together: {problem}")
                if f"early {name}" in results:
                    verdict.add(_early_problem(run, r, size, name, where, verdict))
            if verdict.not_written or verdict.problems:
                return verdict
    return verdict


def _early_problem(run, r: int, size: int, name: str, where: str, verdict: Verdict) -> str | None:
    outcome, got = run.results[r][f"early {name}"]
    if outcome_problem(f"{where}, calls made before the other ranks called", outcome, verdict):
        return None
    for n, tensor in zip((PRIME, 97, 4099), got):
        want = expected_output(Case(n), [verify.make_values(Case(n), q, run.seed(q, f"early {n} {name}"))
                                         for q in range(size)])
        problem = same(want, tensor)
        if problem:
            return f"{where}, a bucket of {n} made before the other ranks called: {problem}"
    took, done = outcome.value
    if r == 0 and (took >= RETURNED_WITHIN or any(done)):
        return (f"{where}: three calls took {took:.2f} s to return while the other ranks waited "
                f"{PEER_DELAY:g} s before calling: a call must return at once, not wait for its peers")
    return None


# ---- task 6: the DDP communication hook -------------------------------------------------

def _model(seed: int) -> torch.nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8)).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in model.parameters():
            w.copy_(torch.randint(-1, 2, w.shape, generator=g))
    return model


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, (4, 16), generator=g).double(), torch.randint(-2, 3, (4, 8), generator=g).double()


def _train(ddp, model, batch) -> list[torch.Tensor]:
    x, c = batch
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    try:
        for _ in range(STEPS):
            opt.zero_grad()
            (ddp(x) * c).sum().backward()
            opt.step()
    except Exception as exc:
        stub = STUB.search(str(exc))
        if isinstance(exc, NotImplementedError) or (stub and "NotImplementedError" in str(exc)):
            raise NotImplementedError(stub.group(0) if stub else str(exc)) from None
        raise
    return [w.detach().clone() for w in model.parameters()]


def probe_hook(probe: Probe) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    hook = probe.student("hierarchical_hook")
    state_class = probe.student("HierarchicalHookState")
    out = {}
    for layout in _layouts(probe.size)[:1]:
        name = layout_name(layout, probe.size)
        model = _model(probe.seed("weights"))       # DDP starts every rank from rank 0's
        ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
        ddp.register_comm_hook(state_class(layout=layout), hook)
        out[name] = probe.call(f"training, {name}", _train, ddp, model, _batch(probe.seed("batch")))
    return out


def expected_training(run) -> list[torch.Tensor]:
    """DDP's promise, one rank after the other: every rank's gradient on its own batch,
    averaged, then an SGD step; all ranks start from rank 0's weights."""
    model = _model(run.seed(0, "weights"))
    batches = [_batch(run.seed(r, "batch")) for r in range(run.size)]
    params = list(model.parameters())
    for _ in range(STEPS):
        total = [torch.zeros_like(w) for w in params]
        for x, c in batches:
            model.zero_grad()
            (model(x) * c).sum().backward()
            for t, w in zip(total, params):
                t += w.grad
        with torch.no_grad():
            for t, w in zip(total, params):
                w -= LR * (t / run.size)
    return [w.detach().clone() for w in params]


def judge_hook(grading: Grading) -> Verdict:
    import torch._dynamo  # noqa: F401 - DDP imports it on first use (seconds): once, before the ranks fork

    verdict = Verdict()
    for size in grading.sizes(4):
        run = grading.world(f"{HERE}:probe_hook", size)
        expected = expected_training(run)
        numel = sum(w.numel() for w in expected)
        for layout in _layouts(size)[:1]:
            D, M = shape(layout, size)
            name = layout_name(layout, size)
            for r in range(size):
                where = f"hierarchical_hook, world of {size}, rank {r}, {name}, {STEPS} steps of DDP"
                outcome = run.results[r][name]
                if outcome_problem(where, outcome, verdict):
                    continue
                for i, (want, got) in enumerate(zip(expected, outcome.value)):
                    problem = same(want, got)
                    if problem:
                        verdict.add(f"{where}: parameter {i} differs from DDP's: {problem}")
                        break
                tiers = tiers_of(run.of(r, f"training, {name}"), r, D, M)
                # DDP's own: the bucket order it broadcasts once, when it rebuilds its buckets
                # (a few hundred bytes); a gradient gathered flat is far more
                own = sum(tiers.mixed_by_kind.get(kind, 0.0) for kind in DDP_OWN)
                if own <= DDP_OWN_BYTES:
                    tiers.mixed_kinds -= set(DDP_OWN)
                    tiers.mixed -= own
                problem = flat_problem(tiers)
                least = STEPS * 2 * (M - 1) / M * numel * 8 / D
                if problem is None and M > 1 and not least <= tiers.across <= 1.5 * least:
                    problem = (f"sent {tiers.across:.0f} bytes across machines in {STEPS} steps; the hierarchy "
                               f"sends 2(M-1)/M·n/D per step, {least:.0f} in all (and a little padding)")
                verdict.add(problem and f"{where}: {problem}")
            if verdict.not_written or verdict.problems:
                return verdict
    return verdict
