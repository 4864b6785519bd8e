"""Lesson 8's graded tasks 3 and 4, their common part: ``sparse_all_reduce``'s contract, per
transport.

The cases (:func:`contract_cases`) and every rank's input (:func:`contract_input`), drawn
from the ranks' secrets; the calls that must be refused (:func:`refusals`); the probe that
makes every call, and the judge that rebuilds each expected sum and residual with plain
tensor arithmetic and holds each call's messages, read from the tap, to its transport's
design. Task 3 runs it on the all-gather and dense transports, task 4 (:mod:`.lesson08`)
on split and auto.
"""

from __future__ import annotations

import math

import torch

from ....core.ops import ReduceOp
from .lesson08_inputs import compare_sum, draw, pairs_pattern, pg_calls, residual_problem, sent_of, split_sends
from .world import Grading, Probe, Run, Verdict, outcome_problem, same

HERE = __name__


# ---- tasks 3 and 4: sparse_all_reduce's contract, per transport ---------------------------------

def contract_cases(p: int, transports) -> list[tuple]:
    """(name, n, dtype, mode, transport, AVG, with a residual)."""
    out = []
    for transport in transports:
        for mode in ({"density": 0.1}, {"threshold": 150.0}):
            m = next(iter(mode))
            out += [(f"{transport} {m} float32", 241, torch.float32, mode, transport, False, True),
                    (f"{transport} {m} int64", 241, torch.int64, mode, transport, False, True),
                    (f"{transport} {m} bfloat16", 100, torch.bfloat16, mode, transport, False, True)]
        out += [(f"{transport} AVG float64", 241, torch.float64, {"density": 0.05}, transport, True, True),
                (f"{transport} no residual", 241, torch.float32, {"density": 0.2}, transport, False, False),
                (f"{transport} zero on some", 241, torch.float32, {"threshold": 300.0}, transport, False, True),
                (f"{transport} zero on all", 241, torch.float64, {"threshold": 999.0}, transport, False, True),
                (f"{transport} everything kept", 241, torch.float32, {"density": 1.0}, transport, False, True),
                (f"{transport} threshold 0", 241, torch.int32, {"threshold": 0.0}, transport, False, True),
                (f"{transport} everything kept, random float64", 241, torch.float64, {"density": 1.0}, transport,
                 False, True),
                (f"{transport} non-finite top-k", 241, torch.float32, {"density": 0.1}, transport, False, True),
                (f"{transport} non-finite threshold", 241, torch.float32, {"threshold": 150.0}, transport, False,
                 True),
                (f"{transport} strided view", 241, torch.float32, {"density": 0.1}, transport, False, True)]
    if p >= 3:
        out += [(f"{transports[0]} subgroup", 241, torch.float32, {"density": 0.1}, transports[0], False, True),
                (f"{transports[0]} subgroup AVG everything kept", 241, torch.float64, {"density": 1.0},
                 transports[0], True, True)]
    return out


def contract_input(seed: int, key: str, n: int, dtype, rank: int, size: int, residual: bool):
    """The case's ``(tensor_in, residual_in)`` on ``rank`` (the residual unused when
    ``residual`` is False: the tensor then holds the sum). "random": floats, not integers;
    "non-finite": NaN on the last rank, +inf on the first and -inf beside it on the last."""
    if "random" in key:
        g = torch.Generator().manual_seed(seed)
        t = (torch.rand(n, generator=g, dtype=torch.float64) * 200 - 100).to(dtype)
        r = (torch.rand(n, generator=g, dtype=torch.float64) - 0.5).to(dtype)
        return t, r
    t, r = draw(seed, n, dtype, low=_low(key, rank))
    if "non-finite" in key:
        at = (seed % 50) + 3
        if rank == size - 1:
            t[at], t[at + 1] = math.nan, -math.inf
        if rank == 0:
            t[at + 2] = math.inf
    if not residual:
        t = t + r
    return t, r


def _low(key: str, rank: int) -> bool:
    """Case "zero on some": odd ranks draw magnitudes up to n only, below its threshold."""
    return "zero on some" in key and rank % 2 == 1


def refusals(n: int):
    """(name, keyword arguments, what is passed) of calls that must be refused: the residual
    itself ("same"), one of another size, the tensor's own memory; a bool tensor; an
    expanded tensor of 2^31 elements."""
    return [("selection 'bogus'", dict(density=0.1, selection="bogus"), "same"),
            ("'reuse' without a state", dict(density=0.1, selection="reuse"), "same"),
            ("density 0", dict(density=0.0), "same"), ("density 1.5", dict(density=1.5), "same"),
            ("both density and threshold", dict(density=0.1, threshold=1.0), "same"),
            ("neither density nor threshold", dict(), "same"), ("threshold -1", dict(threshold=-1.0), "same"),
            ("threshold NaN", dict(threshold=math.nan), "same"),
            ("transport 'bogus'", dict(density=0.1, transport="bogus"), "same"),
            ("op MAX", dict(density=0.1, op=ReduceOp.MAX), "same"),
            ("a residual of another size", dict(density=0.1), "wrong"),
            ("a residual sharing the tensor's memory", dict(density=0.1), "shared"),
            ("a bool tensor", dict(density=0.1), "bool"), ("2^31 elements", dict(density=0.01), "huge")]


