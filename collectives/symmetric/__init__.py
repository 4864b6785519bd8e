"""Lesson 12: collectives without messages -- one-shot and two-shot all-reduce on shared memory.

Inside one machine a rank can read its peers' memory. The all-reduce then needs no
message: each rank writes its input where the others can see it, a barrier of flags says
when, and every rank reads what it needs.

* :mod:`.workspace` -- the segment every rank maps (``/dev/shm`` on a CPU), its slots and
  epoch flags, the two buffers used in turn, and the switches that remove each guard;
* :mod:`.shared` -- the flag barrier, :func:`one_shot_all_reduce` and
  :func:`two_shot_all_reduce` on CPUs: equal to ``dist.all_reduce``, no message sent;
* :mod:`.cost` -- the α–β model with a barrier term and the bytes read from p − 1 peers;
* :mod:`.gpu` -- the same two algorithms on torch's symmetric memory, in plain torch;
* :mod:`.triton_barrier` and :mod:`.triton_allreduce` -- the barrier on signal pads and
  the one-shot and two-shot kernels in Triton (imported only on a machine with GPUs);
* :mod:`.triton_launch` -- their launches, past Triton's per-call dispatch once a shape is known;
* :mod:`.triton_errors` -- what a kernel records when it gives up on a peer, in pinned host
  memory the host reads without synchronising, and the error the host raises.
"""

from .cost import SharedLink, crossover, fit_shared, one_shot_seconds, ring_seconds, two_shot_seconds
from .shared import flag_barrier, one_shot_all_reduce, two_shot_all_reduce
from .workspace import DEFAULT_CAPACITY, BarrierTimeout, SharedWorkspace, workspace

__all__ = ["one_shot_all_reduce", "two_shot_all_reduce", "flag_barrier", "SharedWorkspace", "workspace",
           "BarrierTimeout", "DEFAULT_CAPACITY", "SharedLink", "one_shot_seconds", "two_shot_seconds",
           "ring_seconds", "crossover", "fit_shared"]
