"""Hierarchical all-reduce in training: a DDP communication hook, and lesson 6's reducer.

torch's ``DistributedDataParallel`` lets a hook replace its per-bucket all-reduce::

    state = HierarchicalHookState(layout=(2, 2))
    ddp_model.register_comm_hook(state, hierarchical_hook)

DDP calls ``hierarchical_hook(state, bucket)`` for each bucket as soon as its gradients
are in, in bucket order, on every rank. The hook divides the bucket by the world size (as
DDP's default ``allreduce_hook`` does, so the two agree bit for bit on integer-valued
gradients), hands it to a :class:`~.inflight.HierarchicalAllReducer` and returns the
bucket's future *without waiting*: backward goes on computing the next bucket while this
one crosses machines, and several buckets are in flight at once. DDP waits for the
futures at the end of backward.

:class:`HierarchicalBucketedReducer` is the same thing through lesson 6's
``BucketedReducer``: each bucket, once full, is handed to the in-flight reducer instead
of ``dist.all_reduce(async_op=True)``; its handle is what the reducer waits on.
"""

# (no `from __future__ import annotations`: DDP checks the hook's annotations as objects)

import time

import torch
import torch.distributed as dist

from ..bucketing import BucketedReducer
from .inflight import DEFAULT_MEMORY, HierarchicalAllReducer


class HierarchicalHookState:
    """What :func:`hierarchical_hook` keeps between buckets: the in-flight reducer (made on
    the first bucket, on every rank at once) and how many buckets it reduced."""

    def __init__(self, group=None, layout=None, memory_bytes: int = DEFAULT_MEMORY, **reducer_options):
        self.group, self.layout, self.memory_bytes = group, layout, memory_bytes
        self.options = reducer_options
        self.reducer: HierarchicalAllReducer | None = None
        self.buckets = 0

    def reducer_for(self, tensor: torch.Tensor) -> HierarchicalAllReducer:
        if self.reducer is None:
            self.reducer = HierarchicalAllReducer(self.group, self.layout, memory_bytes=self.memory_bytes,
                                                  device=tensor.device, **self.options)
        return self.reducer


def hierarchical_hook(state: HierarchicalHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: average the bucket by a hierarchical all-reduce in flight."""
    flat = bucket.buffer()
    flat.div_(dist.get_world_size(state.group))        # as DDP's allreduce_hook: divide, then sum
    state.buckets += 1
    return state.reducer_for(flat).all_reduce(flat).get_future()


class HierarchicalBucketedReducer(BucketedReducer):
    """Lesson 6's reducer with each bucket all-reduced hierarchically, buckets in flight.

    ``HierarchicalBucketedReducer(model, layout=(2, 2))`` trains like
    ``BucketedReducer(model)``; the bucket already holds gradients divided by the world
    size, so it is summed. ``memory_bytes`` and the other keywords of
    :class:`~.inflight.HierarchicalAllReducer` go to the in-flight reducer.
    """

    def __init__(self, module, *, layout=None, memory_bytes: int = DEFAULT_MEMORY, reducer_options=None,
                 **kwargs):
        super().__init__(module, **kwargs)
        device = self.buckets[0].flat.device if self.buckets else self._comm_device()
        self.in_flight = HierarchicalAllReducer(self.group, layout, memory_bytes=memory_bytes, device=device,
                                                **(reducer_options or {}))

    def _launch(self, b: int) -> None:
        bucket, stats = self.buckets[b], self.stats
        stats.bucket_launched[b] = time.perf_counter()
        bucket.work = self.in_flight.all_reduce(bucket.flat)    # returns at once; waited at the end
        bucket.work.get_future().add_done_callback(
            lambda _, b=b: stats.bucket_done.__setitem__(b, time.perf_counter()))

    def close(self) -> None:
        super().close()
        self.in_flight.close()
