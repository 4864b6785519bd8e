"""The deduplicated dispatch's rows, streamed: forwarded inside while the rest still crosses.

:mod:`.dedup` decides what goes where -- one row per (token, machine) across to the rail
peer, a copy per expert choice inside -- and exchanges the small parts first: the counts,
the gates, the experts and slots. What is left is the bulk, the rows themselves, and it
moves here without waiting stage for stage. Each rank forwards:

* first its own machine's rows (its own tokens, which need no crossing), while the first
  rows from the other machines are still on the link;
* then, chunk by chunk, the rows arriving across: chunk c is forwarded inside as soon as
  it has arrived, while chunk c + 1 crosses.

The combine runs the same schedule backwards: the experts' outputs go back to their
forwarders chunk by chunk, the crossing chunks first, and a forwarder sums each chunk over
its machine's experts and sends it across the moment its last term has arrived, while the
next chunk's terms still come in; the own machine's rows, which cross nothing, are summed
last.

Every receive is posted before anything is sent (gloo moves bytes once the receiver has
posted), and every received row lands straight in a buffer of its own: the only copies
are a gather per outgoing message and, a step after each arrival, the sort of those rows
into the experts' batch (or, coming back, their sum into the tokens). Messages between
two ranks follow one order on both sides, so gloo matches them first to first.

The two directions are each other's transpose -- the dispatch gathers copies, the
combine adds them up -- so each is the other's backward (:class:`StreamRows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core import ops, trace

__all__ = ["StreamPlan", "segments", "segment_rows", "dispatch_rows", "combine_rows", "StreamRows"]


def segments(machine: int, M: int, chunks: int) -> list[tuple[int, int]]:
    """A forwarder's row segments, in its rows' order: (source machine, chunk); the own
    machine's rows are one segment, every other machine's ``chunks``."""
    return [(mm, c) for mm in range(M) for c in (range(1) if mm == machine else range(chunks))]


def segment_rows(machine: int, counts: list[int], chunks: int) -> list[tuple[int, int]]:
    """(start, end) of each segment in a forwarder's rows, ``counts[mm]`` rows from machine mm."""
    out, at = [], 0
    for mm, n in enumerate(counts):
        parts = [(0, n)] if mm == machine else ops.chunk_bounds(n, chunks)
        out += [(at + a, at + b) for a, b in parts]
        at += n
    return out


def dispatch_order(machine: int, M: int, chunks: int) -> list[int]:
    """The order a forwarder on ``machine`` handles its segments going out: the own
    machine's first (nothing to wait for), then chunk by chunk as they arrive."""
    segs = segments(machine, M, chunks)
    own = [s for s, (mm, _) in enumerate(segs) if mm == machine]
    return own + sorted((s for s, (mm, _) in enumerate(segs) if mm != machine), key=lambda s: (segs[s][1], segs[s][0]))


def combine_order(machine: int, M: int, chunks: int) -> list[int]:
    """Coming back: the chunks that cross first, in the same order, the own machine's last."""
    order = dispatch_order(machine, M, chunks)
    return order[1:] + order[:1]


