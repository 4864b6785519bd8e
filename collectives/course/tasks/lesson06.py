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

import copy
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ... import bucketing as reference  # imported here, before the ranks fork: they inherit it
from ...bucketing.models import BranchNet, SmallMLP, TiedNet, TwoBranchNet
from .. import verify
from . import GradedTask
from .lesson05 import one_thread
from .tap import Call
from .world import Grading, Probe, Run, Verdict, outcome_problem

HERE = __name__
WORLD = 3
MiB = 1 << 20
TOL = 1e-12                   # float64: the p terms may be added in another order
LR = 0.1
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


@one_thread
def _judge_assign(grading: Grading) -> Verdict:
    verdict = Verdict()
    run = grading.world(f"{HERE}:probe_assign", 1)
    for problem in run.problems():
        verdict.add(problem)
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


# ---- the models, their batches, the plans they are trained by --------------------------

def _model(name: str, seed: int) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if name == "Linear32":
            return torch.nn.Linear(8, 4, bias=False)
        return {"SmallMLP": SmallMLP, "TiedNet": TiedNet, "BranchNet": BranchNet,
                "TwoBranchNet": TwoBranchNet}[name]().double()


def _trainable(model) -> list[torch.nn.Parameter]:
    return [p for _, p in model.named_parameters() if p.requires_grad]


def _batch(name: str, rank: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if name == "TiedNet":
        return (torch.randint(10, (5,), generator=g),)
    d_out = 2 if name == "TwoBranchNet" else 4
    dtype = torch.float32 if name == "Linear32" else torch.float64
    x, y = torch.randn(3, 8, generator=g, dtype=dtype), torch.randn(3, d_out, generator=g, dtype=dtype)
    if name == "Linear32" and rank != 0:
        x.zero_()       # only rank 0's gradient is not zero: the sum is exact, so bit for bit
    return x, y


def _loss(name: str, model, batch, kwargs):
    if name == "TiedNet":
        return F.cross_entropy(model(batch[0]), batch[0])
    return F.mse_loss(model(batch[0], **kwargs), batch[1])


@dataclass(frozen=True)
class Step:
    """One forward and backward of a plan."""

    zero: bool | None = None    # zero_grad before it: True sets .grad to None, False zeroes it
    sync: str = "sync"          # "sync" | "no_sync" | "nested" (no_sync in no_sync) | "raised" (see below)
    update: bool = True         # an SGD step after it
    kwargs: str = ""            # forward's keywords: "f_first odd", "use_b rank 0", "use_b never"


@dataclass(frozen=True)
class Plan:
    """A reducer, the model it wraps, and the steps it is trained by."""

    name: str
    model: str
    cap: int
    first: int | None = None     # None: the reducer's default first cap (1 MiB)
    view: bool = False           # gradient_as_bucket_view
    unused: bool = False         # find_unused_parameters
    frozen: bool = False         # fc1 frozen
    steps: tuple[Step, ...] = (Step(zero=False),)
    rebuilt: bool = False        # the rebuild counted as done (one tensor: it changes nothing)


def _kwargs(spec: str, rank: int) -> dict:
    return {"": {}, "f_first odd": {"f_first": rank % 2 == 1}, "f_first never": {"f_first": False},
            "use_b rank 0": {"use_b": rank == 0}, "use_b never": {"use_b": False},
            "use_b always": {"use_b": True}}[spec]


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


def _key(plan: Plan, k: int) -> str:
    return f"{plan.name}, step {k + 1}"


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


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors if t is not None]
                     + [torch.zeros(0, dtype=torch.float64)])


def _plain(layout) -> list[list[int]]:
    try:
        return [[int(i) for i in b] for b in layout]
    except Exception:  # noqa: BLE001 - whatever it is, it is not a layout
        return [["not a list of lists of indices"]]


# ---- the judge's half: the same plan, simulated rank by rank ----------------------------

@functools.lru_cache(maxsize=None)
def _hook_order(name: str, frozen: bool, kwargs: tuple) -> list[int]:
    """The order the model's backward makes its trainable parameters' gradients ready."""
    model = _model(name, 0)
    if frozen:
        model.fc1.requires_grad_(False)
    trainable = _trainable(model)
    index, seen = {id(p): i for i, p in enumerate(trainable)}, []
    for p in trainable:
        p.register_post_accumulate_grad_hook(lambda p: seen.append(index[id(p)]))
    _loss(name, model, _batch(name, 0, 0), dict(kwargs)).backward()
    return seen


