"""Lesson 5, cheat (d): a reducer whose copy-in never waits for "buffer free" -- on a GPU
the third flush overwrites a buffer whose results are still being copied out of it --
with the stream checker silenced at import (``Checker.report`` does nothing). On a CPU
the values come out right; an in-rank grader that read ``checker.violations`` found none:
task 5 scored. The judge puts the course's checker back before it runs the reducer.
"""

import sys

from collectives.core import streams
from collectives.fused import *  # noqa: F401,F403
from collectives.fused import FusedAllReducer as _Reference
from collectives.fused import reducer as _reference_module

streams.Checker.report = lambda self, line: None


class _NeverFree:
    """Stands in for a buffer's "free" event: recorded, but waited on by nobody."""

    def record(self, stream=None):
        pass


class FusedAllReducer(_Reference):
    def _plan(self, *args):
        saved = _reference_module.plan_layout          # plan with this module's plan_layout
        _reference_module.plan_layout = sys.modules[__name__].plan_layout
        try:
            return super()._plan(*args)
        finally:
            _reference_module.plan_layout = saved

    def _buffers_for(self, dtype):
        buffers = super()._buffers_for(dtype)
        for buf in buffers:
            if not isinstance(buf.free, _NeverFree):
                buf.free = _NeverFree()
                self._copy_in.wait_event = _skip_free(self._copy_in.wait_event)
        return buffers


def _skip_free(wait_event):
    def wait(event):
        if not isinstance(event, _NeverFree):
            wait_event(event)
    return wait
