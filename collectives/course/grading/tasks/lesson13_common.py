"""Lesson 13's judges' shared pieces: drawing inputs, copying results out, judging traffic."""

from __future__ import annotations

import torch

from .world import Verdict

TOL = 1e-5
P2P = ("send", "recv")


def _ints(seed: int, shape, lo: int = -4, hi: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed % (1 << 62))
    return torch.randint(lo, hi, tuple(shape), generator=g).float()


def _randn(seed: int, shape, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed % (1 << 62))
    return torch.randn(tuple(shape), generator=g) * scale


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _grad(x: torch.Tensor):
    return None if x.grad is None else x.grad.detach().clone()


def _sent(calls) -> int:
    return sum(c.numel for c in calls if c.kind == "send")


def _collectives(calls) -> list[str]:
    return sorted({c.kind for c in calls if c.kind not in P2P and not c.kind.startswith("store.")})


def _traffic(run, rank: int, key: str, most: int, where: str, verdict: Verdict) -> None:
    """No dist collective, and no more than ``most`` elements sent, under case ``key``."""
    calls = run.of(rank, key)
    banned = _collectives(calls)
    if banned:
        verdict.add(f"{where}: called {', '.join(banned)}; build it on lesson 4's ring (ring_all_reduce...)")
    sent = _sent(calls)
    if sent > most:
        verdict.add(f"{where}: sent {sent} elements; " + (f"at most {most} travel here" if most else
                                                           "nothing should travel here"))


def _ring_all_reduce_bound(n: int, p: int) -> int:
    return 2 * (p - 1) * -(-n // p)


def _backward(probe, name: str, forward, upstream: torch.Tensor):
    """The student's backward, called (as ``name``) through the output ``forward`` gave, when that
    output is a tensor autograd tracks; None when there is nothing to call it through."""
    value = forward.value
    if forward.error or forward.not_written or not isinstance(value, torch.Tensor) or not value.requires_grad:
        return None
    return probe.call(name, lambda: (value * upstream).sum().backward())


def _runs(grading, probe_target: str):
    """Each world a lesson-13 task is judged on: 2 and 3 ranks, or ``--world``'s."""
    return (grading.world(probe_target, p) for p in grading.sizes(2, 3))
