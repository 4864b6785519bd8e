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
from its own small and large runs and puts the predicted crossovers beside the measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..core.cost import AlphaBeta, predict

__all__ = ["SharedLink", "one_shot_seconds", "two_shot_seconds", "ring_seconds", "crossover", "fit_shared"]


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
    """The first of ``sizes`` (ascending) where ``second`` is faster than ``first``, having
    been slower at the size before (None: no change of winner). Where ``second`` is
    faster from the start, the first size."""
    slower_before = None
    for n in sizes:
        faster = second(n) < first(n)
        if faster and (slower_before is None or slower_before):
            return n
        slower_before = not faster
    return None


def fit_shared(p: int, small: tuple[float, float, float], large: tuple[float, float, float],
               gamma: float = 0.0) -> SharedLink:
    """σ, ρ, ω from two sizes of one-shot and two-shot times (``(n, one_shot_s, two_shot_s)``
    each): σ from the small size, where the bytes cost little; ρ and ω from the large one,
    which both algorithms copy in (ω) and read at different rates (ρ). Clamped at 0."""
    n_s, one_s, two_s = small
    n_l, one_l, two_l = large
    # two-shot − one-shot at the large size: σ + (p−1)/p·n·ρ·(2 − p) ... solved for ρ
    # one_l − two_l = −σ + (p − 1)·n·(ρ + γ) − 2(p−1)/p·n·ρ − (p−1)/p·n·γ
    #               = −σ + (p − 1)(p − 2)/p·n·ρ + (p − 1)² /p·n·γ
    sigma = max(two_s - one_s, 1e-9)           # the second barrier, at a size where bytes do not count
    if p > 2:
        rho = (one_l - two_l + sigma - (p - 1) ** 2 / p * n_l * gamma) / ((p - 1) * (p - 2) / p * n_l)
    else:
        rho = (two_l - 2 * sigma - n_l * gamma / 2) / (2 * n_l)
    rho = max(rho, 0.0)
    omega = max((one_l - sigma - (p - 1) * n_l * (rho + gamma)) / n_l, 0.0)
    return SharedLink(sigma, rho, omega, gamma)