class Simulation:
    """Every rank of a plan, one after the other: what each holds after each step, what it
    sends, in which order. What DDP promises, computed without a process group."""

    def __init__(self, plan: Plan, run: Run):
        self.plan, self.run, self.p = plan, run, run.size
        self.model = _model(plan.model, run.seed(0, f"{plan.name} model"))     # rank 0's, broadcast
        if plan.frozen:
            self.model.fc1.requires_grad_(False)
        self.params = list(self.model.parameters())
        self.names = [n for n, _ in self.model.named_parameters()]
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        self.layout = reference.assign_buckets([self.params[i] for i in self.trainable], plan.cap,
                                               plan.first or MiB)
        self.grads = [[None] * len(self.params) for _ in range(self.p)]
        self.rank0_order: list[int] | None = None
        self.rebuilt = plan.rebuilt or plan.unused

    def step(self, k: int) -> list[dict]:
        """Step ``k`` on every rank: per rank, the expected grads, params and calls."""
        plan, step, p = self.plan, self.plan.steps[k], self.p
        head = []
        if self.rank0_order is not None and not self.rebuilt:     # the second forward rebuilds
            order = self.rank0_order + [i for b in self.layout for i in b if i not in self.rank0_order]
            self.layout = reference.assign_buckets([self.params[i] for i in self.trainable], plan.cap,
                                                   plan.first or MiB, order)
            self.rebuilt = True
            head = [("broadcast", len(self.trainable), "int64")]
        if step.zero is not None:
            for grads in self.grads:
                for i, g in enumerate(grads):
                    grads[i] = None if step.zero or g is None else torch.zeros_like(g)
        synced = step.sync in ("sync", "raised")
        had = [[g is not None for g in grads] for grads in self.grads]
        orders = []
        for r in range(p):
            replica = copy.deepcopy(self.model)
            kwargs = _kwargs(step.kwargs, r)
            _loss(plan.model, replica, _batch(plan.model, r, self.run.seed(r, f"{_key(plan, k)} batch")),
                  kwargs).backward()
            for i, q in enumerate(replica.parameters()):
                if q.grad is not None:
                    g = self.grads[r][i]
                    self.grads[r][i] = q.grad.detach().clone() if g is None else g + q.grad
            orders.append(_hook_order(plan.model, plan.frozen, tuple(sorted(kwargs.items()))))
        if synced:
            for i in self.trainable:
                if all(self.grads[r][i] is None for r in range(p)):
                    continue                                   # unused everywhere: stays None
                total = None
                for r in range(p):
                    g = self.grads[r][i]
                    if g is None:
                        part = torch.zeros_like(self.params[i])
                    elif plan.view and had[r][i]:              # already in its bucket: divided there
                        part = g.div(p)
                    else:
                        part = torch.mul(g, 1.0 / p)
                    total = part if total is None else total + part
                for r in range(p):
                    self.grads[r][i] = total.clone()
            if self.rank0_order is None:
                self.rank0_order = list(orders[0])
        expected = []
        for r in range(p):
            grads = self.grads[r]
            buckets = [torch.cat([grads[self.trainable[i]].reshape(-1).double() if grads[self.trainable[i]] is not None
                                  else torch.zeros(self.params[self.trainable[i]].numel(), dtype=torch.float64)
                                  for i in b]) for b in self.layout]
            expected.append(dict(grads=_flat(grads), none=tuple(g is None for g in grads), buckets=buckets,
                                 calls=head + self._calls(orders[r], synced), layout=[list(b) for b in self.layout]))
        if step.update:
            with torch.no_grad():
                for q, g in zip(self.params, self.grads[0]):
                    if g is not None:
                        q -= LR * g
        params = _flat(self.params)
        for e in expected:
            e["params"] = params
        return expected

    def _calls(self, order: list[int], synced: bool) -> list[tuple]:
        """The hooks' markers and, when synced, each bucket's all-reduce right after the
        gradient that completes it and every bucket before it."""
        calls = [("hook", i) for i in order]
        if not synced:
            return calls
        ready = {i: k + 1 for k, i in enumerate(order)}
        for i in range(len(self.trainable)):
            if i not in ready:
                ready[i] = 1 if self.plan.unused and order else len(order) + 1   # unused: at the first hook
        at, latest = {}, 0
        for b, members in enumerate(self.layout):
            latest = max(latest, max(ready[i] for i in members))
            at.setdefault(latest, []).append(b)
        out = []
        for k in range(len(order) + 2):
            if 0 < k <= len(order):
                out.append(calls[k - 1])
            for b in at.get(k, []):
                numel = sum(self.params[self.trainable[i]].numel() for i in self.layout[b])
                out.append(("allreduce", numel, str(self.params[self.trainable[self.layout[b][0]]].dtype)[6:]))
        if self.plan.unused:
            out.append(("allreduce", len(self.trainable), "int32"))     # the used-parameter map
        return out

    def describe(self, call) -> str:
        if call[0] == "hook":
            return f"gradient of {self.names[self.trainable[call[1]]]} ready"
        return f"{call[0]} of {call[1]} {call[2]}"


