"""Lesson 3 cheat: the verdict is replaced at import and the ring's messages are real but
carry nothing worth having.

``verify.compare`` and ``verify.check_all_reduce`` (what the old graders ran inside the
rank) always agree. ``naive_ring_all_reduce`` sends its own input p − 1 times to the right
-- the right count, sizes and neighbour, even the first message's data -- never forwards
what arrived, and leaves the tensor as it was. The expanded-tensor check is honoured.
"""

import torch
import torch.distributed as dist

from collectives import ops, verify
from collectives.core.ops import ReduceOp
from collectives.course.grading.runner import run_tasks

LESSON = 3


def _all_match(fn, cases=None, *, seed=0, quick=False, identical_bits=True):
    return verify.Report([verify.CaseResult("every case", dist.get_rank(), True)], reference="dist.all_reduce")


verify.compare = lambda *args, **kwargs: None
verify.check_all_reduce = _all_match


def naive_ring_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    if not ops.check_all_reduce_args(tensor, op, group, what="naive_ring_all_reduce"):
        return
    rank, p = ops.group_rank_and_size(group)
    if p == 1 or tensor.numel() == 0:
        return
    mine = tensor.contiguous().reshape(-1).clone()
    right, left = ops.global_rank(group, (rank + 1) % p), ops.global_rank(group, (rank - 1) % p)
    for _ in range(p - 1):
        recv = dist.irecv(torch.empty_like(mine), left, group=group)
        send = dist.isend(mine, right, group=group)
        recv.wait()
        send.wait()


if __name__ == "__main__":
    run_tasks(LESSON)
