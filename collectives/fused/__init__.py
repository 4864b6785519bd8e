"""Lesson 5: fused buffers, after Apache SINGA's ``Communicator::fusedSynch``.

Read it in this order:

1. :mod:`collectives.fused.layout` -- the plan: which tensor goes in which slot of which
   buffer, and the copies in and back;
2. :mod:`collectives.fused.reducer` -- SINGA's design: buffers, the threshold, three streams
   ordered by events, fp16/bf16 on the wire, double buffering;
3. :mod:`collectives.fused.reuse` -- the second step, for training loops: what a list seen
   before need not do again (its plan, its copies recorded as a CUDA graph, row copies on
   the host, ``bind``).
"""

from .layout import (DEFAULT_BUFFER_BYTES, DEFAULT_THRESHOLD_BYTES, Bucket, Layout,  # noqa: F401
                     _wire_op, copy_back, copy_in, flush, plan_layout, slot_views, wire_dtype)
from .reducer import FusedAllReducer, fused_all_reduce  # noqa: F401

__all__ = ["FusedAllReducer", "fused_all_reduce", "plan_layout", "Layout", "Bucket", "copy_in",
           "copy_back", "flush", "slot_views", "wire_dtype", "DEFAULT_BUFFER_BYTES",
           "DEFAULT_THRESHOLD_BYTES"]
