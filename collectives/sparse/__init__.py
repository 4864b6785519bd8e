"""Lesson 8: sparse all-reduce with error feedback, after SINGA's ``valSparsAllReduce``.

Gradients are large and most of their entries are small. A sparse all-reduce sends only
the entries that matter -- those above a threshold, or the k largest -- and keeps the rest
in a **residual** that is added to the next step's gradient (error feedback): nothing is
lost, only delayed. The lesson is split along its ideas:

* :mod:`.select`    -- which entries to send: a threshold, or top-k four ways, timed;
* :mod:`.allgather` -- SINGA's transport: all-gather (index, value) pairs, sum into zeros;
* :mod:`.split`     -- SparCML's transport that scales with p: sparse reduce-scatter,
                       then all-gather of the reduced pieces, dense once they fill;
* :mod:`.hooks`     -- the same inside training: a DDP communication hook, and lesson 6's
                       reducer with a sparse all-reduce per bucket;
* :mod:`.lab`       -- data-parallel training on real digits, to measure what it costs.

:func:`sparse_all_reduce` ties them together; ``collectives.cost.choose_sparse_variant``
picks the transport from n, k, p and the link's α and β.
"""

from __future__ import annotations

from .all_reduce import VARIANTS, SparseInfo, select_to_send, sparse_all_reduce
from .allgather import allgather_sum_, exchange_counts, pack_pairs, unpack_pairs
from .hooks import SparseBucketedReducer, SparseHookState, sparse_hook
from .select import (INDEX_DTYPE, MAX_NUMEL, METHODS, keep_count, threshold_indices, time_selection,
                     topk_indices, truncated_magnitude_topk)
from .split import SplitInfo, piece_bounds, split_sum_

__all__ = ["sparse_all_reduce", "SparseInfo", "select_to_send", "allgather_sum_", "split_sum_",
           "exchange_counts", "pack_pairs", "unpack_pairs", "keep_count", "threshold_indices",
           "topk_indices", "truncated_magnitude_topk", "time_selection", "piece_bounds",
           "SparseHookState", "sparse_hook", "SparseBucketedReducer",
           "METHODS", "VARIANTS", "MAX_NUMEL", "INDEX_DTYPE", "SplitInfo"]
