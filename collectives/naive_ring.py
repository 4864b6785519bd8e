"""Lesson 3: the naive ring all-reduce -- every rank's whole tensor travels all the way round.

The simplest all-reduce built from point-to-point messages: arrange the ranks in a ring,
and p − 1 times pass a whole tensor to the right while receiving one from the left. After
the first step every rank holds its left neighbour's tensor, after the second the one from
two to the left, and so on; adding each arrival to an accumulator gives every rank the sum
of all p tensors after p − 1 steps::

    step 0            step 1            step 2           (p = 4; xk = rank k's input)
    0 --x0--> 1       0 --x3--> 1       0 --x2--> 1
    ^         |       ^         |       ^         |
    x3        x1      x2        x0      x1        x3
    |         v       |         v       |         v
    3 <--x2-- 2       3 <--x1-- 2       3 <--x0-- 2

    rank 1 accumulates x1 (its own) + x0 + x3 + x2 = the sum of all four.

Cost, for a tensor of n bytes on p ranks (α: per-message latency, β: seconds per byte):

    time        (p − 1)·α + (p − 1)·n·β       every step moves the whole tensor
    bytes/rank  (p − 1)·n                      sent (and as many received)

The bandwidth term grows with p: with 8 ranks each link carries 7 copies of the tensor.
Lesson 4's ring sends 2(p − 1)/p·n (under 2n, whatever p is) and wins as soon as n is big.

This is the ring of the PyTorch "Writing distributed applications" tutorial, rebuilt as
an ``all_reduce``: in place, every ``ReduceOp``, every dtype, views and subgroups.
:func:`tutorial_all_reduce` keeps the tutorial's shape for comparison (lesson page and lab).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .core import nccl_memory, ops, trace
from .core.ops import ReduceOp

__all__ = ["naive_ring_all_reduce", "tutorial_all_reduce"]


def naive_ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """All-reduce ``tensor`` in place by passing whole tensors p − 1 times round the ring.

    Same contract as ``dist.all_reduce(tensor, op, group)``. Each rank sends p − 1
    messages of ``tensor.numel()`` elements, all to its right neighbour.

    Two receive buffers alternate: the tensor that arrived at step k is forwarded at
    step k + 1 while the next one lands in the other buffer. The first message is our
    own input, sent straight from ``flat`` -- safe, because we wait for that send to
    finish before the first combine writes into ``flat``.

    Note: floating-point results may differ in the last bits from rank to rank: each
    rank adds the same p terms in a different order (its own first). ``dist.all_reduce``
    (and lesson 4's ring) give every rank the very same bits.
    """
    if not ops.check_all_reduce_args(tensor, op, group, what="naive_ring_all_reduce"):
        return                         # not in the group: nothing to do, as dist.*
    rank, p = ops.group_rank_and_size(group)
    if p == 1 or tensor.numel() == 0:
        return  # nothing to exchange (AVG over one rank divides by 1)
    flat = ops.work_buffer(tensor)          # the accumulator: the tensor's own memory when contiguous
    right = ops.global_rank(group, (rank + 1) % p)
    left = ops.global_rank(group, (rank - 1) % p)
    # where arrivals land; two alternate when p > 2
    landing = nccl_memory.scratch_parts(2 if p > 2 else 1, flat.numel(), flat.dtype, flat.device,
                                         group)
    forward = flat                          # what goes right this step: our own input first
    for step in range(p - 1):
        incoming = landing[step % 2]
        origin = (rank - step) % p          # whose input we forward this step
        with trace.label(f"step {step}: x{origin}"):
            recv, send = ops.sendrecv(forward, right, incoming, left, group)  # irecv, then isend
            recv.wait()
            send.wait()                      # `forward` may be `flat`: finish before writing it
        ops.combine_(flat, incoming, op)
        forward = incoming                   # pass on what just arrived, unchanged
    ops.finish_(flat, op, p)
    ops.write_back(tensor, flat)


def tutorial_all_reduce(send: torch.Tensor, recv: torch.Tensor) -> None:
    """The tutorial's ring, kept in its original shape to show what it leaves out.

    Writes the sum of every rank's ``send`` into ``recv``. Two alternating buffers, an
    ``isend`` to the right and a blocking ``recv`` from the left each step, the arrival
    added with ``accum[:] +=``. What it does not do (each checked in the lab):

    * it is not in place: the caller passes an output tensor;
    * SUM only; no ``op`` argument;
    * no ``group`` argument: ranks and size are the world's;
    * a transposed view fails (the clones keep its strides, and ``isend`` rejects a
      non-contiguous tensor); a 0-d tensor fails on ``[:]``;
    * it holds three extra copies of the tensor (two buffers and the accumulator).

    One change from the tutorial: the isend is waited for even when the addition fails, so
    the lab's failing cases end with their error on every rank instead of a hung neighbour.
    """
    rank, size = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % size, (rank + 1) % size
    buffers = [send.clone(), send.clone()]
    accum = send.clone()
    for i in range(size - 1):
        outgoing, arriving = buffers[i % 2], buffers[(i + 1) % 2]
        request = dist.isend(outgoing, right)
        dist.recv(arriving, left)
        try:
            accum[:] += arriving[:]
        finally:
            request.wait()       # the one change from the tutorial (see the docstring)
    recv[:] = accum[:]
