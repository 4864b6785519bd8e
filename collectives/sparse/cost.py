"""Lesson 8's cost model: what moving k (index, value) pairs costs, on the wire and off it.

Built on :mod:`collectives.core.cost`'s α–β primitives. A sparse all-reduce sends k pairs
instead of n values. Indices are int32 (4 bytes), values keep the tensor's dtype (e bytes):
a float32 pair is 8 bytes, twice a dense element, so sparse pays only while k·(4+e) stays
well under what the dense ring sends. Bytes as they cross the wire, per rank, for p ranks::

    dense ring   2(p−1)/p·n·e                                   (about 2·n·e, whatever p)
    all-gather   (p−1)·k·(4+e)                                  (grows with p)
    split        (p−1)/p·k·(4+e) + (p−1)·min(u·(4+e), n/p·e)    (u: distinct indices in a piece)
    dense        the ring's, on the kept values written into zeros

The all-gather beats the ring only while k/n < 2e/(p·(4+e)) -- 1/p for float32; split's
gather is capped by the dense all-gather once its pieces fill, so it lasts to about 1/2.

Bytes are half of it. :class:`SparseCompute` prices what the processor does (selection
reads all n elements; every pair is packed, unpacked and added), and
:func:`choose_transport` picks the transport from both, for one group's measured link
(:class:`SparseProfile`, measured by :func:`collectives.sparse.profile.measure_profile`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.cost import AlphaBeta, Cost, ring

INDEX_BYTES = 4            # int32 indices: tensors of 2^31 elements or more are refused
TRANSPORTS = ("allgather", "split", "dense")
# The split transport's two small exchanges before its bulk: (count, n) to every peer, then
# one all-gathered int64 (the distinct indices of each reduced piece).
SPLIT_HEADER_BYTES = 16
GIGABIT = AlphaBeta(alpha=100e-6, beta=1 / 125e6)   # a 1 Gbit/s link, for examples and the lab


def expected_union(n: float, k: float, p: int) -> float:
    """Expected distinct indices in one of p pieces when each rank keeps k of n indices at
    random: (n/p)·(1 − (1 − k/n)^p). Real gradients overlap more (the same large entries on
    every rank), which only helps the split transport."""
    if n <= 0:
        return 0.0
    return n / p * (1.0 - (1.0 - min(k, n) / n) ** p)


def sparse_cost(transport: str, n: float, k: float, p: int, value_bytes: int = 4,
                counts: bool = False, union: float | None = None) -> Cost:
    """What ``transport`` costs for k kept of n elements on p ranks (bytes from element counts).

    ``counts``: threshold mode, where every rank first all-gathers its count (one more round
    of p−1 messages of 8 bytes). ``union``: the largest number of distinct indices in a
    reduced piece, if known (default: :func:`expected_union`).
    """
    if p == 1:
        return Cost(0, 0.0, 0.0)
    pair = INDEX_BYTES + value_bytes
    count_steps, count_bytes = ((p - 1), (p - 1) * 8.0) if counts else (0, 0.0)
    if transport == "allgather":
        moved = (p - 1) * k * pair
        return Cost(p - 1 + count_steps, moved + count_bytes, moved + count_bytes, (p - 1) * k * value_bytes)
    if transport == "split":
        u = expected_union(n, k, p) if union is None else union
        piece = math.ceil(n / p)
        scatter = (p - 1) / p * k * pair
        gather = (p - 1) * min(u * pair, piece * value_bytes)
        small = (p - 1) * (SPLIT_HEADER_BYTES + 8.0)
        moved = scatter + gather + small
        return Cost(4 * (p - 1), moved, moved, k * value_bytes)
    if transport == "dense":
        return ring(n * value_bytes, p)
    raise ValueError(f"unknown transport {transport!r}; use one of {', '.join(TRANSPORTS)}")


@dataclass(frozen=True)
class SparseCompute:
    """What a sparse all-reduce spends off the wire, on each rank's processor.

    The bytes are few; the work is not. Selection reads every one of the n elements (a
    comparison pass; the result is zeroed before the sums land in it), then spends time per
    kept element (gathering the candidates' magnitudes, trimming them to k, copying the
    values out); every pair that travels is packed, unpacked and added. On a fast link this
    is most of the time; on a slow one it still sets where sparse stops paying. The rates
    are measured, not derived (:func:`collectives.sparse.profile.measure_compute`).
    """

    scan: float = 0.0     # seconds per element of the tensor (the comparison pass, the zeroing)
    pick: float = 0.0     # seconds per element kept (selection's work beyond the pass)
    pair: float = 0.0     # seconds per pair packed, unpacked and added

    def seconds(self, transport: str, n: float, k: float, p: int, union: float | None = None,
                value_bytes: int = 4) -> float:
        """Predicted processor time of ``transport`` for k kept of n on p ranks (one rank)."""
        if p == 1:
            return 0.0
        if transport == "allgather":
            moved = k + p * k                      # ours packed; every rank's unpacked and added
        elif transport == "split":
            u = expected_union(n, k, p) if union is None else union
            piece = math.ceil(n / p)
            dense = u * (INDEX_BYTES + value_bytes) >= piece * value_bytes
            moved = k + k + (0 if dense else u + p * u)   # ours packed; a piece's worth added; pieces
        elif transport == "dense":
            moved = 0.0
        else:
            raise ValueError(f"unknown transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
        return self.scan * n + self.pick * k + self.pair * moved


@dataclass(frozen=True)
class SparseProfile:
    """One group's link and processor, as ``transport="auto"`` prices them."""

    link: AlphaBeta
    compute: SparseCompute


