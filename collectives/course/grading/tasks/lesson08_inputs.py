"""Lesson 8's graded inputs and message patterns, shared by its judges (:mod:`.lesson08`,
:mod:`.lesson08_hook`): tensors drawn from a seed, what the contract sends from them, and
what each transport's messages must be."""

from __future__ import annotations

import math

import torch

from .world import same

ROUGH = (torch.float16, torch.bfloat16)


# ---- inputs: drawn in the rank, redrawn in the judge ---------------------------------------

def draw(seed: int, n: int, dtype, low: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tensor_in, residual_in)``: their sum has distinct magnitudes in 1..2n (n of them;
    ``low``: all of 1..n), random signs; the residual is in [-3, 3]. Exact in every dtype
    for 2n + 3 <= 256."""
    g = torch.Generator().manual_seed(seed)
    mags = (torch.randperm(n, generator=g) if low else torch.randperm(2 * n, generator=g)[:n]) + 1
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    r = torch.randint(-3, 4, (n,), generator=g)
    return (mags * signs - r).to(dtype), r.to(dtype)


def keep_of(x: torch.Tensor, mode: dict) -> torch.Tensor:
    """Which elements of ``x`` the contract sends (the judge's own arithmetic, in float64)."""
    mag = x.double().abs()
    if "threshold" in mode:
        return ~(mag < mode["threshold"])
    k = 0 if x.numel() == 0 else min(x.numel(), max(1, math.ceil(mode["density"] * x.numel())))
    keep = torch.zeros(x.numel(), dtype=torch.bool)
    keep[torch.sort(mag, descending=True, stable=True).indices[:k]] = True      # NaN sorts first
    return keep


def sent_of(x: torch.Tensor, mode: dict) -> torch.Tensor:
    """What the contract sends from ``x``; zeros elsewhere."""
    return torch.where(keep_of(x, mode), x, torch.zeros_like(x))


def residual_problem(x: torch.Tensor, mode: dict, dtype, got) -> str | None:
    """The residual left: ``x`` where nothing was sent, zero where it was (exactly)."""
    expected = torch.where(keep_of(x, mode), torch.zeros_like(x), x).to(dtype)
    if same(expected, got) is not None:
        return "the residual is not tensor_in + residual_in with the sent places zeroed (exactly)"
    return None


def compare_sum(expected64: torch.Tensor, got, dtype, p: int, avg: bool,
                magnitude64: torch.Tensor | None = None) -> str | None:
    """``got`` is the sum (AVG: the mean) of the ranks' sent values. In bfloat16 and float16
    each addition rounds, in an order the transport chooses: with ``magnitude64`` (the sum of
    the terms' sizes) an element may be off by p roundings of that size, however much the
    terms cancel."""
    expected = (expected64 / p if avg else expected64).to(dtype)
    if dtype in ROUGH and magnitude64 is not None and isinstance(got, torch.Tensor):
        problem = same(expected, got, exact=False, rtol=float("inf"), atol=float("inf"))  # shape, NaN, inf
        if problem is not None:
            return problem
        eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
        scale = (magnitude64 / p if avg else magnitude64)
        finite = torch.isfinite(expected64)
        off = (got.double() - expected.double()).abs()
        bad = finite & (off > p * eps * scale + eps * expected.double().abs())
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            return (f"{int(bad.sum())} of {bad.numel()} elements differ by more than {p} roundings of their "
                    f"terms; first at index {i}: expected {expected[i].item()}, got {got.reshape(-1)[i].item()}")
        return None
    if dtype in ROUGH or avg:
        from ... import verify
        rtol, atol = verify.tolerance(dtype, p) if dtype in ROUGH else (1e-6, 1e-6)
        return same(expected, got, exact=False, rtol=rtol, atol=atol)
    return same(expected, got)


def pg_calls(calls) -> list:
    return [c for c in calls if not c.kind.startswith("store.")]


def pairs_pattern(calls, p: int, n: int, width: int, e: int, transport: str, threshold: bool,
                  everything: bool, dtype: str) -> str | None:
    """The messages of one call of a transport (the course's own check-mode traffic aside)."""
    calls = pg_calls(calls)
    kinds = [(c.kind, c.numel) for c in calls]
    counts = [("allgather", p)]
    if everything:
        expected = [("allreduce", n)]
    elif transport == "dense":
        expected = [("allreduce", n)]
    else:
        expected = [("allgather", p * width * (4 + e))] if width and p > 1 else []
    if threshold and not everything:
        allowed = [counts + expected, expected]
    else:
        allowed = [expected]
    if p == 1:
        allowed += [[], counts]
    if kinds in allowed:
        return None
    if transport == "allgather" and any(k == "allreduce" for k, _ in kinds):
        return ("called all_reduce: the all-gather transport moves (index, value) pairs in one "
                "all-gather, not the masked tensor in a dense all-reduce")
    shown = ", ".join(f"{k} of {m}" for k, m in kinds) or "no collective"
    want = " then ".join(f"{k} of {m}" for k, m in allowed[0]) or "no collective"
    return f"made {shown}; expected {want} (elements; pairs travel packed as bytes)"


def split_sends(calls, sent: torch.Tensor, members: list[int], rank: int, e: int) -> str | None:
    """Split sends each owner exactly the pairs in its piece, in one message (no all-reduce)."""
    from ....core.ops import chunk_bounds
    calls = pg_calls(calls)
    if any(c.kind == "allreduce" for c in calls):
        return "called all_reduce: split moves pairs to their owners and gathers the reduced pieces"
    idx = torch.nonzero(sent).view(-1)
    for j, (lo, hi) in enumerate(chunk_bounds(sent.numel(), len(members))):
        if members[j] == rank:
            continue
        pairs = int(((idx >= lo) & (idx < hi)).sum())
        if pairs and not any(c.kind == "send" and c.peer == members[j] and c.numel == pairs * (4 + e)
                             for c in calls):
            return (f"no message of {pairs} pairs ({pairs * (4 + e)} bytes) to rank {members[j]}, "
                    "the owner of those indices")
    return None
