"""Lesson 5 exercise: fused buffers, after Apache SINGA's ``Communicator::fusedSynch``.

Many small tensors, each all-reduced as ``dist.all_reduce`` would -- but in a few large
calls: small tensors are packed into a preallocated buffer, the buffer is all-reduced
once, the results are copied back. Large tensors go on their own.

Fill in the five tasks in order; each builds on the ones before.

  1. plan_layout       which tensor goes into which buffer, and when each buffer is sent
  2. copy_in, flush    pack a group into a buffer in one call; start its all-reduce
  3. slot_views,       the views of a buffer where each tensor lives; copy results back
     copy_back
  4. fused_all_reduce  the whole thing, serially: plan, flush, wait, copy back
  5. FusedAllReducer   a reusable reducer: layout planned once, two buffers per dtype so
                       that the next group is packed while the previous one is on the wire

Check your work:

    .venv/bin/python lessons/05_fused/exercise.py                          # PASS/FAIL per task
    .venv/bin/torchrun --nproc-per-node 4 lessons/05_fused/exercise.py     # the same, under torchrun
    make check LESSON=05                                                   # the same, from make
    make grade LESSON=05                                                   # the points

Each task is judged outside your process: on lists whose sizes, dtypes and values you
cannot know in advance, and on every all-reduce your ranks make (one per flush, of the
flush's size -- never one per tensor).

Course functions you may call (the sheet is checked against the code):

    ops.check_all_reduce_args(tensor, op=ReduceOp.SUM, group=None, *, what='all_reduce',
                              compare=True, agree=None) -> bool
        Raise a clear error for input an in-place all-reduce cannot honour; return whether
        this rank takes part.
    ops.work_buffer(tensor) -> torch.Tensor
        A flat, contiguous buffer holding ``tensor``'s elements: the tensor's own memory
        when it is contiguous, else a copy (to be written back with :func:`write_back`).
    ops.write_back(tensor, flat) -> None
        Copy ``flat`` into ``tensor`` (its data, detached) unless it already is ``tensor``'s
        memory.
    ops.finish_(tensor, op, group_size) -> torch.Tensor
        Apply what remains after the combining: for AVG, one division by the group size.
    streams.current_stream(device=None)
        The stream work is issued on now (a :class:`NullStream` on CPU).
    streams.new_stream(device=None, priority=0, name=None)
        A new side stream on ``device`` (a :class:`NullStream` on CPU; ``name`` names it in
        :func:`checking`'s reports).
    streams.new_event(device=None, timing=False, name=None)
    streams.use(stream)
        Context manager: issue work on ``stream`` inside the block (nothing on CPU).
    streams.checking(raise_errors=True)
        Inside the block, CPU streams and events made by this module keep count (see the
        module docstring); yields the :class:`Checker`. Make the streams and events inside
        the block. At its end, raises :class:`OrderingError` listing every violation
        (``raise_errors``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from collectives import ops, streams  # noqa: F401 - what the tasks use
from collectives.core.ops import ReduceOp
from collectives.course.grading.runner import run_tasks

LESSON = 5
DEFAULT_THRESHOLD_BYTES = 1 << 20   # tensors this big or bigger are all-reduced on their own
DEFAULT_BUFFER_BYTES = 16 << 20     # one fused buffer


# ---------------------------------------------------------------------------------------
# Given: the layout's data types.

@dataclass(frozen=True)
class Bucket:
    """One flush: consecutive tensors of one dtype, packed end to end in a buffer."""

    dtype: torch.dtype        # dtype of the tensors in it (never mixed)
    wire_dtype: torch.dtype   # dtype of the buffer (float16 only with compression, an extension)
    indices: tuple[int, ...]  # positions in the caller's list, in buffer order
    sizes: tuple[int, ...]    # elements of each, same order

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.numel * self.wire_dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """The plan of one call: ``steps`` in the order every rank issues them."""

    steps: tuple[tuple[str, int], ...]  # ("direct", tensor index) or ("flush", bucket index)
    buckets: tuple[Bucket, ...]
    direct: tuple[int, ...]             # tensors all-reduced on their own
    skipped: tuple[int, ...]            # empty tensors: nothing to send

    @property
    def flushes(self) -> int:
        return len(self.buckets)


def wire_dtype(dtype: torch.dtype, compress_fp16: bool = False) -> torch.dtype:
    """The dtype a tensor travels in: float16 for float32 under compression, else its own."""
    return torch.float16 if compress_fp16 and dtype == torch.float32 else dtype


# ---------------------------------------------------------------------------------------
# Task 1

def plan_layout(specs: Sequence[tuple[int, torch.dtype]], threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                buffer_bytes: int = DEFAULT_BUFFER_BYTES, compress_fp16: bool = False) -> Layout:
    """Lesson 5, task 1: plan the flushes for tensors described by ``(numel, dtype)``.

    TODO:     walk the list once and return a Layout:
              * numel == 0                               -> skipped
              * numel * itemsize >= threshold_bytes, or
                more bytes than one buffer holds         -> ("direct", i), at its place in order
              * otherwise the tensor joins the open bucket of its dtype; if it would overflow
                that bucket (more than buffer_bytes), first close the bucket: append it to
                buckets and ("flush", its index) to steps. At the end, close the buckets
                still open, in the order they were opened.
    APPROACH: keep a dict dtype -> list of (index, numel) for the open buckets.
    EXAMPLE:  float32 sizes (200, 200, 200, 100, 2000, 300, 0, 212), threshold 4096 bytes,
              buffer 2048 bytes (512 elements):
              buckets (0, 1), (2, 3), (5, 7); direct (4,); skipped (6,);
              steps [("flush", 0), ("direct", 4), ("flush", 1), ("flush", 2)].
    HINT:     ``dtype.itemsize`` is the bytes per element; bytes in a bucket are counted in
              its wire dtype (``wire_dtype(dtype, compress_fp16)``).
    CALLS:    none
    """
    raise NotImplementedError("Lesson 5, task 1: plan_layout")


# ---------------------------------------------------------------------------------------
# Task 2

def copy_in(tensors: Sequence[torch.Tensor], buffer: torch.Tensor,
            slots: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Lesson 5, task 2: pack ``tensors`` end to end into ``buffer``; return the filled part.

    TODO:     write the elements of tensors[0], then tensors[1], ... into the first elements
              of ``buffer`` and return ``buffer[:total]`` (a view: same memory).
    APPROACH: ONE call for the whole group, never a Python loop of one copy per tensor (on a
              GPU that is one kernel launch per tensor: 1000 gradients, 1000 launches).
              When every tensor is 1-D and of the buffer's dtype: ``torch.cat(tensors, out=part)``.
              Otherwise (2-D tensors, views, a cast): ``torch._foreach_copy_(slots, tensors)``,
              where ``slots`` (when none are given) are views of ``part`` shaped like the
              tensors: ``part.split(sizes)``, then ``.view(t.shape)`` each. (Task 3 names this
              ``slot_views``; write it here inline, so that this task stands on its own.)
    EXAMPLE:  copy_in([tensor([0, 1, 2]), tensor([[10, 11], [12, 13]])], zeros(8))
              -> tensor([0, 1, 2, 10, 11, 12, 13]), and the buffer's last element is untouched.
    HINT:     a transposed view's elements go in in logical (row-major) order: copy_ does that.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 5, task 2: copy_in")


def flush(tensors: Sequence[torch.Tensor], buffer: torch.Tensor, op=ReduceOp.SUM, group=None):
    """Lesson 5, task 2: copy ``tensors`` into ``buffer`` and start ONE all-reduce of the filled part.

    TODO:     copy_in, then ``dist.all_reduce(filled, op=..., group=group, async_op=True)``.
              Return ``(work, filled)``; the caller waits on ``work``.
    APPROACH: AVG travels as SUM (the caller divides once at the end, ops.finish_): every
              backend has SUM, and it matches the harness's reference.
    EXAMPLE:  4 ranks, tensors [tensor([r]), tensor([r, r])] on rank r
              -> after work.wait(), filled == tensor([6, 6, 6]) on every rank.
    HINT:     async_op=True returns a handle; its wait() is what lets the next group be packed
              while this one is on the wire (task 5).
    CALLS:    ops.finish_
    """
    raise NotImplementedError("Lesson 5, task 2: flush")


# ---------------------------------------------------------------------------------------
# Task 3

def slot_views(buffer: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Lesson 5, task 3: views of ``buffer``'s first elements, one per shape, end to end.

    TODO:     slot i starts where slot i-1 ends and has shape ``shapes[i]``; all share
              ``buffer``'s memory.
    APPROACH: ``buffer.view(-1)[:total].split(sizes)``, then ``.view(shape)`` each.
    EXAMPLE:  slot_views(arange(10), [(2,), (0,), (2, 3)]) -> [tensor([0, 1]), tensor([]),
              tensor([[2, 3, 4], [5, 6, 7]])]
    HINT:     ``torch.Size(shape).numel()``; a shape of () is a scalar with one element.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 5, task 3: slot_views")


def copy_back(buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
              slots: list[torch.Tensor] | None = None) -> None:
    """Lesson 5, task 3: copy each tensor's slot of ``buffer`` back into it, in one call.

    TODO:     ``torch._foreach_copy_(tensors, slots)``, with ``slots = slot_views(buffer,
              [t.shape for t in tensors])`` when none are given.
    APPROACH: the slots are shaped like the tensors, so copy_ writes a strided or transposed
              view element for element and leaves the memory between its elements alone.
    EXAMPLE:  copy_back(arange(5.), [a, b]) with a = zeros(2), b = zeros(3)
              -> a == [0, 1], b == [2, 3, 4]
    HINT:     copy_ also casts: a float16 buffer copies back into float32 tensors.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 5, task 3: copy_back")


