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
    β term. Only where neighbours have direct links: on a switch (NVSwitch: one ring 0.77×
    NCCL, bidirectional 0.69× on 4 H200s) or one shared link (gloo over loopback) the
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


# ---- lesson 8: sparse all-reduce ----------------------------------------------------------
#
# A sparse all-reduce sends k (index, value) pairs instead of n values. Indices are int32
# (4 bytes), values keep the tensor's dtype (``value_bytes``): a pair of float32 costs 8 bytes,
# twice a dense element, so sparse pays only while k·(4+e) stays well under what the dense
# ring sends. Three ways to move the pairs (collectives.sparse):
#
#   all-gather  every rank receives every other rank's k pairs:   (p−1)·k·(4+e) bytes per rank.
#               Beats the dense ring, 2(p−1)/p·n·e, only while k/n < 2e/(p·(4+e)) = 1/p for fp32.
#   split       SparCML: pairs go to the owner of their index range (all-to-all), the owner
#               sums them, then every owner's reduced piece is all-gathered -- as pairs while
#               that is smaller, as a dense piece once it fills (densification):
#               (p−1)/p·k·(4+e) + (p−1)·min(u·(4+e), n/p·e),  u = distinct indices per piece.
#   dense       the kept values written into a zeroed tensor and all-reduced by the ring.

INDEX_BYTES = 4            # int32 indices: tensors of 2^31 elements or more are refused
SPARSE_VARIANTS = ("allgather", "split", "dense")


def expected_union(n: float, k: float, p: int) -> float:
    """Expected distinct indices in one of p pieces when each rank keeps k of n indices at
    random: (n/p)·(1 − (1 − k/n)^p). Real gradients overlap more (the same large entries on
    every rank), which only helps the split variant."""
    if n <= 0:
        return 0.0
    return n / p * (1.0 - (1.0 - min(k, n) / n) ** p)


def sparse_cost(variant: str, n: float, k: float, p: int, value_bytes: int = 4,
                counts: bool = False, union: float | None = None) -> Cost:
    """What ``variant`` costs for k kept of n elements on p ranks (bytes from element counts).

    ``counts``: threshold mode, where every rank first all-gathers its count (one more round
    of p−1 messages of 8 bytes). ``union``: the largest number of distinct indices in a
    reduced piece, if known (default: :func:`expected_union`).
    """
    if p == 1:
        return Cost(0, 0.0, 0.0)
    pair = INDEX_BYTES + value_bytes
    count_steps, count_bytes = ((p - 1), (p - 1) * 8.0) if counts else (0, 0.0)
    if variant == "allgather":
        moved = (p - 1) * k * pair
        return Cost(p - 1 + count_steps, moved + count_bytes, moved + count_bytes, (p - 1) * k * value_bytes)
    if variant == "split":
        u = expected_union(n, k, p) if union is None else union
        piece = math.ceil(n / p)
        scatter = (p - 1) / p * k * pair
        gather = (p - 1) * min(u * pair, piece * value_bytes)
        # two small exchanges: how many pairs go to each rank, how many each piece holds
        small = 2 * (p - 1) * 8.0
        moved = scatter + gather + small
        return Cost(4 * (p - 1), moved, moved, k * value_bytes)
    if variant == "dense":
        return ring(n * value_bytes, p)
    raise ValueError(f"unknown sparse variant {variant!r}; use one of {', '.join(SPARSE_VARIANTS)}")


