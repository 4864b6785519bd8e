"""The flat ring that uses every rail: what the hierarchy must beat when there are rails.

gloo's ``dist.all_reduce`` and lesson 4's ring are one ring over all D·M ranks,
machine-major: it leaves each machine once, from the last local rank to the next machine's
first, so with a network card per local rank (rails) it uses one card of D. NCCL's flat
ring does not: it runs a *channel* per card, each a ring of its own over part of the
tensor. This is that ring (lesson 4's multi-ring over the rails): D rings, ring c carrying
part c of the tensor and entering every machine at local rank c, so that its hop between
machines lands on local rank c -- on rail c::

    D = 2, M = 2, ranks (d, m):            ring 0 (rail 0)          ring 1 (rail 1)
    machine 0: (0,0) (1,0)                 (0,0) → (1,0) ─┐         (1,0) → (0,0) ─┐
    machine 1: (0,1) (1,1)            ┌────────────────────┘    ┌────────────────────┘
                                      └→ (0,1) → (1,1) ─→ (0,0) └→ (1,1) → (0,1) ─→ (1,0)

In the simulated cluster a message leaves its machine on the link of the receiver's rail
(its address is on that rail's subnet), so ring c's hops between machines all use rail c.

Cost, n bytes on p = D·M ranks: every rank sends 2(p − 1)/p·n in all, D messages a step
(one per ring); across machines each rail carries 2(p − 1)/p·n/D. With one link per
machine the D rings share it: 2(p − 1)/p·n, the plain ring's bytes. Against the
hierarchy's 2(M − 1)/M·n/D per rail, the rails buy the flat ring as much as the
hierarchy; what the hierarchy still saves is the byte count, M(p − 1)/(p(M − 1)) --
1.5× on 2 × 2, 1.07× on 8 × 8 (:func:`collectives.hierarchical.cost.tiered`,
``"rail_ring"``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core import ops, trace
from ..core.ops import ReduceOp
from .layout import checked_layout


def ring_order(ranks: list[int], D: int, M: int, c: int) -> list[int]:
    """Global ranks of ring ``c`` in ring order: every machine visited from local rank c."""
    return [ranks[m * D + (c + i) % D] for m in range(M) for i in range(D)]


def rail_ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, layout=None) -> None:
    """A flat all-reduce over D rings, one per rail (NCCL's channels over several NICs).

    Part c of the tensor (``ops.chunk_bounds(n, D)[c]``) is reduce-scattered and
    all-gathered around ring c (:func:`ring_order`), lesson 4's schedule; every step posts
    every ring's receive, then every ring's send, and waits for all of them.
    """
    shape = checked_layout(tensor, op, group, layout, "rail_ring_all_reduce")
    if shape is None:
        return                         # not in the group: nothing to do, as dist.all_reduce
    p = dist.get_world_size(group)
    if p == 1 or tensor.numel() == 0:
        return
    ranks = list(range(p)) if group is None else dist.get_process_group_ranks(group)
    me = dist.get_rank()
    flat = ops.work_buffer(tensor.detach())
    rings = []      # per ring: (my position, send to, receive from, chunk bounds in flat, landing)
    for c, (lo, hi) in enumerate(ops.chunk_bounds(flat.numel(), shape.D)):
        order = ring_order(ranks, shape.D, shape.M, c)
        pos = order.index(me)
        bounds = [(lo + a, lo + b) for a, b in ops.chunk_bounds(hi - lo, p)]
        widest = max(b - a for a, b in bounds)
        rings.append((pos, order[(pos + 1) % p], order[(pos - 1) % p], bounds,
                      torch.empty(widest, dtype=flat.dtype, device=flat.device)))

    for step in range(p - 1):        # reduce-scatter: chunk (pos - 1 - step) leaves, (pos - 2 - step) arrives
        recvs, sends, combines = [], [], []
        for pos, right, left, bounds, landing in rings:
            s_lo, s_hi = bounds[(pos - 1 - step) % p]
            r_lo, r_hi = bounds[(pos - 2 - step) % p]
            recvs.append((landing[: r_hi - r_lo], left))
            sends.append((flat[s_lo:s_hi], right))
            combines.append((flat[r_lo:r_hi], landing[: r_hi - r_lo]))
        with trace.label(f"rings: reduce-scatter {step}"):
            _wait(ops.post_exchange(recvs, sends, group))
        for target, arrived in combines:
            ops.combine_(target, arrived, op)
    for pos, _, _, bounds, _ in rings:
        lo, hi = bounds[pos]
        ops.finish_(flat[lo:hi], op, p)
    for step in range(p - 1):        # all-gather: chunk (pos - step) leaves, (pos - 1 - step) arrives
        recvs, sends = [], []
        for pos, right, left, bounds, _ in rings:
            s_lo, s_hi = bounds[(pos - step) % p]
            r_lo, r_hi = bounds[(pos - 1 - step) % p]
            recvs.append((flat[r_lo:r_hi], left))
            sends.append((flat[s_lo:s_hi], right))
        with trace.label(f"rings: all-gather {step}"):
            _wait(ops.post_exchange(recvs, sends, group))
    ops.write_back(tensor.detach(), flat)


def _wait(works) -> None:
    for work in works:
        work.wait()