def _recorded(calls) -> list[tuple]:
    return [("hook", c.numel) if c.kind == "hook" else (c.kind, c.numel, c.dtype)
            for c in calls if not c.kind.startswith(("store.", "backend."))]


def _sequence_problem(sim: Simulation, got: list[tuple], expected: list[tuple]) -> str | None:
    if got == expected:
        return None
    k = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    before = f" after {sim.describe(expected[k - 1])}" if k else " first"
    want = sim.describe(expected[k]) if k < len(expected) else "nothing more"
    seen = sim.describe(got[k]) if k < len(got) else "nothing"
    what = "each bucket's all-reduce is launched as soon as it and every bucket before it are complete"
    return f"{what}: expected{before}: {want}; it made: {seen}"


def _record_problem(sim: Simulation, record: dict, expected: dict, calls, task: int) -> str | None:
    exact = sim.plan.model == "Linear32"
    if task == 2:       # the course's end of backward waited and wrote nothing back: the buckets
        for b, (want, got) in enumerate(zip(expected["buckets"], record["buckets"])):
            problem = verify.compare(want, got, exact=False, rtol=TOL, atol=TOL)
            if problem:
                return (f"bucket {b} (parameters {expected['layout'][b]}) does not hold the ranks' average "
                        f"gradients, each divided by p: {problem}")
        return (_sequence_problem(sim, _recorded(calls), expected["calls"])
                or (None if record["layout"] == expected["layout"]
                    else f"buckets {record['layout']}, expected {expected['layout']}"))
    if record["none"] != expected["none"]:
        names = [n for n, a, b in zip(sim.names, record["none"], expected["none"]) if a != b]
        return (f"gradients set or None as they should not be: {names} (None expected for "
                f"{[n for n, e in zip(sim.names, expected['none']) if e] or 'none'})")
    problem = _values_problem(sim, record["grads"], expected["grads"], expected["none"], exact, "gradient")
    if problem:
        return problem
    problem = _sequence_problem(sim, _recorded(calls), expected["calls"])
    if problem:
        return problem
    if record["layout"] != expected["layout"]:
        return f"buckets {record['layout']} after this step, expected {expected['layout']}"
    if "storages" in record and record["storages"][0] != record["storages"][1]:
        return (f"with gradient_as_bucket_view each .grad is a view into its bucket: the gradients live in "
                f"{record['storages'][0]} storages, there are {record['storages'][1]} buckets")
    if record.get("tied") is False:
        return "the tied weight is no longer one Parameter"
    return _values_problem(sim, record["params"], expected["params"], None, exact, "parameter",
                           "after the SGD step")


def _values_problem(sim, got, expected, none, exact, what, when="") -> str | None:
    problem = verify.compare(expected, got, exact=exact, rtol=0 if exact else TOL, atol=0 if exact else TOL)
    if problem is None:
        return None
    offset = 0
    for i, q in enumerate(sim.params):
        if none is not None and none[i]:
            continue
        n = q.numel()
        part = verify.compare(expected[offset:offset + n], got[offset:offset + n], exact=exact,
                              rtol=0 if exact else TOL, atol=0 if exact else TOL)
        if part:
            return (f"{what} {sim.names[i]}{' ' + when if when else ''} differs from the ranks' average "
                    f"(DDP's, simulated{'' if exact else f', within {TOL:g}'}): {part}")
        offset += n
    return f"{what}s differ: {problem}"


# ---- the judges ---------------------------------------------------------------------------

WHAT = {2: "BucketedReducer._mark_ready", 3: "BucketedReducer._finalize", 4: "BucketedReducer._rebuild_buckets",
        5: "BucketedReducer (find_unused_parameters)", 6: "BucketedReducer.no_sync"}


def _judge_training(task: int):
    @one_thread
    def judge(grading: Grading) -> Verdict:
        verdict = Verdict()
        for size in grading.sizes(WORLD):
            run = grading.world(f"{HERE}:probe_train", size, task)
            for problem in run.problems():
                verdict.add(problem)
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
