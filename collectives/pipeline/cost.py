"""What a pipeline costs: its bubble, its memory, and its bytes across a slow link.

With p stages, m micro-batches, v chunks per rank, and one micro-batch's F, B and W
taking ``f``, ``b``, ``w`` seconds on a whole stage (B and W as one: ``b + w``)::

    schedule      bubble (idle share of every rank's time)          micro-batches held, rank r
    GPipe         (p − 1)/(m + p − 1)                               m
    1F1B          (p − 1)/(m + p − 1)                               p − r
    interleaved   (p − 1)/(v·m + p − 1)                             ≈ p − r + (v − 1)·p (chunks of 1/v)
    ZB-H1         (p − 1)(f + b − w)/(m(f + b + w) + (p − 1)(f + b − w))

Across machines the pipeline cuts the model where the link is: each micro-batch sends one
activation across and one gradient back, ``2·m·a`` bytes per step for an activation of
``a`` bytes. Data parallel sends the gradients instead: a ring all-reduce of ``G`` bytes of
gradients on p ranks puts ``2(p − 1)/p·G`` on every ring link, and a machine-major ring on
M machines crosses between machines M times. Pipeline parallelism wins across the link
when ``2·m·a`` is small beside ``G`` -- deep models, small activations.
"""

from __future__ import annotations

from ..core.cost import AlphaBeta

__all__ = ["bubble", "bubble_gpipe", "bubble_interleaved", "bubble_zb_h1", "held", "step_seconds",
           "pp_bytes_across", "dp_bytes_across", "pp_step_seconds", "dp_step_seconds"]


def bubble_gpipe(p: int, m: int) -> float:
    """GPipe's and 1F1B's bubble: (p − 1)/(m + p − 1)."""
    return (p - 1) / (m + p - 1)


def bubble_interleaved(p: int, m: int, v: int) -> float:
    """Interleaved 1F1B's: (p − 1)/(v·m + p − 1)."""
    return (p - 1) / (v * m + p - 1)


def bubble_zb_h1(p: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """ZB-H1's: (p − 1)(f + b − w) idle beside m(f + b + w) of work, per rank."""
    idle = (p - 1) * (f + b - w)
    return idle / (m * (f + b + w) + idle)


def bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The formula's bubble of schedule ``name`` with equal F, B and W."""
    if name in ("gpipe", "1f1b"):
        return bubble_gpipe(p, m)
    if name == "interleaved":
        return bubble_interleaved(p, m, v)
    if name == "zb-h1":
        return bubble_zb_h1(p, m)
    raise ValueError(f"no formula for schedule {name!r}")


def held(name: str, p: int, m: int, rank: int) -> int:
    """Micro-batches rank ``rank`` holds at most, until their backward (GPipe m, 1F1B p − r)."""
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(m, p - rank)
    raise ValueError(f"held() knows gpipe and 1f1b, not {name!r}")


def step_seconds(p: int, m: int, per_microbatch: float, bubble_share: float) -> float:
    """A step's time: each rank's work m·t, stretched by its idle share."""
    return m * per_microbatch / (1 - bubble_share)


def pp_bytes_across(m: int, activation_bytes: float, cuts: int = 1) -> float:
    """Bytes a pipeline step sends across the slow link: one activation and one gradient
    per micro-batch at each of the ``cuts`` stage boundaries that cross it."""
    return 2.0 * m * activation_bytes * cuts


def dp_bytes_across(grad_bytes: float, p: int, machines: int) -> float:
    """Bytes a ring all-reduce of ``grad_bytes`` on p ranks (machine-major) sends across:
    2(p − 1)/p·G on each of the ``machines`` ring links between machines."""
    if machines < 2 or p < 2:
        return 0.0
    return 2.0 * (p - 1) / p * grad_bytes * machines


def pp_step_seconds(p: int, m: int, per_microbatch: float, activation_bytes: float, across: AlphaBeta,
                    bubble_share: float) -> float:
    """A pipeline step across a slow link: compute with its bubble, plus the boundary's
    messages on the critical path (each micro-batch's activation and gradient cross once;
    with m ≥ p most of them hide behind compute, the first and last do not)."""
    compute = step_seconds(p, m, per_microbatch, bubble_share)
    crossing = 2 * across.message(activation_bytes)
    return compute + crossing * min(m, p)


def dp_step_seconds(p: int, m: int, per_microbatch: float, grad_bytes: float, across: AlphaBeta) -> float:
    """A data-parallel step: every rank computes m/p of the micro-batches on the whole model
    (``per_microbatch`` is one stage's share, so p of them), then a ring all-reduce whose
    every step waits for the slow link: 2(p − 1) messages of G/p."""
    compute = m / p * per_microbatch * p
    ring = 2 * (p - 1) * across.message(grad_bytes / p)
    return compute + ring