# ---------------------------------------------------------------------------------------
# Task 4

def fused_all_reduce(tensors: Sequence[torch.Tensor], op=ReduceOp.SUM, group=None,
                     threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                     buffer_bytes: int = DEFAULT_BUFFER_BYTES, compress_fp16: bool = False) -> None:
    """Lesson 5, task 4: all-reduce each tensor of ``tensors`` in place, as dist.all_reduce would.

    TODO:     1. refuse bad input before sending anything (every rank refuses alike):
                 tensors on different devices -> ValueError naming "device";
                 ops.check_all_reduce_args(t, op) on each (expanded tensors, AVG on ints).
              2. layout = plan_layout([(t.numel(), t.dtype) ...], threshold_bytes, buffer_bytes).
              3. for each step, in order: ("flush", k) -> flush the bucket's tensors into a
                 buffer of its dtype, wait, divide for AVG (ops.finish_), copy_back;
                 ("direct", i) -> all-reduce that tensor on its own.
    APPROACH: a direct tensor may be a view: gloo reduces the wrong elements of a
              non-contiguous view. ops.work_buffer(t) gives a contiguous buffer (the tensor
              itself when it is contiguous), ops.write_back(t, buf) puts the result back.
    EXAMPLE:  4 ranks, [full((3,), r), empty(0), full((2, 2), r, dtype=int64)] on rank r
              -> [full((3,), 6), empty(0), full((2, 2), 6)] on every rank.
    HINT:     one buffer per dtype (torch.empty(buffer_bytes // itemsize, dtype=...)) is
              enough here; compress_fp16 is an extension (the reference has it), not graded.
    CALLS:    ops.check_all_reduce_args, ops.work_buffer, ops.write_back, ops.finish_
    """
    raise NotImplementedError("Lesson 5, task 4: fused_all_reduce")


