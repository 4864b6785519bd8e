"""Lesson 10: one parameter split on dim 0 over p ranks, padded so every shard is the same size.

FSDP2's layout (``fully_shard``): parameter ``w`` of ``rows`` rows gets ``c = ceil(rows / p)``
rows per rank; rank r owns rows ``[r·c, min((r+1)·c, rows))`` -- fewer, or none, for the
last ranks -- stored padded with zeros to ``c`` rows, so an all-gather of equal pieces
rebuilds it and a reduce-scatter hands each rank exactly its rows::

    w: 7 rows, p = 3, c = 3        rank 0: rows 0 1 2
                                   rank 1: rows 3 4 5
                                   rank 2: row  6  + 2 rows of padding

A :class:`ShardGroup` holds several parameters that travel together (a layer, a bucket):
a rank's piece of the group is its padded shards one after the other, ``shard_numel``
elements, and the collective's buffer is the p pieces in rank order -- ``p · shard_numel``
elements, of which :attr:`ShardGroup.padding` are zeros. Packing the gradients into that
buffer (:meth:`ShardGroup.pack`) and unpacking a gathered buffer into full tensors
(:meth:`ShardGroup.unpack`) are the two data movements of every ZeRO stage.

:func:`reduce_scatter` and :func:`all_gather` run lesson 4's ring by default and
``dist.reduce_scatter_tensor`` / ``dist.all_gather_into_tensor`` when ``use_torch`` is set;
the trace shows which (the ring's sends and receives, or one collective).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from collectives.core import ops
from collectives.core.ops import ReduceOp
from collectives.ring import reduce_scatter_in, ring_all_gather, ring_reduce_scatter


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter of ``shape`` is cut on dim 0 over ``p`` ranks."""
    shape: tuple[int, ...]
    p: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def rows_per_shard(self) -> int:
        return -(-self.rows // self.p)                       # ceil(rows / p)

    @property
    def shard_numel(self) -> int:
        return self.rows_per_shard * self.row_numel

    def owned_rows(self, rank: int) -> tuple[int, int]:
        """The rows ``[lo, hi)`` rank ``rank`` owns (``lo == hi``: none, all padding)."""
        c = self.rows_per_shard
        return min(rank * c, self.rows), min((rank + 1) * c, self.rows)

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s padded shard of ``full`` as a new flat tensor of ``shard_numel``."""
        lo, hi = self.owned_rows(rank)
        out = full.new_zeros(self.shard_numel)
        out[:(hi - lo) * self.row_numel] = full.reshape(self.rows, self.row_numel)[lo:hi].reshape(-1)
        return out

    def unpad(self, shard: torch.Tensor, rank: int) -> torch.Tensor:
        """The rows of a padded flat ``shard`` that rank ``rank`` really owns, shaped as rows."""
        lo, hi = self.owned_rows(rank)
        return shard[:(hi - lo) * self.row_numel].view((hi - lo,) + tuple(self.shape[1:]))


class ShardGroup:
    """Parameters of the given ``shapes`` sharded together over ``p`` ranks (see the module)."""

    def __init__(self, shapes, p: int):
        if p < 1:
            raise ValueError(f"ShardGroup: p must be at least 1, got {p}")
        self.p = p
        self.specs = [ShardSpec(tuple(int(d) for d in s), p) for s in shapes]
        self.offsets = []
        offset = 0
        for spec in self.specs:
            self.offsets.append(offset)
            offset += spec.shard_numel
        self.shard_numel = offset

    @property
    def numel(self) -> int:
        """Elements of the unsharded parameters (Ψ of this group)."""
        return sum(math.prod(s.shape) for s in self.specs)

    @property
    def padding(self) -> int:
        """Zeros in the collective's buffer of ``p · shard_numel`` elements."""
        return self.p * self.shard_numel - self.numel

    def _check(self, tensors, what: str) -> None:
        if len(tensors) != len(self.specs):
            raise ValueError(f"{what}: expected {len(self.specs)} tensors, got {len(tensors)}")
        for i, (t, spec) in enumerate(zip(tensors, self.specs)):
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"{what}: tensor {i} has shape {tuple(t.shape)}, expected {spec.shape}")

    def shard(self, tensors, rank: int) -> list[torch.Tensor]:
        """Rank ``rank``'s padded flat shard of each tensor."""
        self._check(tensors, "ShardGroup.shard")
        return [spec.shard(t, rank) for t, spec in zip(tensors, self.specs)]

    def shard_views(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """Views of a rank's flat piece (``shard_numel``), one padded shard per parameter."""
        return [piece[o:o + s.shard_numel] for o, s in zip(self.offsets, self.specs)]

    def pack(self, tensors, dtype=None) -> torch.Tensor:
        """The reduce-scatter input: for rank 0, 1, ..., p-1 its rows of every tensor, padded."""
        self._check(tensors, "ShardGroup.pack")
        dtype = dtype or tensors[0].dtype
        out = torch.zeros(self.p, self.shard_numel, dtype=dtype, device=tensors[0].device)
        for t, spec, o in zip(tensors, self.specs, self.offsets):
            rows = t.reshape(spec.rows, spec.row_numel)
            for r in range(self.p):                 # rank r's block: its rows, then zeros
                lo, hi = spec.owned_rows(r)
                out[r, o:o + (hi - lo) * spec.row_numel].copy_(rows[lo:hi].reshape(-1))
        return out.view(-1)

    def unpack(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Full tensors from an all-gathered buffer (``p · shard_numel``), padding dropped."""
        if gathered.numel() != self.p * self.shard_numel:
            raise ValueError(f"ShardGroup.unpack: expected {self.p * self.shard_numel} elements, "
                             f"got {gathered.numel()}")
        blocks = gathered.view(self.p, self.shard_numel)
        out = []
        for spec, o in zip(self.specs, self.offsets):
            rows = blocks[:, o:o + spec.shard_numel].reshape(self.p * spec.rows_per_shard, spec.row_numel)
            out.append(rows[:spec.rows].reshape(spec.shape))
        return out

    def unpack_into(self, gathered: torch.Tensor, fulls) -> None:
        """Copy an all-gathered buffer into the full tensors ``fulls`` (their own memory):
        rank r's rows of each, block by block -- no tensor the size of the buffer in between."""
        if gathered.numel() != self.p * self.shard_numel:
            raise ValueError(f"ShardGroup.unpack_into: expected {self.p * self.shard_numel} elements, "
                             f"got {gathered.numel()}")
        self._check(fulls, "ShardGroup.unpack_into")
        blocks = gathered.view(self.p, self.shard_numel)
        for full, spec, o in zip(fulls, self.specs, self.offsets):
            rows = full.view(spec.rows, spec.row_numel)
            for r in range(self.p):
                lo, hi = spec.owned_rows(r)
                if hi > lo:
                    rows[lo:hi].copy_(blocks[r, o:o + (hi - lo) * spec.row_numel].view(hi - lo, spec.row_numel))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, use_torch: bool = False,
                   op=ReduceOp.AVG, group=None, scratch: bool = False) -> None:
    """``output`` ← this rank's piece of the reduction of ``input`` over the group.

    Lesson 4's ring by default; ``dist.reduce_scatter_tensor`` when ``use_torch`` (gloo
    and NCCL sum in their own orders, so the two agree to rounding unless p ≤ 2).
    ``scratch``: ``input`` (flat, contiguous) is a buffer nobody reads again, and the ring
    builds its running sums in it instead of in a copy -- the same steps, the same bits,
    one buffer the size of ``input`` fewer.
    """
    if use_torch:
        dist.reduce_scatter_tensor(output, input, op=op, group=group)
    elif scratch and input.is_contiguous() and ops.check_all_reduce_args(input, op, group,
                                                                         what="reduce_scatter"):
        reduce_scatter_in(output, input.detach().view(-1), op, group, what="reduce_scatter")
    else:
        ring_reduce_scatter(output, input, op=op, group=group)


def all_gather(output: torch.Tensor, input: torch.Tensor, *, use_torch: bool = False, group=None) -> None:
    """``output`` ← every rank's ``input`` in rank order (exact either way: nothing is added)."""
    if use_torch:
        dist.all_gather_into_tensor(output, input, group=group)
    else:
        ring_all_gather(output, input, group=group)
