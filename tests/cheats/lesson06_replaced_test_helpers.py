"""Lesson 6, cheat (b): the graded tests' own helpers replaced at import. The old tests ran
their checks in the ranks and measured the difference from torch DDP with helpers of the
test module (``_max_diff``, ``_grad_diff``), which this file makes return 0; the reducer
then never writes the averages back (without ``gradient_as_bucket_view``, each rank keeps
its own gradients). Tasks 3 and 4 scored. The judge compares in the grading process.
"""

import sys

from collectives.bucketing import *  # noqa: F401,F403
from collectives.bucketing import BucketedReducer as _Reference

for _name in ("tests.test_06_bucketing", "test_06_bucketing"):
    _tests = sys.modules.get(_name)
    if _tests is not None:
        _tests._max_diff = lambda a, b: 0.0
        _tests._grad_diff = lambda a, b: 0.0


class BucketedReducer(_Reference):
    def _finalize(self):
        if self.gradient_as_bucket_view or self.find_unused_parameters:
            return super()._finalize()
        for i, marked in enumerate(self._marked):
            if not marked:
                self._mark_ready(i)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None          # and nothing written back: every rank keeps its own
