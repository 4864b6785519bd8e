"""All-to-all from point-to-point: linear, pairwise exchange and Bruck.

Every rank holds p blocks, one for each rank; afterwards rank r holds block r of every
rank, in rank order -- a transpose of the p × p matrix of blocks, with the rows on the
ranks. The contract is ``dist.all_to_all_single(output, input, output_split_sizes,
input_split_sizes, group)``: blocks are cut along dim 0, equal unless split sizes are
given, and rank r's ``output`` block s is rank s's ``input`` block r::

    before                       after
    rank 0:  a0 a1 a2            rank 0:  a0 b0 c0
    rank 1:  b0 b1 b2     ->     rank 1:  a1 b1 c1
    rank 2:  c0 c1 c2            rank 2:  a2 b2 c2

Three ways to move the blocks, n the bytes of one rank's input, b = n/p a block:

* **linear**: every receive and every send posted at once, p − 1 of each; the network
  (or the library) decides the order. (p − 1)·α + (p − 1)·b·β on one port.
* **pairwise exchange** (MPI's pairwise algorithm): p − 1 rounds, one partner per round:
  rank r ⊕ k when p is a power of two (a perfect matching: both directions of every pair
  at once), else send to r + k and receive from r − k. The same cost as linear, but only
  one message in flight each way: no incast, no p − 1 connections at once.
* **Bruck** (Bruck et al., 1997, MPI's small-message all-to-all): ⌈log2 p⌉ rounds. Rotate
  so slot i holds the block for rank r + i; at round k send every slot whose bit k is set
  to rank r + 2^k. Each block hops to its destination along the bits of its distance.
  ⌈log2 p⌉·α, but each round moves about half of the blocks: ~(n/2)·⌈log2 p⌉·β. Fewer
  messages, more bytes: it wins below the crossover the cost model predicts (:mod:`.cost`).

Whatever the algorithm, each rank must send (p − 1)/p of its input and receive as much:
every byte that is not its own has somewhere else to be. No algorithm can do with less,
which is why all-to-all, unlike all-reduce, has no trick that trades latency for bytes
below that bound -- Bruck only trades the other way.
"""

from __future__ import annotations

import math

import torch

from ..core import ops, trace
from ..core.ops import ReduceOp

__all__ = ["linear_all_to_all", "pairwise_all_to_all", "bruck_all_to_all", "check_all_to_all_args",
           "pairwise_schedule"]


def _is_split_list(value) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


def check_all_to_all_args(output, input, output_split_sizes, input_split_sizes, group, what: str):
    """Check an all-to-all's arguments before anything is sent; return ``(rows_out, rows_in)``,
    the block sizes along dim 0 (lists of p), or None for a rank outside ``group``.

    Everything checked here depends on this rank's arguments only, so a wrong call raises
    on the rank that made it before any message leaves it.
    """
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not ops.check_all_reduce_args(input, ReduceOp.SUM, group, what=what,
                                     compare=output_split_sizes is None and input_split_sizes is None):
        return None
    rank, p = ops.group_rank_and_size(group)
    if output.dtype != input.dtype:
        raise TypeError(f"{what}: rank {rank}'s output is {output.dtype} but its input is {input.dtype}")
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError(f"{what}: rank {rank}: input and output need at least one dimension (blocks are rows)")
    if input.shape[1:] != output.shape[1:]:
        raise ValueError(f"{what}: rank {rank}: input rows {tuple(input.shape[1:])} and output rows "
                         f"{tuple(output.shape[1:])} differ")
    if output.numel() > 1 and torch._debug_has_internal_overlap(output) == 1:
        raise ValueError(f"{what}: rank {rank}'s output has elements that share memory (an expanded tensor)")
    splits = []
    for name, sizes, t in (("output_split_sizes", output_split_sizes, output),
                           ("input_split_sizes", input_split_sizes, input)):
        if sizes is None:
            if t.shape[0] % p:
                raise ValueError(f"{what}: rank {rank}: the {name[:-12]}'s {t.shape[0]} rows do not split into "
                                 f"{p} equal blocks; pass {name}")
            splits.append([t.shape[0] // p] * p)
            continue
        if not _is_split_list(sizes) or len(sizes) != p or any(s < 0 for s in sizes):
            raise ValueError(f"{what}: rank {rank}: {name} must be {p} non-negative integers, got {sizes!r}")
        if sum(sizes) != t.shape[0]:
            raise ValueError(f"{what}: rank {rank}: {name} {list(sizes)} add up to {sum(sizes)} rows, "
                             f"but the {name[:-12]} has {t.shape[0]}")
        splits.append(list(sizes))
    return splits[0], splits[1]


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


class _Blocks:
    """A tensor seen as p blocks of rows, flat: ``block(i)`` is a contiguous 1-D view."""

    def __init__(self, flat: torch.Tensor, rows: list[int], row_numel: int):
        self.flat, self.rows, self.row_numel = flat, rows, row_numel
        self.starts = [o * row_numel for o in _offsets(rows)]

    def block(self, i: int) -> torch.Tensor:
        return self.flat[self.starts[i]: self.starts[i] + self.rows[i] * self.row_numel]


def _prepare(output, input, output_split_sizes, input_split_sizes, group, what):
    checked = check_all_to_all_args(output, input, output_split_sizes, input_split_sizes, group, what)
    if checked is None:
        return None
    rows_out, rows_in = checked
    row_numel = math.prod(input.shape[1:])
    source = input.detach().reshape(-1) if input.is_contiguous() else input.detach().contiguous().view(-1)
    target = ops.work_buffer(output)
    return _Blocks(source, rows_in, row_numel), _Blocks(target, rows_out, row_numel)


def linear_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None) -> None:
    """All-to-all with every receive and every send posted at once (p − 1 of each).

    Cost: (p − 1)·α + (p − 1)/p·n·β on one port; the order is the transport's.
    """
    prepared = _prepare(output, input, output_split_sizes, input_split_sizes, group, "linear_all_to_all")
    if prepared is None:
        return
    src, dst = prepared
    rank, p = ops.group_rank_and_size(group)
    dst.block(rank).copy_(src.block(rank))
    peers = [(rank + k) % p for k in range(1, p)]
    with trace.label("linear: every pair at once"):
        works = ops.post_exchange([(dst.block(s), ops.global_rank(group, s)) for s in peers],
                                  [(src.block(d), ops.global_rank(group, d)) for d in peers], group)
        for work in works:
            work.wait()
    ops.write_back(output, dst.flat)


def pairwise_schedule(rank: int, p: int) -> list[tuple[int, int]]:
    """The (send to, receive from) group ranks of rounds 1 .. p − 1 of the pairwise exchange."""
    if p & (p - 1) == 0:
        return [(rank ^ k, rank ^ k) for k in range(1, p)]
    return [((rank + k) % p, (rank - k) % p) for k in range(1, p)]


def pairwise_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                        input_split_sizes=None, group=None) -> None:
    """All-to-all in p − 1 rounds, one partner each way per round (after MPI's pairwise exchange).

    Round k: with p a power of two the partner is rank ⊕ k, both ways; otherwise send to
    rank + k and receive from rank − k. Every rank is sending one block and receiving one
    at any time. Cost: (p − 1)·α + (p − 1)/p·n·β.
    """
    prepared = _prepare(output, input, output_split_sizes, input_split_sizes, group, "pairwise_all_to_all")
    if prepared is None:
        return
    src, dst = prepared
    rank, p = ops.group_rank_and_size(group)
    dst.block(rank).copy_(src.block(rank))
    for k, (to, frm) in enumerate(pairwise_schedule(rank, p), start=1):
        with trace.label(f"pairwise round {k}: to {to}, from {frm}"):
            recv, send = ops.sendrecv(src.block(to), ops.global_rank(group, to),
                                      dst.block(frm), ops.global_rank(group, frm), group)
            recv.wait()
            send.wait()
    ops.write_back(output, dst.flat)


