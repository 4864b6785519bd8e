"""Lesson 6's graded tasks: a DDP-style bucketed reducer, judged against a simulation.

Task 1 (``assign_buckets``) runs in a world of one rank on tensor lists, caps and orders
drawn from its secret; the judge buckets the same lists with the reference. Tasks 2 to 6
train small float64 models in a world of three ranks, each rank on batches drawn from its
secret, and the judge holds every rank to what DDP promises, computed here without a
process group: the three ranks simulated one after the other, their gradients averaged
(within 1e-12; the float32 division by p bit for bit). The launches are read from the
tap: the course puts a marker into the rank's record each time a gradient becomes ready
(a hook registered before the reducer's), and the judge, knowing the model's backward
order and the buckets the reference builds, requires each bucket's all-reduce -- one, of
the bucket's size -- right after the gradient that completes it and every bucket before
it, and nothing else but the rebuild's broadcast and the used-parameter map.
"""

from __future__ import annotations

import torch

from .... import bucketing as reference  # imported here, before the ranks fork: they inherit it
from ....bucketing.models import SmallMLP
from . import GradedTask
from .lesson06_simulation import (
    LR,
    MiB,
    Plan,
    Simulation,
    Step,
    _batch,
    _flat,
    _key,
    _kwargs,
    _loss,
    _model,
    _record_problem,
    _trainable,
)
from .tap import Call
from .world import Grading, Probe, Run, Verdict, outcome_problem

HERE = __name__
WORLD = 3
MAX_PROBLEMS = 20
# SmallMLP in float64, backward order: 32, 512, 128, 2048, 128, 1024 bytes
ONE, TWO, THREE = MiB, 2720, 544


# ---- task 1: assign_buckets ------------------------------------------------------------

ASSIGN_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64)


