"""A sparse all-reduce that scales with p: sparse reduce-scatter, then all-gather (SparCML).

The all-gather variant hands every rank all p·k pairs: (p−1)·k pairs received per rank,
so its cost grows with p while the dense ring's stays near 2n. The split variant does what
the ring does -- reduce-scatter, then all-gather -- on pairs instead of values::

    index range:   [ piece 0 ][ piece 1 ][ piece 2 ][ piece 3 ]     rank j owns piece j

    1. scatter     each rank sends the pairs that fall in piece j to rank j
                   (one all-to-all; k/p pairs to each rank on average)
    2. reduce      rank j adds what arrived into its dense piece, zeros first
    3. gather      every rank gathers every reduced piece -- as (index, value) pairs while
                   that is smaller, as the dense piece once it fills up (densification)

Bytes per rank, pairs of 4+e bytes, u distinct indices in the fullest piece:

    (p−1)/p·k·(4+e)   +   (p−1)·min(u·(4+e), n/p·e)
         scatter                 gather

At low density u ≈ k and this is the all-gather variant's (p−1)·k·(4+e) plus the scatter:
slightly worse. Above density ≈ 1/p the pieces fill, the gather becomes the dense ring's
all-gather half, (p−1)/p·n·e, and split wins; it stays ahead of the dense ring until
k·(4+e) ≈ n·e (density 1/2 for float32). SparCML (Renggli et al., 2019) switches
per piece, on the fly; here the switch is one global decision per call, taken from the
largest piece, so that every rank gathers buffers of one size.

Two small exchanges precede the big ones (how many pairs go to each rank; how many each
reduced piece holds): the host must know them to size buffers, so this variant, like
threshold mode, synchronises with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core import ops, trace

from .allgather import exchange_counts, pack_pairs, unpack_pairs
from .select import INDEX_DTYPE


@dataclass
class SplitInfo:
    """What one split all-reduce did on this rank (for tests, the lab and the trace)."""

    sent: list[int]          # pairs this rank sent to each rank (its own piece: kept here)
    received: list[int]      # pairs it received from each rank
    union: list[int]         # distinct indices in each rank's reduced piece
    densified: bool          # the gather moved dense pieces instead of pairs


def piece_bounds(numel: int, p: int) -> list[tuple[int, int]]:
    """Rank j owns indices ``[start_j, end_j)``: the ring's chunks, sizes differing by one."""
    return ops.chunk_bounds(numel, p)


def split_sum_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, group=None,
               densify: bool = True) -> SplitInfo:
    """``out`` <- the sum over ranks of each rank's pairs, via a sparse reduce-scatter and an
    all-gather of the reduced pieces. ``out`` is 1-D; ``indices`` int64 in any order."""
    r, p = ops.group_rank_and_size(group)
    device, dtype = out.device, out.dtype
    pair_bytes = torch.empty((), dtype=INDEX_DTYPE).element_size() + out.element_size()
    bounds = piece_bounds(out.numel(), p)

    # ---- 1. scatter: sort by index, cut at the piece boundaries, all-to-all ------------
    order = torch.argsort(indices)
    idx, val = indices[order], values[order]
    starts = torch.tensor([lo for lo, _ in bounds] + [out.numel()], dtype=idx.dtype, device=device)
    offsets = torch.searchsorted(idx, starts)             # pairs for rank j: offsets[j]:offsets[j+1]
    to_each = offsets.diff()
    to_others = to_each.clone()
    to_others[r] = 0                                       # our own piece never leaves the rank
    from_each = torch.empty_like(to_others)
    with trace.label("sparse split: counts"):
        dist.all_to_all_single(from_each, to_others, group=group)
    sent, received = to_others.tolist(), from_each.tolist()     # host synchronisation
    first = offsets.tolist()
    parts = [pack_pairs(idx[first[j]:first[j + 1]], val[first[j]:first[j + 1]], sent[j])
             for j in range(p) if j != r and sent[j]]
    send_buf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    recv_buf = torch.empty(sum(received) * pair_bytes, dtype=torch.uint8, device=device)
    with trace.label("sparse split: scatter pairs"):
        dist.all_to_all_single(recv_buf, send_buf, [c * pair_bytes for c in received],
                               [c * pair_bytes for c in sent], group=group)

    # ---- 2. reduce: add every rank's pairs for our piece, in rank order ------------------
    lo, hi = bounds[r]
    piece = torch.zeros(hi - lo, dtype=dtype, device=device)
    touched = torch.zeros(hi - lo, dtype=torch.bool, device=device)
    at = 0
    for src in range(p):
        if src == r:
            ids, vals = idx[first[r]:first[r + 1]], val[first[r]:first[r + 1]]
        else:
            size = received[src] * pair_bytes
            ids, vals = unpack_pairs(recv_buf[at:at + size], received[src], dtype)
            at += size
        piece.index_add_(0, ids - lo, vals)
        touched[ids - lo] = True

    # ---- 3. gather the reduced pieces: pairs, or dense once a piece fills ----------------
    union = exchange_counts(int(touched.sum()), group, device)      # host synchronisation
    longest = max(b - a for a, b in bounds)
    densified = densify and max(union) * pair_bytes >= longest * out.element_size()
    if densified:
        mine = torch.zeros(longest, dtype=dtype, device=device)
        mine[:hi - lo] = piece
        every = torch.empty(p * longest, dtype=dtype, device=device)
        with trace.label("sparse split: gather dense pieces"):
            dist.all_gather(list(every.chunk(p)), mine, group=group)
        for src, (a, b) in enumerate(bounds):
            out[a:b] = every[src * longest:src * longest + (b - a)]
    else:
        width = max(union)
        kept = torch.nonzero(touched).view(-1)
        mine = pack_pairs(kept + lo, piece[kept], width)
        every = torch.empty(p * mine.numel(), dtype=torch.uint8, device=device)
        out.zero_()
        if width:
            with trace.label("sparse split: gather reduced pairs"):
                dist.all_gather(list(every.chunk(p)), mine, group=group)
            per_rank = every.view(p, mine.numel())
            for src in range(p):
                ids, vals = unpack_pairs(per_rank[src], width, dtype)
                out[ids[:union[src]]] = vals[:union[src]]     # pieces are disjoint: a copy
    return SplitInfo(sent, received, union, densified)
