"""Lesson 10: ZeRO-1 and ZeRO-2 -- the model replicated, the optimizer state (and gradients) sharded.

After ZeRO (Rajbhandari et al., 2020), stages 1 and 2. Every rank holds the whole model and
computes the whole gradient, as in data parallel training; what it keeps of the optimizer
is only its rows of every parameter (:mod:`collectives.sharded.shard`'s dim-0 layout)::

    backward          g (full, every rank)
    reduce-scatter    g -> my rows of mean(g)          (p-1)/p · Ψ elements sent
    step              Adam on my rows only             optimizer state 8 B · Ψ/p (fp32)
    all-gather        my rows -> everybody's rows      (p-1)/p · Ψ elements sent

Reduce-scatter plus all-gather move exactly what one ring all-reduce moves (lesson 4): the
optimizer state shrinks p-fold for free.

* **ZeRO-1** (:class:`ZeRO` with ``stage=1``): one reduce-scatter over every gradient
  after backward, the full gradients kept until then (4 B · Ψ).
* **ZeRO-2** (``stage=2``): the gradients reduce-scattered bucket by bucket *during*
  backward, with lesson 6's buckets (:func:`collectives.bucketing.buckets.assign_buckets`),
  and freed at once: a rank holds its gradient rows and at most one bucket of full ones.

A rank's rows of a parameter are contiguous in it, so the optimizer steps on views of the
model's own parameters: no second copy of the weights (fp32 here; the mixed-precision
masters are :mod:`collectives.sharded.fsdp`'s).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from collectives.bucketing.buckets import assign_buckets
from collectives.core import ops

from .shard import ShardGroup, all_gather, reduce_scatter

DEFAULT_BUCKET_CAP_BYTES = 1 << 20


def _rank_and_size(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("sharded training needs an initialized process group (dist.init_process_group)")
    return ops.group_rank_and_size(group)


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts with its storage)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen and storage.nbytes() > 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (Adam: exp_avg, exp_avg_sq, step)."""
    tensors = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


class ZeRO:
    """ZeRO-1 or ZeRO-2 data parallel training of ``model`` (see the module).

    ``optimizer`` builds the optimizer from a list of parameters (default Adam, lr 1e-3);
    it is given this rank's rows of each parameter. Use::

        zero = ZeRO(model, stage=2)
        loss_fn(model(x), y).backward()
        zero.step()                       # reduce-scatter (stage 1), step, all-gather
        zero.zero_grad()

    ``use_torch`` swaps lesson 4's ring for ``dist.reduce_scatter_tensor`` /
    ``dist.all_gather_into_tensor``.
    """

    def __init__(self, model: nn.Module, stage: int = 1, optimizer=None, *, use_torch: bool = False,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, group=None):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO: stage must be 1 or 2 (stage 3 is collectives.sharded.FSDP), got {stage!r}")
        if bucket_cap_bytes <= 0:
            raise ValueError(f"ZeRO: bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
        self.rank, self.p = _rank_and_size(group)
        self.model, self.stage, self.use_torch, self.group = model, stage, use_torch, group
        self.params = [q for q in model.parameters() if q.requires_grad]
        if not self.params:
            raise ValueError("ZeRO: the model has no parameter that requires a gradient")
        dtypes = {q.dtype for q in self.params}
        if len(dtypes) != 1 or not self.params[0].is_floating_point():
            raise ValueError(f"ZeRO: parameters must share one floating dtype, got {sorted(map(str, dtypes))}")
        if stage == 1:
            self.buckets = [list(range(len(self.params)))]
        else:
            self.buckets = assign_buckets(self.params, bucket_cap_bytes)
        self.groups = [ShardGroup([self.params[i].shape for i in b], self.p) for b in self.buckets]
        # this rank's rows of each parameter: a view of the parameter itself, stepped in place
        self.rows = {}
        for b, g in zip(self.buckets, self.groups):
            for i, spec in zip(b, g.specs):
                lo, hi = spec.owned_rows(self.rank)
                flat = self.params[i].detach().view(spec.rows, spec.row_numel)
                self.rows[i] = nn.Parameter(flat[lo:hi].view((hi - lo,) + spec.shape[1:]))
        self.shards = [self.rows[i] for i in range(len(self.params))]
        make = optimizer or functools.partial(torch.optim.Adam, lr=1e-3)
        self.optimizer = make(self.shards)
        self.reduced_buckets = 0
        self._pending = [len(b) for b in self.buckets]
        self._bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        self._hooks = []
        if stage == 2:
            for i, q in enumerate(self.params):
                self._hooks.append(q.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i)))

    # -- gradients -> this rank's rows of their mean -----------------------------------------
    def _reduce_bucket(self, k: int) -> None:
        bucket, g = self.buckets[k], self.groups[k]
        grads = []
        for i in bucket:
            q = self.params[i]
            if q.grad is None:
                raise RuntimeError(f"ZeRO: parameter {i} ({tuple(q.shape)}) got no gradient in backward; "
                                   "every parameter must be used")
            grads.append(q.grad)
        packed = g.pack(grads)
        del grads
        for i in bucket:
            self.params[i].grad = None                  # the full gradients are packed: not needed any more
        piece = packed.new_empty(g.shard_numel)
        # packed is ours to overwrite: the ring sums in it, no copy
        reduce_scatter(piece, packed, use_torch=self.use_torch, group=self.group, scratch=True)
        del packed
        for i, spec, view in zip(bucket, g.specs, g.shard_views(piece)):
            row_grad = spec.unpad(view, self.rank)
            shard = self.rows[i]
            shard.grad = row_grad if shard.grad is None else shard.grad.add_(row_grad)
        self.reduced_buckets += 1

    def _grad_ready(self, i: int, param) -> None:
        k = self._bucket_of[i]
        self._pending[k] -= 1
        if self._pending[k] == 0:
            self._reduce_bucket(k)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        """Reduce-scatter what backward has not (all of it in stage 1), step, all-gather."""
        if self.stage == 1:
            self._reduce_bucket(0)
        elif any(n != 0 for n in self._pending):
            waiting = [k for k, n in enumerate(self._pending) if n != 0]
            raise RuntimeError(f"ZeRO-2 on rank {self.rank}: buckets {waiting} never filled during backward; "
                               "call step() after a backward that uses every parameter")
        self._pending = [len(b) for b in self.buckets]
        self.optimizer.step()
        with torch.no_grad():
            for b, g in zip(self.buckets, self.groups):
                mine = torch.cat(g.shard([self.params[i].detach() for i in b], self.rank))
                gathered = mine.new_empty(self.p * g.shard_numel)
                all_gather(gathered, mine, use_torch=self.use_torch, group=self.group)
                g.unpack_into(gathered, [self.params[i] for i in b])   # straight into the weights
                del gathered

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for q in self.params:
            q.grad = None

    def memory(self) -> dict:
        """Bytes this rank holds now: parameters, gradients, optimizer state."""
        return dict(params=tensor_bytes(self.params),
                    grads=tensor_bytes([q.grad for q in self.params] + [s.grad for s in self.shards]),
                    optimizer=optimizer_state_bytes(self.optimizer))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