@dataclass
class StreamPlan:
    """Where every row goes, on this rank (D ranks per machine, M machines, rank (m, i))."""

    D: int
    M: int
    rank: int
    chunks: int
    tokens: int
    sent: torch.Tensor            # the token of each row, by destination machine (the own one too)
    send_a: list[int]             # rows to each machine's rank i (the own machine's: kept here)
    recv_a: list[int]             # rows from each machine's rank i
    copies: torch.Tensor          # the forwarder row of each copy, by destination, then row
    send_b: list[list[int]]       # [local rank][segment]: copies this rank forwards it
    recv_b: list[list[int]]       # [local rank][segment]: copies it forwards this rank
    order: torch.Tensor           # received copies (by forwarder, then its order) -> the experts' batch

    def __post_init__(self):
        self.machine, self.local = divmod(self.rank, self.D)
        self.segs = segments(self.machine, self.M, self.chunks)
        # the forwarder's rows: by source machine, each one's rows cut into its segments
        self.seg_rows = segment_rows(self.machine, self.recv_a, self.chunks)
        self.rows_a = sum(self.recv_a)
        self.sent_rows = segment_rows(self.machine, self.send_a, self.chunks)   # the rows sent, cut the same way
        self.copy_at = _offsets(self.send_b)          # [local rank][segment]: (start, end) in copies
        self.recv_at = _offsets(self.recv_b)          # [local rank][segment]: (start, end) in the received
        self.own = self.segs.index((self.machine, 0))
        self.out_order = dispatch_order(self.machine, self.M, self.chunks)
        self.back_order = combine_order(self.machine, self.M, self.chunks)
        self.crossing = self.out_order[1:]            # chunk by chunk, machine by machine
        self.others = [j for j in range(self.D) if j != self.local]
        # the batch position of each received copy, and the token of each copy of an own row
        self.pos = torch.empty_like(self.order).index_copy_(0, self.order, torch.arange(
            self.order.numel(), device=self.order.device))
        own_rows, own_sent = self.seg_rows[self.own], self.sent_rows[self.own]
        own = (self.copies >= own_rows[0]) & (self.copies < own_rows[1])
        at = (self.copies - own_rows[0] + own_sent[0]).clamp(0, max(self.sent.numel() - 1, 0))
        self.copy_token = torch.where(own, self.sent[at], -1) if self.sent.numel() else torch.full_like(self.copies, -1)

    def peer(self, machine: int) -> int:
        return machine * self.D + self.local


def _offsets(counts: list[list[int]]) -> list[list[tuple[int, int]]]:
    out, at = [], 0
    for row in counts:
        out.append([])
        for n in row:
            out[-1].append((at, at + n))
            at += n
    return out


def _rows(t: torch.Tensor, at: tuple[int, int]) -> torch.Tensor:
    return t[at[0]:at[1]]


def dispatch_rows(plan: StreamPlan, x: torch.Tensor) -> torch.Tensor:
    """x [tokens, H] -> this rank's experts' batch [copies received, H]."""
    H, me, base = x.shape[1], plan.local, plan.machine * plan.D
    x = x.contiguous()
    rows_a = x.new_empty((plan.rows_a, H))            # the rows that crossed to this forwarder
    got = x.new_empty((plan.order.numel(), H))         # the other forwarders' copies, as they come
    batch = torch.empty_like(got)
    keep, sends, arrived, incoming = [], [], {}, {}
    with trace.label("dedup: rows across, chunk by chunk"):
        for s in plan.crossing:
            if _size(plan.seg_rows[s]):
                arrived[s] = dist.irecv(_rows(rows_a, plan.seg_rows[s]), plan.peer(plan.segs[s][0]))
        for s in plan.out_order:
            for j in plan.others:
                if _size(plan.recv_at[j][s]):
                    incoming.setdefault(s, []).append(
                        (plan.recv_at[j][s], dist.irecv(_rows(got, plan.recv_at[j][s]), base + j)))
        for s in plan.crossing:                        # this rank's rows, gathered and sent a chunk at a time
            if _size(plan.sent_rows[s]):
                keep.append(x.index_select(0, _rows(plan.sent, plan.sent_rows[s])))
                sends.append(dist.isend(keep[-1], plan.peer(plan.segs[s][0])))
    with trace.label("dedup: forward inside"):
        for step, s in enumerate(plan.out_order):       # own rows first: they need no crossing
            if s in arrived:
                arrived[s].wait()
            for j in range(plan.D):
                at = plan.copy_at[j][s]
                if not _size(at):
                    continue
                rows = x.index_select(0, _rows(plan.copy_token, at)) if s == plan.own else \
                    rows_a.index_select(0, _rows(plan.copies, at))
                if j == me:
                    batch.index_copy_(0, _rows(plan.pos, plan.recv_at[me][s]), rows)
                else:
                    keep.append(rows)
                    sends.append(dist.isend(rows, base + j))
            # the other forwarders' copies of the segment before, which have had a step to come
            _place(incoming.pop(plan.out_order[step - 1], []) if step else [], batch, got, plan.pos)
        for rest in incoming.values():
            _place(rest, batch, got, plan.pos)
        for work in sends:
            work.wait()
    return batch


