"""All-to-all from point-to-point: linear, pairwise exchange and Bruck.

Every rank holds p blocks, one for each rank; afterwards rank r holds block r of every
rank, in rank order -- a transpose of the p × p matrix of blocks, with the rows on the
ranks. The contract is ``dist.all_to_all_single(output, input, output_split_sizes,
input_split_sizes, group)``: blocks are cut along dim 0, equal unless split sizes are
given, and rank r's ``output`` block s is rank s's ``input`` block r::

    before                       after
    rank 0:  a0 a1 a2            rank 0:  a0 b0 c0
    rank 1:  b0 b1 b2     ->     rank 1:  a1 b1 c1
    rank 2:  c0 c1 c2            rank 2:  a2 b2 c2

Three ways to move the blocks, n the bytes of one rank's input, b = n/p a block:

* **linear**: every receive and every send posted at once, p − 1 of each; the network
  (or the library) decides the order. (p − 1)·α + (p − 1)·b·β on one port.
* **pairwise exchange** (MPI's pairwise algorithm): p − 1 rounds, one partner per round:
  rank r ⊕ k when p is a power of two (a perfect matching: both directions of every pair
  at once), else send to r + k and receive from r − k. The same cost as linear, but only
  one message in flight each way: no incast, no p − 1 connections at once.
* **Bruck** (Bruck et al., 1997, MPI's small-message all-to-all): ⌈log2 p⌉ rounds. Rotate
  so slot i holds the block for rank r + i; at round k send every slot whose bit k is set
  to rank r + 2^k. Each block hops to its destination along the bits of its distance.
  ⌈log2 p⌉·α, but each round moves about half of the blocks: ~(n/2)·⌈log2 p⌉·β. Fewer
  messages, more bytes: it wins below the crossover the cost model predicts (:mod:`.cost`).

Whatever the algorithm, each rank must send (p − 1)/p of its input and receive as much:
every byte that is not its own has somewhere else to be. No algorithm can do with less,
which is why all-to-all, unlike all-reduce, has no trick that trades latency for bytes
below that bound -- Bruck only trades the other way.
"""

from __future__ import annotations

import torch

from ..core import ops, trace
from .plan import Plan, alias, check_all_to_all_args, plan_for, post, wait

__all__ = ["linear_all_to_all", "pairwise_all_to_all", "bruck_all_to_all", "check_all_to_all_args",
           "pairwise_schedule"]


def linear_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None) -> None:
    """All-to-all with every receive and every send posted at once (p − 1 of each).

    Cost: (p − 1)·α + (p − 1)/p·n·β on one port; the order is the transport's. The
    receives land straight in the output's blocks; the own block is copied while the
    messages are under way. What to post is worked out on the first call and reused
    (:mod:`.plan`): one ``batch_isend_irecv`` of a ready list per call.
    """
    plan = plan_for("linear_all_to_all", output, input, output_split_sizes, input_split_sizes, group)
    if plan is None:
        return
    p2p = plan.cache.get("linear")
    if p2p is None:
        peers = [(plan.rank + k) % plan.p for k in range(1, plan.p)]
        p2p = plan.cache["linear"] = plan.p2p([(plan.dst.blocks[s], s) for s in peers],
                                              [(plan.src.blocks[d], d) for d in peers])
    plan.stage_in(input)
    with trace.label("linear: every pair at once"):
        works = post(p2p)
        plan.copy_self()
        wait(works)
    plan.stage_out(output)


def pairwise_schedule(rank: int, p: int) -> list[tuple[int, int]]:
    """The (send to, receive from) group ranks of rounds 1 .. p − 1 of the pairwise exchange."""
    if p & (p - 1) == 0:
        return [(rank ^ k, rank ^ k) for k in range(1, p)]
    return [((rank + k) % p, (rank - k) % p) for k in range(1, p)]


def pairwise_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                        input_split_sizes=None, group=None) -> None:
    """All-to-all in p − 1 rounds, one partner each way per round (after MPI's pairwise exchange).

    Round k: with p a power of two the partner is rank ⊕ k, both ways; otherwise send to
    rank + k and receive from rank − k. Every rank is sending one block and receiving one
    at any time. Cost: (p − 1)·α + (p − 1)/p·n·β.
    """
    plan = plan_for("pairwise_all_to_all", output, input, output_split_sizes, input_split_sizes, group)
    if plan is None:
        return
    rounds = plan.cache.get("pairwise")
    if rounds is None:
        src, dst = plan.src.blocks, plan.dst.blocks
        rounds = plan.cache["pairwise"] = [
            (f"pairwise round {k}: to {to}, from {frm}", plan.p2p([(dst[frm], frm)], [(src[to], to)]))
            for k, (to, frm) in enumerate(pairwise_schedule(plan.rank, plan.p), start=1)]
    plan.stage_in(input)
    if not rounds:
        plan.copy_self()
    for k, (text, p2p) in enumerate(rounds):
        with trace.label(text):
            works = post(p2p)
            if k == 0:
                plan.copy_self()            # while the first round's messages are under way
            wait(works)
    plan.stage_out(output)


