"""Lesson 10: sharded data parallel -- ZeRO-1, ZeRO-2 and ZeRO-3 / FSDP on the ring's halves.

* :mod:`~collectives.sharded.shard` -- dim-0 shards with padding, packing for the collectives;
* :mod:`~collectives.sharded.zero` -- ZeRO-1 and ZeRO-2 (optimizer state, then gradients, sharded);
* :mod:`~collectives.sharded.fsdp` -- ZeRO-3 / FSDP with prefetch and mixed precision;
* :mod:`~collectives.sharded.groups` -- hybrid sharding's groups and ``reshard_after_forward=k``'s;
* :mod:`~collectives.sharded.usage` -- parameters used on some ranks and not on others;
* :mod:`~collectives.sharded.steps` -- the exercise's four moves, one function each;
* :mod:`~collectives.sharded.zero3_steps` -- ZeRO-3's whole step from them: a layer's hooks, training;
* :mod:`~collectives.sharded.cost` -- memory per rank and bytes moved, by stage.
"""

from .cost import comm_elements, memory_bytes
from .fsdp import FSDP, MixedPrecision
from .groups import hybrid_groups
from .shard import ShardGroup, ShardSpec, all_gather, reduce_scatter
from .steps import forward_prefetch, free_layer, gather_layer, shard_rows, unshard_rows, zero1_step
from .zero import ZeRO, optimizer_state_bytes, tensor_bytes
from .zero3_steps import reduce_scatter_grads, zero3_layer, zero3_train

__all__ = [
    "FSDP", "MixedPrecision", "ShardGroup", "ShardSpec", "ZeRO", "all_gather", "comm_elements",
    "forward_prefetch", "free_layer", "gather_layer", "hybrid_groups", "memory_bytes",
    "optimizer_state_bytes", "reduce_scatter", "reduce_scatter_grads", "shard_rows", "tensor_bytes",
    "unshard_rows", "zero1_step", "zero3_layer", "zero3_train",
]
