"""What lesson 6's tasks train, and what DDP promises for it, computed without a process group.

A :class:`Plan` is a reducer, the model it wraps and the steps it is trained by; the ranks
run it (:mod:`~collectives.course.grading.tasks.lesson06`), and :class:`Simulation` runs the same
plan here, one rank after the other, from the ranks' secrets: each rank's gradients on its
own batch, averaged as DDP averages them (each rank's gradient times 1/p, or divided by p
where it already lies in its bucket), SGD steps, the buckets the reference builds (rebuilt
from rank 0's order before the second forward), and the calls each rank must make, in
order -- the course's marker for each gradient as it becomes ready, and each bucket's
all-reduce right after the gradient that completes it and every bucket before it.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .... import bucketing as reference  # imported here, before the ranks fork: they inherit it
from ....bucketing.models import BranchNet, SmallMLP, TiedNet, TwoBranchNet
from ... import verify
from .world import Run

MiB = 1 << 20
TOL = 1e-12                   # float64: the p terms may be added in another order
LR = 0.1


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


def _kwargs(spec: str, rank: int) -> dict:
    return {"": {}, "f_first odd": {"f_first": rank % 2 == 1}, "f_first never": {"f_first": False},
            "use_b rank 0": {"use_b": rank == 0}, "use_b never": {"use_b": False},
            "use_b always": {"use_b": True}}[spec]


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


def _key(plan: Plan, k: int) -> str:
    return f"{plan.name}, step {k + 1}"


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors if t is not None]
                     + [torch.zeros(0, dtype=torch.float64)])


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
