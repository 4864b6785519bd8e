"""The ring's messages, right count, right sizes, right neighbour -- carrying zeros."""

import torch
import torch.distributed as dist

from collectives import ops


def ring_of_zeros(tensor, group=None, pieces=1, overlap=False):
    """2(p - 1) steps of the ring, each chunk in ``pieces`` messages of zeros.

    ``overlap``: post every step's messages before waiting on any, so that a piece of a step
    leaves before the previous step has arrived (what the pipelining test times).
    """
    rank, p = ops.group_rank_and_size(group)
    if p == 1:
        return
    right, left = ops.global_rank(group, (rank + 1) % p), ops.global_rank(group, (rank - 1) % p)
    bounds = ops.chunk_bounds(tensor.numel(), p)
    works = []
    for step in range(2 * (p - 1)):
        out_chunk, in_chunk = (rank - 1 - step) % p, (rank - 2 - step) % p
        out_n = bounds[out_chunk][1] - bounds[out_chunk][0]
        in_n = bounds[in_chunk][1] - bounds[in_chunk][0]
        k = max(1, min(pieces, out_n, in_n)) if pieces > 1 else 1
        for (olo, ohi), (ilo, ihi) in zip(ops.chunk_bounds(out_n, k), ops.chunk_bounds(in_n, k)):
            works.append(dist.irecv(torch.zeros(ihi - ilo, dtype=tensor.dtype), left, group=group))
            works.append(dist.isend(torch.zeros(ohi - olo, dtype=tensor.dtype), right, group=group))
        if not overlap:
            for w in works:
                w.wait()
            works = []
    for w in works:
        w.wait()