def probe_contract(probe: Probe, name: str, transports: tuple, with_refusals: bool) -> dict:
    import torch.distributed as dist
    fn = probe.student(name)
    cases = contract_cases(probe.size, transports)
    group = dist.new_group(list(range(probe.size - 1))) if probe.size >= 3 else None
    out = {}
    for case in cases:
        key, n, dtype, mode, transport, avg, residual = case
        t, r = contract_input(probe.seed(key), key, n, dtype, probe.rank, probe.size, residual)
        base = None
        if "strided" in key:                    # every other element of a larger buffer
            base = torch.full((2 * n,), 77, dtype=dtype)
            base[::2] = t
            t = base[::2]
        extra = {}
        if "subgroup" in key:
            extra["group"] = group
        outcome = probe.call(key, fn, t, r if residual else None, transport=transport,
                             op=ReduceOp.AVG if avg else ReduceOp.SUM, **mode, **extra)
        gaps = base is None or bool((base[1::2] == 77).all())
        out[key] = (outcome, t.clone(), r, gaps)
    if with_refusals:
        for key, kwargs, residual in refusals(50):
            t, r = draw(probe.seed(key), 50, torch.float32)
            if residual == "bool":
                t = t > 0
            t0, r0 = t.clone(), r.clone()
            res = {"same": r, "wrong": torch.zeros(49), "shared": t, "bool": None, "huge": None}[residual]
            if residual == "huge":
                t = torch.zeros(1, dtype=torch.int8).expand(2**31)     # 2^31 elements, no memory
                t0 = t
            outcome = probe.call(key, fn, t, res, **kwargs)
            out[key] = (outcome, bool(torch.equal(t, t0) and torch.equal(r, r0)))
    return out


def judge_contract(grading: Grading, name: str, transports: tuple, sizes, *, with_refusals: bool = True,
                   verdict: Verdict | None = None) -> Verdict:
    verdict = verdict or Verdict()
    for size in grading.sizes(*sizes):
        run = grading.world(f"{HERE}:probe_contract", size, name, transports, with_refusals)
        for case in contract_cases(size, transports):
            _judge_case(run, name, case, verdict)
        if with_refusals:
            for key, _, _ in refusals(50):
                for r in range(size):
                    outcome, unchanged = run.results[r][key]
                    where = f"{name}, world of {size}, rank {r}, case {key}"
                    if outcome.not_written:
                        verdict.not_written = verdict.not_written or outcome.not_written
                    elif not outcome.error.startswith(("raised ValueError", "raised TypeError")):
                        verdict.add(f"{where}: must raise ValueError or TypeError, got {outcome.error or 'no error'}")
                    elif key == "2^31 elements" and "2^31" not in outcome.error:
                        verdict.add(f"{where}: refuse 2^31 elements or more first, saying so (indices travel "
                                    f"as int32), got {outcome.error}")
                    elif not unchanged:
                        verdict.add(f"{where}: refused after changing the tensor or the residual (check first)")
                    elif pg_calls(run.of(r, key)):
                        verdict.add(f"{where}: sent messages before refusing")
        if verdict.not_written or len(verdict.problems) > 20:
            break
    return verdict


def _judge_case(run: Run, name: str, case: tuple, verdict: Verdict) -> None:
    key, n, dtype, mode, transport, avg, residual = case
    size = run.size
    members = list(range(size - 1)) if "subgroup" in key else list(range(size))
    xs = {}
    for r in members:
        t, res = contract_input(run.seed(r, key), key, n, dtype, r, size, True)
        xs[r] = (t + res).double()           # the residual is added in the tensor's dtype
    sents = {r: sent_of(x, mode) for r, x in xs.items()}
    total = sum(sents.values(), torch.zeros(n, dtype=torch.float64))
    magnitude = sum((s.abs() for s in sents.values()), torch.zeros(n, dtype=torch.float64))
    counts = [int(s.count_nonzero()) for s in sents.values()]
    everything = mode.get("density") == 1.0 or mode.get("threshold") == 0.0
    e = torch.empty((), dtype=dtype).element_size()
    for r in range(size):
        where = f"{name}, world of {size}, rank {r}, case {key}"
        outcome, t_out, r_out, gaps = run.results[r][key]
        if outcome_problem(where, outcome, verdict):
            continue
        if r not in members:
            t_in, r_in = contract_input(run.seed(r, key), key, n, dtype, r, size, residual)
            touched = not (torch.equal(t_in, t_out) and torch.equal(r_in, r_out))
            if touched or pg_calls(run.of(r, key)):
                verdict.add(f"{where}: a rank outside the group must return at once, touching nothing")
            continue
        if "random" in key and len(members) > 2:    # gloo may add three or more in another order
            problem = same((total / len(members) if avg else total).to(dtype), t_out, exact=False,
                           rtol=1e-12, atol=1e-12)
        else:
            problem = compare_sum(total, t_out, dtype, len(members), avg, magnitude)
        if problem is None and not gaps:
            problem = "wrote between the elements of a strided view"
        if problem is None and residual:
            problem = residual_problem(xs[r], mode, dtype, r_out)
        if problem is None and transport not in ("auto", "split"):
            problem = pairs_pattern(run.of(r, key), len(members), n, max(counts), e, transport,
                                    "threshold" in mode, everything, str(dtype)[6:])
        if problem is None and transport == "split" and not everything and len(members) > 1:
            problem = split_sends(run.of(r, key), sents[r], members, r, e)
        verdict.add(problem and f"{where}: {problem}")
