"""A sparse all-reduce that scales with p: sparse reduce-scatter, then all-gather (SparCML).

The all-gather transport hands every rank all p·k pairs: (p−1)·k pairs received per rank,
so its cost grows with p while the dense ring's stays near 2n. The split transport does what
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

At low density u ≈ k and this is the all-gather transport's (p−1)·k·(4+e) plus the scatter:
slightly worse. Above density ≈ 1/p the pieces fill, the gather becomes the dense ring's
all-gather half, (p−1)/p·n·e, and split wins; it stays ahead of the dense ring until
k·(4+e) ≈ n·e (density 1/2 for float32). SparCML (Renggli et al., 2019) switches
per piece, on the fly; here the switch is one global decision per call, taken from the
largest piece, so that every rank gathers buffers of one size.

Two small exchanges precede the big ones (how many pairs go to each rank, with the tensor's
length; how many each reduced piece holds): the host must know them to size buffers, so
this transport, like threshold mode, synchronises with the host -- and so it cannot be
left in flight as the all-gather can (gloo's point-to-point messages have no futures to
chain): :func:`collectives.sparse.sparse_all_reduce_async` runs it to the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core import ops, trace
from ..ring import ring_all_gather
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


def balanced_bounds(indices: torch.Tensor, numel: int, group=None, bins: int = 4096) -> list[tuple[int, int]]:
    """Ok-Topk's balanced partition (Li and Hoefler, PPoPP 2022): piece boundaries that give
    every owner about as many pairs, wherever the selected indices crowd.

    Equal index ranges suit indices spread evenly. A gradient's large entries are not: they
    gather in some layers (the last ones, the biases) and are the same entries on every rank,
    so one owner receives most of the pairs and the others wait for it. Each rank counts its
    indices in ``bins`` equal bins, one all-reduce sums the counts, and the range is cut where
    the running total passes j/p of all pairs. Ok-Topk recomputes the cuts only every few
    steps; the pairs' places change slowly, and the all-reduce of the counts then costs little.
    """
    p = dist.get_world_size(group)
    bins = max(1, min(bins, numel))
    width = -(-numel // bins)
    counts = torch.bincount(torch.div(indices, width, rounding_mode="floor"), minlength=bins).to(torch.int64)
    with trace.label("sparse split: balance counts"):
        dist.all_reduce(counts, group=group)
    running = counts.cumsum(0)
    total = int(running[-1])
    cuts = [0]
    for j in range(1, p):
        b = int(torch.searchsorted(running, -(-total * j // p)))     # first bin reaching j/p of all
        cuts.append(min(numel, max(cuts[-1], (b + 1) * width)))
    cuts.append(numel)
    return list(zip(cuts, cuts[1:]))


def split_sum_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, group=None,
               densify: bool = True, bounds: list[tuple[int, int]] | None = None) -> SplitInfo:
    """``out`` <- the sum over ranks of each rank's pairs, via a sparse reduce-scatter and an
    all-gather of the reduced pieces. ``out`` is 1-D; its contents are not read (it is the
    result's memory); ``indices`` int64, ascending or not (the selection hands them over
    ascending, which saves a sort). ``bounds``: the pieces, the same on every rank (default:
    equal index ranges; :func:`balanced_bounds` for Ok-Topk's)."""
    r, p = ops.group_rank_and_size(group)
    members = [ops.global_rank(group, j) for j in range(p)]
    device, dtype = out.device, out.dtype
    pair_bytes = torch.empty((), dtype=INDEX_DTYPE).element_size() + out.element_size()
    equal = piece_bounds(out.numel(), p)
    bounds = equal if bounds is None else [tuple(b) for b in bounds]

    # ---- 1. scatter: cut the (sorted) pairs at the piece boundaries, one message per owner --
    if indices.numel() > 1 and not bool((indices[1:] >= indices[:-1]).all()):
        order = torch.argsort(indices)
        indices, values = indices[order], values[order]
    starts = torch.tensor([lo for lo, _ in bounds] + [out.numel()], dtype=indices.dtype, device=device)
    first = torch.searchsorted(indices, starts).tolist()    # pairs for rank j: first[j]:first[j+1]
    # Each peer gets (how many pairs come, how long my tensor is): the second number costs 8
    # bytes and turns ranks that pass different sizes -- whose pieces would not line up --
    # into an error on every rank, before any pair moves, check mode or not.
    header = torch.tensor([[first[j + 1] - first[j] if j != r else 0, out.numel()] for j in range(p)],
                          dtype=torch.int64, device=device)   # our own piece never leaves
    from_each = torch.empty_like(header)
    with trace.label("sparse split: counts"):
        dist.all_to_all_single(from_each, header, group=group)
    sent, received = header[:, 0].tolist(), from_each[:, 0].tolist()     # host synchronisation
    sizes = from_each[:, 1].tolist()
    if len(set(sizes)) > 1:
        listed = ", ".join(f"rank {members[j]}: {sizes[j]}" for j in range(p))
        raise ValueError(f"split_sum_: the ranks passed tensors of different sizes ({listed} elements); "
                         "every rank of the group must pass the same number of elements")
    others = [j for j in range(p) if j != r]
    outgoing = {j: pack_pairs(indices[first[j]:first[j + 1]], values[first[j]:first[j + 1]], sent[j])
                for j in others}
    incoming = {j: torch.empty(received[j] * pair_bytes, dtype=torch.uint8, device=device) for j in others}
    with trace.label("sparse split: scatter pairs"):
        works = ops.post_exchange(recvs=[(incoming[j], members[j]) for j in others],
                                  sends=[(outgoing[j], members[j]) for j in others], group=group)

    # ---- 2. reduce: add every rank's pairs for our piece into out's own piece ------------
    lo, hi = bounds[r]
    piece = out[lo:hi].zero_()                 # out's own memory: no buffer the size of a piece
    touched = torch.zeros(hi - lo, dtype=torch.bool, device=device)
    mine = indices[first[r]:first[r + 1]] - lo
    piece.index_add_(0, mine, values[first[r]:first[r + 1]])   # ours first: it needs no message
    touched.index_fill_(0, mine, True)
    for work in works:
        work.wait()
    for src in others:                         # then the others', in rank order
        ids, vals = unpack_pairs(incoming[src], received[src], dtype)
        piece.index_add_(0, ids - lo, vals)
        touched.index_fill_(0, ids - lo, True)

    # ---- 3. gather the reduced pieces: pairs, or dense once a piece fills ----------------
    union = exchange_counts(int(torch.count_nonzero(touched)), group, device)   # host synchronisation
    longest = max(b - a for a, b in bounds)
    densified = densify and max(union) * pair_bytes >= longest * out.element_size()
    if densified and bounds == equal:
        # Every piece is dense already, in its place in out: lesson 4's ring all-gather, in place.
        with trace.label("sparse split: gather dense pieces"):
            ring_all_gather(out, piece, group=group)
    elif densified:                            # pieces of other lengths: padded to the longest
        padded = torch.zeros(longest, dtype=dtype, device=device)
        padded[:hi - lo] = piece
        every = torch.empty(p * longest, dtype=dtype, device=device)
        with trace.label("sparse split: gather dense pieces"):
            dist.all_gather(list(every.chunk(p)), padded, group=group)
        for src, (a, b) in enumerate(bounds):
            out[a:b] = every[src * longest:src * longest + b - a]
    else:
        width = max(union)
        kept = torch.nonzero(touched).view(-1)
        mine = pack_pairs(kept + lo, piece.index_select(0, kept), width)
        every = torch.empty(p * mine.numel(), dtype=torch.uint8, device=device)
        out.zero_()
        if width:
            with trace.label("sparse split: gather reduced pairs"):
                dist.all_gather(list(every.chunk(p)), mine, group=group)
            per_rank = every.view(p, mine.numel())
            for src in range(p):
                ids, vals = unpack_pairs(per_rank[src], width, dtype)
                out.index_copy_(0, ids[:union[src]], vals[:union[src]])   # pieces are disjoint
    return SplitInfo(sent, received, union, densified)
