"""Hierarchical all-to-all: gather inside a machine, one message per machine pair across,
scatter inside (a leader-based, two-level all-to-all).

D ranks per machine on M machines, machine-major (:mod:`collectives.hierarchical.layout`,
lesson 7's). A flat all-to-all sends D·D messages from every machine to every other one,
each of one block b. The hierarchy sends one message of D·D blocks per machine pair,
carried by one rank of each machine -- the *carrier* of pair (m → m') is local rank
m' mod D on machine m, and it hands over to local rank m mod D on machine m', so the pairs
spread over the local ranks::

    machine 0 (ranks 0, 1)                         machine 1 (ranks 2, 3)
    1. gather: rank 0 ──{b02, b03}──► rank 1        rank 3 ──{b30, b31}──► rank 2
    2. across: rank 1 ══{b02 b03 b12 b13}══════════► rank 2 (D·D blocks, one message)
               rank 1 ◄═════════{b20 b21 b30 b31}══ rank 2
    3. scatter: rank 1 ──{b20, b30}──► rank 0       rank 2 ──{b03, b13}──► rank 3
    (blocks for ranks of the own machine go straight to them in step 1)

Across, the bytes are the flat version's -- all-to-all cannot send fewer -- but in
M·(M − 1) messages instead of D²·M·(M − 1): the slow link pays α once per machine pair,
carries one long stream instead of D² competing ones, and each message is D² times
longer (past the size where a link reaches its bandwidth). The price: every block for
another machine crosses the fast links twice more (gather and scatter), and with one NIC
per GPU only the carriers' NICs carry anything: M − 1 of a machine's D (one of D with two
machines). Every byte still crosses -- an all-to-all's blocks are all different -- so on
one link per machine it can win only the α's it saves.
Cost (:func:`collectives.alltoall.cost.hierarchical_seconds`).

This is *not* DeepEP's inter-node dispatch. DeepEP sends over RDMA from each GPU to the
same-index GPU of the target node (every NIC busy), forwards inside over NVLink, and
sends a token bound for several experts on one node across once: fewer bytes across,
not only fewer messages. That dispatch is :mod:`collectives.alltoall.dedup`.
"""

from __future__ import annotations

import torch

from ..core import trace
from ..hierarchical.layout import resolve
from .plan import alias, plan_for, post, wait

__all__ = ["hierarchical_all_to_all", "carrier"]


def carrier(src_machine: int, dst_machine: int, D: int) -> tuple[int, int]:
    """(local rank sending on ``src_machine``, local rank receiving on ``dst_machine``) of that pair."""
    return dst_machine % D, src_machine % D


def hierarchical_all_to_all(output: torch.Tensor, input: torch.Tensor, group=None, layout=None) -> None:
    """``dist.all_to_all_single(output, input, group=group)`` (equal blocks) in three stages.

    ``layout=(D, M)`` as in lesson 7, or from the launcher's ``LOCAL_WORLD_SIZE``. Equal
    blocks only: the gather and the scatter would otherwise need every rank's sizes.
    The stages are worked out on the first call and reused (:mod:`.plan`).
    """
    plan = plan_for("hierarchical_all_to_all", output, input, None, None, group, extra=("layout", layout),
                    check=lambda made: made.cache.update(hierarchical=_stages(made, resolve(layout, group))),
                    agree=lambda: {"layout": _layout_text(layout, group)})
    if plan is None:
        return
    plan.stage_in(input)
    for text, before, p2p, after in plan.cache["hierarchical"]:
        with trace.label(text):
            works = post(p2p)
            for to, frm in before:
                to.copy_(frm)
            wait(works)
        for to, frm in after:
            to.copy_(frm)
    plan.stage_out(output)


def _layout_text(layout, group) -> str:
    lay = resolve(layout, group)
    return f"(D={lay.D}, M={lay.M})"


def _stages(plan, lay) -> list:
    """The three stages, each ``(label, copies while posted, P2POps, copies after)``."""
    src, dst = plan.src, plan.dst
    D, M = lay.D, lay.M
    rank = plan.rank
    m, d = lay.machine(rank), lay.local(rank)
    block = src.rows[0] * src.row_numel               # elements per block
    span = D * block                                  # the blocks of one machine, contiguous
    new = lambda n: torch.empty(n, dtype=src.flat.dtype, device=src.flat.device)   # noqa: E731
    for_machine = lambda t, mm: alias(t, mm * span, span)                          # noqa: E731

    # 1. inside: own machine's blocks straight to their ranks; other machines' to their carrier
    mine_out = [mm for mm in range(M) if mm != m and carrier(m, mm, D)[0] == d]   # pairs I carry out
    gathered = {mm: new(D * span) for mm in mine_out}
    recvs, sends, copies = [], [], [(dst.blocks[rank], src.blocks[rank])]
    for dd in range(D):
        peer = m * D + dd
        if dd != d:
            recvs.append((dst.blocks[peer], peer))
            sends.append((src.blocks[peer], peer))
    for mm in range(M):
        if mm == m:
            continue
        c = carrier(m, mm, D)[0]
        if c == d:
            copies.append((alias(gathered[mm], d * span, span), for_machine(src.flat, mm)))
        else:
            sends.append((for_machine(src.flat, mm), m * D + c))
    for mm in mine_out:
        recvs += [(alias(gathered[mm], dd * span, span), m * D + dd) for dd in range(D) if dd != d]
    stages = [("hierarchical 1: gather inside", copies, plan.p2p(recvs, sends), [])]

    # 2. across: one message per machine pair, carrier to carrier
    mine_in = [mm for mm in range(M) if mm != m and carrier(mm, m, D)[1] == d]     # pairs I receive
    arrived = {mm: new(D * span) for mm in mine_in}
    recvs = [(arrived[mm], mm * D + carrier(mm, m, D)[0]) for mm in mine_in]
    sends = [(gathered[mm], mm * D + carrier(m, mm, D)[1]) for mm in mine_out]
    # an arrival holds [source d][destination d'][block]; each d' gets its column
    columns = {mm: new(D * span) for mm in mine_in}
    after = [(columns[mm].view(D, D, block), arrived[mm].view(D, D, block).transpose(0, 1)) for mm in mine_in]
    stages.append(("hierarchical 2: across, one message per machine pair", [], plan.p2p(recvs, sends), after))

    # 3. inside: the carrier scatters the columns
    recvs, sends, copies = [], [], []
    for mm in range(M):
        if mm == m:
            continue
        c = carrier(mm, m, D)[1]
        if c == d:
            for dd in range(D):
                column = alias(columns[mm], dd * span, span)
                if dd == d:
                    copies.append((for_machine(dst.flat, mm), column))
                else:
                    sends.append((column, m * D + dd))
        else:
            recvs.append((for_machine(dst.flat, mm), m * D + c))
    stages.append(("hierarchical 3: scatter inside", copies, plan.p2p(recvs, sends), []))
    return stages
