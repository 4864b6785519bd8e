"""A node-deduplicating MoE dispatch and combine: each token crosses to a machine once.

With top-k routing a token often chooses several experts on the same machine. The flat
dispatch (:class:`~collectives.alltoall.moe.MoELayer`'s) sends one row per (token, choice),
so such a token crosses the slow link once per expert it chose there. Here it crosses
once per *machine*, and is copied inside the machine, where links are fast; on the way
back the machine sums its experts' weighted outputs before the one row crosses back.
D ranks per machine on M machines, machine-major; rank (m, i) is local rank i of
machine m::

    dispatch   A. across, rail-aligned: rank (m, i) sends each token once to rank (m', i)
                  of every machine m' holding one of its experts (m' = m: no message),
                  with its gates and, per choice, the expert and the slot
               B. inside: rank (m', i) forwards a copy of the row to the rank of each of
                  those experts, with a sort key (expert, source rank, slot)
               experts: each expert's rows sorted by the key -- the flat dispatch's batch,
                  row for row
    combine    B'. inside, back: each output to the rank that forwarded it, which sums
                  gate · output over the experts of its machine
               A'. across, back: one row per (token, machine); the source adds them up

Stage by stage (``chunks=None``, and on GPUs), B waits for the whole of A, and A' for the
whole of B': the hops inside add to the crossing. By default the counts, gates, experts,
slots and sort keys go first, as messages of their own, and then the rows stream
(:mod:`.dedup_stream`): B forwards the own machine's rows at once and every chunk of A as
it arrives, while the next crosses; A' sends every chunk across once its sum is complete.
The same messages cross, and the results are the same.

Rank i of one machine talks across only to rank i of the others: with one NIC per GPU
every NIC carries its own rank's tokens (DeepEP's normal dispatch sends across the same
way, GPU to the same-index GPU of the target node, and forwards over NVLink).

What it saves is bytes across: a token bound for k experts spread uniformly over M
machines crosses k·(M − 1)/M times flat and (M − 1)·q times here, q the chance that one
other machine holds at least one of its k experts
(:func:`collectives.alltoall.cost.dedup_rows`). With k = 1 the two are equal -- a token
has one expert, on one machine -- and the forwarding inside is pure extra: nothing can win.

The experts see exactly the flat dispatch's batches, so their outputs are the same bit
for bit; the combine adds the k terms machine by machine instead of choice by choice, a
different order of the same sum: equal to the flat combine to rounding (fp32: about
1e-6 relative), exactly on values whose sums are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import ops, trace
from .dedup_stream import StreamPlan, StreamRows, segment_rows
from .flat import pairwise_all_to_all
from .moe import Routing, all_to_all_autograd

__all__ = ["DedupState", "dedup_dispatch", "dedup_combine", "machines_needed"]

SLOT_BITS = 32
CHUNKS = 4           # pieces per peer of the rows that cross, in the streamed dispatch


@dataclass
class DedupState:
    """What the combine needs from the dispatch."""

    sent_a: torch.Tensor        # token index of each row sent in stage A, in send order
    splits_a: tuple[list[int], list[int]]     # (sent per rank, received per rank)
    copies: torch.Tensor        # stage-A row of each copy forwarded in stage B
    copy_gate: torch.Tensor     # the gate of each copy (differentiable)
    splits_b: tuple[list[int], list[int]]
    order: torch.Tensor         # the received copies' positions in the experts' batch
    tokens: int
    received_a: int
    stream: StreamPlan | None = None          # streamed: the rows' plan (copy_gate then in batch order)


def _plain_all_to_all(t: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
    out = t.new_empty((sum(recv), *t.shape[1:]))
    pairwise_all_to_all(out, t.contiguous(), recv, send)
    return out


def _counts_with(peers: list[int], counts: list[int], rank: int, p: int) -> list[int]:
    """What each of ``peers`` sends this rank, from one integer to and from each of them
    only: no message to a rank that can send nothing (a count across goes to the rail peer
    alone, a count inside stays inside)."""
    ones = [1 if q in peers else 0 for q in range(p)]
    mine = torch.tensor([counts[q] for q in range(p) if ones[q]], dtype=torch.int64, device=ops.rank_device())
    got = _plain_all_to_all(mine, ones, ones).tolist()
    out, at = [0] * p, 0
    for q in range(p):
        if ones[q]:
            out[q] = got[at]
            at += 1
    return out


def _packable(dtype: torch.dtype) -> bool:
    """Whether small integers (below 2^24) ride exactly in the rows' own columns."""
    return dtype in (torch.float32, torch.float64)