def sparse_seconds(transport: str, n: float, k: float, p: int, link: AlphaBeta,
                   compute: SparseCompute | None = None, value_bytes: int = 4, counts: bool = False,
                   union: float | None = None) -> float:
    """Predicted seconds of ``transport``: the wire (:func:`sparse_cost` on ``link``) plus, when
    ``compute`` is given, the processor's part (:class:`SparseCompute`)."""
    wire = sparse_cost(transport, n, k, p, value_bytes, counts, union).seconds(link)
    return wire + (compute.seconds(transport, n, k, p, union, value_bytes) if compute is not None else 0.0)


def choose_transport(n: float, k: float, p: int, link: AlphaBeta, value_bytes: int = 4,
                     counts: bool = False, transports=TRANSPORTS,
                     compute: SparseCompute | None = None) -> str:
    """The transport the model predicts fastest (ties go to the earlier name in ``transports``).

    Without ``compute`` only the wire is priced: on a fast link that is the wrong question
    (selection and the pairs' handling are most of the time), which is why
    ``sparse_all_reduce(transport="auto")`` always passes the group's measured
    :class:`SparseProfile`."""
    return min(transports, key=lambda t: sparse_seconds(t, n, k, p, link, compute, value_bytes, counts))


def sparse_crossover(n: float, p: int, link: AlphaBeta, transport: str = "allgather",
                     value_bytes: int = 4, against: str = "dense",
                     compute: SparseCompute | None = None, against_seconds: float | None = None) -> float:
    """The density k/n above which ``transport`` is predicted slower than ``against`` (1.0 if never).

    Found by bisection on the model; for the all-gather against the dense ring on a link
    where β dominates, it is 2e/(p·(4+e)): 1/p for float32, (2/3)/p for 16-bit values (their
    pairs are 6 bytes for 2 of payload). Against a 16-bit-compressed dense ring (half the
    dense bytes), float32 pairs cross over at 1/(2p). ``transport="best"`` takes the faster
    of all-gather and split at each density. ``compute`` adds the processor's part
    (:class:`SparseCompute`) to ``transport``; ``against`` is priced by the wire alone (the
    plain all-reduce selects nothing), or given as ``against_seconds`` (a measured time).
    """
    def seconds(t, k, with_compute=True):
        if t == "best":
            return min(seconds(w, k, with_compute) for w in ("allgather", "split"))
        return sparse_seconds(t, n, k, p, link, compute if with_compute else None, value_bytes)

    def gap(d):
        k = d * n
        other = against_seconds if against_seconds is not None else seconds(against, k, with_compute=False)
        return seconds(transport, k) - other
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
