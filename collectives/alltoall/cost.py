"""The α–β cost of lesson 11's all-to-alls, on :mod:`collectives.core.cost`'s primitives.

``n`` is the bytes of one rank's input, ``p`` the ranks, b = n/p a block. Every model
counts what one rank sends on the critical path (one port: a rank sends one message at
a time at the link's rate)::

    algorithm   messages (α)   bytes on the path (β)          bytes sent per rank
    linear      p − 1          (p − 1)·b                      (p − 1)·b
    pairwise    p − 1          (p − 1)·b                      (p − 1)·b
    Bruck       ⌈log2 p⌉       Σ_k |{i < p : bit k of i}|·b   the same

(p − 1)·b = (p − 1)/p·n is the floor: every block but the rank's own must leave it.
Bruck sends about half the blocks every round, ~⌈log2 p⌉·n/2: it trades bytes for
messages, and wins while (p − 1 − ⌈log2 p⌉)·α exceeds its extra bytes' β
(:func:`bruck_crossover`).

Across machines (:class:`collectives.core.cost.TwoTier`, D ranks per machine sharing one
link of M): the flat all-to-all puts D·D·(M − 1) blocks on each machine's link, from D
ranks sending at once, D·(M − 1) messages each; the hierarchical one the same bytes in
M − 1 messages, plus two stages inside (:func:`hierarchical_seconds`).

For an MoE dispatch the bytes across *can* shrink, because a token that chose several
experts on one machine is the same row several times: :func:`dedup_rows` counts the rows
per token that cross flat and deduplicated, :func:`moe_seconds` the dispatch + combine.
The deduplicated one adds a hop inside; stage by stage it adds to the crossing, streamed
in chunks it overlaps it, and only the last chunk's forwarding is left in series::

    stage by stage   across + inside
    streamed         max(across, inside) + (M − 1)/M · inside / chunks + α_across + α_inside

Left out, for flat and deduplicated alike: copies in memory, and the pace TCP keeps on a
shaped link. The link's β is the caller's to choose (the cluster benchmark's counts the
frames' headers with the bytes).
"""

from __future__ import annotations

import math

from ..core.cost import AlphaBeta, Cost, TwoTier, log2_ceil

__all__ = ["linear", "pairwise", "bruck", "bruck_blocks", "predict", "bruck_crossover",
           "flat_seconds", "hierarchical_seconds", "MODELS", "dedup_rows", "moe_seconds"]


def linear(n: float, p: int) -> Cost:
    b = n / p
    return Cost(p - 1, (p - 1) * b, (p - 1) * b)


def pairwise(n: float, p: int) -> Cost:
    b = n / p
    return Cost(p - 1, (p - 1) * b, (p - 1) * b)


def bruck_blocks(p: int) -> int:
    """Blocks one rank sends over all of Bruck's rounds: Σ_k |{i < p : bit k of i set}|."""
    return sum(bin(i).count("1") for i in range(p))


def bruck(n: float, p: int) -> Cost:
    sent = bruck_blocks(p) * n / p
    return Cost(log2_ceil(p) if p > 1 else 0, sent, sent)


MODELS = {"linear": linear, "pairwise": pairwise, "bruck": bruck}


def predict(name: str, nbytes: float, p: int, link: AlphaBeta) -> float:
    """Predicted seconds of all-to-all ``name`` with ``nbytes`` of input per rank on ``p`` ranks."""
    return MODELS[name](nbytes, p).seconds(link)


def bruck_crossover(p: int, link: AlphaBeta) -> float:
    """Input bytes per rank below which Bruck is predicted faster than pairwise (0: never)."""
    extra_blocks = bruck_blocks(p) - (p - 1)
    saved_messages = (p - 1) - log2_ceil(p)
    if saved_messages <= 0 or link.beta <= 0:
        return 0.0
    if extra_blocks <= 0:
        return float("inf")
    # saved·α = extra·(n/p)·β  ->  n = p·saved·α / (extra·β)
    return p * saved_messages * link.alpha / (extra_blocks * link.beta)


def flat_seconds(nbytes: float, machine: TwoTier) -> float:
    """A flat all-to-all on a two-tier machine: the busier of each machine's shared link and
    a rank's messages inside. Across, the D ranks of a machine send at once, each its
    D·(M − 1) messages one after another: D·(M − 1) α's in series, and the link carries
    all D·D·(M − 1) blocks' bytes."""
    D, M = machine.ranks_per_machine, machine.machines
    b = nbytes / machine.p
    across = (D * (M - 1) * machine.across.alpha + D * D * (M - 1) * b * machine.across.beta) if M > 1 else 0.0
    inside = (D - 1) * machine.inside.message(b) if D > 1 else 0.0
    return max(across, inside)


