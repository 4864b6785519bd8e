"""Lesson 10's graded tasks: padded shards, ZeRO-1's step, a layer gathered and freed, prefetch.

The judge draws every weight, shape and seed itself (``os.urandom``, never told in advance)
and recomputes every expected value in the grading process from the reference layout
(:class:`collectives.sharded.ShardSpec`) and a full-batch Adam step; each rank's batch
comes from its secret. What comes back from a rank is plain data (tensors copied out,
numbers), and the messages are the tap's. Tasks 2 and 3 say "ring": any library collective
scores nothing, the bytes sent are exactly a ring's (no fewer, no more), and every message
must carry a block it can carry (:mod:`.lesson10_messages`: a piece of the weights, a running
sum of the gradients). A freed layer must hold no memory in the tensors sharing its storage
(what autograd saved), and a gathered one must fill them again. The prefetching forward is
held to its bound on live layers, counted by the probe's own layers at the start and at the
end of a compute that lasts long enough for a gather to land, and must have started layer
i+1's gather before layer i finished computing (the tap's clock against the probe's).
Tasks 5 and 6 (ZeRO-3's backward, a model trained) are :mod:`.lesson10_training`'s.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ....sharded import ShardGroup, ShardSpec
from . import P2P, GradedTask
from . import lesson10_messages as messages
from . import lesson10_training as training
from .lesson10_messages import common_seed as _common_seed
from .lesson10_messages import copy_or_none as _copy
from .lesson10_messages import draw as _draw
from .lesson10_messages import judge_ring as _judge_ring
from .lesson10_messages import tensor as _tensor
from .world import Grading, InWorldGrading, Probe, Verdict, outcome_problem, same

HERE = __name__
TOL = 1e-6
STEPS = 2
ONE_SIZE = (1,)


# ---- task 1: shard_rows / unshard_rows ------------------------------------------------------

def _shard_cases(seed: int) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (3,), (1, 4), (2, 3, 2), (13,), (5, 1), (6, 6)]
    cases = []
    for k, shape in enumerate(shapes):
        p = int(torch.randint(1, 7, (1,), generator=g))
        cases.append((shape, p, int(torch.randint(0, 2**31, (1,), generator=g))))
    cases.append(((2, 2), 6, seed % 1000))          # more ranks than rows: shards of padding only
    cases.append(((), 3, seed % 997))               # a 0-d tensor: one row
    return cases


def probe_shards(probe: Probe, cases: list[tuple]) -> dict:
    shard_rows, unshard_rows = probe.student("shard_rows"), probe.student("unshard_rows")
    out = {}
    for shape, p, seed in cases:
        full = _tensor(seed, shape)
        for r in range(p):
            o = probe.call(f"shard_rows {shape} rank {r} of {p}", shard_rows, full.clone(), r, p)
            o.value = o.value.detach().clone() if isinstance(o.value, torch.Tensor) else o.value
            out[("shard", shape, p, r)] = o
        spec = ShardSpec(tuple(shape), p)
        gathered = torch.cat([spec.shard(full, r) for r in range(p)])
        o = probe.call(f"unshard_rows {shape} over {p}", unshard_rows, gathered, shape, p)
        o.value = o.value.detach().clone() if isinstance(o.value, torch.Tensor) else o.value
        out[("unshard", shape, p)] = o
    bad = probe.call("shard_rows rank p", shard_rows, torch.ones(3, 2), 3, 3)
    out["bad"] = (bad.not_written, bad.error)
    return out


def _judge_shards(grading: Grading) -> Verdict:
    verdict = Verdict()
    cases = _shard_cases(_draw())
    run = grading.world(f"{HERE}:probe_shards", 1, cases)
    # in one torchrun world every rank draws, probes and judges its own cases
    got = run.results[dist.get_rank() if isinstance(grading, InWorldGrading) else 0]
    for shape, p, seed in cases:
        full, spec = _tensor(seed, shape), ShardSpec(tuple(shape), p)
        for r in range(p):
            where = f"shard_rows of a {tuple(shape)} tensor, rank {r} of {p}"
            o = got[("shard", shape, p, r)]
            if not outcome_problem(where, o, verdict):
                problem = same(spec.shard(full, r), o.value)
                if problem and isinstance(o.value, torch.Tensor) and o.value.numel() != spec.shard_numel:
                    problem += (f" -- every shard holds c = ceil(rows / p) = {spec.rows_per_shard} rows, "
                                f"{spec.shard_numel} elements, the missing rows zeros")
                verdict.add(_named(where, problem))
        where = f"unshard_rows of a {tuple(shape)} tensor over {p}"
        o = got[("unshard", shape, p)]
        if not outcome_problem(where, o, verdict):
            verdict.add(_named(where, same(full, o.value)))
    not_written, error = got["bad"]
    if not not_written and "ValueError" not in error:
        verdict.add("shard_rows(tensor, rank=3, p=3): expected a ValueError (rank must be below p), "
                    + (f"got {error}" if error else "it returned"))
    return verdict


def _named(where: str, problem: str | None) -> str | None:
    return f"{where}: {problem}" if problem else None


# ---- task 2: zero1_step ----------------------------------------------------------------

def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def _batch(seed: int, step: int) -> torch.Tensor:
    return _tensor(seed + 7919 * step, (4, 5))


def _rows_view(q: torch.Tensor, spec: ShardSpec, rank: int) -> nn.Parameter:
    lo, hi = spec.owned_rows(rank)
    return nn.Parameter(q.detach().view(spec.rows, spec.row_numel)[lo:hi].view((hi - lo,) + spec.shape[1:]))


def probe_zero1(probe: Probe) -> dict:
    fn = probe.student("zero1_step")
    model = make_model(_common_seed(probe, "model"))
    params = list(model.parameters())
    shards = [_rows_view(q, ShardSpec(tuple(q.shape), probe.size), probe.rank) for q in params]
    opt = torch.optim.Adam(shards, lr=1e-2, foreach=False)
    seed = probe.seed("batch")
    out = {"steps": []}
    for s in range(STEPS):
        for q in params:
            q.grad = None
        model(_batch(seed, s)).square().mean().backward()
        o = probe.call(f"step {s}", fn, params, shards, opt)
        o.value = None
        out["steps"].append((o, [q.detach().clone() for q in params]))
        if o.error or o.not_written:
            break
    out["state"] = [(tuple(st["exp_avg"].shape), float(st["step"])) if "exp_avg" in st else None
                    for st in (opt.state.get(s, {}) for s in shards)]
    out["shard_shapes"] = [tuple(s.shape) for s in shards]
    return out


def _expected_zero1(model_seed: int, seeds: list[int]) -> tuple[list, list]:
    """The parameters after each step, and each step's gradients of every rank."""
    model = make_model(model_seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    after, by_step = [], []
    for s in range(STEPS):
        grads, per_rank = None, []
        for seed in seeds:
            model.zero_grad(set_to_none=True)
            model(_batch(seed, s)).square().mean().backward()
            g = [q.grad.clone() for q in model.parameters()]
            per_rank.append(g)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for q, g in zip(model.parameters(), grads):
            q.grad = g / len(seeds)
        opt.step()
        after.append([q.detach().clone() for q in model.parameters()])
        by_step.append(per_rank)
    return after, by_step


def _rows_differ(want: torch.Tensor, have: torch.Tensor, p: int) -> str:
    """Which ranks' rows of a parameter differ: the rank whose packing (or step) went wrong."""
    if tuple(have.shape) != tuple(want.shape) or have.dtype != want.dtype:
        return ""
    spec = ShardSpec(tuple(want.shape), p)
    bad = ~torch.isclose(have.double().reshape(spec.rows, -1), want.double().reshape(spec.rows, -1),
                         rtol=0, atol=TOL)
    owners = sorted({r for r in range(p) for row in bad.any(1).nonzero().view(-1).tolist()
                     if spec.owned_rows(r)[0] <= row < spec.owned_rows(r)[1]})
    if not owners:
        return ""
    return " -- the rows of rank" + ("s " if len(owners) > 1 else " ") + ", ".join(map(str, owners)) + \
        " (block " + ", ".join(map(str, owners)) + " of the reduce-scatter: check how it is packed)"


def _judge_zero1(grading: Grading) -> Verdict:
    verdict = Verdict()
    for p in grading.sizes(2, 3):
        run = grading.world(f"{HERE}:probe_zero1", p)
        p = run.size
        model_seed = run.seed(0, "model") % 1_000_000
        expected, grads = _expected_zero1(model_seed, [run.seed(r, "batch") for r in range(p)])
        shapes = [tuple(q.shape) for q in make_model(model_seed).parameters()]
        group = ShardGroup(shapes, p)
        piece = group.shard_numel
        carried = [messages.blocks(group, grads[s]) + messages.pieces(group, expected[s]) for s in range(STEPS)]
        for rank in range(p):
            got = run.results[rank]
            for s, (o, params) in enumerate(got["steps"]):
                where = f"zero1_step, step {s + 1} on rank {rank} of {p}"
                if outcome_problem(where, o, verdict):
                    break
                for i, (want, have) in enumerate(zip(expected[s], params)):
                    problem = same(want, have, exact=False, rtol=0, atol=TOL)
                    if problem:
                        verdict.add(f"{where}, parameter {i} {shapes[i]}: {problem}{_rows_differ(want, have, p)}")
                calls = run.of(rank, f"step {s}")
                _judge_ring(where, calls, 2 * (p - 1) * piece, carried[s],
                            "ZeRO-1 reduce-scatters the gradients and all-gathers the weights", verdict)
            if len(got["steps"]) == STEPS and got["steps"][-1][0].error == "":
                for i, (st, shape) in enumerate(zip(got["state"], got["shard_shapes"])):
                    if st is None or st != (shape, float(STEPS)):
                        verdict.add(f"zero1_step on rank {rank} of {p}: the optimizer you were given holds "
                                    f"{st} for shard {i} {shape}; expected Adam's state of that shard "
                                    f"after {STEPS} steps")
                        break
    return verdict


# ---- task 3: gather_layer / free_layer --------------------------------------------------------

LAYER_SHAPES = [(7, 5), (7,), (3, 2, 2)]
LAYER_BATCH = 3


def _layer_loss(params, x):
    """A layer's forward as autograd sees it: a linear layer (it saves a view of its weight)
    and a parameter used as itself."""
    w, b, extra = params
    return nn.functional.linear(x, w, b).square().sum() + (extra * extra).sum()


def probe_gather(probe: Probe) -> dict:
    gather_layer, free_layer = probe.student("gather_layer"), probe.student("free_layer")
    seed = _common_seed(probe, "weights")
    fulls = [_tensor(seed + k, s) for k, s in enumerate(LAYER_SHAPES)]
    params = [nn.Parameter(f.clone()) for f in fulls]
    group = ShardGroup(LAYER_SHAPES, probe.size)
    piece = torch.cat(group.shard(fulls, probe.rank))
    x = _tensor(probe.seed("x"), (LAYER_BATCH, LAYER_SHAPES[0][1])).requires_grad_()
    loss = _layer_loss(params, x)            # autograd saves the weights, as a layer's forward does
    held = [q.view(-1) for q in params]      # tensors sharing each parameter's storage, as autograd's
    out = {}
    o = probe.call("free_layer", free_layer, params)
    out["free"] = (o, [h.untyped_storage().nbytes() for h in held], [q.untyped_storage().nbytes() for q in params],
                   [(tuple(q.shape), q.dtype == torch.float32) for q in params])
    o = probe.call("gather_layer", gather_layer, params, list(LAYER_SHAPES), piece.clone())
    out["gather"] = (o, [_copy(q) for q in params], [_copy(h) for h in held])
    backward = ""
    if not o.error and not o.not_written:
        try:
            loss.backward()
        except RuntimeError as exc:
            backward = str(exc).splitlines()[0]
    out["backward"] = (backward, x.grad.clone() if x.grad is not None else None,
                       [q.grad.clone() if q.grad is not None else None for q in params])
    return out


def _judge_gather(grading: Grading) -> Verdict:
    verdict = Verdict()
    for p in grading.sizes(2, 3, 5):
        run = grading.world(f"{HERE}:probe_gather", p)
        p = run.size
        seed = run.seed(0, "weights") % 1_000_000
        fulls = [_tensor(seed + k, s) for k, s in enumerate(LAYER_SHAPES)]
        group = ShardGroup(LAYER_SHAPES, p)
        carried = messages.pieces(group, fulls)
        for rank in range(p):
            got = run.results[rank]
            o, held_bytes, param_bytes, kept = got["free"]
            where = f"free_layer on rank {rank} of {p}"
            if outcome_problem(where, o, verdict):
                continue
            if any(held_bytes):
                how = ("a new tensor was put under the Parameters: `.data = torch.empty(0)` swaps the tensor "
                       "and frees nothing autograd holds" if not any(param_bytes) else "the storage was not shrunk")
                verdict.add(f"{where}: the tensors autograd saved of the weights still hold {sum(held_bytes)} "
                            f"bytes ({how}); free with q.untyped_storage().resize_(0)")
            elif kept != [(s, True) for s in LAYER_SHAPES]:
                verdict.add(f"{where}: the parameters changed shape or dtype ({kept}); keep the Parameter, "
                            "shrink its storage")
            o, params, held = got["gather"]
            where = f"gather_layer on rank {rank} of {p}"
            if outcome_problem(where, o, verdict):
                continue
            for i, (want, have) in enumerate(zip(fulls, params)):
                verdict.add(_named(f"{where}, parameter {i} {LAYER_SHAPES[i]}",
                                   same(want, have) if have is not None else "its storage is still empty"))
            if not any(held_bytes) and any(h is None or same(f.view(-1), h) for f, h in zip(fulls, held)):
                verdict.add(f"{where}: the tensors autograd saved still do not see the weights: grow the "
                            "storage back (untyped_storage().resize_) and copy into it through q.data, "
                            "rather than pointing .data at a new tensor")
            backward, x_grad, grads = got["backward"]
            if backward:
                verdict.add(f"{where}: the layer's backward failed after free and gather: {backward}")
            else:
                _judge_layer_backward(where, rank, run, fulls, x_grad, grads, verdict)
            _judge_ring(where, run.of(rank, "gather_layer"), (p - 1) * group.shard_numel, carried,
                        "a layer is gathered by a ring all-gather of the pieces", verdict)
    return verdict


def _judge_layer_backward(where, rank, run, fulls, x_grad, grads, verdict) -> None:
    params = [nn.Parameter(f.clone()) for f in fulls]
    x = _tensor(run.seed(rank, "x"), (LAYER_BATCH, LAYER_SHAPES[0][1])).requires_grad_()
    _layer_loss(params, x).backward()
    for name, want, have in [("the input", x.grad, x_grad)] + [(f"parameter {i}", q.grad, g)
                                                               for i, (q, g) in enumerate(zip(params, grads))]:
        problem = same(want, have, exact=False, rtol=1e-5, atol=1e-5) if have is not None else "no gradient"
        if problem:
            verdict.add(f"{where}: the backward after free and gather gave {name} a wrong gradient: {problem}")
            return


# ---- task 4: forward_prefetch ------------------------------------------------------------------

PREFETCH_WIDTHS = [5, 9, 4, 13, 7]       # layer i: Linear(w[i], w[i+1]); pieces of distinct sizes at p = 2, 3
COMPUTE_SECONDS = 0.1          # long enough for a prefetch to start under check mode on a loaded machine


class Watched(nn.Linear):
    """A layer that notes, as it runs, how many of its set are whole, and when it ran."""

    def __init__(self, n_in, n_out, family, log, compute=COMPUTE_SECONDS):
        super().__init__(n_in, n_out)
        self.family, self.log, self.compute = family, log, compute

    def whole(self) -> int:
        return sum(1 for m in self.family if m.weight.untyped_storage().nbytes() > 0)

    def forward(self, x):
        alive = self.whole()
        start = time.perf_counter()
        y = super().forward(x)
        time.sleep(self.compute)              # the compute a prefetched gather hides under
        alive = max(alive, self.whole())      # a gather started before the compute has landed by now
        self.log.append((self.family.index(self), alive, start, time.perf_counter()))
        return y


def _prefetch_layers(seed: int, family: list, log: list, compute: float = 0.0) -> list:
    torch.manual_seed(seed)
    layers = [Watched(PREFETCH_WIDTHS[i], PREFETCH_WIDTHS[i + 1], family, log, compute)
              for i in range(len(PREFETCH_WIDTHS) - 1)]
    family.extend(layers)
    return layers


def probe_prefetch(probe: Probe, limits: list[int]) -> dict:
    fn = probe.student("forward_prefetch")
    seed = _common_seed(probe, "weights")
    out = {}
    for limit in limits:
        family, log = [], []
        layers = _prefetch_layers(seed, family, log, COMPUTE_SECONDS)
        shapes = [[tuple(q.shape) for q in m.parameters()] for m in layers]
        pieces = [torch.cat(ShardGroup(s, probe.size).shard([q.detach() for q in m.parameters()], probe.rank))
                  for s, m in zip(shapes, layers)]
        for m in layers:
            for q in m.parameters():
                q.untyped_storage().resize_(0)          # freed, as task 3 frees
        x = _tensor(seed + probe.rank, (3, PREFETCH_WIDTHS[0]))
        o = probe.call(f"max_alive {limit}", fn, layers, shapes, pieces, x, limit)
        o.value = o.value.detach().clone() if isinstance(o.value, torch.Tensor) else o.value
        left = sum(q.untyped_storage().nbytes() // q.element_size() for m in layers for q in m.parameters())
        out[limit] = (o, list(log), left, [ShardGroup(s, probe.size).shard_numel for s in shapes])
    return out


def _judge_prefetch(grading: Grading) -> Verdict:
    verdict = Verdict()
    limits = [2, 1]
    for p in grading.sizes(2, 3):
        run = grading.world(f"{HERE}:probe_prefetch", p, limits)
        p = run.size
        seed = run.seed(0, "weights") % 1_000_000
        reference = _prefetch_layers(seed, [], [])
        for rank in range(p):
            x = _tensor(seed + rank, (3, PREFETCH_WIDTHS[0]))
            with torch.no_grad():
                want = x
                for m in reference:
                    want = nn.functional.linear(want, m.weight, m.bias)
            for limit in limits:
                o, log, left, pieces = run.results[rank][limit]
                where = f"forward_prefetch with max_alive {limit}, rank {rank} of {p}"
                if outcome_problem(where, o, verdict):
                    continue
                verdict.add(_named(where, same(want, o.value, exact=False, rtol=0, atol=TOL)))
                order = [i for i, *_ in log]
                if order != list(range(len(reference))):
                    verdict.add(f"{where}: the layers ran in the order {order}")
                    continue
                over = [(i, alive) for i, alive, _, _ in log if alive > limit]
                if over:
                    verdict.add(f"{where}: layer {over[0][0]} ran with {over[0][1]} layers whole, "
                                f"more than max_alive = {limit} (a layer counts from the moment its gather "
                                "is submitted: prefetch only while alive < max_alive)")
                library = messages.library_calls(run.of(rank, f"max_alive {limit}"))
                if library:
                    verdict.add(f"{where}: called {', '.join(library)}: {messages.LIBRARY}")
                if left:
                    verdict.add(f"{where}: {left} elements of full weights still held on return; free every layer")
                if limit >= 2:
                    _judge_overlap(run.of(rank, f"max_alive {limit}"), log, pieces, p, where, verdict)
    return verdict


def _judge_overlap(calls, log, pieces, p, where, verdict) -> None:
    """Layer i+1's gather (its messages: pieces of its own size) began before layer i finished."""
    for i, _, _, end in log[:-1]:
        sizes = {pieces[i + 1], p * pieces[i + 1]}
        first = min((c.t for c in calls if c.numel in sizes and c.kind != "recv"), default=None)
        if first is None:
            verdict.add(f"{where}: no message of layer {i + 1}'s all-gather was recorded")
            return
        if first > end:
            verdict.add(f"{where}: layer {i + 1}'s all-gather began {first - end:.4f} s after layer {i} "
                        "finished: start it before layer i computes, so it travels meanwhile")
            return


TASKS = [
    GradedTask(10, 1, "shard and unshard with padding", 2, _judge_shards, ("shard_rows", "unshard_rows"), routes=P2P),
    GradedTask(10, 2, "ZeRO-1 step", 4, _judge_zero1, ("zero1_step",), routes=P2P),
    GradedTask(10, 3, "gather and free a layer", 3, _judge_gather, ("gather_layer", "free_layer"), routes=P2P),
    GradedTask(10, 4, "prefetch the next layer", 4, _judge_prefetch, ("forward_prefetch",), routes=P2P),
] + training.TASKS
