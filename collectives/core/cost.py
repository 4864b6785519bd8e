"""The α–β cost model: a message of m bytes costs α + β·m seconds.

α is the per-message latency (start-up, scheduling, a round trip through the stack);
β the inverse bandwidth (seconds per byte). Lesson 1's ping-pong measures both on your
machine (:func:`fit_alpha_beta`); each algorithm below predicts its time from them as
(messages on the critical path)·α + (bytes on the critical path)·β. A third, optional
coefficient γ (seconds per byte combined, :func:`measure_gamma`) adds the time spent in
the reduction's arithmetic: zero by default, it matters on CPUs, where adding two large
buffers runs at a few GB/s, not far above the link.

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
    gamma: float = 0.0   # seconds per byte combined (the add of a reduction); 0: ignored

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
    bytes_per_rank: float  # bytes each rank sends in total (the most any rank sends)
    combine_bytes: float = 0.0  # bytes combined on the critical path (each costs γ)

    def seconds(self, link: AlphaBeta) -> float:
        return (self.steps * link.alpha + self.bytes_on_path * link.beta
                + self.combine_bytes * link.gamma)


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
    """The whole tensor passed p−1 times around the ring: (p−1)·α + (p−1)·n·β + (p−1)·n·γ."""
    return Cost(p - 1, (p - 1) * n, (p - 1) * n, (p - 1) * n)


@model("ring")
def ring(n: float, p: int) -> Cost:
    """Reduce-scatter then all-gather over p chunks: 2(p−1)·α + 2(p−1)/p·n·β + (p−1)/p·n·γ."""
    if p == 1:
        return Cost(0, 0.0, 0.0)
    return Cost(2 * (p - 1), 2 * (p - 1) / p * n, 2 * (p - 1) / p * n, (p - 1) / p * n)


def log2_ceil(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def _pof2_below(p: int) -> int:
    """The largest power of two ≤ p."""
    return 1 << (p.bit_length() - 1)


PIPELINE_PIECES = 4   # collectives.ring.PIPELINE_PIECES: the default split of each chunk
CHANNELS = 2          # collectives.ring.multi_ring_all_reduce's default


def pipelined_ring_cost(n: float, p: int, pieces: int = PIPELINE_PIECES) -> Cost:
    """The ring with each chunk cut into ``pieces``: k× the messages, the same bytes, and only
    one piece's combine per step left uncovered: 2(p−1)k·α + 2(p−1)/p·n·β + (p−1)/p·n/k·γ."""
    if p == 1:
        return Cost(0, 0.0, 0.0)
    return Cost(2 * (p - 1) * pieces, 2 * (p - 1) / p * n, 2 * (p - 1) / p * n,
                (p - 1) / p * n / pieces)


@model("pipelined_ring")
def pipelined_ring(n: float, p: int) -> Cost:
    """:func:`pipelined_ring_cost` with the reference's default of 4 pieces per chunk."""
    return pipelined_ring_cost(n, p, PIPELINE_PIECES)


def multi_ring_cost(n: float, p: int, channels: int = CHANNELS, links: int = 2) -> Cost:
    """``channels`` rings side by side, each over n/channels bytes, spread over ``links``
    independent outgoing links per rank (2: a direct link to each neighbour, both used at
    once). Only direct links give the second link: on a switch (NVSwitch) or one shared
    link, pass ``links=1`` -- the plain ring's β term."""
    if p == 1:
        return Cost(0, 0.0, 0.0)
    share = n / min(channels, links)     # bytes one link carries, in total
    return Cost(2 * (p - 1), 2 * (p - 1) / p * share, 2 * (p - 1) / p * n,
                (p - 1) / p * share)


@model("multi_ring")
def multi_ring(n: float, p: int) -> Cost:
    """Two rings in opposite directions, each on a direct link of its own: half the ring's
    β term. Only where neighbours have direct links: on a switch (NVSwitch, where both
    directions share each GPU's connection) or one shared link (gloo over loopback) the
    plain ring's model is the right one."""
    return multi_ring_cost(n, p, CHANNELS)


@model("recursive_doubling")
def recursive_doubling(n: float, p: int) -> Cost:
    """log2 p exchanges of the whole tensor: L·α + L·n·β + L·n·γ for p = 2^L.
    Other p fold the extra ranks in and out first: two more messages of n."""
    if p == 1:
        return Cost(0, 0.0, 0.0)
    steps = _pof2_below(p).bit_length() - 1
    fold = 0 if p == _pof2_below(p) else 1
    return Cost(steps + 2 * fold, (steps + 2 * fold) * n, (steps + fold) * n, (steps + fold) * n)


@model("halving_doubling")
def halving_doubling(n: float, p: int) -> Cost:
    """Reduce-scatter by recursive halving, all-gather by doubling (Rabenseifner):
    2L·α + 2(p−1)/p·n·β + (p−1)/p·n·γ for p = 2^L; two more messages of n otherwise."""
    if p == 1:
        return Cost(0, 0.0, 0.0)
    q = _pof2_below(p)
    steps = 2 * (q.bit_length() - 1)
    fold = 0 if p == q else 1
    core = 2 * (q - 1) / q * n
    return Cost(steps + 2 * fold, core + 2 * fold * n, core + fold * n, (q - 1) / q * n + fold * n)


