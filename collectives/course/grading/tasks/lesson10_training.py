"""Lesson 10's graded tasks 5 and 6: ZeRO-3's backward for a layer, and a model trained with it.

Task 5 hooks three linear layers with the student's ``zero3_layer`` and runs two backwards
(the second accumulates). The probe's layers note, as they run forward and as their
backward begins, how many layers are whole (storage of nonzero size); what comes back is
plain data -- the loss, each ``grad_piece``, what is left allocated, those notes -- and the
judge recomputes every rank's gradients from its secret. The messages must be a ring's:
two all-gathers of each layer's pieces and one reduce-scatter of its gradients, every
message carrying a block it can carry, and a layer's reduce-scatter finished before the
backward of the layer below begins (it runs from the gradient hook, during backward).

Task 6 trains a small model (linear layers, GELU, a LayerNorm) with the student's
``zero3_train`` for three steps, in fp32 and in bf16 over fp32 masters (gradients reduced in
fp32). The judge trains the same model in its own process on every rank's batch at once --
what ``fully_shard`` computes (``tests/test_10_sharded.py`` holds the reference to it) -- and
compares losses and the returned fp32 pieces; in bf16 the all-gathers must travel in bf16
and the reduce-scatters in fp32.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ....sharded import ShardGroup
from . import P2P, GradedTask
from . import lesson10_messages as messages
from .world import Grading, Probe, Verdict, outcome_problem, same

HERE = __name__
TOL = 1e-5
WIDTHS = [6, 9, 5, 7]          # three linear layers, pieces of distinct sizes at p = 2, 3
BACKWARDS = 2


class _Mark(torch.autograd.Function):
    """Notes when a layer's backward begins, and how many layers are whole then."""

    @staticmethod
    def forward(ctx, y, layer):
        ctx.layer = layer
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        layer.log.append(("backward", layer.index, layer.whole(), time.perf_counter()))
        return grad, None


class Noted(nn.Linear):
    def __init__(self, n_in, n_out, index, family, log):
        super().__init__(n_in, n_out)
        self.index, self.family, self.log = index, family, log

    def whole(self) -> list[int]:
        return [m.index for m in self.family if m.weight.untyped_storage().nbytes() > 0]

    def forward(self, x):
        self.log.append(("forward", self.index, self.whole(), time.perf_counter()))
        return _Mark.apply(super().forward(x), self)


def _layers(seed: int, family: list, log: list) -> list:
    torch.manual_seed(seed)
    layers = [Noted(WIDTHS[i], WIDTHS[i + 1], i, family, log) for i in range(len(WIDTHS) - 1)]
    family.extend(layers)
    return layers


def _loss(layers, x):
    h = x
    for i, m in enumerate(layers):
        h = m(h)
        if i < len(layers) - 1:
            h = torch.relu(h)
    return h.square().mean()


def _batch(seed: int, k: int) -> torch.Tensor:
    return messages.tensor(seed + 7919 * k, (4, WIDTHS[0]))


def probe_layer(probe: Probe) -> dict:
    zero3_layer = probe.student("zero3_layer")
    seed = messages.common_seed(probe, "weights")
    family, log = [], []
    layers = _layers(seed, family, log)
    shapes = [[tuple(q.shape) for q in m.parameters()] for m in layers]
    groups = [ShardGroup(s, probe.size) for s in shapes]
    pieces = [torch.cat(g.shard([q.detach() for q in m.parameters()], probe.rank)) for g, m in zip(groups, layers)]
    grads = [torch.zeros_like(x) for x in pieces]
    for m in layers:
        for q in m.parameters():
            q.untyped_storage().resize_(0)
    out = {"backwards": []}
    o = probe.call("hooks", lambda: [zero3_layer(m, s, x, g) for m, s, x, g in zip(layers, shapes, pieces, grads)])
    out["hooks"] = (o.error, o.not_written)
    if o.error or o.not_written:
        return out
    x_seed = probe.seed("x")
    for k in range(BACKWARDS):
        del log[:]

        def step():
            loss = _loss(layers, _batch(x_seed, k))
            loss.backward()
            return loss.item()
        o = probe.call(f"backward {k}", step)
        left = [[q.untyped_storage().nbytes() for q in m.parameters()] for m in layers]
        kept = [[q.grad is not None for q in m.parameters()] for m in layers]
        out["backwards"].append((o, [g.clone() for g in grads], list(log), left, kept))
        if o.error or o.not_written:
            break
    return out


