"""Lesson 12 on GPUs, in plain torch: the one-shot and the two-shot on torch's symmetric memory.

``symm_mem.empty`` allocates a buffer that ``symm_mem.rendezvous(buffer, group)`` maps into
every peer's address space (over NVLink, through the CUDA driver's memory handles);
``handle.get_buffer(q, shape, dtype)`` is rank q's buffer as a tensor *on this GPU*: a
torch op that reads it loads from q's memory across NVLink, with no message and no copy
engine. ``handle.barrier(channel)`` is a stream-ordered barrier on the signal pads. That is
the CPU lesson's segment, flags and slots, on GPUs::

    one-shot                                  two-shot
      barrier (inputs are written)              barrier
      out = Σ_q peer_q[:n]  (rank order)        buf[chunk r] = Σ_q peer_q[chunk r]
      barrier (nobody reads us any more)        barrier
                                                buf[chunk j] = peer_j[chunk j]  for j ≠ r
                                                barrier

Each ``+`` here is a kernel of its own (p − 1 of them in the one-shot), so this version pays
a launch per peer and reads the running sum back each time: the Triton kernels of
:mod:`collectives.symmetric.triton_allreduce` do it in one launch. Both keep NVLink
multicast off: :func:`no_multicast` sets ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NCCL_NVLS_ENABLE=0`` and ``NVSHMEM_DISABLE_NVLS=1``, and nothing here calls a
multicast (multimem) op.

Everything imports lazily: on a machine without CUDA this module imports and does nothing.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["NO_MULTICAST", "no_multicast", "triton_available", "SymmetricBuffer", "torch_one_shot",
           "torch_two_shot", "symm_mem_ops"]

NO_MULTICAST = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


def no_multicast() -> None:
    """Keep NVLink multicast off, in this process and every process it starts: call it
    before CUDA, NCCL or symmetric memory initialise."""
    os.environ.update(NO_MULTICAST)


def triton_available() -> bool:
    """Triton installed and a CUDA GPU present: the lesson's kernels can run."""
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


class SymmetricBuffer:
    """``numel`` elements of ``dtype`` in symmetric memory, rendezvoused over ``group``
    (collective), with every peer's buffer as a local tensor."""

    def __init__(self, numel: int, dtype: torch.dtype, group=None):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group = group or dist.group.WORLD
        _enable(symm_mem, group.group_name)
        self.buffer = symm_mem.empty(numel, dtype=dtype, device=torch.device("cuda", torch.cuda.current_device()))
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.group_name = group.group_name
        self.rank, self.size = self.handle.rank, self.handle.world_size
        self.peers = [self.handle.get_buffer(q, (numel,), dtype) for q in range(self.size)]


def _enable(symm_mem, group_name: str) -> None:
    """Older torch (2.5 to about 2.9) must be told which groups use symmetric memory; newer
    torch does it by itself and only warns that the call is no longer needed."""
    import warnings

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is None or symm_mem.is_symm_mem_enabled_for_group(group_name):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            enable(group_name)
        except (RuntimeError, TypeError, KeyError):
            pass                       # already set up by torch itself


def torch_one_shot(buf: SymmetricBuffer, numel: int, out: torch.Tensor) -> torch.Tensor:
    """``out[:numel]`` <- Σ over ranks of their buffers' first ``numel`` elements (rank order).
    ``out`` must not overlap this rank's buffer, which the peers read meanwhile."""
    own, start = buf.buffer.data_ptr(), out.data_ptr()
    if start < own + buf.buffer.numel() * buf.buffer.element_size() and own < start + numel * out.element_size():
        raise ValueError(f"torch_one_shot on rank {buf.rank}: out overlaps this rank's own symmetric buffer, which "
                         "its peers read while the sums are written; pass a tensor outside symmetric memory")
    buf.handle.barrier(channel=0)                 # every rank's input is in its buffer
    acc = out[:numel]
    acc.copy_(buf.peers[0][:numel])
    for q in range(1, buf.size):
        acc.add_(buf.peers[q][:numel])            # a load of rank q's memory, over NVLink
    buf.handle.barrier(channel=1)                 # nobody reads our buffer any more
    return out


def torch_two_shot(buf: SymmetricBuffer, numel: int) -> None:
    """The first ``numel`` elements of this rank's buffer <- their sum over ranks, in place."""
    p, r = buf.size, buf.rank
    chunk = -(-numel // p)
    lo, hi = min(r * chunk, numel), min((r + 1) * chunk, numel)
    buf.handle.barrier(channel=0)
    acc = buf.peers[0][lo:hi].clone()
    for q in range(1, p):
        acc.add_(buf.peers[q][lo:hi])
    buf.buffer[lo:hi].copy_(acc)                  # only we read chunk r of our buffer before the barrier
    buf.handle.barrier(channel=1)                 # every chunk is reduced, in its owner's buffer
    for q in range(p):
        if q != r:
            a, b = min(q * chunk, numel), min((q + 1) * chunk, numel)
            buf.buffer[a:b].copy_(buf.peers[q][a:b])
    buf.handle.barrier(channel=0)                 # nobody reads our buffer any more


def symm_mem_ops() -> dict:
    """torch's own one-shot and two-shot on symmetric memory, where the installed torch has
    them (``torch.ops.symm_mem.one_shot_all_reduce``, ``two_shot_all_reduce_``: loads from
    the peers' buffers; the multicast (multimem) variants are never used)."""
    import torch.distributed._symmetric_memory  # noqa: F401 - registers torch.ops.symm_mem

    ops = {}
    for name in ("one_shot_all_reduce", "two_shot_all_reduce_"):
        if hasattr(torch.ops.symm_mem, name) and not name.startswith("multimem"):
            ops[name] = getattr(torch.ops.symm_mem, name)
    return ops