def _size_matrix(rows_in: list[int], equal: bool, group) -> list[list[int]]:
    """sizes[s][d]: rows rank s sends rank d. Equal blocks need no message; uneven ones are
    all-gathered first (one small ring all-gather of p·p counts, lesson 4's)."""
    rank, p = ops.group_rank_and_size(group)
    if equal:
        return [rows_in[:] for _ in range(p)]
    from ..ring import ring_all_gather
    gathered = torch.zeros(p * p, dtype=torch.int64, device=ops.rank_device())
    with trace.label("bruck: the size matrix"):
        ring_all_gather(gathered, torch.tensor(rows_in, dtype=torch.int64, device=gathered.device), group=group)
    flat = gathered.tolist()
    return [flat[s * p:(s + 1) * p] for s in range(p)]


def bruck_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                     input_split_sizes=None, group=None) -> None:
    """All-to-all in ⌈log2 p⌉ rounds (after Bruck et al.'s algorithm, as in MPI's small-message path).

    Slot i of this rank starts with the block for rank + i. At round k every slot with
    bit k set travels to rank + 2^k, packed into one message; a block has arrived once it
    has travelled its distance i = the sum of those bits. At the end slot i holds the
    block from rank − i. With uneven splits every rank needs every rank's sizes to know
    what a packed message holds: they are all-gathered first (p·p integers).
    Cost: ⌈log2 p⌉·α + Σ_k |{i : bit k of i}|·b·β ≈ ⌈log2 p⌉·α + ⌈log2 p⌉·(n/2)·β.
    """
    prepared = _prepare(output, input, output_split_sizes, input_split_sizes, group, "bruck_all_to_all")
    if prepared is None:
        return
    src, dst = prepared
    rank, p = ops.group_rank_and_size(group)
    equal = input_split_sizes is None and output_split_sizes is None
    sizes = _size_matrix(src.rows, equal, group)
    row = src.row_numel
    slots = [src.block((rank + i) % p) for i in range(p)]          # slot i: for rank + i
    d = 1
    while d < p:
        moving = [i for i in range(p) if i & d]
        to, frm = (rank + d) % p, (rank - d) % p
        # slot i on the sender frm holds the block from source frm − (i mod d), for source + i
        incoming = []
        for i in moving:
            source = (frm - (i & (d - 1))) % p
            incoming.append(sizes[source][(source + i) % p] * row)
        packed = torch.cat([slots[i] for i in moving]) if moving else src.flat[:0]
        landing = torch.empty(sum(incoming), dtype=src.flat.dtype, device=src.flat.device)
        with trace.label(f"bruck round {d.bit_length() - 1}: {len(moving)} blocks to {to}"):
            recv, send = ops.sendrecv(packed, ops.global_rank(group, to), landing, ops.global_rank(group, frm), group)
            recv.wait()
            send.wait()
        for i, piece in zip(moving, torch.split(landing, incoming)):
            slots[i] = piece
        d <<= 1
    for s in range(p):
        dst.block(s).copy_(slots[(rank - s) % p])
    ops.write_back(output, dst.flat)