def _expected_layer(seed: int, seeds: list[int]):
    """Per backward: the loss of each rank, the mean gradients summed so far, each rank's gradients."""
    layers = _layers(seed, [], [])
    total, out = None, []
    for k in range(BACKWARDS):
        losses, per_rank = [], []
        for s in seeds:
            for m in layers:
                m.zero_grad(set_to_none=True)
            loss = _loss(layers, _batch(s, k))
            loss.backward()
            losses.append(loss.item())
            per_rank.append([[q.grad.clone() for q in m.parameters()] for m in layers])
        mean = [[sum(r[i][j] for r in per_rank) / len(seeds) for j in range(2)] for i in range(len(layers))]
        total = mean if total is None else [[a + b for a, b in zip(t, m)] for t, m in zip(total, mean)]
        out.append((losses, total, per_rank))
    return out, [[q.detach().clone() for q in m.parameters()] for m in layers]


def _judge_layer(grading: Grading) -> Verdict:
    verdict = Verdict()
    for p in grading.sizes(2, 3):
        run = grading.world(f"{HERE}:probe_layer", p)
        p = run.size
        expected, fulls = _expected_layer(run.seed(0, "weights") % 1_000_000, [run.seed(r, "x") for r in range(p)])
        groups = [ShardGroup([tuple(q.shape) for q in f], p) for f in fulls]
        for rank in range(p):
            got = run.results[rank]
            error, stub = got["hooks"]
            if stub:
                verdict.not_written = verdict.not_written or stub
                return verdict
            if error:
                verdict.add(f"zero3_layer on rank {rank} of {p}: {error}")
                continue
            for k, (o, grads, log, left, kept) in enumerate(got["backwards"]):
                where = f"zero3_layer, backward {k + 1} on rank {rank} of {p}"
                if o.error and ("storage" in o.error or "size" in o.error):
                    verdict.add(f"{where}: {o.error} -- the layer was freed after its forward: gather it again "
                                "before its backward (a hook on the forward's output runs just then)")
                    break
                if outcome_problem(where, o, verdict):
                    break
                losses, total, per_rank = expected[k]
                if abs(o.value - losses[rank]) > TOL * max(1.0, abs(losses[rank])):
                    verdict.add(f"{where}: the loss is {o.value!r}, expected {losses[rank]!r}")
                _judge_grads(where, k, rank, p, groups, grads, expected, verdict)
                _judge_log(where, log, left, kept, verdict)
                carried = [(messages.pieces(g, f), messages.blocks(g, [r[i] for r in per_rank]))
                           for i, (g, f) in enumerate(zip(groups, fulls))]
                _judge_layer_messages(where, run.of(rank, f"backward {k}"), groups, carried, log, p, verdict)
    return verdict


def _judge_grads(where, k, rank, p, groups, grads, expected, verdict) -> None:
    for i, (g, have) in enumerate(zip(groups, grads)):
        want = torch.cat(g.shard(expected[k][1][i], rank))
        if same(want, have, exact=False, rtol=TOL, atol=TOL) is None:
            continue
        hint = ""
        if same(want * p, have, exact=False, rtol=TOL, atol=TOL) is None:
            hint = ": it is p times the mean -- reduce with ReduceOp.AVG"
        elif k and same(torch.cat(g.shard(expected[k][1][i], rank)) - torch.cat(g.shard(expected[k - 1][1][i], rank)),
                        have, exact=False, rtol=TOL, atol=TOL) is None:
            hint = ": it holds this backward's gradient only -- add to grad_piece, do not overwrite it"
        verdict.add(f"{where}: layer {i}'s grad_piece {same(want, have, exact=False, rtol=TOL, atol=TOL)}{hint}")
        return


def _judge_log(where, log, left, kept, verdict) -> None:
    for what, i, whole, _ in log:
        others = [j for j in whole if j != i]
        if others:
            verdict.add(f"{where}: layer {others[0]} was still whole when layer {i}'s {what} began: "
                        + ("free a layer after its forward" if what == "forward" else
                           "free a layer once its gradients are reduce-scattered"))
            return
    still = [i for i, sizes in enumerate(left) if any(sizes)]
    if still:
        verdict.add(f"{where}: layer {still[0]} still holds its full weights after backward: free it after "
                    "its reduce-scatter")
    grads = [i for i, k in enumerate(kept) if any(k)]
    if grads:
        verdict.add(f"{where}: layer {grads[0]}'s parameters still hold full gradients after backward: "
                    "drop them (q.grad = None) once reduce-scattered -- ZeRO-3 keeps only the rows")