def assign_cases(seed: int) -> list[tuple[str, list[torch.Tensor], int, int | None, list[int] | None]]:
    """(name, tensors, cap, first cap, order): up to 16 tensors of mixed dtypes and devices
    (cpu, meta), caps from a few bytes to more than all of them, the default order or a
    random one; and orders that are not permutations."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))
    cases = []
    for k in range(40):
        n = draw(1, 16)
        kinds = [(ASSIGN_DTYPES[draw(0, 3)], "meta" if k % 3 == 2 and draw(0, 1) else "cpu")
                 for _ in range(draw(1, 3))]
        tensors = []
        for _ in range(n):
            dtype, device = kinds[draw(0, len(kinds) - 1)]
            tensors.append(torch.empty(draw(0, 300), dtype=dtype, device=device))
        order = None if k % 2 == 0 else torch.randperm(n, generator=g).tolist()
        walk = list(reversed(range(n))) if order is None else order
        # a cap met exactly by the bytes of the first few tensors of one kind ("at least its cap")
        key = (tensors[walk[0]].dtype, tensors[walk[0]].device)
        sizes = [tensors[i].numel() * tensors[i].element_size() for i in walk
                 if (tensors[i].dtype, tensors[i].device) == key]
        exact = sum(sizes[:draw(1, len(sizes))]) or 1
        total = sum(t.numel() * t.element_size() for t in tensors)
        cap = exact if k % 3 == 0 else draw(1, max(2, total // draw(1, 5)))
        first = None if k % 4 == 0 else exact if k % 3 == 1 else draw(1, max(2, total // draw(2, 8)))
        cases.append((f"buckets {k} ({n} tensors, cap {cap} B, first {first} B, "
                      f"{'default order' if order is None else 'an order given'})", tensors, cap, first, order))
    bad = [[0, 1, 1], [0, 2], [2, 0, 1, 3], [1, 0, -1]]
    for k, order in enumerate(bad):
        cases.append((f"not a permutation {k}: order {order}", [torch.empty(4) for _ in range(3)], 16, None, order))
    return cases


def probe_assign(probe: Probe) -> dict:
    assign = probe.student("assign_buckets")

    def assign_buckets(tensors, cap, first, order):
        return [[int(i) for i in b] for b in assign(tensors, cap, first, order)]
    out = {name: probe.call(name, assign_buckets, tensors, cap, first, order)
           for name, tensors, cap, first, order in assign_cases(probe.seed("assign"))}
    Reducer = probe.student("BucketedReducer")

    def layouts():
        built = {}
        for cap in (ONE, TWO, THREE):
            r = Reducer(_model("SmallMLP", probe.seed("layouts")), bucket_cap_mb=cap / MiB,
                        first_bucket_cap_mb=cap / MiB)
            built[cap] = r.bucket_indices
            r.close()
        frozen = _model("SmallMLP", probe.seed("layouts"))
        frozen.fc1.requires_grad_(False)
        r = Reducer(frozen, bucket_cap_mb=THREE / MiB, first_bucket_cap_mb=THREE / MiB)
        built["frozen"] = (len(r.params), r.bucket_indices)
        r = Reducer(_model("TiedNet", probe.seed("layouts")), bucket_cap_mb=1)
        built["tied"] = (len(r.params), r.bucket_indices)
        try:
            Reducer(SmallMLP(), bucket_cap_mb=0)
            built["bad cap"] = "accepted"
        except ValueError:
            built["bad cap"] = "ValueError"
        return built
    layouts.__name__ = "BucketedReducer"
    out["reducer layouts"] = probe.call("reducer layouts", layouts)
    return out


def _judge_assign(grading: Grading) -> Verdict:
    verdict = Verdict()
    run = grading.world(f"{HERE}:probe_assign", 1)
    for name, tensors, cap, first, order in assign_cases(run.seed(0, "assign")):
        where = f"assign_buckets, world of 1, rank 0, case {name}"
        outcome = run.results[0][name]
        if outcome.not_written:
            outcome_problem(where, outcome, verdict)
            continue
        try:
            expected = reference.assign_buckets(tensors, cap, first, order)
        except ValueError:
            if "ValueError" not in outcome.error:
                verdict.add(f"{where}: must be refused with ValueError, got {outcome.error or outcome.value}")
            continue
        if not outcome_problem(where, outcome, verdict) and outcome.value != expected:
            kinds = [(str(t.dtype)[6:], t.device.type, t.numel() * t.element_size()) for t in tensors]
            verdict.add(f"{where}: {outcome.value}, expected {expected}; the tensors (dtype, device, bytes): {kinds}")
        if verdict.not_written or len(verdict.problems) > MAX_PROBLEMS:
            return verdict
    where = "BucketedReducer, world of 1, rank 0, case its buckets"
    outcome = run.results[0]["reducer layouts"]
    if not outcome_problem(where, outcome, verdict):
        params = _trainable(_model("SmallMLP", 0))
        want = {cap: reference.assign_buckets(params, cap, cap) for cap in (ONE, TWO, THREE)}
        want["frozen"] = (4, reference.assign_buckets(params[2:], THREE, THREE))
        want["tied"] = (3, reference.assign_buckets(_trainable(_model("TiedNet", 0)), MiB, MiB))
        want["bad cap"] = "ValueError"
        for key, value in want.items():
            if outcome.value.get(key) != value:
                verdict.add(f"{where} ({key}): {outcome.value.get(key)}, expected {value}")
    return verdict


# ---- what tasks 2 to 6 train ------------------------------------------------------------

def _steps(n: int, **kw) -> tuple[Step, ...]:
    """n steps: zero_grad(set_to_none=False) before the first three, True after."""
    return tuple(Step(zero=k >= 3, **kw) for k in range(n))


def _trained(n: int) -> list[Plan]:
    return [Plan("SmallMLP, 3 buckets", "SmallMLP", THREE, THREE, steps=_steps(n)),
            Plan("SmallMLP, 1 bucket", "SmallMLP", ONE, ONE, steps=_steps(n)),
            Plan("SmallMLP, 2 buckets, gradient_as_bucket_view", "SmallMLP", TWO, TWO, view=True, steps=_steps(n)),
            Plan("SmallMLP, fc1 frozen", "SmallMLP", THREE, frozen=True, steps=_steps(min(n, 3))),
            Plan("TiedNet, a weight used twice", "TiedNet", ONE, steps=_steps(min(n, 3)))]


STRICT = Plan("BranchNet without find_unused_parameters", "BranchNet", THREE, steps=(Step(kwargs="use_b always"),))
PLANS = {
    2: [Plan("SmallMLP, 3 buckets", "SmallMLP", THREE, THREE, steps=(Step(update=False),)),
        Plan("TwoBranchNet, a bucket per tensor, hooks out of bucket order", "TwoBranchNet", 1, 1,
             steps=(Step(update=False, kwargs="f_first never"),))],
    3: _trained(1) + [Plan("Linear float32, gradient_as_bucket_view, 3 steps", "Linear32", 4096, 2048, view=True,
                           steps=_steps(3), rebuilt=True)],
    4: _trained(5) + [Plan("TwoBranchNet, rebuilt from rank 0's order", "TwoBranchNet", 136, 136,
                           steps=_steps(4, kwargs="f_first odd"))],
    5: [Plan("BranchNet, find_unused_parameters", "BranchNet", 288, 288, unused=True,
             steps=_steps(3, kwargs="use_b rank 0")), STRICT],
    6: [Plan("SmallMLP, no_sync", "SmallMLP", THREE, THREE,
             steps=tuple(Step(zero=True if micro == 0 else None, sync="no_sync" if micro < 2 else "sync",
                              update=micro == 2) for _ in range(2) for micro in range(3))),
        Plan("BranchNet, no_sync with find_unused_parameters", "BranchNet", THREE, unused=True,
             steps=(Step(sync="no_sync", update=False, kwargs="use_b rank 0"), Step(kwargs="use_b never"))),
        Plan("SmallMLP, no_sync nested, then raised in", "SmallMLP", THREE, THREE,
             steps=(Step(sync="nested", update=False), Step(sync="raised", update=False), Step()))],
}


# ---- the rank's half: train a plan with the student's reducer ---------------------------

def probe_train(probe: Probe, task: int) -> dict:
    Reducer = probe.student("BucketedReducer")
    out = {}
    for plan in PLANS[task]:
        model = _model(plan.model, probe.seed(f"{plan.name} model"))   # each rank its own: rank 0's wins
        if plan.frozen:
            model.fc1.requires_grad_(False)
        index = {id(p): i for i, p in enumerate(_trainable(model))}
        for p in _trainable(model):     # before the reducer's: the marker comes first
            p.register_post_accumulate_grad_hook(lambda p: probe._sink(Call("hook", None, index[id(p)], "", 0, 0, ())))
        first = plan.first / MiB if plan.first else 1
        reducer = probe.call(f"{plan.name}, wrapped", Reducer, model, bucket_cap_mb=plan.cap / MiB,
                             first_bucket_cap_mb=first, find_unused_parameters=plan.unused,
                             gradient_as_bucket_view=plan.view)
        if reducer.error or reducer.not_written:
            out[plan.name] = reducer
            continue
        r = reducer.value
        if plan.rebuilt:
            r._rebuilt = True
        if task == 2:
            r._finalize = _landing(r)
        for k, step in enumerate(plan.steps):
            if step.zero is not None:
                r.zero_grad(set_to_none=step.zero)
            batch = _batch(plan.model, probe.rank, probe.seed(f"{_key(plan, k)} batch"))
            kwargs = _kwargs(step.kwargs, probe.rank)
            outcome = probe.call(_key(plan, k), _one_step, r, plan.model, batch, kwargs, step.sync)
            grads = [p.grad for p in model.parameters()]
            record = dict(outcome=outcome, grads=_flat(grads), none=tuple(g is None for g in grads),
                          layout=_plain(r.bucket_indices))
            if task == 2:
                record["buckets"] = [b.flat.detach().double().clone() for b in r.buckets]
            if plan.view:
                record["storages"] = (len({p.grad.untyped_storage().data_ptr() for p in r.params
                                           if p.grad is not None}), len(r.buckets))
            if plan.model == "TiedNet":
                record["tied"] = model.out.weight is model.embed.weight
            if step.update and not outcome.error and not outcome.not_written:
                with torch.no_grad():
                    for p in model.parameters():
                        if p.grad is not None:
                            p -= LR * p.grad
            record["params"] = _flat(list(model.parameters()))
            out[_key(plan, k)] = record
            if outcome.error or outcome.not_written:
                break
    return out


class _Raised(Exception):
    pass


def _one_step(reducer, name, batch, kwargs, sync):
    """One forward and backward, synced or inside ``no_sync()`` (nested; or left by an error)."""
    if sync == "sync":
        _loss(name, reducer, batch, kwargs).backward()
    elif sync == "no_sync":
        with reducer.no_sync():
            _loss(name, reducer, batch, kwargs).backward()
    elif sync == "nested":
        with reducer.no_sync():
            with reducer.no_sync():
                pass
            _loss(name, reducer, batch, kwargs).backward()     # still not synced: the outer block's
    else:
        try:
            with reducer.no_sync():
                raise _Raised("left no_sync by an error")
        except _Raised:
            pass
        _loss(name, reducer, batch, kwargs).backward()         # synced again
    return None


def _landing(reducer):
    """Task 2's end of backward, the course's: wait for every launched bucket (task 3 is yours)."""
    def finalize():
        for bucket in reducer.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
    return finalize


def _plain(layout) -> list[list[int]]:
    try:
        return [[int(i) for i in b] for b in layout]
    except Exception:  # noqa: BLE001 - whatever it is, it is not a layout
        return [["not a list of lists of indices"]]


# ---- the judges ---------------------------------------------------------------------------

WHAT = {2: "BucketedReducer._mark_ready", 3: "BucketedReducer._finalize", 4: "BucketedReducer._rebuild_buckets",
        5: "BucketedReducer (find_unused_parameters)", 6: "BucketedReducer.no_sync"}


def _judge_training(task: int):
    def judge(grading: Grading) -> Verdict:
        verdict = Verdict()
        for size in grading.sizes(WORLD):
            run = grading.world(f"{HERE}:probe_train", size, task)
            for plan in PLANS[task]:
                _judge_one_plan(run, plan, task, verdict)
                if verdict.not_written or len(verdict.problems) > MAX_PROBLEMS:
                    break
            if verdict.not_written or verdict.problems:
                break
        return verdict
    return judge


def _judge_one_plan(run: Run, plan: Plan, task: int, verdict: Verdict) -> None:
    size = run.size
    for r in range(size):
        if plan.name in run.results[r]:           # the reducer could not even be built
            outcome_problem(f"BucketedReducer, world of {size}, rank {r}, case {plan.name}",
                            run.results[r][plan.name], verdict)
    if verdict.problems or verdict.not_written:
        return
    sim = Simulation(plan, run)
    for k in range(len(plan.steps)):
        expected = sim.step(k)
        for r in range(size):
            where = f"{WHAT[task]}, world of {size}, rank {r}, case {_key(plan, k)}"
            record = run.results[r].get(_key(plan, k))
            if record is None:
                verdict.add(f"{where}: no result from this rank")
                continue
            outcome = record["outcome"]
            if plan is STRICT:
                if outcome.not_written:
                    outcome_problem(where, outcome, verdict)
                elif "find_unused_parameters" not in outcome.error:
                    verdict.add(f"{where}: a parameter without a gradient (find_unused_parameters=False) must "
                                f"end backward with an error naming find_unused_parameters, got "
                                f"{outcome.error or 'no error'}")
                continue
            if outcome_problem(where, outcome, verdict):
                continue
            problem = _record_problem(sim, record, expected[r], run.of(r, _key(plan, k)), task)
            verdict.add(problem and f"{where}: {problem}")
        if verdict.problems or verdict.not_written:
            return


TASKS = [
    GradedTask(6, 1, "assign_buckets", 4, _judge_assign, ("assign_buckets",)),
    GradedTask(6, 2, "mark ready, launch in order", 5, _judge_training(2), ("BucketedReducer._mark_ready",)),
    GradedTask(6, 3, "finalize and write back", 5, _judge_training(3), ("BucketedReducer._finalize",)),
    GradedTask(6, 4, "rebuild buckets, train on", 4, _judge_training(4), ("BucketedReducer._rebuild_buckets",)),
    GradedTask(6, 5, "unused parameters", 4, _judge_training(5),
               ("BucketedReducer._find_unused", "BucketedReducer._globally_used")),
    GradedTask(6, 6, "no_sync", 3, _judge_training(6), ("BucketedReducer.no_sync",)),
]
