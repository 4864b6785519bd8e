"""Lesson 4: the bandwidth-optimal ring -- reduce-scatter, then all-gather, over p chunks.

Cut the tensor into p chunks. In the **reduce-scatter** each rank sends one chunk to its
right neighbour per step, and adds the chunk arriving from its left into its own copy;
after p − 1 steps rank r holds chunk r summed over every rank. In the **all-gather** the
finished chunks travel round the ring once more, p − 1 steps, and land in place::

    reduce-scatter, p = 4 (ck: chunk k; rank r sends chunk r−1−s at step s)

    step 0:  0 --c3--> 1 --c0--> 2 --c1--> 3 --c2--> 0      each arrival is added in
    step 1:  0 --c2--> 1 --c3--> 2 --c0--> 3 --c1--> 0      what is sent is what was
    step 2:  0 --c1--> 1 --c2--> 2 --c3--> 3 --c0--> 0      just added: a running sum
             rank r now holds chunk r reduced over all four ranks

    all-gather: rank r sends chunk r−s at step s; arrivals are copied in place.

Cost, n bytes on p ranks (α per message, β per byte, γ per byte combined)::

    time        2(p − 1)·α + 2(p − 1)/p·n·β + (p − 1)/p·n·γ
    bytes/rank  2(p − 1)/p·n    (the naive ring: (p − 1)·n)

Each rank sends under 2n bytes whatever p is -- the least any all-reduce can send per
rank when the ranks do the reducing themselves (Patarasuk & Yuan, 2009; a switch that
reduces in the network, NVLink SHARP or InfiniBand SHARP, lets each rank send n once) --
which is why the ring is the workhorse of NCCL, gloo and
Horovod (Baidu's ring all-reduce, 2017, carried it from HPC to deep learning). Its 2(p − 1) latency
terms are its weakness: for small tensors the latency-optimal algorithms of
:mod:`collectives.topologies` win.

Two variants follow the plain ring: :func:`pipelined_ring_all_reduce` cuts every chunk
into pieces, so the combine of one piece hides under the transfer of the next; and
:func:`multi_ring_all_reduce` runs several rings at once, half of them the other way
round, posted together with ``batch_isend_irecv`` so NCCL drives them concurrently.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .core import nccl_memory, ops, trace
from .core.ops import ReduceOp
from .topologies import halving_doubling_all_reduce, recursive_doubling_all_reduce, tree_all_reduce

__all__ = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
           "pipelined_ring_all_reduce", "multi_ring_all_reduce",
           "recursive_doubling_all_reduce", "halving_doubling_all_reduce", "tree_all_reduce"]


def _neighbours(group) -> tuple[int, int, int, int]:
    """(rank in group, group size, right neighbour, left neighbour); neighbours as global ranks."""
    rank, p = ops.group_rank_and_size(group)
    return rank, p, ops.global_rank(group, (rank + 1) % p), ops.global_rank(group, (rank - 1) % p)


def _reduce_scatter_in_place(flat, bounds, op, rank, p, right, left, group) -> None:
    """p − 1 steps on a flat buffer: afterwards chunk ``rank`` of ``flat`` holds the reduction.

    At step s this rank sends chunk (rank − 1 − s) and receives chunk (rank − 2 − s): the
    one its left neighbour just finished adding to. The arrival lands in ``landing`` (one
    buffer, allocated once, the size of the largest chunk) and is combined into ``flat``
    in place. The combine may start before our own send has finished: they touch
    different chunks.
    """
    largest = max(hi - lo for lo, hi in bounds)
    landing = nccl_memory.scratch(largest, flat.dtype, flat.device, group)
    for step in range(p - 1):
        send_chunk, recv_chunk = (rank - 1 - step) % p, (rank - 2 - step) % p
        s_lo, s_hi = bounds[send_chunk]
        r_lo, r_hi = bounds[recv_chunk]
        arrived = landing[: r_hi - r_lo]
        with trace.label(f"reduce-scatter {step}: c{send_chunk}"):
            recv, send = ops.sendrecv(flat[s_lo:s_hi], right, arrived, left, group)
            recv.wait()
        ops.combine_(flat[r_lo:r_hi], arrived, op)
        send.wait()


def _all_gather_in_place(flat, bounds, rank, p, right, left, group) -> None:
    """p − 1 steps: rank r starts with chunk r finished and ends with every chunk.

    At step s this rank forwards chunk (rank − s), the one that arrived last step (its own
    at step 0), and receives chunk (rank − 1 − s) straight into its place: no copies.
    """
    for step in range(p - 1):
        send_chunk, recv_chunk = (rank - step) % p, (rank - 1 - step) % p
        s_lo, s_hi = bounds[send_chunk]
        r_lo, r_hi = bounds[recv_chunk]
        with trace.label(f"all-gather {step}: c{send_chunk}"):
            recv, send = ops.sendrecv(flat[s_lo:s_hi], right, flat[r_lo:r_hi], left, group)
            recv.wait()
            send.wait()


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                        group=None) -> None:
    """``output`` ← chunk ``rank`` of the reduction of every rank's ``input`` (input unchanged).

    Like ``dist.reduce_scatter_tensor(output, input, op, group)``: with ``input`` of
    p·m elements, rank r gets elements [r·m, (r+1)·m) of the reduction. Sizes that do not
    divide by p are split with :func:`ops.chunk_bounds` (the first n mod p chunks are one
    element longer), and ``output`` must have the size of this rank's chunk.

    Cost: (p − 1)·α + (p − 1)/p·n·β, n the bytes of ``input``.
    """
    if not ops.check_all_reduce_args(input, op, group, what="ring_reduce_scatter"):
        return                         # not in the group: nothing to do, as dist.*
    # the running sums are built in a copy (registered memory once nccl_memory.register() has run)
    reduce_scatter_in(output, nccl_memory.contiguous_copy(input), op, group)


def reduce_scatter_in(output: torch.Tensor, flat: torch.Tensor, op=ReduceOp.SUM, group=None,
                      what: str = "ring_reduce_scatter") -> None:
    """:func:`ring_reduce_scatter` building its running sums in ``flat`` itself (flat,
    contiguous, overwritten): for a caller whose input is a buffer nobody reads again, one
    buffer the size of the input fewer. The same steps and bits. The caller has checked the
    call (``ops.check_all_reduce_args``); the output's size is checked here, before any message."""
    rank, p, right, left = _neighbours(group)
    bounds = ops.chunk_bounds(flat.numel(), p)
    lo, hi = bounds[rank]
    if output.numel() != hi - lo or output.dtype != flat.dtype:
        raise ValueError(f"{what}: rank {rank}'s output must hold {hi - lo} elements "
                         f"of {flat.dtype} (chunk {rank} of {flat.numel()} split {p} ways), "
                         f"got {output.numel()} of {output.dtype}")
    if p > 1 and flat.numel() > 0:
        _reduce_scatter_in_place(flat, bounds, op, rank, p, right, left, group)
    ops.finish_(flat[lo:hi], op, p)
    output.copy_(flat[lo:hi].view(output.shape))


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``output`` ← every rank's ``input``, concatenated in rank order.

    Like ``dist.all_gather_into_tensor(output, input, group)``; ``input`` must have the size
    of chunk ``rank`` of ``output`` under :func:`ops.chunk_bounds` (all equal when p divides it).

    Cost: (p − 1)·α + (p − 1)/p·n·β, n the bytes of ``output``.
    """
    if not ops.check_all_reduce_args(output, ReduceOp.SUM, group, what="ring_all_gather"):
        return                         # not in the group: nothing to do, as dist.*
    rank, p, right, left = _neighbours(group)
    bounds = ops.chunk_bounds(output.numel(), p)
    lo, hi = bounds[rank]
    if input.numel() != hi - lo or output.dtype != input.dtype:
        raise ValueError(f"ring_all_gather: rank {rank}'s input must hold {hi - lo} elements "
                         f"of {output.dtype} (chunk {rank} of {output.numel()} split {p} ways), "
                         f"got {input.numel()} of {input.dtype}")
    flat = ops.work_buffer(output)
    flat[lo:hi].copy_(input.reshape(-1))
    if p > 1:
        _all_gather_in_place(flat, bounds, rank, p, right, left, group)
    ops.write_back(output, flat)


def ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """All-reduce ``tensor`` in place: ring reduce-scatter, then ring all-gather.

    Each rank sends 2(p − 1) messages, all to its right neighbour, each of ⌈n/p⌉ or ⌊n/p⌋
    elements. AVG divides only the chunk this rank finished, before the all-gather: one
    division of n/p elements instead of n, and every rank ends with the same bits.
    """
    if not ops.check_all_reduce_args(tensor, op, group, what="ring_all_reduce"):
        return                         # not in the group: nothing to do, as dist.*
    rank, p, right, left = _neighbours(group)
    if p == 1 or tensor.numel() == 0:
        return
    flat = ops.work_buffer(tensor)
    bounds = ops.chunk_bounds(flat.numel(), p)
    _reduce_scatter_in_place(flat, bounds, op, rank, p, right, left, group)
    lo, hi = bounds[rank]
    ops.finish_(flat[lo:hi], op, p)
    _all_gather_in_place(flat, bounds, rank, p, right, left, group)
    ops.write_back(tensor, flat)


# ---------------------------------------------------------------------------------------
# Pipelining: the combine of one piece hides under the transfer of the next.

PIPELINE_PIECES = 4


def pipelined_ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                              pieces: int = PIPELINE_PIECES) -> None:
    """The ring with every chunk cut into ``pieces``: a piece moves on as soon as it is ready.

    In the plain ring a step ends only when its whole chunk has arrived and been combined,
    so the link idles while we add. Here every piece of a step is received into its own
    part of a landing buffer; as soon as piece j is combined it is sent on for the next
    step, while pieces j + 1, ... are still arriving::

        plain:      [recv c ....][add c ..][recv c' ....][add c' ..]
        pipelined:  [recv c.0][recv c.1][recv c.2][recv c.3][recv c'.0] ...
                              [add c.0 ][add c.1 ][add c.2 ][add c.3 ] ...
                                        [send c.0 onward ...]

    Two landing buffers alternate between steps: piece j of step s + 1 may be posted
    before piece j + 1 of step s has been combined, and must not land on top of it.
    Messages between a pair are matched in the order they were posted, which both ends
    share: step by step, piece by piece.

    Cost: 2(p − 1)·k·α + 2(p − 1)/p·n·β + (p − 1)/p·n·γ/k (only one piece's combine per
    step is left uncovered). More pieces hide more of γ and pay more α: worth it only
    for large tensors.

    The number of messages, 2(p − 1)·k, depends on ``pieces`` alone, never on the tensor's
    size: a chunk smaller than k elements has empty pieces, posted as empty messages on
    gloo. A rank handed a tensor of another size than its peers then makes some neighbour
    receive a longer message than it posted for, and gloo aborts at once; were the count
    to follow the size (k capped at the chunk), the ranks would post different numbers of
    messages, a shorter message would land silently in a longer receive, and the ranks
    would wait for ever for the messages in between.
    """
    if not ops.check_all_reduce_args(tensor, op, group, what="pipelined_ring_all_reduce"):
        return                         # not in the group: nothing to do, as dist.*
    if pieces < 1:
        raise ValueError(f"pipelined_ring_all_reduce: pieces must be at least 1, got {pieces}")
    rank, p, right, left = _neighbours(group)
    if p == 1 or tensor.numel() == 0:
        return
    flat = ops.work_buffer(tensor)
    bounds = ops.chunk_bounds(flat.numel(), p)
    largest = max(hi - lo for lo, hi in bounds)
    k = pieces                              # not capped by the size: see above

    def piece(chunk: int, j: int) -> tuple[int, int]:
        """Element range of piece j of ``chunk`` in ``flat``."""
        lo, hi = bounds[chunk]
        a, b = ops.chunk_bounds(hi - lo, k)[j]
        return lo + a, lo + b

    landing = nccl_memory.scratch_parts(2, largest, flat.dtype, flat.device, group)   # registered, under NCCL

    def post_reduce_step(step: int, j: int):
        """Post piece j of reduce-scatter step ``step``; return (recv work, send work)."""
        send_lo, send_hi = piece((rank - 1 - step) % p, j)
        recv_lo, recv_hi = piece((rank - 2 - step) % p, j)
        offset = recv_lo - bounds[(rank - 2 - step) % p][0]
        arrived = landing[step % 2][offset: offset + recv_hi - recv_lo]
        with trace.label(f"reduce-scatter {step}: c{(rank - 1 - step) % p}.{j}"):
            recv, send = ops.sendrecv(flat[send_lo:send_hi], right, arrived, left, group,
                                      post_empty=True)
        return recv, send, arrived, (recv_lo, recv_hi)

    posted = [post_reduce_step(0, j) for j in range(k)]
    sends = [s for _, s, _, _ in posted]
    for step in range(p - 1):
        following = []
        for j, (recv, _, arrived, (lo, hi)) in enumerate(posted):
            recv.wait()
            ops.combine_(flat[lo:hi], arrived, op)
            if step + 1 < p - 1:            # this piece is next step's outgoing piece j
                following.append(post_reduce_step(step + 1, j))
                sends.append(following[-1][1])
        posted = following
    for send in sends:                      # the all-gather overwrites chunks we sent
        send.wait()

    lo, hi = bounds[rank]
    ops.finish_(flat[lo:hi], op, p)

    def post_gather_step(step: int, j: int):
        send_lo, send_hi = piece((rank - step) % p, j)
        recv_lo, recv_hi = piece((rank - 1 - step) % p, j)
        with trace.label(f"all-gather {step}: c{(rank - step) % p}.{j}"):
            recv, send = ops.sendrecv(flat[send_lo:send_hi], right, flat[recv_lo:recv_hi], left, group,
                                      post_empty=True)
        return recv, send

    posted = [post_gather_step(0, j) for j in range(k)]
    sends = [s for _, s in posted]
    for step in range(p - 1):               # forward each piece the moment it lands
        following = []
        for j, (recv, _) in enumerate(posted):
            recv.wait()
            if step + 1 < p - 1:
                following.append(post_gather_step(step + 1, j))
                sends.append(following[-1][1])
        posted = following
    for send in sends:
        send.wait()
    ops.write_back(tensor, flat)


# ---------------------------------------------------------------------------------------
# Several rings at once, for GPUs whose links a single ring leaves idle.

def _batch(p2p: list) -> None:
    """Post every operation in one ``batch_isend_irecv`` (one NCCL group) and wait for all.

    Empty messages are dropped under NCCL only: on gloo they are posted, so the number of
    messages depends on the channels alone and ranks handed tensors of different sizes
    fail at once (a longer message than its receive aborts gloo) instead of waiting."""
    if p2p and p2p[0].tensor.is_cuda:
        p2p = [op for op in p2p if op.tensor.numel()]
    if p2p:
        for work in dist.batch_isend_irecv(p2p):
            work.wait()


def multi_ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          channels: int = 2) -> None:
    """``channels`` rings over slices of the tensor, even ones clockwise, odd ones
    counter-clockwise, every step of every ring posted in one ``batch_isend_irecv``.

    One ring drives one outgoing link per GPU. Where neighbours are joined by direct links
    of their own (NVLink bridges, a mesh of point-to-point links), the link to the left
    neighbour idles; a second ring going the other way uses it, as NCCL does with its
    channels. On an NVSwitch machine there is no idle left link: each GPU reaches every
    other through its connection to the switches, which both directions share.
    Posting all channels' sends and receives of a step in one
    ``batch_isend_irecv`` lets NCCL launch them as one group, so they run concurrently.
    Arrivals land in a landing buffer per channel (allocated once) and are combined in
    place; the all-gather receives straight into the tensor.

    Slice c of the tensor (``ops.chunk_bounds(n, channels)[c]``) runs on ring c; within it,
    a rank's position is its rank (clockwise) or −rank mod p (counter-clockwise), and the
    chunk schedule is :func:`ring_all_reduce`'s by position.

    Cost, when each ring has direct links of its own: 2(p − 1)·α + 2(p − 1)/p·(n/c)·β. On
    a shared link or a switch (gloo over loopback, NVSwitch) it is the plain ring's, with
    c× the messages.
    """
    if not ops.check_all_reduce_args(tensor, op, group, what="multi_ring_all_reduce"):
        return                         # not in the group: nothing to do, as dist.*
    if channels < 1:
        raise ValueError(f"multi_ring_all_reduce: channels must be at least 1, got {channels}")
    rank, p = ops.group_rank_and_size(group)
    if p == 1 or tensor.numel() == 0:
        return
    flat = ops.work_buffer(tensor)
    rings = []   # per channel: (position, send-to, receive-from, chunk bounds in flat, landing)
    parts = ops.chunk_bounds(flat.numel(), channels)
    widest = max(max(b - a for a, b in ops.chunk_bounds(hi - lo, p)) for lo, hi in parts)
    landings = nccl_memory.scratch_parts(channels, widest, flat.dtype, flat.device, group)
    for c, (lo, hi) in enumerate(parts):
        direction = 1 if c % 2 == 0 else -1
        position = (direction * rank) % p
        to = ops.global_rank(group, (rank + direction) % p)
        frm = ops.global_rank(group, (rank - direction) % p)
        bounds = [(lo + a, lo + b) for a, b in ops.chunk_bounds(hi - lo, p)]
        rings.append((position, to, frm, bounds, landings[c]))

    for step in range(p - 1):               # reduce-scatter, all channels together
        p2p, combines = [], []
        for position, to, frm, bounds, landing in rings:
            s_lo, s_hi = bounds[(position - 1 - step) % p]
            r_lo, r_hi = bounds[(position - 2 - step) % p]
            arrived = landing[: r_hi - r_lo]
            p2p += [dist.P2POp(dist.irecv, arrived, frm, group=group),
                    dist.P2POp(dist.isend, flat[s_lo:s_hi], to, group=group)]
            combines.append((flat[r_lo:r_hi], arrived))
        with trace.label(f"reduce-scatter {step}"):
            _batch(p2p)
        for target, arrived in combines:
            ops.combine_(target, arrived, op)

    for position, _, _, bounds, _ in rings:
        lo, hi = bounds[position]
        ops.finish_(flat[lo:hi], op, p)

    for step in range(p - 1):               # all-gather, all channels together
        p2p = []
        for position, to, frm, bounds, _ in rings:
            s_lo, s_hi = bounds[(position - step) % p]
            r_lo, r_hi = bounds[(position - 1 - step) % p]
            p2p += [dist.P2POp(dist.irecv, flat[r_lo:r_hi], frm, group=group),
                    dist.P2POp(dist.isend, flat[s_lo:s_hi], to, group=group)]
        with trace.label(f"all-gather {step}"):
            _batch(p2p)
    ops.write_back(tensor, flat)