def _judge_layer_messages(where, calls, groups, carried, log, p, verdict) -> None:
    library = messages.library_calls(calls)
    if library:
        verdict.add(f"{where}: called {', '.join(library)}: {messages.LIBRARY}")
        return
    sends = [c for c in calls if c.kind == "send"]
    want = 3 * (p - 1) * sum(g.shard_numel for g in groups)
    sent = sum(c.numel for c in sends)
    if sent != want:
        verdict.add(f"{where}: sent {sent} elements; each layer's two ring all-gathers and one reduce-scatter "
                    f"send {want}")
        return
    begins = {i: t for what, i, _, t in log if what == "backward"}
    for n, c in enumerate(sends):
        layer = next((i for i, (w, g) in enumerate(carried) if messages.matches(c, w + g)), None)
        if layer is None:
            verdict.add(f"{where}: message {n + 1} of {len(sends)} carries none of the blocks the ring sends "
                        "(a layer's piece, or a running sum of its gradients)")
            return
        is_grad = not messages.matches(c, carried[layer][0])
        if is_grad and layer > 0 and layer - 1 in begins and c.t > begins[layer - 1]:
            verdict.add(f"{where}: layer {layer}'s reduce-scatter was still sending after layer {layer - 1}'s "
                        "backward began: start it from the gradient hook, as the gradients arrive")
            return


# ---- task 6: zero3_train ----------------------------------------------------------------------

TRAIN_STEPS = 3
TRAIN_LR = 1e-2
CONFIGS = {"fp32": (None, None), "bf16": (torch.bfloat16, torch.float32)}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.LayerNorm(12), nn.Linear(12, 12), nn.GELU(),
                         nn.Linear(12, 4))


def _train_batches(seed: int) -> list[torch.Tensor]:
    return [messages.tensor(seed + 104729 * s, (4, 8)) for s in range(TRAIN_STEPS)]


