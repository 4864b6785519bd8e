"""Uneven all-to-all: the sizes first, then the data -- what every MoE dispatch does.

A rank knows how many rows it sends each rank (its router decided), not how many it will
receive: that depends on every other rank's router. So a dispatch is two all-to-alls.
The first moves one integer per pair, the counts; it tells each rank its
``output_split_sizes`` and so the size of the buffer to allocate. The second moves the
rows, with empty blocks where a pair has nothing to say (no message at all: both ends
know the size is zero)::

    rank 0 sends [2, 0, 1] rows     counts all-to-all     rank 0 receives [2, 1, 0]
    rank 1 sends [1, 3, 0] rows  ─────────────────────►   rank 1 receives [0, 3, 2]
    rank 2 sends [0, 2, 2] rows                           rank 2 receives [1, 0, 2]

The counts' all-to-all is a round of p − 1 tiny messages: pure latency, (p − 1)·α on
the pairwise schedule, paid again on every call, and the host must read the counts
before it can size the output. Real systems pay it or avoid it. DeepEP's normal kernels
(for training and prefill) exchange the counts on the GPU, then the CPU waits for them to
size the receive buffers: a host synchronisation, so that mode cannot be captured in a
CUDA graph. Its low-latency kernels (for decoding) skip the exchange: every receive buffer
is sized for the worst case, so shapes are fixed and a graph can replay them, at the price
of memory. GShard avoids it with a fixed capacity, padding every block to the same size
and dropping what does not fit.
"""

from __future__ import annotations

import torch

from ..core import ops, trace
from .flat import pairwise_all_to_all

__all__ = ["exchange_splits", "all_to_all_uneven"]


def exchange_splits(input_split_sizes, group=None) -> list[int]:
    """The ``output_split_sizes`` that match ``input_split_sizes``: one count per pair, all-to-all.

    Rank r's result[s] is rank s's ``input_split_sizes[r]``. Accepts a list of ints or a
    1-D integer tensor of p counts.
    """
    rank, p = ops.group_rank_and_size(group)
    if isinstance(input_split_sizes, torch.Tensor):
        if input_split_sizes.dim() != 1 or input_split_sizes.is_floating_point() \
                or input_split_sizes.is_complex() or input_split_sizes.dtype == torch.bool:
            raise ValueError(f"exchange_splits: rank {rank}: input_split_sizes must be a 1-D integer tensor, "
                             f"got {input_split_sizes.dtype} of shape {tuple(input_split_sizes.shape)}")
        input_split_sizes = input_split_sizes.tolist()
    sizes = list(input_split_sizes) if isinstance(input_split_sizes, (list, tuple)) else None
    if sizes is None or len(sizes) != p or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                               for s in sizes):
        raise ValueError(f"exchange_splits: rank {rank}: input_split_sizes must be {p} non-negative integers, "
                         f"got {input_split_sizes!r}")
    device = ops.rank_device()
    send = torch.tensor(sizes, dtype=torch.int64, device=device)
    recv = torch.empty(p, dtype=torch.int64, device=device)
    with trace.label("the split sizes"):
        pairwise_all_to_all(recv, send, group=group)
    return recv.tolist()


def all_to_all_uneven(input: torch.Tensor, input_split_sizes, group=None, *, algorithm=None):
    """Send ``input_split_sizes[d]`` rows of ``input`` to rank d; return ``(output, output_split_sizes)``.

    The sizes are exchanged first (:func:`exchange_splits`), the output allocated from
    them, then the rows move with ``algorithm`` (:func:`pairwise_all_to_all` by default;
    any function with ``dist.all_to_all_single``'s signature). Blocks may be empty.
    """
    if not isinstance(input, torch.Tensor) or input.dim() == 0:
        raise TypeError("all_to_all_uneven: input must be a tensor of at least one dimension (rows)")
    if isinstance(input_split_sizes, torch.Tensor):
        input_split_sizes = input_split_sizes.tolist()
    output_split_sizes = exchange_splits(input_split_sizes, group)
    output = torch.empty((sum(output_split_sizes), *input.shape[1:]), dtype=input.dtype, device=input.device)
    (algorithm or pairwise_all_to_all)(output, input, output_split_sizes, list(input_split_sizes), group)
    return output, output_split_sizes
