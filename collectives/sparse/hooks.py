"""Sparse all-reduce in training: a DDP communication hook, and lesson 6's reducer.

torch's ``DistributedDataParallel`` lets a user replace its per-bucket all-reduce::

    state = SparseHookState(density=0.01)
    ddp_model.register_comm_hook(state, sparse_hook)

DDP calls ``sparse_hook(state, bucket)`` once per bucket as soon as the bucket's gradients
are in; the hook returns a future holding the averaged gradients. Error feedback needs
memory that outlives the step: one residual per bucket, kept in the state. DDP rebuilds its
buckets once, after the first iteration (to follow the order gradients really arrived in),
so a bucket's index can name a differently-sized buffer from the second step on: a
residual whose size no longer matches is started again at zeros (torch's PowerSGD hook
sidesteps the same issue by compressing only from its second iteration).

:class:`SparseBucketedReducer` is the same thing through lesson 6's ``BucketedReducer``:
each bucket, once full, is sparse-all-reduced with its own residual instead of
all-reduced.

As in torch's default hook, gradients are divided by the world size *before* the
reduction, so at density 1 the hook is bit for bit DDP's own all-reduce, and the residual
holds averaged units.
"""

# (no `from __future__ import annotations`: DDP checks the hook's annotations as objects)

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..bucketing import BucketedReducer
from .all_reduce import sparse_all_reduce


@dataclass
class SparseHookState:
    """Settings and per-bucket memory of :func:`sparse_hook`."""

    density: float | None = None        # top-k mode ...
    threshold: float | None = None      # ... or threshold mode
    error_feedback: bool = True         # keep what was not sent for the next step
    method: str = "auto"                # transport: auto | allgather | split | dense
    selection: str = "auto"             # top-k method (collectives.sparse.select)
    group: object = None                # the process group (DDP's own is passed to the hook too)
    residuals: dict = field(default_factory=dict)    # bucket index -> residual
    selection_state: dict = field(default_factory=dict)   # bucket index -> "reuse" threshold
    sent: int = 0                       # pairs sent by this rank, since creation
    elements: int = 0                   # elements reduced, since creation

    def residual_for(self, key, flat: torch.Tensor) -> torch.Tensor | None:
        """The residual of bucket ``key``; zeros when new or when the bucket changed size."""
        if not self.error_feedback:
            return None
        res = self.residuals.get(key)
        if res is None or res.shape != flat.shape or res.dtype != flat.dtype:
            res = self.residuals[key] = torch.zeros_like(flat)
        return res

    def reduce_(self, key, flat: torch.Tensor, group=None) -> torch.Tensor:
        """Sparse-all-reduce ``flat`` (already divided by the world size) in place; SUM."""
        info = sparse_all_reduce(flat, self.residual_for(key, flat), density=self.density,
                                 threshold=self.threshold, method=self.method,
                                 selection=self.selection, group=group or self.group,
                                 state=self.selection_state.setdefault(key, {}))
        self.sent += info.kept
        self.elements += flat.numel()
        return flat


def sparse_hook(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: average the bucket's gradients by a sparse all-reduce."""
    flat = bucket.buffer()
    group = state.group
    p = dist.get_world_size(group)
    flat.div_(p)                          # as DDP's allreduce_hook: divide, then sum
    state.reduce_(bucket.index(), flat, group)
    fut = torch.futures.Future()
    fut.set_result(flat)
    return fut


class _Done:
    """The handle of a reduction that already happened (what ``bucket.work`` expects)."""

    def __init__(self, tensor: torch.Tensor):
        self._future = torch.futures.Future()
        self._future.set_result(tensor)

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class SparseBucketedReducer(BucketedReducer):
    """Lesson 6's reducer with a sparse all-reduce per bucket (error feedback per bucket).

    ``SparseBucketedReducer(model, density=0.01)`` trains like ``BucketedReducer(model)``
    with every bucket's all-reduce replaced by :func:`collectives.sparse.sparse_all_reduce`.
    The bucket already holds gradients divided by the world size, so it is summed.
    """

    def __init__(self, module, *, density=None, threshold=None, error_feedback=True,
                 method="auto", selection="auto", **kwargs):
        super().__init__(module, **kwargs)
        self.sparse = SparseHookState(density, threshold, error_feedback, method, selection, self.group)

    def _launch(self, b: int) -> None:
        bucket, stats = self.buckets[b], self.stats
        stats.bucket_launched[b] = time.perf_counter()
        self.sparse.reduce_(b, bucket.flat, self.group)    # synchronous: done when it returns
        bucket.work = _Done(bucket.flat)
        stats.bucket_done[b] = time.perf_counter()
