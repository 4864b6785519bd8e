"""Lesson 5: fused buffers, after Apache SINGA's ``Communicator::fusedSynch``.

Read it in this order:

1. :mod:`collectives.fused.layout` -- the plan: which tensor goes in which slot of which
   buffer, and the copies in and back;
2. :mod:`collectives.fused.reducer` -- SINGA's design, plainly: :class:`FusedAllReducer`,
   with buffers, the threshold, three streams ordered by events, fp16/bf16, double buffering;
3. :mod:`collectives.fused.fast` -- the second step, for training loops:
   :class:`FastFusedAllReducer` builds on the plain reducer so that a list seen before
   skips what it need not do again (its plan, its copies recorded as a CUDA graph, row
   copies on the host, ``bind`` and ``bind_grads``), with the mechanics in
   :mod:`collectives.fused.reuse`. :func:`fused_all_reduce`, the one-call form, uses it.
"""

from .fast import FastFusedAllReducer, fused_all_reduce  # noqa: F401
from .layout import (DEFAULT_BUFFER_BYTES, DEFAULT_THRESHOLD_BYTES, Bucket, Layout,  # noqa: F401
                     _wire_op, copy_back, copy_in, flush, plan_layout, slot_views, wire_dtype)
from .reducer import FusedAllReducer  # noqa: F401

__all__ = ["FusedAllReducer", "FastFusedAllReducer", "fused_all_reduce", "plan_layout", "Layout",
           "Bucket", "copy_in", "copy_back", "flush", "slot_views", "wire_dtype",
           "DEFAULT_BUFFER_BYTES", "DEFAULT_THRESHOLD_BYTES"]
