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
forwarders at once, and a forwarder sums each chunk over its machine's experts and sends
it across the moment its last term has arrived, while the next chunk's terms still come
in; the own machine's rows, which cross nothing, are summed last.

Every message is posted as soon as its buffer is known, receives before sends (gloo
moves bytes once the receiver has posted), and every received row lands straight in its
place: the only copies are a gather per outgoing message and the final sort into the
experts' batch. Messages between two ranks follow one order on both sides, so gloo
matches them first to first.

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
    sent: torch.Tensor            # the token of each row sent across, by destination machine
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
    rows_a = x.new_empty((plan.rows_a, H))
    got = x.new_empty((plan.order.numel(), H))
    crossing = [s for s, (mm, _) in enumerate(plan.segs) if mm != plan.machine]
    with trace.label("dedup: rows across, chunk by chunk"):
        arrived = {s: dist.irecv(_rows(rows_a, plan.seg_rows[s]), plan.peer(plan.segs[s][0]))
                   for s in _by_chunk(plan, crossing) if plan.seg_rows[s][1] > plan.seg_rows[s][0]}
        out_a, sends, keep = [], [], []
        for mm in range(plan.M):
            if mm != plan.machine and plan.send_a[mm]:
                lo = sum(plan.send_a[:mm])
                out_a.append((mm, x.index_select(0, plan.sent[lo:lo + plan.send_a[mm]]), lo))
        for c in range(plan.chunks):
            for mm, buf, lo in out_a:
                a, b = plan.sent_rows[_seg_index(plan, mm, c)]
                if b > a:
                    sends.append(dist.isend(buf[a - lo:b - lo], plan.peer(mm)))
    own = plan.seg_rows[plan.segs.index((plan.machine, 0))]
    lo = sum(plan.send_a[:plan.machine])
    torch.index_select(x, 0, plan.sent[lo:lo + plan.send_a[plan.machine]], out=_rows(rows_a, own))
    with trace.label("dedup: forward inside"):
        incoming = []
        for j in range(plan.D):                        # every forwarder's copies, in its order
            if j != me:
                for s in dispatch_order(plan.machine, plan.M, plan.chunks):
                    at = plan.recv_at[j][s]
                    if at[1] > at[0]:
                        incoming.append(dist.irecv(_rows(got, at), base + j))
        for s in dispatch_order(plan.machine, plan.M, plan.chunks):
            if s in arrived:
                arrived[s].wait()
            for j in range(plan.D):
                at = plan.copy_at[j][s]
                if at[1] == at[0]:
                    continue
                if j == me:
                    torch.index_select(rows_a, 0, _rows(plan.copies, at), out=_rows(got, plan.recv_at[me][s]))
                else:
                    buf = rows_a.index_select(0, _rows(plan.copies, at))
                    sends.append(dist.isend(buf, base + j))
                    keep.append(buf)                   # alive until sent
        for work in incoming + sends:
            work.wait()
    return got.index_select(0, plan.order)


def combine_rows(plan: StreamPlan, z: torch.Tensor) -> torch.Tensor:
    """z [the experts' batch, H] -> [tokens, H]: each row summed over its copies, machine
    by machine, then over its machines."""
    H, me, base = z.shape[1], plan.local, plan.machine * plan.D
    lay = z.new_empty((plan.order.numel(), H)).index_copy_(0, plan.order, z.contiguous())   # the received order
    back = z.new_empty((plan.copies.numel(), H))
    back_a = z.new_empty((plan.sent.numel(), H))
    later = combine_order(plan.machine, plan.M, plan.chunks)
    with trace.label("dedup: back inside, then across chunk by chunk"):
        arrived = {}
        for j in range(plan.D):
            if j != me:
                for s in later:
                    at = plan.copy_at[j][s]
                    if at[1] > at[0]:
                        arrived[j, s] = dist.irecv(_rows(back, at), base + j)
        crossing = {}
        for s in later:
            mm, c = plan.segs[s]
            if mm != plan.machine:
                a, b = plan.sent_rows[_seg_index(plan, mm, c)]
                if b > a:
                    crossing[s] = dist.irecv(back_a[a:b], plan.peer(mm))
        sends = []
        for j in range(plan.D):
            if j != me:
                for s in later:
                    at = plan.recv_at[j][s]
                    if at[1] > at[0]:
                        sends.append(dist.isend(_rows(lay, at), base + j))
        partial = z.new_zeros((plan.rows_a, H))
        for s in later:
            for j in range(plan.D):
                at = plan.copy_at[j][s]
                if at[1] == at[0]:
                    continue
                if j == me:
                    terms = _rows(lay, plan.recv_at[me][s])
                else:
                    arrived[j, s].wait()
                    terms = _rows(back, at)
                partial.index_add_(0, _rows(plan.copies, at), terms)
            mm, c = plan.segs[s]
            rows = _rows(partial, plan.seg_rows[s])
            if mm != plan.machine:
                if rows.numel():
                    sends.append(dist.isend(rows, plan.peer(mm)))
            else:
                _rows(back_a, plan.sent_rows[s]).copy_(rows)
        for work in list(crossing.values()) + sends:
            work.wait()
    return z.new_zeros((plan.tokens, H)).index_add_(0, plan.sent, back_a)


def _seg_index(plan: StreamPlan, mm: int, c: int) -> int:
    return plan.segs.index((mm, c))


def _by_chunk(plan: StreamPlan, segs: list[int]) -> list[int]:
    return sorted(segs, key=lambda s: (plan.segs[s][1], plan.segs[s][0]))


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