def _copies_by_destination(meta_a: torch.Tensor, recv_a: list[int], p: int, k: int, El: int) -> tuple:
    """Step B's copies of the rows that arrived across (``meta_a``: each row's k experts, -1
    where none, then its k slots; ``recv_a`` rows from each source): a copy per (row, choice)
    for an expert on this machine, with its destination rank and its sort key (expert, source
    rank, slot), ordered by destination. Returns (row, choice, dest, key)."""
    dev = meta_a.device
    source = torch.repeat_interleave(torch.arange(p, device=dev), torch.tensor(recv_a, device=dev))   # its source
    experts, slots = meta_a[:, :k], meta_a[:, k:]
    row, choice = torch.nonzero(experts >= 0, as_tuple=True)                   # row-major: token, then choice
    e = experts[row, choice]
    dest = e // El
    key = ((e - dest * El) * p + source[row]) << SLOT_BITS | slots[row, choice]
    by_dest = torch.argsort(dest, stable=True)
    return row[by_dest], choice[by_dest], dest[by_dest], key[by_dest]


def machines_needed(routing: Routing, experts_per_rank: int, D: int) -> torch.Tensor:
    """[T, k]: the machine of each kept choice's expert, −1 where the choice was dropped."""
    machine = routing.expert // experts_per_rank // D
    return torch.where(routing.slot >= 0, machine, torch.full_like(machine, -1))


def dedup_dispatch(x: torch.Tensor, routing: Routing, num_experts: int, layout: tuple[int, int],
                   rank: int, chunks: int | None = CHUNKS) -> tuple[torch.Tensor, list[int], DedupState]:
    """Stages A and B: returns this rank's experts' rows (expert by expert, each sorted by
    source rank then slot, as the flat dispatch hands them), the rows per local expert, and
    the state :func:`dedup_combine` needs. The world's ranks, machine-major.

    ``chunks``: the rows stream (:mod:`.dedup_stream`): the small parts first, then the
    rows across in ``chunks`` pieces per peer, each forwarded inside as soon as it has
    arrived. ``None``, or tensors on a GPU: stage after stage, each one all-to-all."""
    if chunks is not None and chunks < 1:
        raise ValueError(f"dedup_dispatch: chunks must be at least 1 (or None), got {chunks}")
    D, M = layout
    p = D * M
    El = num_experts // p
    m, i = divmod(rank, D)
    k = routing.expert.shape[1]
    T = x.shape[0]
    where = machines_needed(routing, El, D)                                   # [T, k]
    # A. one row per (token, machine it needs), to local rank i of that machine
    picks, send_a = [], [0] * p
    for mm in range(M):
        tokens = torch.nonzero((where == mm).any(1)).squeeze(1)
        picks.append(tokens)
        send_a[mm * D + i] = tokens.numel()
    dev = x.device
    sent = torch.cat(picks)
    machine_of_row = torch.repeat_interleave(torch.arange(M, device=dev),
                                             torch.tensor([t.numel() for t in picks], device=dev))
    on_it = where.index_select(0, sent) == machine_of_row.unsqueeze(1)        # [N, k]: choices on that machine
    meta = torch.cat([torch.where(on_it, routing.expert.index_select(0, sent), -1),
                      torch.where(on_it, routing.slot.index_select(0, sent), -1)], dim=1)
    gates = routing.gate.index_select(0, sent) * on_it
    rails = [mm * D + i for mm in range(M)]
    pack = _packable(x.dtype) and T * k < 1 << 24 and num_experts * p < 1 << 24
    with trace.label("dedup A: the counts"):
        recv_a = _counts_with(rails, send_a, rank, p)
    H = x.shape[1]
    if chunks is not None and not x.is_cuda:
        return _streamed(x, routing, (D, M), rank, chunks, (sent, picks, send_a, recv_a, meta, gates), pack, El)
    with trace.label("dedup A: across, one row per machine"):
        parts = [x.index_select(0, sent), gates.to(x.dtype)] + ([meta.to(x.dtype)] if pack else [])
        rows_a = all_to_all_autograd(torch.cat(parts, dim=1), recv_a, send_a)
        meta_a = rows_a[:, H + k:].detach().to(torch.int64) if pack else _plain_all_to_all(meta, recv_a, send_a)
    # B. inside: a copy per choice on this machine, to its expert's rank, with its sort key
    row, choice, dest, key = _copies_by_destination(meta_a, recv_a, p, k, El)
    send_b = torch.bincount(dest, minlength=p).tolist()
    with trace.label("dedup B: the counts"):
        recv_b = _counts_with(list(range(m * D, (m + 1) * D)), send_b, rank, p)
    with trace.label("dedup B: forward inside"):
        copies = rows_a[:, :H].index_select(0, row)
        if pack:                          # the key's two halves, each below 2^24, ride as two columns
            halves = torch.stack([key >> SLOT_BITS, key & ((1 << SLOT_BITS) - 1)], dim=1).to(x.dtype)
            rows_b = all_to_all_autograd(torch.cat([copies, halves], dim=1), recv_b, send_b)
            got = rows_b[:, H:].detach().to(torch.int64)
            keys_b = got[:, 0] << SLOT_BITS | got[:, 1]
            rows_b = rows_b[:, :H]
        else:
            rows_b = all_to_all_autograd(copies, recv_b, send_b)
            keys_b = _plain_all_to_all(key, recv_b, send_b)
    order = torch.argsort(keys_b)
    counts = torch.bincount(keys_b >> SLOT_BITS, minlength=El * p).view(El, p).sum(1).tolist()
    state = DedupState(sent, (send_a, recv_a), row, rows_a[:, H:H + k][row, choice], (send_b, recv_b), order, T,
                       rows_a.shape[0])
    return rows_b.index_select(0, order), counts, state