def tree_schedule(p: int) -> tuple[int, int, int]:
    """(reduce rounds, broadcast rounds, most messages any rank sends) of the binary-heap tree
    (children of r: 2r+1, 2r+2), with one message in or out of a rank at a time: a parent
    takes its children's messages one after the other, in child order, and sends to them
    one after the other."""
    ready = [0] * p                      # when rank r's partial result is ready to go up
    for r in reversed(range(p)):
        t = 0
        for c in (2 * r + 1, 2 * r + 2):
            if c < p:
                t = max(t, ready[c]) + 1
        ready[r] = t
    arrives = [0] * p                    # when the result reaches rank r going down
    for r in range(p):
        for i, c in enumerate(x for x in (2 * r + 1, 2 * r + 2) if x < p):
            arrives[c] = arrives[r] + i + 1
    sends = [(1 if r > 0 else 0) + sum(1 for c in (2 * r + 1, 2 * r + 2) if c < p) for r in range(p)]
    return ready[0], max(arrives), max(sends)


@model("tree")
def tree(n: float, p: int) -> Cost:
    """Binary-tree reduce then broadcast of the whole tensor, one message at a time per
    rank: at most 4·⌊log2 p⌋·(α + n·β); an inner rank sends up to 3n."""
    if p == 1:
        return Cost(0, 0.0, 0.0)
    up, down, most = tree_schedule(p)
    return Cost(up + down, (up + down) * n, most * n, up * n)


@model("reduce_scatter")
def reduce_scatter(n: float, p: int) -> Cost:
    """Ring reduce-scatter of an n-byte input: (p−1)·α + (p−1)/p·n·β + (p−1)/p·n·γ."""
    if p == 1:
        return Cost(0, 0.0, 0.0)
    return Cost(p - 1, (p - 1) / p * n, (p - 1) / p * n, (p - 1) / p * n)


@model("all_gather")
def all_gather(n: float, p: int) -> Cost:
    """Ring all-gather into an n-byte output: (p−1)·α + (p−1)/p·n·β, nothing to combine."""
    if p == 1:
        return Cost(0, 0.0, 0.0)
    return Cost(p - 1, (p - 1) / p * n, (p - 1) / p * n)


# ---------------------------------------------------------------------------------------
# Two tiers: fast links inside a machine, slow ones across.
#
#     machine 0                 machine 1
#   r0 ──inside──► r1 ──across──► r2 ──inside──► r3 ──across──► (back to r0)
#
# A flat ring placed machine-major crosses between machines once per machine; every step,
# every rank sends its chunk at the same moment, so a step lasts as long as its slowest
# hop: the ring is as slow as its slowest link, whatever the fast ones do.


@dataclass(frozen=True)
class TwoTier:
    """A cluster's links: ``inside`` a machine (between its ranks) and ``across`` machines."""

    inside: AlphaBeta
    across: AlphaBeta
    machines: int
    ranks_per_machine: int

    @property
    def p(self) -> int:
        return self.machines * self.ranks_per_machine

    def step(self, chunk_bytes: float) -> float:
        """Seconds of one ring step moving ``chunk_bytes`` on every hop at once: its
        slowest hop (across, once there are two machines)."""
        hops = [self.inside] if self.ranks_per_machine > 1 else []
        hops += [self.across] if self.machines > 1 else []
        return max(link.message(chunk_bytes) for link in hops) if hops else 0.0


def predict_flat(name: str, nbytes: float, machine: TwoTier) -> float:
    """Predicted seconds of a flat algorithm ``name`` (one of :data:`MODELS`) on all
    ``machine.p`` ranks placed machine-major on a two-tier machine.

    Every step of the critical path costs its slowest hop (:meth:`TwoTier.step`), plus γ
    for the bytes combined: exact for the ring family, where every step has a hop across
    machines; an upper bound for an algorithm whose steps could stay inside a machine.
    """
    c = cost(name, nbytes, machine.p)
    if c.steps == 0:
        return 0.0
    gamma = max(machine.inside.gamma, machine.across.gamma)
    return c.steps * machine.step(c.bytes_on_path / c.steps) + c.combine_bytes * gamma


def fastest(names: list[str], nbytes: float, p: int, link: AlphaBeta) -> str:
    """The name of the algorithm the model predicts fastest for ``nbytes`` on ``p`` ranks."""
    return min(names, key=lambda name: predict(name, nbytes, p, link))


def measure_gamma(nbytes: int = 16 << 20, repeats: int = 5, dtype=None) -> float:
    """Seconds per byte of ``acc += incoming`` on this machine's CPU (median of ``repeats``).

    The per-byte cost of combining, γ, for :class:`AlphaBeta`: measure it in the process
    that will do the adding (a rank of a world, which has one thread).
    """
    import statistics
    import time

    import torch

    dtype = dtype or torch.float32
    n = max(nbytes // torch.empty((), dtype=dtype).element_size(), 1)
    acc, incoming = torch.zeros(n, dtype=dtype), torch.ones(n, dtype=dtype)
    acc.add_(incoming)                   # first touch: page faults are not the add's
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        acc.add_(incoming)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / (n * acc.element_size())


# ---------------------------------------------------------------------------------------
# Lesson 7's tier-aware model (a link inside, a link across, rails, stages, slices) builds on
# these primitives in collectives.hierarchical.cost.


