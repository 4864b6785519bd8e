"""Lesson 3 exercise: the naive ring all-reduce.

Build ``naive_ring_all_reduce`` -- the ring of the PyTorch distributed tutorial, made into
a real ``all_reduce``: in place, every op, every dtype, views and subgroups. One function,
graded in three tasks that ask progressively more of it.

Check your work:

    torchrun --nproc-per-node 4 lessons/03_naive_ring/exercise.py   # PASS/FAIL per task, per rank
    python lessons/03_naive_ring/exercise.py                        # the same, on a local world
    make grade LESSON=03                                            # the graded tests

The reference is ``collectives/naive_ring.py``; the lesson page is docs/lessons/03-naive-ring.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from collectives import ops, trace, verify
from collectives.course.runner import Task, run_tasks
from collectives.core.ops import ReduceOp

LESSON = 3


def naive_ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """Lesson 3, tasks 1-3: all-reduce ``tensor`` in place by passing whole tensors round a ring.

    TODO:     p − 1 times: send a whole tensor to the right neighbour, receive one from the
              left, combine the arrival into ``tensor``. The first tensor you send is your
              own input; after that, forward what just arrived, unchanged.
    APPROACH: task 1 -- the loop, for SUM on contiguous tensors. Two receive buffers that
              alternate: the one that arrived last step is being sent while the next one
              lands in the other. Wait for the send before you reuse its buffer.
              task 2 -- every op: ``ops.combine_(acc, incoming, op)`` and, for AVG, one
              ``ops.finish_(acc, op, p)`` at the end.
              task 3 -- the rest of ``dist.all_reduce``'s contract: ``ops.check_all_reduce_args``
              first (bad op, AVG on ints, complex MIN/MAX, expanded tensors; it returns
              False on a rank outside ``group``: return at once); views through
              ``flat = ops.work_buffer(tensor)`` ... ``ops.write_back(tensor, flat)``;
              groups through ``ops.group_rank_and_size(group)`` and ``ops.global_rank(group, r)``
              (send/recv take global ranks); nothing to do when p == 1 or the tensor is empty.
    EXAMPLE:  p = 4, rank r holds [r, r]  ->  every rank holds [6, 6]. Rank 1 receives, in
              order, rank 0's input, rank 3's, rank 2's.
    HINT:     post ``dist.irecv`` from the left and ``dist.isend`` to the right, then wait on
              both, every step: if every rank did a blocking send first, the ring would
              deadlock -- on gloo at every message size, one element included. Each rank
              sends exactly p − 1 messages of n elements.
    """
    raise NotImplementedError("Lesson 3, tasks 1-3: naive_ring_all_reduce")


# ---------------------------------------------------------------------------------------
# The checks `python lessons/03_naive_ring/exercise.py` runs (on every rank).

def _plain(case, p) -> bool:
    """A whole contiguous tensor of at least p elements, on the whole world."""
    return case.group is None and case.layout == "contiguous" and case.numel >= p


def _loop_cases(p):
    """Task 1: SUM on plain float32 and int64 tensors."""
    return [c for c in verify.default_cases(p) if _plain(c, p) and c.op == ReduceOp.SUM
            and c.dtype in (torch.float32, torch.int64)]


def _ops_and_dtypes_cases(p):
    """Task 2: every other op and dtype, on plain tensors."""
    loop = _loop_cases(p)
    return [c for c in verify.default_cases(p) if _plain(c, p) and c not in loop]


def _contract_cases(p):
    """Task 3: views, subgroups, and tensors smaller than the world (0 and 1 elements)."""
    return [c for c in verify.default_cases(p) if not _plain(c, p)]


def _pattern_problems(numel: int = 1000) -> list[str]:
    """The ring's shape, from the trace: p − 1 messages of n elements, all to the right."""
    rank, p = dist.get_rank(), dist.get_world_size()
    x = torch.ones(numel)
    with trace.recording() as t:
        naive_ring_all_reduce(x)
    sends = t.sends()
    problems = []
    if len(sends) != p - 1:
        problems.append(f"sent {len(sends)} messages, expected p - 1 = {p - 1}")
    if any(e.peer != (rank + 1) % p for e in sends):
        problems.append(f"sent to ranks {sorted({e.peer for e in sends})}, expected only {(rank + 1) % p}")
    if any(e.numel != numel for e in sends):
        problems.append(f"message sizes {sorted({e.numel for e in sends})}, expected {numel} each")
    if t.collectives():
        problems.append("called a collective: build it from point-to-point messages only")
    return problems


def _report(report: verify.Report, problems: list[str], name: str) -> verify.Report:
    for problem in problems:
        report.results.append(verify.CaseResult(name, dist.get_rank(), False, problem))
    return report


def check_ring_loop() -> verify.Report:
    report = verify.check_all_reduce(naive_ring_all_reduce, _loop_cases(dist.get_world_size()),
                                     identical_bits=False)
    return _report(report, _pattern_problems(), "ring pattern")


def check_ops_and_dtypes() -> verify.Report:
    return verify.check_all_reduce(naive_ring_all_reduce, _ops_and_dtypes_cases(dist.get_world_size()),
                                   identical_bits=False)


def check_contract() -> verify.Report:
    report = verify.check_all_reduce(naive_ring_all_reduce, _contract_cases(dist.get_world_size()),
                                     identical_bits=False)
    report.results.append(verify.check_expanded_rejected(naive_ring_all_reduce))
    return report


if __name__ == "__main__":
    run_tasks(LESSON, [
        Task(1, "the ring loop (SUM, contiguous tensors)", check_ring_loop),
        Task(2, "every op and dtype", check_ops_and_dtypes),
        Task(3, "views, subgroups, tiny tensors, bad input", check_contract),
    ])
