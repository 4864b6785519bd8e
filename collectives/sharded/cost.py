"""Lesson 10: what each stage keeps per rank, and what it sends per step.

Memory, after ZeRO (Rajbhandari et al.): a model of Ψ parameters trained with Adam in mixed
precision holds 2 bytes per parameter of bf16 weights, 2 of bf16 gradients and 12 of fp32
optimizer state (master copy, first and second moments) -- 16·Ψ on every rank in data
parallel training. Each stage shards one more term over the p ranks::

    stage 0 (DDP)   2Ψ      + 2Ψ      + 12Ψ
    ZeRO-1          2Ψ      + 2Ψ      + 12Ψ/p
    ZeRO-2          2Ψ      + 2Ψ/p    + 12Ψ/p
    ZeRO-3          2Ψ/p    + 2Ψ/p    + 12Ψ/p      = 16Ψ/p

In plain fp32 the weights are the masters: 4 + 4 + 8 bytes (:data:`FP32_ADAM`).

Communication per step, elements each rank sends (ring collectives, lesson 4): DDP's
all-reduce is a reduce-scatter plus an all-gather, 2·(p-1)/p·Ψ; ZeRO-1 and ZeRO-2 do
exactly those two halves; ZeRO-3 gathers the weights twice (forward, backward) and
reduce-scatters once: 3·(p-1)/p·Ψ, 1.5x data parallel's bytes.
"""

from __future__ import annotations

from collectives.core.cost import AlphaBeta, TwoTier, cost, predict_flat

MIXED_ADAM = (2, 2, 12)     # bytes per parameter: weights, gradients, optimizer state
FP32_ADAM = (4, 4, 8)


def memory_bytes(psi: float, p: int, stage: int, per_param=MIXED_ADAM) -> dict:
    """Bytes per rank of weights, gradients and optimizer state at ``stage`` (0 = DDP)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"memory_bytes: stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if p < 1:
        raise ValueError(f"memory_bytes: p must be at least 1, got {p}")
    w, g, o = per_param
    params = psi * w / (p if stage >= 3 else 1)
    grads = psi * g / (p if stage >= 2 else 1)
    optimizer = psi * o / (p if stage >= 1 else 1)
    return dict(params=params, grads=grads, optimizer=optimizer, total=params + grads + optimizer)


def comm_elements(psi: float, p: int, stage: int) -> float:
    """Elements each rank sends per step at ``stage`` (0 = DDP) with ring collectives."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"comm_elements: stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    passes = 3 if stage == 3 else 2
    return passes * (p - 1) / p * psi


def zero3_seconds(nbytes: float, p: int, link: AlphaBeta) -> float:
    """Predicted communication seconds of one ZeRO-3 step on ``p`` ranks of one link:
    two all-gathers and one reduce-scatter of the ``nbytes`` of weights."""
    return 2 * cost("all_gather", nbytes, p).seconds(link) + cost("reduce_scatter", nbytes, p).seconds(link)


def full_shard_seconds(nbytes: float, machine: TwoTier) -> float:
    """ZeRO-3 over every rank of a two-tier cluster: every ring step crosses machines."""
    return 2 * predict_flat("all_gather", nbytes, machine) + predict_flat("reduce_scatter", nbytes, machine)


def hybrid_shard_seconds(nbytes: float, machine: TwoTier) -> float:
    """Hybrid sharding: ZeRO-3 inside each machine, the gradient shards (nbytes / g, g
    ranks a machine) averaged across machines by a ring all-reduce over the slow link."""
    g = machine.ranks_per_machine
    inside = zero3_seconds(nbytes, g, machine.inside)
    ring = cost("ring", nbytes / g, machine.machines)      # the g shards' rings share one link
    across = ring.steps * machine.across.alpha + g * ring.bytes_on_path * machine.across.beta
    return inside + across


def flat_all_reduce_seconds(nbytes: float, machine: TwoTier) -> float:
    """Data parallel's ring all-reduce of the gradients over every rank of the cluster."""
    return predict_flat("ring", nbytes, machine)
