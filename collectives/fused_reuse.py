"""Lesson 5, part 3: what a training loop's second call need not do again.

A training loop hands the fused all-reducer the same tensors every step. On a GPU that
matters more than the bytes: for 1000 tensors of 16 KiB, planning the list costs several
hundred µs of host time, a ``torch.cat`` 0.3 ms and a ``_foreach_copy_`` 0.45 ms, while the
flat all-reduce of the same 16 MiB takes 0.2 ms in all (H200; ``tools/gpu_fused_profile.py``).
The work is per tensor, on the host; the GPU moves the bytes in microseconds. Three ways
to stop paying it every step, used by :class:`collectives.fused.FusedAllReducer`:

* :class:`KnownList` -- recognise a list seen before (same tensor objects, same memory)
  in two C-level passes, and reuse its plan;
* :class:`StepGraphs` -- record everything one call of that list issues (copy-in on one
  stream, the all-reduces on another, copy-back on a third, and the events between them)
  once as a CUDA graph, and replay it: one launch per step, whatever the number of
  tensors. NCCL collectives can be captured like any kernel (Megatron-LM and vLLM run
  theirs that way); the streams and events become the graph's edges, so the order SINGA's
  three streams give is kept;
* :func:`host_copy_pairs` -- on a CPU, keep NumPy views of the list's tensors and of
  their slots in the buffer: copying back is then a loop of ``a[...] = b``, under half the
  host time of ``_foreach_copy_``, which dispatches one ``copy_`` per tensor (NumPy views
  cannot be made per call instead: ``Tensor.numpy()`` costs 3 µs);
* :func:`move_into_arenas` -- make the copies unnecessary: the tensors are re-pointed into
  the fused buffer itself (``FusedAllReducer.bind``), as DDP's ``gradient_as_bucket_view``
  and Megatron-LM's contiguous gradient buffer do.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .fused_layout import Bucket, slot_views


@dataclass
class KnownList:
    """A list of tensors recognised in O(1) Python calls, with what was made for it."""

    tensors: list[torch.Tensor]
    data_ptrs: list[int]
    plan: Any                       # the reducer's prepared plan for this list
    graph: Any = None               # its recorded step (a CUDA graph), once there is one
    host_views: dict = field(default_factory=dict)  # CPU: bucket -> host_copy_pairs(), or None

    @classmethod
    def of(cls, tensors: list[torch.Tensor], plan) -> "KnownList":
        return cls(tensors, list(map(torch.Tensor.data_ptr, tensors)), plan)

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        """The same tensor objects, in the same order, still in the same memory.

        A tensor given new memory (``t.data = ...``, ``set_``) no longer matches; one reshaped
        in place (``resize_``) to the same address would, so the reducer asks callers not to.
        For 1000 tensors the two passes cost about 15 and 55 µs of host time on an H200's
        host: the floor of this check, one C call per tensor. (torch's C++ loop for the same
        check, ``torch._C._tensors_data_ptrs_at_indices_equal``, measured slower: 84 µs.)
        """
        return (len(tensors) == len(self.tensors) and all(map(operator.is_, tensors, self.tensors))
                and list(map(torch.Tensor.data_ptr, tensors)) == self.data_ptrs)


class StepGraphs:
    """Record what a function issues on the GPU as one CUDA graph, for a known list to replay.

    A recorded graph keeps the addresses it was recorded with, which is why it belongs to
    a :class:`KnownList`: the same tensors in the same memory, checked on every call.
    Recording runs nothing: the caller replays the graph to do the work.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = None         # the side stream graphs are recorded on

    def record(self, issue: Callable[[], object]) -> "torch.cuda.CUDAGraph":
        """Capture every kernel, copy, collective and cross-stream event ``issue()`` makes.

        Streams forked inside ``issue`` (waiting on the recording stream) must join it again
        before it returns: a graph has one beginning and one end.
        """
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(stream)
        with torch.cuda.stream(self._stream):
            # thread_local: NCCL's watchdog thread may query its events meanwhile; that is fine
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                issue()
            finally:
                graph.capture_end()
        stream.wait_stream(self._stream)
        return graph


def host_copy_pairs(targets: Sequence[torch.Tensor], slots: Sequence[torch.Tensor]):
    """``[(target_array, slot_array), ...]`` sharing the tensors' CPU memory, or None when a
    tensor has no NumPy equivalent (bfloat16, a conjugate or negative view)."""
    try:
        return [(t.detach().numpy(), s.detach().numpy()) for t, s in zip(targets, slots)]
    except (TypeError, RuntimeError):
        return None


def copy_pairs(pairs) -> None:
    """Copy each pair's second array into its first (NumPy casts, as ``copy_`` does)."""
    for target, slot in pairs:
        target[...] = slot


def move_into_arenas(buckets: Sequence[Bucket], tensors: Sequence[torch.Tensor],
                     device: torch.device) -> list[torch.Tensor]:
    """Re-point each bucket's tensors at their slots of one new buffer per bucket; return the buffers.

    Values and Python objects stay the same (``tensor.set_``); from now on an all-reduce of a
    buffer reads and writes the tensors in place. The tensors must own their memory and be
    contiguous: a view's base would keep the old memory, and its other views would not follow.
    """
    arenas = []
    for bucket in buckets:
        members = [tensors[i] for i in bucket.indices]
        for i, t in zip(bucket.indices, members):
            if not t.is_contiguous() or t._base is not None:
                raise ValueError(f"bind: tensor {i} is a view or not contiguous; bind needs "
                                 "tensors that own their memory")
        arena = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        slots = slot_views(arena, [t.shape for t in members])
        torch._foreach_copy_(slots, members)
        with torch.no_grad():
            for t, slot in zip(members, slots):
                t.set_(arena.untyped_storage(), slot.storage_offset(), slot.size(), slot.stride())
        arenas.append(arena)
    return arenas
