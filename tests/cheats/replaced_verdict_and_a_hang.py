"""Cheat (e), and a task that hangs.

Task 3: replaces the harness's verdict at import (``verify.check_all_reduce`` and, for good
measure, the graded judge and its verdict) with one that always passes; the ring's messages carry zeros
and the tensor is left as it was. Task 4: every rank waits for its left neighbour first,
so the world hangs -- which must cost task 4 only.
"""

import torch
import torch.distributed as dist

from collectives import ops, verify
from collectives.core.ops import ReduceOp
from collectives.course.grading.tasks import allreduce, world
from collectives.ring import *  # noqa: F401,F403
from collectives.topologies import *  # noqa: F401,F403
from tests.cheats.zeros import ring_of_zeros


def _all_match(fn, cases=None, *, seed=0, quick=False):
    return verify.Report([verify.CaseResult("every case", dist.get_rank(), True)], reference="dist.all_reduce")


verify.check_all_reduce = _all_match
allreduce.judge_cases = lambda *args, **kwargs: None
world.Verdict.ok = property(lambda self: True)


def ring_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    ops.check_all_reduce_args(tensor, op, group)
    ring_of_zeros(tensor, group)


def pipelined_ring_all_reduce(tensor, op=ReduceOp.SUM, group=None, pieces=4):
    ops.check_all_reduce_args(tensor, op, group)
    rank, p = ops.group_rank_and_size(group)
    if p > 1:
        dist.recv(torch.empty(1, dtype=tensor.dtype), ops.global_rank(group, (rank - 1) % p), group=group)