# ---------------------------------------------------------------------------------------
# Task 5

class FusedAllReducer:
    """Lesson 5, task 5: all-reduce lists of tensors through preallocated fused buffers.

    ``all_reduce(tensors)`` issues everything and returns; ``wait()`` finishes it. The
    constructor is given; write ``all_reduce`` and ``wait``.
    """

    def __init__(self, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, device=None, op=ReduceOp.SUM,
                 group=None, compress_fp16: bool = False, double_buffer: bool = True):
        self.threshold_bytes, self.buffer_bytes = threshold_bytes, buffer_bytes
        self.device = torch.device(device if device is not None else "cpu")
        self.op, self.group = op, group
        self.compress_fp16, self.double_buffer = compress_fp16, double_buffer
        self._copy_in = streams.new_stream(self.device)     # packs groups into buffers
        self._comm = streams.new_stream(self.device)        # runs the all-reduces
        self._copy_back = streams.new_stream(self.device)   # copies results back
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}  # dtype -> 1 or 2 buffers
        self._layouts: dict[tuple, Layout] = {}   # (shapes, dtypes, devices) -> planned layout
        self._inflight: list = []                 # flushes issued and not yet copied back

    def _buffers_for(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The buffers of ``dtype``: allocated once, two with double buffering."""
        if dtype not in self._buffers:
            numel = self.buffer_bytes // dtype.itemsize
            self._buffers[dtype] = [torch.empty(numel, dtype=dtype, device=self.device)
                                    for _ in range(2 if self.double_buffer else 1)]
        return self._buffers[dtype]

    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> "FusedAllReducer":
        """Lesson 5, task 5: issue the fused all-reduce of ``tensors``; return self.

        TODO:     check the input as in task 4; look the layout up in self._layouts by
                  (shapes, dtypes, devices) and call plan_layout only on a miss; then issue
                  each step: a flush packs its bucket into the next buffer of its dtype
                  (buffers of a dtype are used in turn) and starts an async all-reduce;
                  a direct tensor gets an async all-reduce of its own. Keep what wait()
                  needs in self._inflight.
        APPROACH: double buffering -- before packing into a buffer that still holds an
                  earlier flush, land that flush (work.wait(), divide for AVG, copy_back).
                  With two buffers, flush k+1 is packed while flush k is on the wire; with
                  one (double_buffer=False) each flush lands before the next is packed.
        EXAMPLE:  six tensors of 400 float32, buffers of 512 elements: six flushes;
                  with two buffers flush 2 waits for flush 0, flush 3 for flush 1, ...
        HINT:     streams (stand-ins on CPU, real on CUDA): self._copy_in.wait_stream(current)
                  before packing (the producer wrote the tensors there), pack under
                  streams.use(self._copy_in), start the all-reduce under
                  streams.use(self._comm) after self._comm waits on the copy-in.
                  Each buffer needs two events (streams.new_event(self.device)):
                  "filled" -- recorded on the copy-in stream after packing, waited on by
                  the comm stream before the all-reduce; and "buffer free" -- recorded on
                  the copy-back stream after that buffer's results were copied back,
                  waited on by the copy-in stream before packing the buffer again (record
                  it once when the buffer is made, so the first wait has something to wait
                  on). Without "buffer free", on a GPU the next group overwrites the buffer
                  while the previous one is still being copied out of it. On CPU,
                  ``with streams.checking():`` reports a missing wait; the grader
                  runs your reducer inside it.
        CALLS:    streams.new_event, streams.use, streams.checking
        """
        raise NotImplementedError("Lesson 5, task 5: FusedAllReducer.all_reduce")

    def wait(self) -> None:
        """Lesson 5, task 5: land every flush still in flight, in order; then the caller sees
        the results.

        TODO:     for each entry of self._inflight not landed yet: work.wait(), divide for
                  AVG, copy back (or ops.write_back for a direct tensor); then clear it.
        APPROACH: do the landing under streams.use(self._copy_back): work.wait() there makes
                  the copy-back stream wait for the all-reduce. At the end make the caller's
                  stream wait: streams.current_stream(self.device).wait_stream(self._copy_back).
        EXAMPLE:  reducer.all_reduce(grads); reducer.wait()  -> grads hold the sums.
        HINT:     land in the order you issued; keep the entries (and so the tensors) alive
                  until the end of wait(), so that nothing is freed while a copy may still run.
        CALLS:    ops.write_back, streams.current_stream, streams.use
        """
        raise NotImplementedError("Lesson 5, task 5: FusedAllReducer.wait")


if __name__ == "__main__":
    run_tasks(LESSON)
