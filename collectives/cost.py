"""The α–β cost model: a message of m bytes costs α + β·m seconds.

α is the per-message latency (start-up, scheduling, a round trip through the stack);
β the inverse bandwidth (seconds per byte). Lesson 1's ping-pong measures both on your
machine (:func:`fit_alpha_beta`); each algorithm below predicts its time from them as
(messages on the critical path)·α + (bytes on the critical path)·β, ignoring the time
to combine (γ), which on these sizes hides under β.

Every model also says how many bytes each rank sends, which the tour and the tests
compare with what the trace measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class AlphaBeta:
    """Latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte) of one link."""

    alpha: float
    beta: float

    def message(self, nbytes: float) -> float:
        """Predicted seconds for one message of ``nbytes``."""
        return self.alpha + self.beta * nbytes

    @property
    def bandwidth(self) -> float:
        """Bytes per second, 1/β."""
        return 1.0 / self.beta if self.beta > 0 else float("inf")


def fit_alpha_beta(sizes_bytes: list[float], seconds: list[float]) -> AlphaBeta:
    """Least-squares fit of ``seconds = α + β·bytes`` (one-way message times).

    Both coefficients are clamped at a tiny positive value: a noisy small-message run can
    otherwise give a negative latency.
    """
    n = len(sizes_bytes)
    if n < 2:
        raise ValueError("need at least two message sizes to fit α and β")
    mx = sum(sizes_bytes) / n
    my = sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes_bytes)
    sxy = sum((x - mx) * (y - my) for x, y in zip(sizes_bytes, seconds))
    beta = sxy / sxx if sxx else 0.0
    alpha = my - beta * mx
    return AlphaBeta(max(alpha, 1e-9), max(beta, 1e-15))


@dataclass(frozen=True)
class Cost:
    """What an algorithm costs for ``nbytes`` on ``p`` ranks."""

    steps: int            # messages on the critical path (each costs α)
    bytes_on_path: float  # bytes on the critical path (each costs β)
    bytes_per_rank: float  # bytes each rank sends in total

    def seconds(self, link: AlphaBeta) -> float:
        return self.steps * link.alpha + self.bytes_on_path * link.beta


# name -> cost(nbytes, p). Lessons add their algorithms here.
MODELS: dict[str, Callable[[float, int], Cost]] = {}


def model(name: str):
    """Decorator registering a cost function under ``name``."""
    def register(fn: Callable[[float, int], Cost]):
        MODELS[name] = fn
        return fn
    return register


def cost(name: str, nbytes: float, p: int) -> Cost:
    try:
        return MODELS[name](nbytes, p)
    except KeyError:
        raise KeyError(f"no cost model named {name!r}; known: {', '.join(sorted(MODELS))}") from None


def predict(name: str, nbytes: float, p: int, link: AlphaBeta) -> float:
    """Predicted seconds of algorithm ``name`` all-reducing ``nbytes`` on ``p`` ranks."""
    return cost(name, nbytes, p).seconds(link)


@model("naive_ring")
def naive_ring(n: float, p: int) -> Cost:
    """The whole tensor passed p−1 times around the ring: (p−1)·α + (p−1)·n·β."""
    return Cost(p - 1, (p - 1) * n, (p - 1) * n)


@model("ring")
def ring(n: float, p: int) -> Cost:
    """Reduce-scatter then all-gather over p chunks: 2(p−1)·α + 2(p−1)/p·n·β."""
    if p == 1:
        return Cost(0, 0.0, 0.0)
    return Cost(2 * (p - 1), 2 * (p - 1) / p * n, 2 * (p - 1) / p * n)


def log2_ceil(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0
