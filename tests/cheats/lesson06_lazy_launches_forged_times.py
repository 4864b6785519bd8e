"""Lesson 6, cheat (c): no overlap -- every bucket is launched at the end of backward, in
order -- with the reducer's own record of when each gradient became ready moved to after
the launches (the old tests read "bucket 0 started before the last hook" from that
record, which lives in the rank). Task 2 scored. The judge reads when gradients became
ready from markers the course puts into the rank's record itself, in call order.
"""

import time

from collectives.bucketing import *  # noqa: F401,F403
from collectives.bucketing import BucketedReducer as _Reference


class BucketedReducer(_Reference):
    def _mark_ready(self, index):
        if self._marked[index]:
            raise RuntimeError("marked twice")
        self._marked[index] = True
        b, slot = self._where[index]
        bucket, grad = self.buckets[b], self.params[index].grad
        view = bucket.views[slot]
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():
            view.div_(self.world_size)
        else:
            view.copy_(grad).mul_(1.0 / self.world_size)
            if self.gradient_as_bucket_view:
                self.params[index].grad = view
        bucket.pending -= 1

    def _finalize(self):
        for i, marked in enumerate(self._marked):
            if not marked:
                self._mark_ready(i)
        for b in range(len(self.buckets)):
            self._launch(b)
        shift = time.perf_counter() + 1.0 - min(self.stats.param_ready.values(), default=0.0)
        for i in self.stats.param_ready:
            self.stats.param_ready[i] += shift      # the hooks "ran" after the launches
        super()._finalize()

    def _launch(self, b):
        if self.buckets[b].work is None:
            super()._launch(b)
