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
link of M): the flat all-to-all puts D·D·(M − 1) blocks on each machine's link and as
many messages; the hierarchical one the same bytes in M − 1 messages, plus two stages
inside (:func:`hierarchical_seconds`).
"""

from __future__ import annotations

from ..core.cost import AlphaBeta, Cost, TwoTier, log2_ceil

__all__ = ["linear", "pairwise", "bruck", "bruck_blocks", "predict", "bruck_crossover",
           "flat_seconds", "hierarchical_seconds", "MODELS"]


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
    """A flat all-to-all on a two-tier machine: the busier of each machine's shared link
    (D·D·(M − 1) messages of b) and a rank's messages inside."""
    D, M = machine.ranks_per_machine, machine.machines
    b = nbytes / machine.p
    across = D * D * (M - 1) * machine.across.message(b) if M > 1 else 0.0
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