def _streamed(x, routing, layout, rank, chunks, a, pack, El):
    """The streamed dispatch: gates, experts and slots across and the copies' keys and gates
    inside first (small), then the rows (:func:`.dedup_stream.dispatch_rows`)."""
    D, M = layout
    p, (m, i), k, dev = D * M, divmod(rank, D), routing.expert.shape[1], x.device
    sent, picks, send_a, recv_a, meta, gates = a
    with trace.label("dedup A: gates, experts and slots across"):
        if pack:
            head = all_to_all_autograd(torch.cat([gates.to(x.dtype), meta.to(x.dtype)], dim=1), recv_a, send_a)
            gates_a, meta_a = head[:, :k], head[:, k:].detach().to(torch.int64)
        else:
            gates_a = all_to_all_autograd(gates.to(x.dtype), recv_a, send_a)
            meta_a = _plain_all_to_all(meta, recv_a, send_a)
    row, choice, dest, key = _copies_by_destination(meta_a, recv_a, p, k, El)
    recv_m = [recv_a[mm * D + i] for mm in range(M)]
    bounds = torch.tensor([a for a, _ in segment_rows(m, recv_m, chunks)], device=dev)
    S = bounds.numel()
    seg = torch.searchsorted(bounds, row, right=True) - 1
    send_b = torch.bincount((dest - m * D) * S + seg, minlength=D * S)
    inside = [S if q // D == m else 0 for q in range(p)]
    with trace.label("dedup B: the counts, per segment"):
        recv_b = _plain_all_to_all(send_b, inside, inside).view(D, S).tolist()
    send_b = send_b.view(D, S).tolist()
    per_b = [sum(send_b[q - m * D]) if q // D == m else 0 for q in range(p)]
    got_b = [sum(recv_b[q - m * D]) if q // D == m else 0 for q in range(p)]
    gate_b = gates_a[row, choice].unsqueeze(1)
    with trace.label("dedup B: keys and gates inside"):
        if pack:                          # the key's two halves, each below 2^24, ride as two columns
            halves = torch.stack([key >> SLOT_BITS, key & ((1 << SLOT_BITS) - 1)], dim=1).to(x.dtype)
            head_b = all_to_all_autograd(torch.cat([gate_b, halves], dim=1), got_b, per_b)
            both = head_b[:, 1:].detach().to(torch.int64)
            keys_b, gate_got = both[:, 0] << SLOT_BITS | both[:, 1], head_b[:, 0]
        else:
            gate_got = all_to_all_autograd(gate_b, got_b, per_b)[:, 0]
            keys_b = _plain_all_to_all(key, got_b, per_b)
    order = torch.argsort(keys_b)
    counts = torch.bincount(keys_b >> SLOT_BITS, minlength=El * p).view(El, p).sum(1).tolist()
    plan = StreamPlan(D, M, rank, chunks, x.shape[0], sent, [t.numel() for t in picks], recv_m, row,
                      send_b, recv_b, order)
    state = DedupState(sent, (send_a, recv_a), row, gate_got.index_select(0, order), (per_b, got_b), order,
                       x.shape[0], plan.rows_a, plan)
    return StreamRows.apply(x, plan, True), counts, state


def dedup_combine(y: torch.Tensor, state: DedupState) -> torch.Tensor:
    """Stages B' and A': the experts' outputs (in the batch order :func:`dedup_dispatch`
    returned) back to their forwarders, summed there per token with their gates, and
    one row per (token, machine) back across, added up at the source. Returns [T, H]."""
    if state.stream is not None:          # the gates applied where the outputs are, then summed on the way back
        return StreamRows.apply(y * state.copy_gate.unsqueeze(1), state.stream, False)
    send_b, recv_b = state.splits_b
    send_a, recv_a = state.splits_a
    unsorted = y.index_select(0, torch.argsort(state.order))
    with trace.label("dedup B': back inside"):
        back_b = all_to_all_autograd(unsorted, send_b, recv_b)
    weighted = back_b * state.copy_gate.unsqueeze(1)
    partial = weighted.new_zeros((state.received_a, y.shape[1])).index_add(0, state.copies, weighted)
    with trace.label("dedup A': back across, one row per machine"):
        back_a = all_to_all_autograd(partial, send_a, recv_a)
    return back_a.new_zeros((state.tokens, y.shape[1])).index_add(0, state.sent_a, back_a)