def hierarchical_seconds(nbytes: float, machine: TwoTier) -> float:
    """Gather inside, one message of D·D blocks per machine pair across, scatter inside.

    Stage 1 sends D − 1 own-machine blocks and (M − 1) machine spans of D blocks inside;
    stage 2 puts M − 1 messages of D²·b on each machine's link; stage 3 mirrors stage 1.
    """
    D, M = machine.ranks_per_machine, machine.machines
    b = nbytes / machine.p
    inside_gather = ((D - 1) * machine.inside.message(b)
                     + (M - 1) * machine.inside.message(D * b)) if D > 1 else 0.0
    across = (M - 1) * machine.across.message(D * D * b) if M > 1 else 0.0
    inside_scatter = (M - 1) * machine.inside.message(D * b) if D > 1 else 0.0
    return inside_gather + across + inside_scatter


def _none_of(k: int, E: int, on_machine: int) -> float:
    """The chance that k distinct experts drawn uniformly from E miss a machine's ``on_machine``."""
    if k > E - on_machine:
        return 0.0
    return math.comb(E - on_machine, k) / math.comb(E, k)


def dedup_rows(k: int, E: int, M: int) -> tuple[float, float]:
    """Rows one token sends across machines, (flat, deduplicated), with its k experts drawn
    uniformly from E spread evenly over M machines and nothing dropped.

    Flat: one row per choice on another machine, k·(M − 1)/M. Deduplicated: one row per
    other machine holding at least one of its experts, (M − 1)·(1 − C(E − E/M, k)/C(E, k)).
    The ratio is the k-duplication the deduplication removes; at k = 1 both are (M − 1)/M."""
    flat = k * (M - 1) / M
    dedup = (M - 1) * (1 - _none_of(k, E, E // M))
    return flat, dedup


def moe_seconds(tokens: int, row_bytes: float, k: int, E: int, machine: TwoTier, dedup: bool,
                meta_bytes: float = 0.0, chunks: int | None = None) -> float:
    """Dispatch + combine of ``tokens`` rows per rank, each ``row_bytes``, across a two-tier
    machine (uniform routing, nothing dropped). Both directions cost the same (the combine
    retraces the dispatch), so twice one direction:

    * flat: each machine's link carries D·tokens·rows_flat rows, from D ranks each sending
      D·(M − 1) messages; inside, the choices on the own machine, at the same time;
    * deduplicated: D·tokens·rows_dedup rows across (plus ``meta_bytes`` a row: gates,
      experts, slots), one message from each rank to its rail peer on each other machine;
      inside, every choice forwarded once more: k·tokens rows on the fast links.
      Stage by stage (``chunks=None``) the inside waits for the crossing to end: the two
      add up. Streamed in ``chunks`` pieces (:mod:`.dedup_stream`) they overlap: the
      slower of the two, plus the inside share of the last chunk to cross, which can
      only be forwarded once it has arrived; and each direction exchanges its small parts
      (gates, experts, slots, keys) as messages of their own first: one α across, one
      inside.

    The counts' exchange (p − 1 small messages per rank) is the same for both. Copies in
    memory (gathering the rows to send, sorting them into the experts' batches) are left out."""
    D, M = machine.ranks_per_machine, machine.machines
    flat_rows, dedup_rows_ = dedup_rows(k, E, M)
    counts = (machine.p - 1) * machine.inside.alpha
    if not dedup:
        across = D * (M - 1) * machine.across.alpha + D * tokens * flat_rows * row_bytes * machine.across.beta
        inside = (D - 1) * machine.inside.alpha + tokens * k / M * row_bytes * machine.inside.beta
        return 2 * (counts + max(across, inside))
    across = (M - 1) * machine.across.alpha + D * tokens * dedup_rows_ * (row_bytes + meta_bytes) * machine.across.beta
    inside = (D - 1) * machine.inside.alpha + tokens * k * row_bytes * machine.inside.beta
    if chunks is None:
        return 2 * (2 * counts + across + inside)
    heads = (M - 1) * machine.across.alpha + (D - 1) * machine.inside.alpha
    last = (M - 1) / M * (inside - (D - 1) * machine.inside.alpha) / chunks
    return 2 * (2 * counts + heads + max(across, inside) + last)
