"""Lesson 7: hierarchical all-reduce, after Fairring -- fast links inside, slow ones across.

A cluster has two tiers: D ranks per machine on fast links (NVLink, shared memory), M
machines joined by a slower network. A flat ring over all D·M ranks sends 2(p − 1)/p·n
across every machine boundary; the hierarchy sends each byte across once per rail:

* :mod:`.layout` -- the machine layout (from the launcher's environment or ``layout=(D, M)``),
  a process group per stage, the checks every call starts with, and the bytes of a trace
  by tier;
* :mod:`.slice` -- one slice viewed as [D, M, −1] through five stages: reduce-scatter
  inside, collect on the rail, add, diffuse on the rail, all-gather inside; Fairring's
  staging trick and padding slot;
* :mod:`.pipeline` -- :func:`hierarchical_all_reduce`: slices pipelined, a stream and a
  group per stage, a bounded pool of slots;
* :mod:`.simple` -- the two simpler hierarchies beside it: root-based (Horovod) and
  reduce-scatter → all-reduce on the rails → all-gather;
* :mod:`.rails` -- the flat ring that uses every rail (NCCL's channels over several NICs),
  what the hierarchy is measured against when there are rails;
* :mod:`.inflight` -- the asynchronous call: a handle at once, buckets in flight in a
  bounded staging memory, a lane per stage (a stream on a GPU, a thread on a CPU:
  :mod:`.lanes`, with the staging ring), its slices prepared once per bucket tensor
  (:mod:`.program`);
* :mod:`.hooks` -- a DDP communication hook, and lesson 6's reducer, on the in-flight call;
* :mod:`.cost` -- the tier-aware cost model (``Tiers``, ``tiered``, ``predict_tiered``,
  ``slice_plan``), on :mod:`collectives.core.cost`'s α–β primitives.
"""

from .cost import DEFAULT_TIERS, Tiers, predict_tiered, slice_plan, tiered, tiers_for
from .hooks import HierarchicalBucketedReducer, HierarchicalHookState, hierarchical_hook
from .inflight import Handle, HierarchicalAllReducer, hierarchical_all_reduce_async
from .layout import Layout, StageGroups, bytes_by_tier, check_layout, resolve, stage_groups, tier_bytes
from .pipeline import default_slice_numel, hierarchical_all_reduce, one_slice_all_reduce
from .rails import rail_ring_all_reduce
from .simple import rail_all_reduce, root_based_all_reduce

__all__ = ["hierarchical_all_reduce", "one_slice_all_reduce", "root_based_all_reduce",
           "rail_all_reduce", "rail_ring_all_reduce", "hierarchical_all_reduce_async",
           "HierarchicalAllReducer", "Handle", "hierarchical_hook", "HierarchicalHookState",
           "HierarchicalBucketedReducer", "Layout", "StageGroups", "resolve", "check_layout",
           "stage_groups", "bytes_by_tier", "tier_bytes", "default_slice_numel",
           "Tiers", "DEFAULT_TIERS", "tiered", "predict_tiered", "slice_plan", "tiers_for"]
