"""A slice prepared once: the in-flight reducer's host work, paid on the first call only.

:class:`~.slice.Slice` works out, on every call, which block goes to which peer: a dozen
tensor views and a few lists per stage, each a few microseconds of Python. On a GPU the
host does nothing else -- NCCL and the streams do the work -- so that is what a bucket
costs, and a training step hands over the same buckets (the same tensors) step after step.

:class:`PreparedSlice` does that work once per slice of a bucket tensor and keeps it: every
view of the slice, every message's (buffer, peer), every collective's arguments. A call
then only *binds* what changes -- the reduce op and the few views of its staging, which
comes from the reducer's ring at a different place every time -- and posts. Its stage
methods are :class:`~.slice.Slice`'s, with the same messages in the same order on the same
groups, so the two can be mixed (the reducer keeps :class:`~.slice.Slice` for a slice with
a padding tail: the last slice of a bucket whose size D·M does not divide).

With ``inside="collectives"`` (NCCL) every stage is one collective, as Fairring issues
them: the collect an ``all_to_all_single`` on the rail (row j of ``[d, :, :]`` to machine
j, row j of the staging from it), the diffuse an in-place ``all_gather_into_tensor`` on the
rail -- one call each instead of a batch of 2(M − 1) messages. The bytes are the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core import ops, trace
from ..core.ops import ReduceOp
from .layout import StageGroups


def post(recvs: list, sends: list, group, cuda: bool) -> list:
    """:func:`collectives.core.ops.post_exchange` for lists already made (no empty buffer in
    them): every receive, then every send; on NCCL one grouped batch."""
    if cuda:
        p2p = [dist.P2POp(dist.irecv, buf, src, group=group) for buf, src in recvs]
        p2p += [dist.P2POp(dist.isend, buf, dst, group=group) for buf, dst in sends]
        return list(dist.batch_isend_irecv(p2p)) if p2p else []
    irecv, isend = dist.irecv, dist.isend
    works = [irecv(buf, src, group=group) for buf, src in recvs]
    return works + [isend(buf, dst, group=group) for buf, dst in sends]


class PreparedSlice:
    """One slice (a multiple of D·M elements) of a bucket, its views and messages made once.

    ``bind(op, pools, index)`` before each use (the staging of this call), then the five
    stages as :class:`~.slice.Slice`'s: ``reduce_scatter``, ``collect``, ``add``, ``diffuse``,
    ``all_gather``, ``finish``. ``busy`` is true from ``bind`` to ``finish``: a slice still in
    flight is not bound again (the reducer makes a fresh one)."""

    def __init__(self, piece: torch.Tensor, groups: StageGroups, group_size: int, inside: str = "messages"):
        D, M = groups.layout.D, groups.layout.M
        d, m = groups.d, groups.m
        if piece.numel() % (D * M):
            raise ValueError(f"a prepared slice holds a multiple of D·M = {D * M} elements, got {piece.numel()}")
        self.piece, self.groups, self.p, self.D, self.M, self.d, self.m = piece, groups, group_size, D, M, d, m
        self.cuda, self.collectives_inside = piece.is_cuda, inside == "collectives"
        self.busy, self.index, self.op = False, 0, ReduceOp.SUM
        k = piece.numel() // (D * M)
        blocks = piece.view(D, M, k)
        self.k, self.blocks, self.own, self.mine = k, blocks, blocks[d], blocks[d, m]
        inside_ranks, rail = groups.inside_ranks(), groups.rail_ranks()
        near = [j for j in range(D) if j != d]
        far = [j for j in range(M) if j != m]
        self.near_peers = [inside_ranks[j] for j in near]
        self.rs_sends = [(blocks[j], inside_ranks[j]) for j in near]
        self.ag = [(blocks[j], inside_ranks[j]) for j in near], [(self.own, inside_ranks[j]) for j in near]
        self.far_peers = [rail[j] for j in far]
        self.far = far
        self.collect_sends = [(self.own[j], rail[j]) for j in far]
        self.diffuse_messages = ([(self.own[j], rail[j]) for j in far], [(self.mine, rail[j]) for j in far])
        self.staging = blocks[(d + 1) % D] if D > 1 and M > 1 else None    # Fairring's trick (see .slice)
        # the flat views the collectives take
        self.flat_blocks, self.flat_own, self.flat_mine = blocks.view(-1), self.own.view(-1), self.mine.view(-1)
        self.flat_staging = self.staging.view(-1) if self.staging is not None else None
        self.partials: list = []
        self.rows: list = []
        self.labelled = False

    # ---- per call ----------------------------------------------------------------------

    def bind(self, op, region: torch.Tensor, kinds: dict, index: int) -> "PreparedSlice":
        """This call's op and staging: the partial sums' rows (messages, D > 1) and, with
        D = 1, the collect's M rows, carved from ``region`` (bytes of the reducer's ring laid
        out as ``kinds``: name -> bytes, each on a 64-byte boundary)."""
        self.busy, self.op, self.index = True, op, index
        self.labelled = trace.active()           # a recording is open: the stages label their calls
        dtype, k, D, M = self.piece.dtype, self.k, self.D, self.M
        at = 0
        for kind, size in kinds.items():
            if kind == "partials" and D > 1 and not self.collectives_inside:
                buf = region[at:at + (D - 1) * M * k * dtype.itemsize].view(dtype)
                self.partials = list(buf.view(D - 1, M, k).unbind(0))
            elif kind == "staging" and M > 1 and D == 1:
                self.flat_staging = region[at:at + M * k * dtype.itemsize].view(dtype)
                self.staging = self.flat_staging.view(M, k)
            at += -(-size // 64) * 64
        if M > 1:
            self.rows = [self.staging[j] for j in self.far]
        return self

    def _stage(self, stage: str, post_stage, skip: bool) -> list:
        """Post one stage's works (none when ``skip``: a tier of one), labelled only while a
        trace records."""
        if skip:
            return []
        if not self.labelled:
            return post_stage()
        with trace.label(f"slice {self.index}: {stage}"):
            return post_stage()

    # ---- the stages (labelled in a trace only while a recording is open) ----------------

    def reduce_scatter(self) -> list:
        return self._stage("reduce-scatter", self._reduce_scatter, self.D == 1)

    def _reduce_scatter(self) -> list:
        g = self.groups.reduce_scatter
        if self.collectives_inside:
            base = ReduceOp.SUM if self.op == ReduceOp.AVG else self.op
            return [dist.reduce_scatter_tensor(self.flat_own, self.flat_blocks, op=base, group=g, async_op=True)]
        return post(list(zip(self.partials, self.near_peers)), self.rs_sends, g, self.cuda)

    def collect(self) -> list:
        for row in self.partials:              # the end of stage 1: the partial sums are in
            ops.combine_(self.own, row, self.op)
        self.partials = []
        return self._stage("collect", self._collect, self.M == 1)

    def _collect(self) -> list:
        g = self.groups.collect
        if self.collectives_inside:
            return [dist.all_to_all_single(self.flat_staging, self.flat_own, group=g, async_op=True)]
        return post(list(zip(self.rows, self.far_peers)), self.collect_sends, g, self.cuda)

    def add(self) -> None:
        for row in self.rows:
            ops.combine_(self.mine, row, self.op)
        ops.finish_(self.mine, self.op, self.p)

    def diffuse(self) -> list:
        return self._stage("diffuse", self._diffuse, self.M == 1)

    def _diffuse(self) -> list:
        return self._gather(self.groups.diffuse, self.flat_own, self.flat_mine, self.diffuse_messages)

    def all_gather(self) -> list:
        return self._stage("all-gather", self._all_gather, self.D == 1)

    def _all_gather(self) -> list:
        return self._gather(self.groups.all_gather, self.flat_blocks, self.flat_own, self.ag)

    def _gather(self, group, whole, part, messages) -> list:
        """Stages 4 and 5 alike: ``part`` (this rank's) to every member of ``group``, landing in
        ``whole`` in place -- one all-gather on NCCL, else the prepared (receives, sends)."""
        if self.collectives_inside:
            return [dist.all_gather_into_tensor(whole, part, group=group, async_op=True)]
        return post(*messages, group, self.cuda)

    def finish(self) -> None:
        self.rows = []
        self.busy = False
