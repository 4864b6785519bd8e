"""Lesson 7: hierarchical all-reduce, after Fairring -- fast links inside, slow ones across.

A cluster has two tiers: D ranks per machine on fast links (NVLink, shared memory), M
machines joined by a slower network. A flat ring over all D·M ranks sends 2(p − 1)/p·n
across every machine boundary; the hierarchy sends each byte across once per rail:

* :mod:`.layout` -- the machine layout (from the launcher's environment or ``layout=(D, M)``),
  a process group per stage, and the bytes of a trace by tier;
* :mod:`.slice` -- one slice viewed as [D, M, −1] through five stages: reduce-scatter
  inside, collect on the rail, add, diffuse on the rail, all-gather inside; Fairring's
  staging trick and padding slot;
* :mod:`.pipeline` -- :func:`hierarchical_all_reduce`: slices pipelined, a stream and a
  group per stage, a bounded pool of slots;
* :mod:`.simple` -- the two simpler hierarchies beside it: root-based (Horovod) and
  reduce-scatter → all-reduce on the rails → all-gather.

The tier-aware cost model is in :mod:`collectives.cost` (``Tiers``, ``tiered``,
``predict_tiered``, ``best_slice_bytes``).
"""

from .layout import Layout, StageGroups, bytes_by_tier, resolve, stage_groups, tier_bytes
from .pipeline import default_slice_numel, hierarchical_all_reduce, one_slice_all_reduce
from .simple import rail_all_reduce, root_based_all_reduce

__all__ = ["hierarchical_all_reduce", "one_slice_all_reduce", "root_based_all_reduce",
           "rail_all_reduce", "Layout", "StageGroups", "resolve", "stage_groups",
           "bytes_by_tier", "tier_bytes", "default_slice_numel"]