def _place(incoming, batch, got, pos) -> None:
    """Wait for these copies and sort them into the experts' batch. (A gloo receive says it
    is complete only once waited for: a step behind, the wait rarely waits.)"""
    for at, work in incoming:
        work.wait()
        batch.index_copy_(0, _rows(pos, at), _rows(got, at))


def combine_rows(plan: StreamPlan, z: torch.Tensor) -> torch.Tensor:
    """z [the experts' batch, H] -> [tokens, H]: each row summed over its copies, machine
    by machine, then over its machines."""
    H, me, base = z.shape[1], plan.local, plan.machine * plan.D
    z = z.contiguous()
    back = z.new_empty((plan.copies.numel(), H))       # the terms other ranks' experts send back
    back_a = z.new_empty((plan.sent.numel(), H))        # the sums the other machines send back
    partial = z.new_zeros((plan.rows_a, H))
    out = z.new_zeros((plan.tokens, H))
    keep, sends, terms, sums = [], [], {}, {}
    with trace.label("dedup: back inside, then across chunk by chunk"):
        for s in plan.back_order:
            for j in plan.others:
                if _size(plan.copy_at[j][s]):
                    terms[j, s] = dist.irecv(_rows(back, plan.copy_at[j][s]), base + j)
            if s in plan.crossing and _size(plan.sent_rows[s]):
                sums[s] = (plan.sent_rows[s], dist.irecv(_rows(back_a, plan.sent_rows[s]), plan.peer(plan.segs[s][0])))
        for step, s in enumerate(plan.back_order):     # crossing chunks first, the own rows last
            for j in plan.others:                      # this rank's experts' terms for s, to their forwarders
                if _size(plan.recv_at[j][s]):
                    keep.append(z.index_select(0, _rows(plan.pos, plan.recv_at[j][s])))
                    sends.append(dist.isend(keep[-1], base + j))
            for j in range(plan.D):                    # the forwarder's sum over its machine's experts
                at = plan.copy_at[j][s]
                if not _size(at):
                    continue
                if j == me:
                    part = z.index_select(0, _rows(plan.pos, plan.recv_at[me][s]))
                else:
                    terms[j, s].wait()
                    part = _rows(back, at)
                partial.index_add_(0, _rows(plan.copies, at), part)
            rows = _rows(partial, plan.seg_rows[s])
            if s == plan.own:
                out.index_add_(0, _rows(plan.sent, plan.sent_rows[s]), rows)
            elif rows.numel():
                sends.append(dist.isend(rows, plan.peer(plan.segs[s][0])))
            if step and plan.back_order[step - 1] in sums:     # the other machines' sums, a step behind
                _add(sums.pop(plan.back_order[step - 1]), out, back_a, plan.sent)
        for one in sums.values():
            _add(one, out, back_a, plan.sent)
        for work in sends:
            work.wait()
    return out


def _add(one, out, back_a, sent) -> None:
    """Wait for one machine's sums of one chunk and add them into their tokens."""
    at, work = one
    work.wait()
    out.index_add_(0, _rows(sent, at), _rows(back_a, at))


def _size(at: tuple[int, int]) -> int:
    return at[1] - at[0]


class StreamRows(torch.autograd.Function):
    """``dispatch_rows`` forward, ``combine_rows`` backward (or the other way round)."""

    @staticmethod
    def forward(ctx, t, plan, dispatch: bool):
        ctx.plan, ctx.dispatch = plan, dispatch
        return dispatch_rows(plan, t) if dispatch else combine_rows(plan, t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        return (combine_rows(ctx.plan, grad) if ctx.dispatch else dispatch_rows(ctx.plan, grad)), None, None