@dataclass(frozen=True)
class SparseCompute:
    """What a sparse all-reduce spends off the wire, on each rank's processor.

    The bytes are few; the work is not. Selection reads every one of the n elements (a
    comparison pass; the result is zeroed before the sums land in it), then spends time per
    kept element (gathering the candidates' magnitudes, trimming them to k, copying the
    values out); every pair that travels is packed, unpacked and added. On a fast link this
    is most of the time; on a slow one it still sets where sparse stops paying. The rates
    are measured, not derived: ``python -m collectives bench-sparse`` times the pieces alone,
    in the same world as the all-reduce it predicts (selection at each density it sweeps,
    which it prices as ``pick``: its cost per kept element grows with the density).
    """

    scan: float = 0.0     # seconds per element of the tensor (the comparison pass, the zeroing)
    pick: float = 0.0     # seconds per element kept (selection's work beyond the pass)
    pair: float = 0.0     # seconds per pair packed, unpacked and added

    def seconds(self, variant: str, n: float, k: float, p: int, union: float | None = None,
                value_bytes: int = 4) -> float:
        """Predicted processor time of ``variant`` for k kept of n on p ranks (one rank)."""
        if p == 1:
            return 0.0
        if variant == "allgather":
            moved = k + p * k                      # ours packed; every rank's unpacked and added
        elif variant == "split":
            u = expected_union(n, k, p) if union is None else union
            piece = math.ceil(n / p)
            dense = u * (INDEX_BYTES + value_bytes) >= piece * value_bytes
            moved = k + k + (0 if dense else u + p * u)   # ours packed; a piece's worth added; pieces
        elif variant == "dense":
            moved = 0.0
        else:
            raise ValueError(f"unknown sparse variant {variant!r}; use one of {', '.join(SPARSE_VARIANTS)}")
        return self.scan * n + self.pick * k + self.pair * moved


def sparse_seconds(variant: str, n: float, k: float, p: int, link: AlphaBeta,
                   compute: SparseCompute | None = None, value_bytes: int = 4, counts: bool = False,
                   union: float | None = None) -> float:
    """Predicted seconds of ``variant``: the wire (:func:`sparse_cost` on ``link``) plus, when
    ``compute`` is given, the processor's part (:class:`SparseCompute`)."""
    wire = sparse_cost(variant, n, k, p, value_bytes, counts, union).seconds(link)
    return wire + (compute.seconds(variant, n, k, p, union, value_bytes) if compute is not None else 0.0)


def choose_sparse_variant(n: float, k: float, p: int, link: AlphaBeta, value_bytes: int = 4,
                          counts: bool = False, variants=SPARSE_VARIANTS,
                          compute: SparseCompute | None = None) -> str:
    """The variant the model predicts fastest (ties go to the earlier name in ``variants``)."""
    return min(variants, key=lambda v: sparse_seconds(v, n, k, p, link, compute, value_bytes, counts))


def sparse_crossover(n: float, p: int, link: AlphaBeta, variant: str = "allgather",
                     value_bytes: int = 4, against: str = "dense",
                     compute: SparseCompute | None = None, against_seconds: float | None = None) -> float:
    """The density k/n above which ``variant`` is predicted slower than ``against`` (1.0 if never).

    Found by bisection on the model; for the all-gather variant against the dense ring on a
    link where β dominates, it is 2e/(p·(4+e)): 1/p for float32, (2/3)/p for 16-bit values
    (their pairs are 6 bytes for 2 of payload). Against an fp16-compressed dense ring
    (half the dense bytes), float32 pairs cross over at 1/(2p). ``variant="best"`` takes
    the faster of all-gather and split at each density. ``compute`` adds the processor's
    part (:class:`SparseCompute`) to ``variant``; ``against`` is priced by the wire alone (the
    plain all-reduce selects nothing), or given as ``against_seconds`` (a measured time).
    """
    def seconds(v, k, with_compute=True):
        if v == "best":
            return min(seconds(w, k, with_compute) for w in ("allgather", "split"))
        return sparse_seconds(v, n, k, p, link, compute if with_compute else None, value_bytes)

    def gap(d):
        k = d * n
        other = against_seconds if against_seconds is not None else seconds(against, k, with_compute=False)
        return seconds(variant, k) - other
    lo, hi = 1.0 / n, 1.0
    if gap(hi) <= 0:
        return 1.0
    if gap(lo) >= 0:
        return lo
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        if gap(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


GIGABIT = AlphaBeta(alpha=100e-6, beta=1 / 125e6)   # a 1 Gbit/s link: the default for choosing