def probe_train(probe: Probe) -> dict:
    fn = probe.student("zero3_train")
    seed = messages.common_seed(probe, "model")
    out = {}
    for name, (param_dtype, reduce_dtype) in CONFIGS.items():
        o = probe.call(name, fn, make_model(seed), _train_batches(probe.seed("batches")), TRAIN_LR,
                       param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        value = o.value
        if isinstance(value, tuple) and len(value) == 2:
            losses, pieces = value
            value = ([float(x) for x in losses] if isinstance(losses, (list, tuple)) else None,
                     [t.detach().clone() for t in pieces if isinstance(t, torch.Tensor)]
                     if isinstance(pieces, (list, tuple)) else None)
        else:
            value = None
        o.value = value
        out[name] = o
    return out


def _expected_train(seed: int, seeds: list[int], param_dtype) -> tuple[list[list[float]], list[list[torch.Tensor]]]:
    """Every rank's batch in one process: the mean gradient of the ranks' losses, Adam on fp32
    masters, the forward in ``param_dtype`` (what fully_shard with a mixed-precision policy does)."""
    masters = make_model(seed)
    opt = torch.optim.Adam(masters.parameters(), lr=TRAIN_LR, foreach=False)
    batches = [_train_batches(s) for s in seeds]
    losses = [[] for _ in seeds]
    for step in range(TRAIN_STEPS):
        total = None
        for r, bs in enumerate(batches):
            work = make_model(seed)
            work.load_state_dict(masters.state_dict())
            if param_dtype is not None:
                work.to(param_dtype)
            x = bs[step].to(param_dtype) if param_dtype is not None else bs[step]
            loss = work(x).float().square().mean()
            loss.backward()
            losses[r].append(loss.item())
            g = [q.grad.float() for q in work.parameters()]
            total = g if total is None else [a + b for a, b in zip(total, g)]
        for q, g in zip(masters.parameters(), total):
            q.grad = g / len(seeds)
        opt.step()
        opt.zero_grad(set_to_none=True)
    units = [m for m in masters.children() if any(True for _ in m.parameters())]
    return losses, [[q.detach().clone() for q in m.parameters()] for m in units]


def _judge_train(grading: Grading) -> Verdict:
    verdict = Verdict()
    for p in grading.sizes(2, 3):
        run = grading.world(f"{HERE}:probe_train", p)
        p = run.size
        seed = run.seed(0, "model") % 1_000_000
        for name, (param_dtype, reduce_dtype) in CONFIGS.items():
            losses, units = _expected_train(seed, [run.seed(r, "batches") for r in range(p)], param_dtype)
            groups = [ShardGroup([tuple(q.shape) for q in u], p) for u in units]
            for rank in range(p):
                where = f"zero3_train in {name} on rank {rank} of {p}"
                o = run.results[rank][name]
                if outcome_problem(where, o, verdict):
                    continue
                _judge_trained(where, o.value, losses[rank], [torch.cat(g.shard(u, rank)) for g, u in
                                                              zip(groups, units)], verdict)
                _judge_wire(where, run.of(rank, name), groups, p, param_dtype, reduce_dtype, verdict)
    return verdict


def _judge_trained(where, value, losses, pieces, verdict) -> None:
    if value is None or value[0] is None or value[1] is None:
        verdict.add(f"{where}: expected (losses, pieces) back: a list of floats and a list of tensors")
        return
    got, have = value
    cast = [i for i, piece in enumerate(have) if piece.dtype != torch.float32]
    if cast:
        verdict.add(f"{where}: unit {cast[0]}'s piece is {have[cast[0]].dtype}: the masters Adam steps stay "
                    "float32 -- cut them from the fp32 weights before casting the unit to param_dtype")
        return
    if len(got) != len(losses):
        verdict.add(f"{where}: {len(got)} losses for {len(losses)} batches")
        return
    bad = [s for s, (a, b) in enumerate(zip(got, losses)) if abs(a - b) > TOL * max(1.0, abs(b))]
    if bad:
        s = bad[0]
        hint = ""
        if s >= 2:
            hint = (" -- the first update was right and a later one was not: a gradient from an earlier "
                    "step was left in grad_piece (zero it after each step)")
        verdict.add(f"{where}: the loss of step {s + 1} is {got[s]!r}, expected {losses[s]!r} "
                    f"(the losses agree through step {s}){hint}")
        return
    if len(have) != len(pieces):
        verdict.add(f"{where}: {len(have)} pieces returned for {len(pieces)} units")
        return
    for i, (want, piece) in enumerate(zip(pieces, have)):
        problem = same(want, piece, exact=False, rtol=TOL, atol=TOL)
        if problem:
            verdict.add(f"{where}: unit {i}'s piece after training: {problem}")
            return


def _judge_wire(where, calls, groups, p, param_dtype, reduce_dtype, verdict) -> None:
    library = messages.library_calls(calls)
    if library:
        verdict.add(f"{where}: called {', '.join(library)}: {messages.LIBRARY}")
        return
    per_step = (p - 1) * sum(g.shard_numel for g in groups)
    by_dtype: dict[str, int] = {}
    for c in calls:
        if c.kind == "send":
            by_dtype[c.dtype] = by_dtype.get(c.dtype, 0) + c.numel
    gather = str(param_dtype or torch.float32).replace("torch.", "")
    reduce = str(reduce_dtype or param_dtype or torch.float32).replace("torch.", "")
    want = {gather: 2 * per_step * TRAIN_STEPS}
    want[reduce] = want.get(reduce, 0) + per_step * TRAIN_STEPS
    if by_dtype != want:
        said = ", ".join(f"{n} elements of {d}" for d, n in sorted(by_dtype.items())) or "nothing"
        wanted = ", ".join(f"{n} of {d}" for d, n in sorted(want.items()))
        hint = ""
        if param_dtype is not None and by_dtype.get(gather, 0) < want[gather]:
            hint = (f" -- the all-gathers travel in {gather}: cast the fp32 piece to the parameters' dtype "
                    "before the all-gather")
        elif reduce_dtype is not None and by_dtype.get(reduce, 0) < want[reduce]:
            hint = f" -- the reduce-scatters travel in reduce_dtype ({reduce})"
        verdict.add(f"{where}: sent {said}; two all-gathers and a reduce-scatter of every unit a step send "
                    f"{wanted}{hint}")


TASKS = [
    GradedTask(10, 5, "ZeRO-3 backward: regather, reduce-scatter in hooks", 4, _judge_layer,
               ("reduce_scatter_grads", "zero3_layer"), routes=P2P),
    GradedTask(10, 6, "train a model under ZeRO-3, fp32 and bf16", 4, _judge_train, ("zero3_train",), routes=P2P),
]
