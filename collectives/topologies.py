"""Lesson 4, the ring's rivals: recursive doubling, halving-doubling, and a binary tree.

The ring sends the fewest bytes but needs 2(p − 1) steps one after the other; for small
tensors, where each message costs mostly its latency α, fewer steps win. These three
trade bytes for steps (n bytes on p ranks; L = log2 p for a power of two)::

    algorithm            steps          bytes/rank          wins when
    ring                 2(p − 1)       2(p − 1)/p·n        n is large
    recursive doubling   L              L·n                 n is small
    halving-doubling     2·L            2(p − 1)/p·n        almost always, for a power of two
    binary tree          ≤ 4·⌊log2 p⌋   ≤ 3n                in the model rarely (NCCL pipelines it)

Recursive doubling and halving-doubling pair rank r with r XOR 2^k at step k; both need
a power of two. For other p the standard fix (MPICH's, after Rabenseifner) folds the
extra ranks in first: with p = 2^L + e, each of the first e even ranks hands its tensor
to the odd rank after it and sits out; the remaining 2^L ranks run the algorithm; the
odd ranks hand the result back. It costs two more steps of n bytes. Thakur, Rabenseifner
& Gropp, "Optimization of Collective Communication Operations in MPICH" (2005), is the
reference for all of this.

Every function has ``dist.all_reduce``'s contract (in place, every op and dtype, views,
subgroups) and gives every rank the same bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .core import nccl_memory, ops, trace
from .core.ops import ReduceOp

__all__ = ["recursive_doubling_all_reduce", "halving_doubling_all_reduce", "tree_all_reduce"]


def _exchange(send_buf, recv_buf, peer: int, group) -> None:
    """Send ``send_buf`` to ``peer`` and receive ``recv_buf`` from it, at the same time.

    :func:`collectives.core.ops.sendrecv` posts both (an empty block is not posted at all; on
    NCCL the two go in one group, without which two ranks exchanging would deadlock).
    """
    recv, send = ops.sendrecv(send_buf, peer, recv_buf, peer, group)
    recv.wait()
    send.wait()


class _Fold:
    """Reduce p ranks to the largest power of two 2^L ≤ p, and back.

    With e = p − 2^L extra ranks, ranks 0..2e−1 pair up (0,1), (2,3), ...: the even rank
    sends its tensor to the odd one, which combines it and takes part as virtual rank
    r // 2; the even rank sits out. Ranks 2e.. take part as virtual rank r − e.
    """

    def __init__(self, rank: int, p: int, group):
        self.rank, self.p, self.group = rank, p, group
        self.pof2 = 1 << (p.bit_length() - 1)
        self.extra = p - self.pof2
        if rank < 2 * self.extra:
            self.virtual = None if rank % 2 == 0 else rank // 2
        else:
            self.virtual = rank - self.extra

    def real(self, virtual: int) -> int:
        """The global rank of a virtual rank."""
        group_rank = 2 * virtual + 1 if virtual < self.extra else virtual + self.extra
        return ops.global_rank(self.group, group_rank)

    def fold_in(self, flat, scratch, op) -> None:
        if self.rank >= 2 * self.extra:
            return
        with trace.label("fold in"):
            if self.virtual is None:
                dist.send(flat, ops.global_rank(self.group, self.rank + 1), group=self.group)
            else:
                dist.recv(scratch, ops.global_rank(self.group, self.rank - 1), group=self.group)
                ops.combine_(flat, scratch, op)

    def fold_out(self, flat) -> None:
        if self.rank >= 2 * self.extra:
            return
        with trace.label("fold out"):
            if self.virtual is None:
                dist.recv(flat, ops.global_rank(self.group, self.rank + 1), group=self.group)
            else:
                dist.send(flat, ops.global_rank(self.group, self.rank - 1), group=self.group)


def recursive_doubling_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """All-reduce in log2 p steps: swap whole tensors with the rank 2^k away, combine.

    ::

        p = 4          step 0 (r XOR 1)       step 1 (r XOR 2)
                       0 <-> 1   2 <-> 3      0 <-> 2   1 <-> 3
        rank 0 holds   x0+x1                  x0+x1+x2+x3

    After step k each rank holds the sum over its block of 2^(k+1) ranks; after L steps,
    over all. Both partners combine the same two values (a+b and b+a round the same), so
    every rank ends with the same bits.

    Cost: L·α + L·n·β + L·n·γ (power of two); two more steps of n otherwise.
    """
    if not ops.check_all_reduce_args(tensor, op, group, what="recursive_doubling_all_reduce"):
        return                         # not in the group: nothing to do, as dist.*
    rank, p = ops.group_rank_and_size(group)
    if p == 1 or tensor.numel() == 0:
        return
    flat = ops.work_buffer(tensor)
    arrived = nccl_memory.scratch(flat.numel(), flat.dtype, flat.device, group)
    fold = _Fold(rank, p, group)
    fold.fold_in(flat, arrived, op)
    if fold.virtual is not None:
        distance = 1
        while distance < fold.pof2:
            partner = fold.real(fold.virtual ^ distance)
            with trace.label(f"distance {distance}"):
                _exchange(flat, arrived, partner, group)
            ops.combine_(flat, arrived, op)
            distance *= 2
    fold.fold_out(flat)
    ops.finish_(flat, op, p)
    ops.write_back(tensor, flat)


def halving_doubling_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """Rabenseifner's all-reduce: reduce-scatter by recursive halving, all-gather by doubling.

    The tensor is cut into 2^L blocks. Reduce-scatter: at distance d = 2^(L−1), ..., 2, 1
    each rank keeps half of its current block range, sends the other half to the rank d
    away (r XOR d) and combines the half it keeps with what arrives. After L steps rank r
    owns block r, fully reduced. All-gather: the same partners in reverse order (d = 1,
    2, ..., 2^(L−1)), each sending everything it owns, so owned ranges double::

        p = 4, blocks b0..b3     halving                   doubling
        step, distance           0, d=2      1, d=1        2, d=1       3, d=2
        rank 0 keeps / owns      b0 b1       b0            b0 b1        b0 b1 b2 b3
        rank 0 sends             b2 b3 -> 2  b1 -> 1       b0 -> 1      b0 b1 -> 2

    The bytes of the ring in 2·L steps instead of 2(p − 1): the best of both for all but
    the smallest and largest tensors, and what MPICH uses for long messages.

    Cost: 2L·α + 2(p − 1)/p·n·β + (p − 1)/p·n·γ (power of two); two more steps of n otherwise.
    """
    if not ops.check_all_reduce_args(tensor, op, group, what="halving_doubling_all_reduce"):
        return                         # not in the group: nothing to do, as dist.*
    rank, p = ops.group_rank_and_size(group)
    if p == 1 or tensor.numel() == 0:
        return
    flat = ops.work_buffer(tensor)
    fold = _Fold(rank, p, group)
    blocks = ops.chunk_bounds(flat.numel(), fold.pof2)

    def elements(first: int, last: int) -> slice:
        """The elements of blocks first..last−1."""
        return slice(blocks[first][0], blocks[last - 1][1])

    # Arrivals land in scratch: the whole tensor when folding in, else at most the first half.
    folds_in = fold.virtual is not None and rank < 2 * fold.extra
    scratch = nccl_memory.scratch(flat.numel() if folds_in else blocks[fold.pof2 // 2 - 1][1],
                                  flat.dtype, flat.device, group)
    fold.fold_in(flat, scratch, op)
    if fold.virtual is not None:
        v, first, last = fold.virtual, 0, fold.pof2      # I am responsible for blocks first..last−1
        distance = fold.pof2 // 2
        while distance >= 1:                              # reduce-scatter by halving
            middle = first + distance
            if v & distance:
                keep, give = (middle, last), (first, middle)
            else:
                keep, give = (first, middle), (middle, last)
            kept, given = elements(*keep), elements(*give)
            arrived = scratch[: kept.stop - kept.start]
            with trace.label(f"halving, distance {distance}: {_blocks_name(*give)}"):
                _exchange(flat[given], arrived, fold.real(v ^ distance), group)
            ops.combine_(flat[kept], arrived, op)
            first, last = keep
            distance //= 2
        ops.finish_(flat[elements(v, v + 1)], op, p)      # block v is complete: AVG divides here
        distance = 1
        while distance < fold.pof2:                       # all-gather by doubling
            if v & distance:
                theirs = (first - distance, first)
            else:
                theirs = (last, last + distance)
            with trace.label(f"doubling, distance {distance}: {_blocks_name(first, last)}"):
                _exchange(flat[elements(first, last)], flat[elements(*theirs)],
                          fold.real(v ^ distance), group)
            first, last = min(first, theirs[0]), max(last, theirs[1])
            distance *= 2
    fold.fold_out(flat)
    ops.write_back(tensor, flat)


def _blocks_name(first: int, last: int) -> str:
    """Blocks first..last−1 as a label for step diagrams: "b2" or "b0-b3"."""
    return f"b{first}" if last - first == 1 else f"b{first}-b{last - 1}"


def tree_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """Reduce up a binary tree to rank 0, then broadcast back down the same tree.

    Ranks form a binary heap: rank r's children are 2r + 1 and 2r + 2, its parent
    (r − 1) // 2. Going up, each rank receives its children's partial results (both
    receives posted before either is waited on: on gloo they arrive concurrently; on NCCL,
    which runs a process group's point-to-point operations one after the other, the first
    child's message is taken before the second's), combines them in child order, and
    sends the sum to its parent. Going down, each rank receives the result from its parent and sends it to
    its children::

                 0            reduce: 3 -> 1, then 1 -> 0 and 2 -> 0
               /   \\          broadcast: 0 -> 1 and 0 -> 2, then 1 -> 3
              1     2
             /
            3

    Every message carries the whole tensor, so the tree moves more bytes than the ring
    (an inner rank sends up to 3n) but needs at most 2·⌊log2 p⌋ message times each way.
    NCCL's trees pipeline the tensor in small pieces (and use two trees, each rank a leaf
    in one) to get the ring's bandwidth back; this plain version shows the shape.

    Cost (one message in or out at a time per rank): at most 4·⌊log2 p⌋·(α + n·β);
    ``cost.tree_schedule(p)`` counts the rounds exactly (5 at p = 4).
    """
    if not ops.check_all_reduce_args(tensor, op, group, what="tree_all_reduce"):
        return                         # not in the group: nothing to do, as dist.*
    rank, p = ops.group_rank_and_size(group)
    if p == 1 or tensor.numel() == 0:
        return
    flat = ops.work_buffer(tensor)
    children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < p]
    parent = ops.global_rank(group, (rank - 1) // 2) if rank > 0 else None
    landing = nccl_memory.scratch_parts(len(children), flat.numel(), flat.dtype, flat.device, group)
    with trace.label("reduce"):
        recvs = [dist.irecv(buf, ops.global_rank(group, c), group=group)
                 for c, buf in zip(children, landing)]
        for recv, buf in zip(recvs, landing):         # child order: same bits every run
            recv.wait()
            ops.combine_(flat, buf, op)
        if parent is not None:
            dist.send(flat, parent, group=group)
    with trace.label("broadcast"):
        if parent is not None:
            dist.recv(flat, parent, group=group)
        else:
            ops.finish_(flat, op, p)                   # the root finishes AVG once
        sends = [dist.isend(flat, ops.global_rank(group, c), group=group) for c in children]
        for send in sends:
            send.wait()
    ops.write_back(tensor, flat)
