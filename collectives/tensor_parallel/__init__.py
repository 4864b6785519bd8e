"""Lesson 13: tensor and sequence parallelism, after Megatron-LM, ending in async TP.

* :mod:`~collectives.tensor_parallel.comm` -- the group and the conjugate operators (f, g and
  the sequence-parallel pair) as autograd functions, on lesson 4's ring or torch's collectives;
* :mod:`~collectives.tensor_parallel.layers` -- column- and row-parallel linear layers, the
  vocabulary-parallel embedding and cross-entropy;
* :mod:`~collectives.tensor_parallel.model` -- a small transformer, whole and split;
* :mod:`~collectives.tensor_parallel.async_tp` -- all-gather → matmul and matmul → reduce-scatter
  cut into p pieces, each transfer under the matmul before it;
* :mod:`~collectives.tensor_parallel.cost` -- bytes per layer and activation memory per rank;
* :mod:`~collectives.tensor_parallel.steps` -- the exercise's moves, one function each;
* :mod:`~collectives.tensor_parallel.torch_tp` -- the same model split by torch's DTensor TP.
"""

from .async_tp import all_gather_matmul, matmul_reduce_scatter
from .comm import TPGroup, copy_to_tp, gather_seq, reduce_from_tp, scatter_seq, split_seq
from .cost import activation_bytes, comm_bytes_per_layer, saved_activation_bytes
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_split,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)
from .model import Config, TinyGPT, TPBlock, TPGPT, check_config
from .steps import (
    chunked_all_gather_matmul,
    column_parallel_linear,
    copy_to_parallel,
    gather_sequence,
    reduce_from_parallel,
    row_parallel_linear,
    scatter_sequence,
    vocab_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear", "Config", "RowParallelLinear", "TPBlock", "TPGPT", "TPGroup", "TinyGPT",
    "VocabParallelEmbedding", "activation_bytes", "all_gather_matmul", "check_config", "check_split",
    "chunked_all_gather_matmul", "column_parallel_linear", "comm_bytes_per_layer", "copy_to_parallel",
    "copy_to_tp", "gather_seq", "gather_sequence", "matmul_reduce_scatter", "reduce_from_parallel",
    "reduce_from_tp", "row_parallel_linear", "saved_activation_bytes", "scatter_seq", "scatter_sequence",
    "split_seq", "sync_sequence_parallel_grads", "vocab_cross_entropy", "vocab_parallel_cross_entropy",
]
