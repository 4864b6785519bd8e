"""When reading beats sending: the α–β model with a barrier and p − 1 peers to read.

A message-passing all-reduce pays α per message on its critical path; the ring has
2(p − 1) of them (:func:`collectives.core.cost.ring`). A shared-memory all-reduce sends
none. It pays instead

* σ per barrier: the flags' round trip through the caches (on a GPU: a signal-pad write
  and a poll over NVLink) -- one for the one-shot, two for the two-shot;
* ω per byte written into the own slot (the copy in);
* ρ per byte read from a peer's slot, and γ per byte combined::

    one-shot   n·ω + σ + (p − 1)·n·(ρ + γ)
    two-shot   n·ω + 2σ + 2(p − 1)/p·n·ρ + (p − 1)/p·n·γ
    ring       2(p − 1)·α + 2(p − 1)/p·n·β + (p − 1)/p·n·γ

σ is far below α (no kernel, no socket, no scheduler in between), so for small tensors
both beat the ring by about 2(p − 1)·α/σ. The one-shot reads (p − 1)·n, the two-shot
2(p − 1)/p·n: past the size where σ stops mattering the two-shot wins over the one-shot,
by up to p/2, and against the ring what is left is ρ against β -- reading a peer's memory
against pushing the same bytes through a socket (or a copy engine).

:func:`crossover` finds where one model overtakes another: the benchmark fits σ, ρ, ω
(:func:`fit_shared`) and the ring's α, β (:func:`fit_ring`) to its own sweep and puts the
predicted crossovers beside the measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..core.cost import AlphaBeta, predict

__all__ = ["SharedLink", "one_shot_seconds", "two_shot_seconds", "ring_seconds", "crossover", "fit_shared",
           "fit_ring"]


@dataclass(frozen=True)
class SharedLink:
    """A machine's shared memory: ``sigma`` s per barrier, ``rho`` s per byte read from a
    peer, ``omega`` s per byte written into the own slot, ``gamma`` s per byte combined."""

    sigma: float
    rho: float
    omega: float = 0.0
    gamma: float = 0.0


def one_shot_seconds(n: float, p: int, link: SharedLink) -> float:
    """n·ω + σ + (p − 1)·n·(ρ + γ): one barrier, every peer's whole tensor read and combined."""
    return n * link.omega + link.sigma + (p - 1) * n * (link.rho + link.gamma)


def two_shot_seconds(n: float, p: int, link: SharedLink) -> float:
    """n·ω + 2σ + 2(p − 1)/p·n·ρ + (p − 1)/p·n·γ: two barriers, a ring's worth of reading."""
    return n * link.omega + 2 * link.sigma + 2 * (p - 1) / p * n * link.rho + (p - 1) / p * n * link.gamma


def ring_seconds(n: float, p: int, link: AlphaBeta) -> float:
    """Lesson 4's ring on message links: 2(p − 1)·α + 2(p − 1)/p·n·β + (p − 1)/p·n·γ."""
    return predict("ring", n, p, link)


def crossover(first: Callable[[float], float], second: Callable[[float], float],
              sizes: Sequence[float]) -> float | None:
    """The first of ``sizes`` (ascending) from which ``second`` is faster than ``first`` at
    every larger size, having been slower before it; None when the winner never changes
    that way (``second`` faster everywhere, or never for good)."""
    faster = [second(n) < first(n) for n in sizes]
    if all(faster) or not faster[-1]:
        return None
    last_slow = max(i for i, f in enumerate(faster) if not f)
    return sizes[last_slow + 1]


def _weighted_fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares of ``rows · x = times`` in relative error (each row divided by its
    time: a sweep spans four orders of magnitude), every coefficient clamped at 0."""
    import torch

    a = torch.tensor(rows, dtype=torch.float64)
    t = torch.tensor(times, dtype=torch.float64)
    x = torch.linalg.lstsq(a / t[:, None], torch.ones_like(t)).solution
    return [max(float(v), 0.0) for v in x]


def fit_shared(p: int, sizes: Sequence[float], one_shot: Sequence[float],
               two_shot: Sequence[float]) -> SharedLink:
    """σ, ρ and ω fitted to measured one-shot and two-shot times at ``sizes`` together
    (γ folded into ρ: each byte read is combined once)::

        one-shot  σ + n·ω + (p − 1)·n·ρ        two-shot  2σ + n·ω + 2(p − 1)/p·n·ρ
    """
    rows = [[1.0, n, (p - 1) * n] for n in sizes] + [[2.0, n, 2 * (p - 1) / p * n] for n in sizes]
    sigma, omega, rho = _weighted_fit(rows, list(one_shot) + list(two_shot))
    return SharedLink(sigma, rho, omega)


def fit_ring(p: int, sizes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """α and β of the ring's model, 2(p − 1)·α + 2(p − 1)/p·n·β, fitted to its measured times."""
    rows = [[2.0 * (p - 1), 2 * (p - 1) / p * n] for n in sizes]
    alpha, beta = _weighted_fit(rows, list(seconds))
    return AlphaBeta(alpha, max(beta, 1e-15))
