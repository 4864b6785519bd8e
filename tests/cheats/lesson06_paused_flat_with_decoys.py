"""Lesson 6, cheat (a): every gradient averaged by one flat ``dist.all_reduce`` under
``trace.paused()`` at the end of backward; the buckets' all-reduces are decoys -- launched
in bucket order, as soon as each bucket is complete, of the buckets' sizes, carrying zeros.

An in-rank grader reading the course's trace saw the right launches and the right
gradients: tasks 2, 5 and 6 scored. The tap records the flat all-reduce at the process group,
and task 2 reads what the buckets themselves hold.
"""

import torch
import torch.distributed as dist

from collectives import trace
from collectives.bucketing import *  # noqa: F401,F403
from collectives.bucketing import BucketedReducer as _Reference


class BucketedReducer(_Reference):
    def _mark_ready(self, index):
        if self._marked[index]:
            raise RuntimeError("marked twice")
        self._marked[index] = True
        b, slot = self._where[index]
        bucket = self.buckets[b]
        bucket.views[slot].zero_()                  # a decoy: the bucket carries zeros
        bucket.pending -= 1
        if bucket.pending == 0:
            while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
                self._launch(self._next_bucket)
                self._next_bucket += 1

    def _finalize(self):
        for i, marked in enumerate(self._marked):
            if not marked:
                self._mark_ready(i)
        used = self._globally_used() if self.find_unused_parameters else None
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        with trace.paused():
            dist.all_reduce(flat, group=self.group)
        flat.div_(self.world_size)
        offset = 0
        for i, p in enumerate(self.params):
            n = p.numel()
            if used is None or used[i]:
                b, slot = self._where[i]
                view = self.buckets[b].views[slot]
                view.copy_(flat[offset:offset + n].view_as(p))
                p.grad = view if self.gradient_as_bucket_view else view.clone()
            offset += n
