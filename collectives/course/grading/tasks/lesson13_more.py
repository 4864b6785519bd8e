"""Lesson 13's tasks 3-5: the sequence pair, the vocabulary-parallel loss, the chunked matmul
(judged as :mod:`.lesson13` describes)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .evidence import carries_blocks
from .lesson10 import _common_seed, _named
from .lesson13_common import (
    TOL,
    _backward,
    _collectives,
    _copy,
    _grad,
    _ints,
    _randn,
    _ring_all_reduce_bound,
    _runs,
    _sent,
    _traffic,
)
from .world import Grading, Probe, Verdict, same

HERE = __name__
B, PIECE, H = 2, 3, 4           # batch, tokens per rank, hidden


# ---- task 3: gather_sequence / scatter_sequence ------------------------------------------------

def probe_sequence(probe: Probe) -> dict:
    gather, scatter = probe.student("gather_sequence"), probe.student("scatter_sequence")
    p = probe.size
    out = {}
    x = _ints(probe.seed("piece"), (B, PIECE, H)).requires_grad_()
    gy = _ints(probe.seed("gather gy"), (B, PIECE * p, H))
    o = probe.call("gather forward", gather, x)
    out["gather"] = (o.error, o.not_written, _copy(o.value))
    k = _backward(probe, "gather backward", o, gy)
    if k is not None:
        out["gather grad"] = (k.error, _grad(x))
    x = _ints(probe.seed("whole"), (B, PIECE * p, H)).requires_grad_()
    gy = _ints(probe.seed("scatter gy"), (B, PIECE, H))
    o = probe.call("scatter forward", scatter, x)
    out["scatter"] = (o.error, o.not_written, _copy(o.value))
    k = _backward(probe, "scatter backward", o, gy)
    if k is not None:
        out["scatter grad"] = (k.error, _grad(x))
    if p > 1:
        bad = probe.call("scatter uneven", scatter, torch.zeros(B, PIECE * p + 1, H))
        out["uneven"] = (bad.error, bad.not_written)
    return out


def _judge_sequence(grading: Grading) -> Verdict:
    verdict = Verdict()
    for run in _runs(grading, f"{HERE}:probe_sequence"):
        p = run.size
        pieces = [_ints(run.seed(r, "piece"), (B, PIECE, H)) for r in range(p)]
        wholes = [_ints(run.seed(r, "whole"), (B, PIECE * p, H)) for r in range(p)]
        g_gys = [_ints(run.seed(r, "gather gy"), (B, PIECE * p, H)) for r in range(p)]
        s_gys = [_ints(run.seed(r, "scatter gy"), (B, PIECE, H)) for r in range(p)]
        bound = (p - 1) * B * PIECE * H
        for rank in range(p):
            got = run.results[rank]
            mine = slice(rank * PIECE, (rank + 1) * PIECE)
            cases = (("gather", torch.cat(pieces, 1), sum(g[:, mine] for g in g_gys), "gather_sequence",
                      " (the gradient's sum over the group, this rank's piece of the sequence)"),
                     ("scatter", sum(w[:, mine] for w in wholes), torch.cat(s_gys, 1), "scatter_sequence",
                      " (every rank's gradient piece, in rank order on the sequence)"))
            for name, want, want_grad, what, hint in cases:
                where = f"{what} on rank {rank} of {p}"
                error, not_written, value = got[name]
                if not_written:
                    verdict.not_written = verdict.not_written or not_written
                    continue
                if error:
                    verdict.add(f"{where}: {error}")
                    continue
                problem = same(want, value)
                if problem and name == "gather" and isinstance(value, torch.Tensor) and value.shape == want.shape \
                        and torch.equal(value.reshape(-1).sort().values, want.reshape(-1).sort().values):
                    problem += " -- the right numbers in the wrong places: gather on the sequence (dim 1), not flat"
                verdict.add(_named(f"{where}, forward", problem))
                _traffic(run, rank, f"{name} forward", bound, f"{where}, forward", verdict)
                if f"{name} grad" not in got:
                    verdict.add(f"{where}: its output does not require grad")
                    continue
                error, grad = got[f"{name} grad"]
                if error:
                    verdict.add(f"{where}, backward: {error}")
                    continue
                problem = same(want_grad, grad) if grad is not None else "x got no gradient"
                verdict.add(_named(f"{where}, backward", problem and problem + hint))
                _traffic(run, rank, f"{name} backward", bound, f"{where}, backward", verdict)
            if p > 1 and not got["uneven"][1]:
                error = got["uneven"][0]
                where = f"scatter_sequence on rank {rank} of {p}, a sequence of {PIECE * p + 1}"
                if "ValueError" not in error:
                    verdict.add(f"{where}: expected a ValueError (it does not split over {p} ranks), "
                                + (f"got {error}" if error else "it returned"))
                if _sent(run.of(rank, "scatter uneven")):
                    verdict.add(f"{where}: sent messages before refusing; check first, on every rank alike")
    return verdict


# ---- task 4: vocab_cross_entropy -------------------------------------------------------------

TOKENS, SLICE = (2, 3), 8      # 6 tokens; 8 classes of the vocabulary per rank


def _logits(seed: int, p: int) -> torch.Tensor:
    logits = _randn(seed, TOKENS + (SLICE * p,), 4.0)
    logits[0, 0] += 100.0             # exp(100) overflows float32: the max must come off first
    return logits


def probe_loss(probe: Probe) -> dict:
    fn = probe.student("vocab_cross_entropy")
    seed = _common_seed(probe, "logits")
    p, r = probe.size, probe.rank
    logits = _logits(seed, p).chunk(p, -1)[r].clone().requires_grad_()
    targets = torch.randint(0, SLICE * p, TOKENS, generator=torch.Generator().manual_seed(seed + 1))
    upstream = _randn(seed + 2, TOKENS)
    o = probe.call("loss forward", fn, logits, targets.clone())
    out = {"loss": (o.error, o.not_written, _copy(o.value))}
    k = _backward(probe, "loss backward", o, upstream)
    if k is not None:
        out["grad"] = (k.error, _grad(logits))
    return out


def _judge_loss(grading: Grading) -> Verdict:
    verdict = Verdict()
    for run in _runs(grading, f"{HERE}:probe_loss"):
        p = run.size
        seed = run.seed(0, "logits") % 1_000_000
        logits = _logits(seed, p).requires_grad_()
        targets = torch.randint(0, SLICE * p, TOKENS, generator=torch.Generator().manual_seed(seed + 1))
        want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(TOKENS)
        (want * _randn(seed + 2, TOKENS)).sum().backward()
        n = targets.numel()
        most = 3 * _ring_all_reduce_bound(n, p)
        for rank in range(p):
            got = run.results[rank]
            where = f"vocab_cross_entropy on rank {rank} of {p}"
            error, not_written, value = got["loss"]
            if not_written:
                verdict.not_written = verdict.not_written or not_written
                continue
            if error:
                verdict.add(f"{where}: {error}")
                continue
            problem = same(want.detach(), value, exact=False, rtol=TOL, atol=TOL)
            if problem and isinstance(value, torch.Tensor) and not torch.isfinite(value).all():
                problem += " -- not finite: subtract the vocabulary's max before exp"
            verdict.add(_named(f"{where}, the loss", problem))
            calls = run.of(rank, "loss forward")
            if _sent(calls) > most:
                verdict.add(f"{where}: sent {_sent(calls)} elements for {n} tokens; the logits ({n} × {SLICE} "
                            f"here) must never travel: all-reduce the max, the sum of exp and the target's "
                            f"logit, at most {most}")
            banned = _collectives(calls)
            if banned:
                verdict.add(f"{where}: called {', '.join(banned)}; build it on lesson 4's ring")
            if "grad" not in got:
                verdict.add(f"{where}: the loss does not require grad; it must be differentiable in the logits")
                continue
            error, grad = got["grad"]
            if error:
                verdict.add(f"{where}, backward: {error}")
                continue
            problem = same(logits.grad.chunk(p, -1)[rank], grad, exact=False, rtol=0, atol=TOL) \
                if grad is not None else "the logits got no gradient"
            verdict.add(_named(f"{where}, the gradient of the logits", problem))
            _traffic(run, rank, "loss backward", 0, f"{where}, backward (the logits' gradient is local)", verdict)
    return verdict


# ---- task 5: chunked_all_gather_matmul ---------------------------------------------------------

M, K, N = 3, 4, 5
COMPUTE_SECONDS = 0.1      # each matmul, and at least each transfer: long enough to see them overlap
TRANSFER_SECONDS = 0.1


class _SlowTransfers:
    """``ops.sendrecv`` made to take at least TRANSFER_SECONDS from posting to the receive's
    return, each transfer's (posted, done) logged: a transfer that overlaps a matmul ends
    after the matmul began."""

    def __init__(self, log):
        from collectives.core import ops

        self.ops, self.original, self.log = ops, ops.sendrecv, log

    def __enter__(self):
        original, log = self.original, self.log

        def sendrecv(*args, **kwargs):
            posted = time.perf_counter()
            recv, send = original(*args, **kwargs)
            entry = [posted, None]
            log.append(entry)

            class Slow:
                def wait(self):
                    recv.wait()
                    time.sleep(max(0.0, posted + TRANSFER_SECONDS - time.perf_counter()))
                    entry[1] = time.perf_counter()
            return Slow(), send
        self.ops.sendrecv = sendrecv
        return self

    def __exit__(self, *exc):
        self.ops.sendrecv = self.original


def probe_chunked(probe: Probe) -> dict:
    fn = probe.student("chunked_all_gather_matmul")
    seed = _common_seed(probe, "weight")
    x, w = _ints(probe.seed("x"), (M, K)), _ints(seed, (K, N))
    log, transfers = [], []

    def matmul(a, b):
        start = time.perf_counter()
        time.sleep(COMPUTE_SECONDS)
        y = torch.matmul(a, b)
        log.append((tuple(a.shape), start, time.perf_counter()))
        return y

    with _SlowTransfers(transfers):
        o = probe.call("chunked", fn, x.clone(), w.clone(), None, matmul)
    return {"out": (o.error, o.not_written, _copy(o.value)), "log": log, "transfers": transfers}


def _judge_chunked(grading: Grading) -> Verdict:
    verdict = Verdict()
    for run in _runs(grading, f"{HERE}:probe_chunked"):
        p = run.size
        w = _ints(run.seed(0, "weight") % 1_000_000, (K, N))
        want = torch.cat([_ints(run.seed(r, "x"), (M, K)) for r in range(p)]) @ w
        for rank in range(p):
            got = run.results[rank]
            where = f"chunked_all_gather_matmul on rank {rank} of {p}"
            error, not_written, value = got["out"]
            if not_written:
                verdict.not_written = verdict.not_written or not_written
                continue
            if error:
                verdict.add(f"{where}: {error}")
                continue
            problem = same(want, value)
            if problem and isinstance(value, torch.Tensor) and value.shape == want.shape:
                blocks = sorted(tuple(b.reshape(-1).tolist()) for b in value.split(M))
                if blocks == sorted(tuple(b.reshape(-1).tolist()) for b in want.split(M)):
                    problem += " -- the right blocks in the wrong places: block j holds rank j's rows"
            verdict.add(_named(where, problem))
            log = got["log"]
            if [shape for shape, _, _ in log] != [(M, K)] * p:
                verdict.add(f"{where}: called matmul on {[s for s, _, _ in log]}; call it once per piece of "
                            f"{(M, K)}, {p} times")
                continue
            calls = run.of(rank, "chunked")
            banned = _collectives(calls)
            if banned:
                verdict.add(f"{where}: called {', '.join(banned)}; the pieces travel as messages (ops.sendrecv)")
            sends = sorted((c for c in calls if c.kind == "send"), key=lambda c: c.t)
            if [c.numel for c in sends] != [M * K] * (p - 1):
                verdict.add(f"{where}: sent {[c.numel for c in sends]} elements; expected {p - 1} pieces of {M * K}")
                continue
            stray = carries_blocks(sends, [_ints(run.seed(r, "x"), (M, K)) for r in range(p)], "a rank's piece of x")
            if stray:
                verdict.add(f"{where}: {stray}")
                continue
            transfers = got["transfers"]
            if len(transfers) != p - 1 or any(done is None for _, done in transfers):
                verdict.add(f"{where}: {len(transfers)} exchanges went through ops.sendrecv (and were waited for); "
                            f"send the p - 1 = {p - 1} pieces with it")
                continue
            for s, (posted, done) in enumerate(transfers):
                if done <= log[s][1]:
                    late = 1e3 * (log[s][1] - done)
                    verdict.add(f"{where}: step {s}'s matmul began {late:.1f} ms after its transfer ended: "
                                "the two ran one after the other; multiply while the piece travels")
                    break
    return verdict

