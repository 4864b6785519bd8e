"""Lesson 7's cost model: two tiers of links, stages, rails, slices and buckets in flight.

It builds on :mod:`collectives.core.cost`'s α–β primitives: a message of m bytes costs
α + β·m on its link. A cluster has two links (:class:`Tiers`): *inside* a machine (NVLink,
shared memory, loopback) and *across* machines (the network); with *rails* each local
rank has a cross-machine link of its own, otherwise the D ranks of a machine share one.

An all-reduce is a list of :class:`Stage` (:func:`tiered`), each on one tier. A stage
costs α for every message a rank sends in it and β for every byte on the busiest link of
its tier::

    t(stage) = messages · α_tier + link_bytes · β_tier

Every message pays its α: the collect and the diffuse are M − 1 messages each, so the
model shows what Fairring's design pays as machines are added (2(M − 1)·α_x per slice),
not only what it saves in bytes. Pipelined over S slices the busier tier sets the pace
(:func:`predict_tiered`); :func:`slice_plan` picks S once per (elements, dtype, layout,
tiers) and remembers it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..core.cost import AlphaBeta


@dataclass(frozen=True)
class Tiers:
    """The two links of a cluster: ``inside`` a machine and ``across`` machines.

    ``rails``: each local rank has a cross-machine link of its own (one NIC per GPU, as
    on DGX-class machines); otherwise the D ranks of a machine share one link, and what
    they send across at the same time adds up on it. (:class:`collectives.core.cost.TwoTier`
    describes the same two links with the cluster's shape; the functions below accept
    either.)

    ``issue``: the host's time to issue one slice (the course's Python, the library's calls,
    the events between stages) -- a third resource beside the two links. On a GPU the host
    issues while the GPUs work, so slices cannot flow faster than one per ``issue``: each
    slice pays it, and a pipeline of many slices pays it many times (:func:`predict_tiered`).
    """

    inside: AlphaBeta
    across: AlphaBeta
    rails: bool = False
    issue: float = 0.0        # host seconds to issue one slice: its calls, events, stream switches


# What the lesson assumes when it is not told, per backend. Assumptions, not measurements:
# the benchmarks fit or state what they use.
# gloo on a CPU: loopback inside a machine (≈ 50 µs a message, ≈ 1 GB/s: gloo's busbw on a
# 2-core CPU), 1 Gbit/s Ethernet between machines, one link per machine.
# Issuing a slice: what ``bench-hier host-cost`` measured (hierarchical_all_reduce, per slice,
# with torch.distributed's calls stubbed: docs/data/bench-hier/host-cost/after) -- about 0.1 ms.
DEFAULT_TIERS = Tiers(AlphaBeta(50e-6, 1 / 1e9), AlphaBeta(100e-6, 8 / 1e9), issue=100e-6)
# NCCL on GPUs: NVLink inside (≈ 10 µs a message, ≈ 150 GB/s a link), a 400 Gbit/s NIC per
# GPU between machines (≈ 20 µs, 50 GB/s), as on DGX-class machines: rails. Issuing one slice
# took the host about 1.3 ms on 2x H100 (NCCL's calls included: docs/data/gpu/host-profile-2x-h100.json,
# host_one_slice_s); tools/gpu_hierarchical.py records it again beside each run.
NCCL_TIERS = Tiers(AlphaBeta(10e-6, 1 / 150e9), AlphaBeta(20e-6, 1 / 50e9), rails=True, issue=1.3e-3)
# NCCL on the GPUs of one host: NVLink on both tiers, ≈ 300 GB/s of bus bandwidth (NCCL's own
# all-reduce of 256 MiB on 4x H100 NV18 took 1.37 ms: docs/data/gpu/lane-4x-h100.json, step hier-p4).
NVLINK_TIERS = Tiers(AlphaBeta(10e-6, 1 / 300e9), AlphaBeta(10e-6, 1 / 300e9), rails=True, issue=1.3e-3)


def tiers_for(backend: str | None, device_type: str = "cpu", one_host: bool = False) -> Tiers:
    """The tiers the hierarchy plans its slices with: NCCL on a GPU is not gloo on a CPU,
    and GPUs of one host (``one_host``: the layout only pretends to be machines) talk over
    NVLink on both tiers.

    Same on every rank of a group (same backend, same device type, same launcher's
    environment), so every rank cuts a tensor into the same slices."""
    if backend == "nccl" or device_type == "cuda":
        return NVLINK_TIERS if one_host else NCCL_TIERS
    return DEFAULT_TIERS


@dataclass(frozen=True)
class Stage:
    """One stage of an all-reduce on a two-tier cluster, for n bytes."""

    name: str
    tier: str                 # "inside" or "across"
    messages: int             # messages each rank sends in the stage (α each)
    bytes_per_rank: float     # bytes each rank sends in the stage
    link_bytes: float         # bytes on the busiest link of the tier (β each)

    def seconds(self, tiers: Tiers) -> float:
        link = tiers.inside if self.tier == "inside" else tiers.across
        return self.messages * link.alpha + self.link_bytes * link.beta


TIERED = ("flat_ring", "rail_ring", "root_based", "rail_all_reduce", "hierarchical")


def tiered(name: str, n: float, D: int, M: int, rails: bool = False) -> list[Stage]:
    """The stages of all-reduce ``name`` for n bytes on D ranks per machine × M machines.

    * ``flat_ring``: one ring over all D·M ranks, machine-major. One ring edge per machine
      leaves it, so each of the 2(p − 1) steps puts n/p on that machine's link: 2(p − 1)/p·n
      across, on one link even when there are rails (what gloo's ``dist.all_reduce`` does).
    * ``rail_ring``: D such rings side by side, ring c over n/D bytes and entering every
      machine at local rank c, so that it crosses machines on rail c
      (:func:`collectives.hierarchical.rail_ring_all_reduce`; NCCL's channels over several
      NICs): with rails each link carries 2(p − 1)/p·n/D; on one link the rings add up to
      the flat ring's bytes. Each rank sends D messages a step.
    * ``root_based`` (Horovod's first hierarchy): reduce to local rank 0, ring all-reduce of
      the whole tensor between the M roots, broadcast inside. Only the roots' links carry
      the 2(M − 1)/M·n across.
    * ``rail_all_reduce``: reduce-scatter inside, ring all-reduce of n/D on each rail,
      all-gather inside: 2(M − 1)/M·n/D per rank across, in 2(M − 1) messages.
    * ``hierarchical`` (Fairring): reduce-scatter inside, collect (all-to-all) and diffuse
      (all-gather) on each rail, all-gather inside: the same bytes as ``rail_all_reduce``,
      in two rounds across instead of 2(M − 1) -- but still M − 1 messages per round.

    Without rails the D ranks of a machine share its link, so a stage in which every rank
    sends b across puts D·b on it.
    """
    p = D * M
    share = 1 if rails else D            # ranks whose cross-machine bytes share one link
    inside_rs = (D - 1) / D * n
    if name in ("flat_ring", "rail_ring"):
        if p == 1:
            return []
        tier = "across" if M > 1 else "inside"
        ring_bytes = 2 * (p - 1) / p * n
        if name == "flat_ring" or D == 1:
            return [Stage("ring", tier, 2 * (p - 1), ring_bytes, ring_bytes)]
        # D rings of n/D; each rank leaves its machine in one of them (the ring of rail d + 1)
        across_link = ring_bytes / D * (1 if rails else D)
        return [Stage(f"{D} rings, one per rail", tier, 2 * (p - 1) * D, ring_bytes,
                      across_link if M > 1 else ring_bytes)]
    out = []
    if name == "root_based":
        if D > 1:
            out.append(Stage("reduce to the root", "inside", D - 1, n, (D - 1) * n))
        if M > 1:
            out.append(Stage("ring all-reduce of the roots", "across", 2 * (M - 1),
                             2 * (M - 1) / M * n, 2 * (M - 1) / M * n))
        if D > 1:
            out.append(Stage("broadcast from the root", "inside", D - 1, (D - 1) * n, (D - 1) * n))
        return out
    if name not in ("rail_all_reduce", "hierarchical"):
        raise KeyError(f"no tiered model named {name!r}; known: {', '.join(TIERED)}")
    if D > 1:
        out.append(Stage("reduce-scatter", "inside", D - 1, inside_rs, inside_rs))
    if M > 1:
        per_rank = (M - 1) / M * n / D
        if name == "rail_all_reduce":
            out.append(Stage("ring all-reduce on the rail", "across", 2 * (M - 1), 2 * per_rank,
                             2 * per_rank * share))
        else:
            out.append(Stage("collect", "across", M - 1, per_rank, per_rank * share))
            out.append(Stage("diffuse", "across", M - 1, per_rank, per_rank * share))
    if D > 1:
        out.append(Stage("all-gather", "inside", D - 1, inside_rs, inside_rs))
    return out


def predict_tiered(name: str, n: float, D: int, M: int, tiers, slices: int = 1) -> float:
    """Predicted seconds of ``name`` on the two tiers; ``slices`` > 1 pipelines them.

    With S slices each stage moves n/S. The inside link and the cross link work at the
    same time, each on its own stages, so the slowest of the two sets the pace: one slice
    goes through every stage, and the other S − 1 follow at the pace of the busier tier --
    or of the host, when issuing a slice (``tiers.issue``, h) takes longer than either::

        T(S) ≈ h + Σ_stages t(n/S) + (S − 1) · max(Σ_inside t(n/S), Σ_across t(n/S), h)

    ``slices = 1`` is the plain sum of the stages. ``tiers`` may also be a
    :class:`collectives.core.cost.TwoTier` (fitted on a cluster; no rails): only its
    ``inside`` and ``across`` links are read.
    """
    stages = tiered(name, n / slices, D, M, getattr(tiers, "rails", False))
    issue = getattr(tiers, "issue", 0.0)
    total = sum(s.seconds(tiers) for s in stages) + issue
    if slices == 1:
        return total
    by_tier = {"inside": 0.0, "across": 0.0}
    for s in stages:
        by_tier[s.tier] += s.seconds(tiers)
    return total + (slices - 1) * max(by_tier["inside"], by_tier["across"], issue)


def best_slice_bytes(n: float, D: int, M: int, tiers, largest_slices: int = 64) -> int:
    """The slice size (bytes) for which :func:`predict_tiered` of ``hierarchical`` is least.

    More slices hide more of the cheaper tier under the busier one, and each pays every
    stage's α and the host's issue time again: the best count balances the two. When the
    host's time per slice outweighs what the overlap hides (NVLink-class links, where a
    stage of 256 MiB takes about a millisecond), that is one slice. Tried: 1 to ``largest_slices``.
    With one tier (D = 1 or M = 1) there is nothing to hide: one slice.

    A few hundred microseconds of Python: call it through :func:`slice_plan`, which
    remembers its answer, never on every all-reduce.
    """
    if n <= 0:
        return 1
    best = min(range(1, largest_slices + 1),
               key=lambda s: predict_tiered("hierarchical", n, D, M, tiers, s))
    return max(1, math.ceil(n / best))


@functools.lru_cache(maxsize=1024)
def slice_plan(numel: int, element_size: int, D: int, M: int, tiers: Tiers) -> int:
    """Elements per slice for ``numel`` elements of ``element_size`` bytes on D × M ranks:
    :func:`best_slice_bytes`, computed once per (elements, dtype size, layout, tiers) and
    remembered (``slice_plan.cache_info()`` counts). Every rank asks with the same key, so
    every rank gets the same slices."""
    best = best_slice_bytes(numel * element_size, D, M, tiers)
    return max(1, best // element_size)


def cross_bytes_per_rank(name: str, n: float, D: int, M: int) -> float:
    """Bytes the busiest rank sends across machines (the ring: a rank at a machine's edge)."""
    if name == "rail_ring":
        return 2 * (D * M - 1) / (D * M) * n / D if M > 1 else 0.0
    return sum(s.bytes_per_rank for s in tiered(name, n, D, M) if s.tier == "across")


def predict_buckets(name: str, bucket_bytes: float, buckets: int, in_flight: int, D: int, M: int,
                    tiers, slices: int = 1) -> float:
    """Predicted seconds to all-reduce ``buckets`` buckets of ``bucket_bytes`` each, with at
    most ``in_flight`` of them issued and not yet waited for (Fairring's benchmark).

    One at a time, every bucket fills and drains the pipeline of its ``slices`` slices:
    B · T(S). With two or more in flight the next bucket's slices are queued before the
    previous bucket's leave, so the slices of all buckets flow as one pipeline:
    Σ_stages t(s) + (B·S − 1) · max(tier sums), s = bucket_bytes / S. A flat algorithm
    (``flat_ring``) on one process group runs its calls one after the other: B · T.
    """
    if name != "hierarchical" or in_flight <= 1 or buckets <= 1:
        return buckets * predict_tiered(name, bucket_bytes, D, M, tiers, slices)
    return predict_tiered(name, bucket_bytes * buckets, D, M, tiers, slices * buckets)
