"""Lesson 13's graded tasks: f and g, the two linear splittings, the sequence pair, the
vocabulary-parallel loss and the chunked all-gather → matmul.

Every input, weight and upstream gradient is drawn from the ranks' secrets (a common seed is
rank 0's, broadcast outside every case); the judge recomputes everything in the grading
process from the same seeds on one process: the full layer, the full sequence, the full
vocabulary. Values are small integers where sums are compared (any order adds them
exactly), so the operators and the sequence pair are judged bit for bit; the layers and the
loss to 1e-5. What a rank returns is plain data (tensors copied out); its messages are the
tap's, judged in both directions: a forward or backward that should send nothing sends
nothing, one that should all-reduce sends no more than the ring's all-reduce would; no
``dist`` collective anywhere (lesson 4's ring is the tool); the loss sends a few numbers a
token, never the logits; the chunked matmul sends p − 1 pieces, and each piece's transfer
starts before the matmul of the piece before it has finished (the tap's clock against the
probe's own ``matmul``, which logs when it ran).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import P2P, GradedTask
from .lesson10 import _common_seed, _named
from .lesson13_common import TOL, _backward, _copy, _grad, _ints, _randn, _ring_all_reduce_bound, _runs, _traffic
from .lesson13_more import _judge_chunked, _judge_loss, _judge_sequence
from .world import Grading, Probe, Verdict, same

HERE = __name__


# ---- task 1: f and g -------------------------------------------------------------------------

SHAPE1 = (3, 5)


def probe_operators(probe: Probe) -> dict:
    f, g = probe.student("copy_to_parallel"), probe.student("reduce_from_parallel")
    x, gy = _ints(probe.seed("x"), SHAPE1), _ints(probe.seed("gy"), SHAPE1)
    out = {}
    xf = x.clone().requires_grad_()
    o = probe.call("f forward", f, xf)
    out["f"] = (o.error, o.not_written, _copy(o.value))
    b = _backward(probe, "f backward", o, gy)
    if b is not None:
        out["f grad"] = (b.error, _grad(xf))
    xg = x.clone().requires_grad_()
    o = probe.call("g forward", g, xg)
    out["g"] = (o.error, o.not_written, _copy(o.value), xg.detach().clone())
    b = _backward(probe, "g backward", o, gy)
    if b is not None:
        out["g grad"] = (b.error, _grad(xg))
    return out


def _judge_operators(grading: Grading) -> Verdict:
    verdict = Verdict()
    for run in _runs(grading, f"{HERE}:probe_operators"):
        p = run.size
        xs = [_ints(run.seed(r, "x"), SHAPE1) for r in range(p)]
        gys = [_ints(run.seed(r, "gy"), SHAPE1) for r in range(p)]
        bound = _ring_all_reduce_bound(xs[0].numel(), p)
        for rank in range(p):
            got = run.results[rank]
            for name, want_fwd, want_grad, fwd_most, bwd_most, what in (
                    ("f", xs[rank], sum(gys), 0, bound, "copy_to_parallel"),
                    ("g", sum(xs), gys[rank], bound, 0, "reduce_from_parallel")):
                where = f"{what} on rank {rank} of {p}"
                error, not_written, value = got[name][:3]
                if not_written:
                    verdict.not_written = verdict.not_written or not_written
                    continue
                if error:
                    verdict.add(f"{where}: {error}")
                    continue
                verdict.add(_named(f"{where}, forward", same(want_fwd, value)))
                if name == "g" and not torch.equal(got["g"][3], xs[rank]):
                    verdict.add(f"{where}: changed its input x; return a new tensor (x may be read again)")
                _traffic(run, rank, f"{name} forward", fwd_most, f"{where}, forward", verdict)
                if f"{name} grad" not in got:
                    verdict.add(f"{where}: its output does not require grad; autograd must see through it")
                    continue
                error, grad = got[f"{name} grad"]
                if error:
                    verdict.add(f"{where}, backward: {error}")
                    continue
                hint = (" (the gradient of x summed over the group: each rank saw only its own outputs)"
                        if name == "f" else " (the gradient passes unchanged: d(Σ x_r)/dx_r = 1)")
                problem = same(want_grad, grad) if grad is not None else "x got no gradient"
                verdict.add(_named(f"{where}, backward", problem and problem + hint))
                _traffic(run, rank, f"{name} backward", bwd_most, f"{where}, backward", verdict)
    return verdict


# ---- task 2: column- and row-parallel linear ---------------------------------------------------

IN, OUT, ROWS = 6, 12, 4       # Linear(IN, OUT) column-split; Linear(OUT, IN) row-split; 4 tokens


def _layer(seed: int, n_in: int, n_out: int):
    return _randn(seed, (n_out, n_in), 0.5), _randn(seed + 1, (n_out,), 0.5)


def probe_linear(probe: Probe) -> dict:
    col, row = probe.student("column_parallel_linear"), probe.student("row_parallel_linear")
    seed = _common_seed(probe, "layers")
    p, r = probe.size, probe.rank
    out = {}
    w, b = _layer(seed, IN, OUT)
    x = _randn(seed + 2, (ROWS, IN)).requires_grad_()
    ws, bs = w.chunk(p, 0)[r].clone().requires_grad_(), b.chunk(p, 0)[r].clone().requires_grad_()
    gy = _randn(seed + 3, (ROWS, OUT)).chunk(p, 1)[r]
    o = probe.call("column forward", col, x, ws, bs)
    out["column"] = (o.error, o.not_written, _copy(o.value))
    k = _backward(probe, "column backward", o, gy)
    if k is not None:
        out["column grads"] = (k.error, _grad(x), _grad(ws), _grad(bs))
    w, b = _layer(seed + 10, OUT, IN)
    h = _randn(seed + 12, (ROWS, OUT))
    hs = h.chunk(p, 1)[r].clone().requires_grad_()
    ws, bias = w.chunk(p, 1)[r].clone().requires_grad_(), b.clone().requires_grad_()
    gy = _randn(seed + 13, (ROWS, IN))
    o = probe.call("row forward", row, hs, ws, bias)
    out["row"] = (o.error, o.not_written, _copy(o.value))
    k = _backward(probe, "row backward", o, gy)
    if k is not None:
        out["row grads"] = (k.error, _grad(hs), _grad(ws), _grad(bias))
    return out


def _expected_linear(seed: int, p: int):
    w, b = (t.requires_grad_() for t in _layer(seed, IN, OUT))
    x = _randn(seed + 2, (ROWS, IN)).requires_grad_()
    y = F.linear(x, w, b)
    (y * _randn(seed + 3, (ROWS, OUT))).sum().backward()
    col = [(y.detach().chunk(p, 1)[r], x.grad, w.grad.chunk(p, 0)[r], b.grad.chunk(p, 0)[r]) for r in range(p)]
    w, b = (t.requires_grad_() for t in _layer(seed + 10, OUT, IN))
    h = _randn(seed + 12, (ROWS, OUT)).requires_grad_()
    y = F.linear(h, w, b)
    (y * _randn(seed + 13, (ROWS, IN))).sum().backward()
    row = [(y.detach(), h.grad.chunk(p, 1)[r], w.grad.chunk(p, 1)[r], b.grad) for r in range(p)]
    return col, row


def _judge_linear(grading: Grading) -> Verdict:
    verdict = Verdict()
    for run in _runs(grading, f"{HERE}:probe_linear"):
        p = run.size
        col, row = _expected_linear(run.seed(0, "layers") % 1_000_000, p)
        for rank in range(p):
            got = run.results[rank]
            for name, want, fwd_most, bwd_most, what in (
                    ("column", col[rank], 0, _ring_all_reduce_bound(ROWS * IN, p), "column_parallel_linear"),
                    ("row", row[rank], _ring_all_reduce_bound(ROWS * IN, p), 0, "row_parallel_linear")):
                where = f"{what} on rank {rank} of {p}"
                error, not_written, value = got[name]
                if not_written:
                    verdict.not_written = verdict.not_written or not_written
                    continue
                if error:
                    verdict.add(f"{where}: {error}")
                    continue
                problem = same(want[0], value, exact=False, rtol=0, atol=TOL)
                if problem and name == "row" and isinstance(value, torch.Tensor) and value.shape == want[0].shape \
                        and torch.allclose(value - want[0], (p - 1) * _layer(run.seed(0, "layers") % 1_000_000 + 10,
                                                                             OUT, IN)[1].expand_as(value), atol=1e-4):
                    problem += f" -- the bias counted {p} times: add it once, after the sum"
                verdict.add(_named(f"{where}, forward", problem))
                _traffic(run, rank, f"{name} forward", fwd_most, f"{where}, forward", verdict)
                if f"{name} grads" not in got:
                    verdict.add(f"{where}: its output does not require grad")
                    continue
                error, *grads = got[f"{name} grads"]
                if error:
                    verdict.add(f"{where}, backward: {error}")
                    continue
                for label, w_, g_ in zip(("the input", "the weight", "the bias"), want[1:], grads):
                    problem = same(w_, g_, exact=False, rtol=0, atol=TOL) if g_ is not None else "no gradient"
                    if problem and name == "column" and label == "the input":
                        problem += " -- x's gradient must be summed over the group (enter through f)"
                    verdict.add(_named(f"{where}, gradient of {label}", problem))
                _traffic(run, rank, f"{name} backward", bwd_most, f"{where}, backward", verdict)
    return verdict


TASKS = [
    GradedTask(13, 1, "f and g as autograd functions", 2, _judge_operators,
               ("copy_to_parallel", "reduce_from_parallel"), routes=P2P),
    GradedTask(13, 2, "column- and row-parallel linear", 3, _judge_linear,
               ("column_parallel_linear", "row_parallel_linear"), routes=P2P),
    GradedTask(13, 3, "sequence parallelism's gather and scatter", 3, _judge_sequence,
               ("gather_sequence", "scatter_sequence"), routes=P2P),
    GradedTask(13, 4, "vocabulary-parallel cross-entropy", 4, _judge_loss, ("vocab_cross_entropy",), routes=P2P),
    GradedTask(13, 5, "chunked all-gather → matmul, overlapped", 4, _judge_chunked, ("chunked_all_gather_matmul",),
               routes=P2P),
]
