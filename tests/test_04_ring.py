"""Lesson 4, the ring and its rivals: what the graded tasks do not cover, and the judges' own edges.

The graded tasks (the ring's halves, the ring, the pipelined ring, recursive doubling,
halving-doubling, the tree) are judged by :mod:`collectives.course.grading.tasks.lesson04`, outside
the ranks; ``tests/test_grader.py`` runs those judges on the reference, on the stubs and on
every partial solution. Here: the reference's multi-ring, which is not an exercise, and
the ring judge failing the mistakes it exists to catch -- each a small exercise file.
"""

import torch
import torch.distributed as dist

from collectives import launch, trace, verify
from collectives.core.ops import ReduceOp
from collectives.course.catalog import world_timeout
from collectives.course.grading.tasks import Grading, Verdict, lesson04
from collectives.course.grading.tasks.allreduce import judge_cases

LESSON = 4
WORLD_TIMEOUT = world_timeout()
RING_N = lesson04.RING_N


def _multi_ring_checks():
    from collectives.ring import multi_ring_all_reduce
    report = verify.check_all_reduce(multi_ring_all_reduce, verify.default_cases(dist.get_world_size(), quick=True))
    with trace.recording() as t:
        multi_ring_all_reduce(torch.ones(RING_N), channels=2)
    return report, t.to_dicts()


def test_multi_ring_matches_dist_all_reduce_and_uses_both_neighbours():
    p = 4
    results = launch.run(_multi_ring_checks, p, timeout=WORLD_TIMEOUT)
    for rank, (report, events) in enumerate(results):
        assert report.ok, report.summary()
        sends = trace.Trace.from_dicts(rank, events).sends()
        assert {e.peer for e in sends} == {(rank + 1) % p, (rank - 1) % p}   # one ring each way
        assert len(sends) == 2 * 2 * (p - 1)                                    # 2 channels × 2(p-1)


def _ring_verdict(target: str, cases: list, p: int = 3) -> Verdict:
    """The ring task's judge on ``cases`` only, for the ring function of ``target`` (a file)."""
    grading = Grading(target, timeout=WORLD_TIMEOUT)
    run = grading.world(f"{lesson04.HERE}:probe_all_reduce", p, "ring_all_reduce", cases, None, None)
    run.results = [r["records"] for r in run.results]
    verdict = Verdict()
    judge_cases(run, cases, verdict, what="ring_all_reduce", pattern=lesson04._ring_task_pattern(False))
    return verdict


def test_an_avg_that_divides_the_whole_tensor_fails_the_ring_pattern():
    # lesson 4 asks for the own chunk to be divided (n/p divisions); the values of a whole
    # division are the same, so the graded pattern counts the divided elements
    cases = [verify.Case(1001, torch.float32, ReduceOp.AVG), verify.Case(1001, torch.float32, ReduceOp.SUM)]
    verdict = _ring_verdict("tests/cheats/avg_divides_the_whole_tensor.py", cases)
    assert len(verdict.problems) == 3 and all("case n=1001 float32 AVG: divided 1001 elements for AVG" in p
                                              for p in verdict.problems), verdict.problems


def test_a_ring_whose_messages_carry_zeros_fails_even_with_the_right_values():
    # values from a library all-reduce the trace never sees, the ring's messages as decoys
    verdict = _ring_verdict("tests/cheats/paused_all_reduce_and_small_worlds.py", [verify.Case(RING_N)])
    assert verdict.problems and all("called allreduce on the process group" in p for p in verdict.problems), \
        verdict.problems


def test_the_reference_ring_passes_its_judge_in_a_world_of_five():
    # five ranks: chunks of 200, and a rank count no other test of this file uses
    assert _ring_verdict("collectives.ring", [verify.Case(RING_N), verify.Case(1001, torch.int64, ReduceOp.MAX)],
                         p=5).ok
