"""The tour's row for lesson 1: ``p2p.exchange`` around a ring, checked and timed.

Every rank sends its tensor to the right and receives the left neighbour's, the step every
later lesson repeats. The check is bit for bit on integer data (each rank's tensor holds its
rank and the position), in a ring of every world size the tour runs; the baseline is torch's
own way of posting the same pair, ``dist.batch_isend_irecv``, on the same bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...core import timing, trace
from .. import verify
from ..impl import resolve


def _ring_check(exchange, numel: int, device) -> str:
    """"" when every rank received its left neighbour's tensor exactly, else what went wrong."""
    p, me = dist.get_world_size(), dist.get_rank()
    right, left = (me + 1) % p, (me - 1) % p
    send = torch.arange(numel, dtype=torch.int64, device=device) + me * 1_000_003
    recv = torch.full_like(send, -1)
    exchange(send, recv, right, left)
    want = torch.arange(numel, dtype=torch.int64, device=device) + left * 1_000_003
    if not torch.equal(recv, want):
        wrong = int((recv != want).sum())
        return f"rank {me}: {wrong} of {numel} elements differ from rank {left}'s tensor"
    return ""


def tour_runner(nbytes: int) -> dict:
    """Verify ``exchange`` (odd sizes and the tour's), count its bytes from the trace, and time
    it against ``dist.batch_isend_irecv`` posting the same send and receive."""
    exchange = resolve("collectives.p2p:exchange")
    device = verify.rank_device()
    p, me = dist.get_world_size(), dist.get_rank()
    right, left = (me + 1) % p, (me - 1) % p
    problems = [_ring_check(exchange, n, device) for n in (1, 1001, max(nbytes // 8, 1))]
    detail = next((d for d in problems if d), "")
    flags = torch.tensor([0.0 if detail else 1.0], device=device)      # on the backend's device (NCCL: GPU)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)            # every rank's verdict
    x = torch.randn(max(nbytes // 4, 1), device=device)
    y = torch.empty_like(x)
    with trace.recording() as t:
        exchange(x, y, right, left)
    sent = timing.max_over_ranks(t.bytes_sent())

    def torch_pair():
        ops = [dist.P2POp(dist.irecv, y, left), dist.P2POp(dist.isend, x, right)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    ours = timing.measure(lambda: exchange(x, y, right, left), device=device)
    ref = timing.measure(torch_pair, device=device)
    return dict(verified=bool(flags.item() == 1.0) and not detail,
                detail=detail or ("" if flags.item() == 1.0 else "another rank received wrong data"),
                seconds=timing.median(ours), ref_seconds=timing.median(ref), nbytes=x.numel() * 4,
                bytes_sent=sent, bytes_theory=float(x.numel() * 4) if p > 1 else 0.0,
                baseline="batch_isend_irecv")
