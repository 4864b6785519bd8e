"""Lesson 8: sparse all-reduce with error feedback, after SINGA's ``valSparsAllReduce``.

Gradients are large and most of their entries are small. A sparse all-reduce sends only
the entries that matter -- those above a threshold, or the k largest -- and keeps the rest
in a **residual** that is added to the next step's gradient (error feedback): nothing is
lost, only delayed. The lesson is split along its ideas:

* :mod:`.select`    -- which entries to send: a threshold, or top-k five ways, timed;
* :mod:`.allgather` -- SINGA's transport: all-gather (index, value) pairs, sum into zeros;
* :mod:`.split`     -- SparCML's transport that scales with p: sparse reduce-scatter,
                       then all-gather of the reduced pieces, dense once they fill;
* :mod:`.cost`      -- bytes on the wire and the processor's share; the transport to pick;
* :mod:`.profile`   -- one group's link and processor, measured once, for ``transport="auto"``;
* :mod:`.hooks`     -- the same inside training: DDP communication hooks (plain, and left
                       in flight), residuals kept per parameter, lesson 6's reducer;
* :mod:`.dgc`       -- Deep Gradient Compression's corrections: per-layer selection,
                       momentum correction with factor masking, density warm-up;
* :mod:`.lab`       -- data-parallel training on real digits, to measure what it costs.

:func:`sparse_all_reduce` ties them together (:func:`sparse_all_reduce_async` leaves its
collective in flight). Two arguments name its choices: ``transport`` (how the pairs travel:
``"allgather"``, ``"split"``, ``"dense"``, ``"auto"``) and ``selection`` (how top-k finds
the k largest: ``"topk"``, ``"sort"``, ``"kthvalue"``, ``"reuse"``, ``"sample"``, ``"auto"``).
"""

from __future__ import annotations

from .all_reduce import (SELECTION_CHOICES, TRANSPORT_CHOICES, SparseInfo, SparseWork, select_to_send,
                         sparse_all_reduce, sparse_all_reduce_async)
from .allgather import add_gathered_, allgather_sum_, allgather_sum_async, exchange_counts, pack_pairs, unpack_pairs
from .cost import (TRANSPORTS, SparseCompute, SparseProfile, choose_transport, sparse_cost, sparse_crossover,
                   sparse_seconds)
from .dgc import DGCState, dgc_hook
from .hooks import (ParameterMemory, SparseBucketedReducer, SparseHookState, on_a_thread, register_sparse_hook,
                    sparse_hook, sparse_hook_async)
from .profile import measure_profile, profile_for, set_profile
from .select import (INDEX_DTYPE, MAX_NUMEL, SELECTIONS, keep_count, magnitude, sample_threshold,
                     threshold_in, threshold_indices, time_selection, topk_indices, topk_per_segment,
                     truncated_magnitude_topk)
from .split import SplitInfo, piece_bounds, split_sum_

__all__ = ["sparse_all_reduce", "sparse_all_reduce_async", "SparseInfo", "SparseWork", "select_to_send",
           "allgather_sum_", "allgather_sum_async", "add_gathered_", "split_sum_", "exchange_counts",
           "pack_pairs", "unpack_pairs", "keep_count", "magnitude", "threshold_in", "sample_threshold",
           "threshold_indices", "topk_indices", "topk_per_segment",
           "truncated_magnitude_topk", "time_selection", "piece_bounds", "SplitInfo",
           "SparseHookState", "ParameterMemory", "sparse_hook", "sparse_hook_async", "on_a_thread",
           "register_sparse_hook",
           "SparseBucketedReducer", "DGCState", "dgc_hook",
           "TRANSPORTS", "TRANSPORT_CHOICES", "SELECTIONS", "SELECTION_CHOICES", "MAX_NUMEL", "INDEX_DTYPE",
           "SparseCompute", "SparseProfile", "sparse_cost", "sparse_seconds", "choose_transport",
           "sparse_crossover", "measure_profile", "profile_for", "set_profile"]