def _size_matrix(rows_in: list[int], rows_out: list[int], equal: bool, group) -> list[list[int]]:
    """sizes[s][d]: rows rank s sends rank d. Equal blocks need no message; uneven ones are
    all-gathered first (one small ring all-gather of p·2p counts, lesson 4's): what every
    rank sends and what it expects, so that every rank sees a pair that disagrees -- a
    sender of 5 rows to a receiver expecting 3 -- and all of them raise, nobody waits."""
    rank, p = ops.group_rank_and_size(group)
    if equal:
        return [rows_in[:] for _ in range(p)]
    from ..ring import ring_all_gather
    gathered = torch.zeros(p * 2 * p, dtype=torch.int64, device=ops.rank_device())
    with trace.label("bruck: the size matrix"):
        ring_all_gather(gathered, torch.tensor(rows_in + rows_out, dtype=torch.int64, device=gathered.device),
                        group=group)
    flat = gathered.tolist()
    sizes = [flat[s * 2 * p:s * 2 * p + p] for s in range(p)]
    expects = [flat[s * 2 * p + p:(s + 1) * 2 * p] for s in range(p)]
    wrong = [(s, d) for s in range(p) for d in range(p) if sizes[s][d] != expects[d][s]]
    if wrong:
        s, d = wrong[0]
        raise ValueError(f"bruck_all_to_all: rank {rank}: group rank {s} sends group rank {d} {sizes[s][d]} rows "
                         f"but rank {d} expects {expects[d][s]} (its output_split_sizes[{s}])"
                         + (f", and {len(wrong) - 1} more pairs disagree" if len(wrong) > 1 else ""))
    return sizes


def bruck_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                     input_split_sizes=None, group=None) -> None:
    """All-to-all in ⌈log2 p⌉ rounds (after Bruck et al.'s algorithm, as in MPI's small-message path).

    Slot i of this rank starts with the block for rank + i. At round k every slot with
    bit k set travels to rank + 2^k, packed into one message; a block has arrived once it
    has travelled its distance i = the sum of those bits. At the end slot i holds the
    block from rank − i. With uneven splits every rank needs every rank's sizes to know
    what a packed message holds: they are all-gathered first (p·p integers).
    Cost: ⌈log2 p⌉·α + Σ_k |{i : bit k of i}|·b·β ≈ ⌈log2 p⌉·α + ⌈log2 p⌉·(n/2)·β.
    """
    plan = plan_for("bruck_all_to_all", output, input, output_split_sizes, input_split_sizes, group)
    if plan is None:
        return
    equal = input_split_sizes is None and output_split_sizes is None
    rounds = plan.cache.get("bruck")
    if rounds is None:
        rounds = _bruck_rounds(plan, _size_matrix(plan.src.rows, plan.dst.rows, equal, group))
        if equal:                   # uneven: the other ranks' sizes may change from call to call
            plan.cache["bruck"] = rounds
    steps, final = rounds
    plan.stage_in(input)
    for text, sources, packed, p2p in steps:
        torch.cat(sources, out=packed)
        with trace.label(text):
            wait(post(p2p))
    torch.cat(final, out=plan.dst.flat)
    plan.stage_out(output)


def _bruck_rounds(plan: Plan, sizes: list[list[int]]):
    """Bruck's rounds, worked out: for each, the slots to pack, the buffer they are packed
    into, and the P2POps (receive into a landing buffer, send the packed one); then the
    slots in output order. The slots a round receives are views of its landing buffer."""
    rank, p, row = plan.rank, plan.p, plan.src.row_numel
    flat = plan.src.flat
    slots = [plan.src.blocks[(rank + i) % p] for i in range(p)]          # slot i: for rank + i
    steps = []
    d = 1
    while d < p:
        moving = [i for i in range(p) if i & d]
        to, frm = (rank + d) % p, (rank - d) % p
        # slot i on the sender frm holds the block from source frm − (i mod d), for source + i
        incoming = []
        for i in moving:
            source = (frm - (i & (d - 1))) % p
            incoming.append(sizes[source][(source + i) % p] * row)
        sources = [slots[i] for i in moving]
        packed = torch.empty(sum(t.numel() for t in sources), dtype=flat.dtype, device=flat.device)
        landing = torch.empty(sum(incoming), dtype=flat.dtype, device=flat.device)
        steps.append((f"bruck round {d.bit_length() - 1}: {len(moving)} blocks to {to}", sources, packed,
                      plan.p2p([(landing, frm)], [(packed, to)])))
        at = 0
        for i, n in zip(moving, incoming):
            slots[i] = alias(landing, at, n)
            at += n
        d <<= 1
    return steps, [slots[(rank - s) % p] for s in range(p)]
