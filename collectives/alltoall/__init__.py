"""Lesson 11: all-to-all, and the mixture-of-experts dispatch built on it.

* :mod:`.flat` -- all-to-all from point-to-point: linear (every pair at once), pairwise
  exchange (p − 1 rounds) and Bruck (⌈log2 p⌉ rounds), ``dist.all_to_all_single``'s
  contract, uneven splits included;
* :mod:`.splits` -- the sizes first, then the rows: :func:`exchange_splits` and
  :func:`all_to_all_uneven`;
* :mod:`.hierarchical` -- across machines: gather inside, one message per machine pair
  across, scatter inside;
* :mod:`.moe` -- a top-k router with capacity, dispatch and combine as autograd
  all-to-alls, and the same layer in one process to check it against; :mod:`.layer`,
  the layer made of them;
* :mod:`.dedup` -- the MoE dispatch and combine that send a token across to a machine
  once, however many of its experts live there; :mod:`.dedup_stream`, its rows streamed
  so that the hop inside overlaps the crossing;
* :mod:`.balance` -- the load-balancing loss and the bias-based balancing without one;
* :mod:`.cost` -- the α–β cost of each, Bruck's crossover, and the deduplication's saving;
* :mod:`.plan` -- what a call works out once and reuses on the same buffers: blocks as
  views of the output, ranks, the ``P2POp`` lists.
"""

from . import balance, cost, dedup, dedup_stream
from .balance import balance_experts
from .flat import bruck_all_to_all, check_all_to_all_args, linear_all_to_all, pairwise_all_to_all, pairwise_schedule
from .hierarchical import carrier, hierarchical_all_to_all
from .layer import MoELayer, PhaseTimer
from .moe import (
    AllToAll,
    Routing,
    all_to_all_autograd,
    capacity_for,
    combine,
    dispatch_order,
    exchange_counts,
    expert_forward,
    flat_combine,
    flat_dispatch,
    run_experts,
    topk_dispatch_combine,
    make_expert,
    make_router,
    moe_dispatch_combine,
    moe_reference,
    route,
)
from .splits import all_to_all_uneven, exchange_splits

__all__ = ["linear_all_to_all", "pairwise_all_to_all", "bruck_all_to_all", "check_all_to_all_args",
           "pairwise_schedule", "hierarchical_all_to_all", "carrier", "exchange_splits", "all_to_all_uneven",
           "AllToAll", "all_to_all_autograd", "moe_dispatch_combine", "MoELayer", "moe_reference", "Routing", "route",
           "capacity_for",
           "dispatch_order", "combine", "expert_forward", "make_router", "make_expert", "exchange_counts", "cost",
           "flat_dispatch", "flat_combine", "run_experts", "dedup", "dedup_stream", "balance", "PhaseTimer",
           "topk_dispatch_combine", "balance_experts"]
