"""Moving the kept pairs by all-gather, after SINGA's ``valSparsAllReduce``.

Every rank has chosen some (index, value) pairs. The plainest way to sum them everywhere:
every rank gathers every rank's pairs and adds them into a zeroed tensor::

    rank 0: (3, a) (9, b)          all-gather           every rank:  zeros(n)
    rank 1: (3, c)          ------------------------>   [3] += a, [9] += b,
    rank 2: (1, d) (9, e)   pairs of all p ranks         [3] += c, [1] += d, [9] += e

Cost per rank: (p−1)·k·(4+e) bytes (int32 index + e-byte value per pair), against the dense
ring's 2(p−1)/p·n·e: fewer bytes only while k/n < 2e/(p(4+e)), i.e. 1/p for float32. Past
that density the all-gather loses, and loses more the larger p: see :mod:`.split`.

Two modes, as in SINGA:

* **threshold** -- each rank keeps what it likes, so counts differ. ``all_gather`` needs
  equal sizes: every rank first all-gathers its count (the one host synchronisation: the
  CPU must know the largest count to size the buffer), then pads its pairs to the largest.
* **top-k** -- k = ⌈density·n⌉ on every rank: no count exchange, no padding, and on a GPU
  nothing waits for the host.

SINGA's trick, kept: indices and values travel in **one buffer, one collective**. SINGA
copies its int32 indices bit for bit into the float send buffer (``k`` "floats" of index,
then ``k`` floats of value) and all-gathers ``2·max_nnz`` floats. We do the same through a
byte view (``tensor.view(torch.uint8)``), which works for every value dtype: a float16
pair is 6 bytes, not 8. SINGA's indices are 1-based so that 0 can mark a dropped element
while it compacts its arrays in place; ``nonzero``/``topk`` hand us the kept indices
directly, so ours are 0-based.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core import trace
from .select import INDEX_DTYPE


def pack_pairs(indices: torch.Tensor, values: torch.Tensor, width: int) -> torch.Tensor:
    """One byte buffer ``[width int32 indices | width values]``, padded with zeros to ``width``.

    The byte view is SINGA's "indices in the value buffer" without its restriction to
    float32: any value dtype travels with its int32 indices in one message.
    """
    count = indices.numel()
    idx = torch.zeros(width, dtype=INDEX_DTYPE, device=values.device)
    val = torch.zeros(width, dtype=values.dtype, device=values.device)
    idx[:count] = indices
    val[:count] = values
    return torch.cat([idx.view(torch.uint8), val.view(torch.uint8)])


def unpack_pairs(buffer: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_pairs` for one rank's bytes: ``(indices int64, values)``."""
    split = width * torch.empty((), dtype=INDEX_DTYPE).element_size()
    return _as(buffer[:split], INDEX_DTYPE).long(), _as(buffer[split:], dtype)


def _as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes seen as ``dtype``; copied first when they do not start at a multiple of its
    size (an odd number of 4-byte indices before 8-byte values, one rank's block after another's)."""
    size = torch.empty((), dtype=dtype).element_size()
    if raw.storage_offset() % size:
        raw = raw.clone()
    return raw.view(dtype)


def exchange_counts(count: int, group=None, device=None) -> list[int]:
    """Every rank's count, on every rank: one all-gather of one int64, read by the host."""
    p = dist.get_world_size(group)
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    every = torch.empty(p, dtype=torch.int64, device=device)
    with trace.label("sparse: counts"):
        dist.all_gather(list(every.chunk(p)), mine, group=group)
    return every.tolist()                   # the host synchronisation of threshold mode


def allgather_sum_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *,
                   counts: list[int] | None = None, group=None) -> torch.Tensor:
    """``out`` <- the sum over ranks of each rank's pairs scattered into zeros; in place.

    ``out`` is 1-D. ``counts``: every rank's number of pairs (threshold mode, from
    :func:`exchange_counts`); ``None`` means top-k mode, every rank sending
    ``indices.numel()`` pairs. Pairs are added in rank order, rank 0 first.
    """
    p = dist.get_world_size(group)
    width = indices.numel() if counts is None else max(counts)
    out.zero_()
    if width == 0:                           # nobody kept anything: the sum is zero
        return out
    send = pack_pairs(indices, values, width)
    gathered = torch.empty(p * send.numel(), dtype=torch.uint8, device=out.device)
    with trace.label("sparse: all-gather pairs"):
        dist.all_gather(list(gathered.chunk(p)), send, group=group)
    return add_gathered_(out, gathered, width, counts)


def add_gathered_(out: torch.Tensor, gathered: torch.Tensor, width: int,
                  counts: list[int] | None = None) -> torch.Tensor:
    """Add every rank's packed pairs (the all-gather's output: p buffers of ``width`` pairs)
    into ``out``, rank 0 first; padding is never added."""
    pair_bytes = torch.empty((), dtype=INDEX_DTYPE).element_size() + out.element_size()
    per_rank = gathered.view(-1, width * pair_bytes)      # one row per rank
    for src in range(per_rank.shape[0]):
        idx, val = unpack_pairs(per_rank[src], width, out.dtype)
        used = width if counts is None else counts[src]
        out.index_add_(0, idx[:used], val[:used])
    return out


# ---- the second step: the all-gather left in flight ------------------------------------------
#
# In training the all-reduce of one bucket can run while backward computes the gradients of
# the next (lesson 6). The plain version above waits for its all-gather; this one starts it
# (``async_op=True``) and returns a future that adds the pairs once they have arrived -- a
# callback chained with ``.then``, as torch's PowerSGD hook chains its steps. Same packing,
# same sums in the same order: the result is bit for bit the plain version's.

def allgather_sum_async(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *,
                        counts: list[int] | None = None, group=None) -> torch.futures.Future:
    """:func:`allgather_sum_` with the all-gather in flight: returns a future of ``out``,
    complete once every rank's pairs have been added into it. ``out`` must not be read
    before then; it is zeroed at once."""
    p = dist.get_world_size(group)
    width = indices.numel() if counts is None else max(counts)
    out.zero_()
    if width == 0:
        done = torch.futures.Future()
        done.set_result(out)
        return done
    send = pack_pairs(indices, values, width)
    gathered = torch.empty(p * send.numel(), dtype=torch.uint8, device=out.device)
    with trace.label("sparse: all-gather pairs"):
        work = dist.all_gather(list(gathered.chunk(p)), send, group=group, async_op=True)
    return work.get_future().then(lambda _: add_gathered_(out, gathered, width, counts))
