"""Lesson 3's graded tasks: one function, the naive ring all-reduce, asked more of in each task.

The harness's cases (``verify.default_cases``), split three ways as the stub's APPROACH
is -- the loop (SUM on plain float32 and int64 tensors), every other op and dtype, and
the rest of ``dist.all_reduce``'s contract (views, subgroups, tensors smaller than the
world, an expanded tensor) -- each on worlds of 1 to 4 ranks, every input drawn from the
ranks' secrets. Every call is held to the ring's design, read from the tap: no library
collective; p − 1 messages, each of the whole tensor, all to the right neighbour; and
each carrying, untouched, the input of the rank it came from -- its own first, then the
one that arrived from the left (by the tap's fingerprint). Floating-point results are not
asked to be the same bits on every rank: each rank adds the p terms in its own order.
"""

from __future__ import annotations

import torch

from ....core.ops import ReduceOp
from ... import verify
from ...verify import Case
from . import P2P, GradedTask
from .allreduce import judge_cases, judge_expanded, messages_only, probe_cases
from .lesson01_messages import fingerprint_of
from .world import Grading, Probe, Verdict

HERE = __name__
NAME = "naive_ring_all_reduce"
SIZES = (1, 2, 3, 4)


def _plain(case: Case, p: int) -> bool:
    """A whole contiguous tensor of at least p elements, on the whole world."""
    return case.group is None and case.layout == "contiguous" and case.numel >= p


def task_cases(task: int, p: int) -> list[Case]:
    """The harness's cases of one task: 1 the loop, 2 ops and dtypes, 3 the rest of the contract."""
    # over 1 Mi elements on 4 ranks only, as lesson 4's ring; n = 1 comes twice at p = 2
    cases = list({c.name: c for c in verify.default_cases(p, large=p == 4)}.values())
    loop = [c for c in cases if _plain(c, p) and c.op == ReduceOp.SUM and c.dtype in (torch.float32, torch.int64)]
    if task == 1:
        return loop
    if task == 2:
        return [c for c in cases if _plain(c, p) and c not in loop]
    return [c for c in cases if not _plain(c, p)]


def probe_ring(probe: Probe, cases: list[Case]) -> dict:
    return probe_cases(probe, NAME, cases)


def _ring_pattern(run):
    """The naive ring's messages in one call (see the module doc)."""
    prints: dict[tuple[str, int], float] = {}     # (case, group rank) -> fingerprint of its input

    def input_print(case: Case, j: int, members: list[int]) -> float:
        if (case.name, j) not in prints:
            prints[case.name, j] = fingerprint_of(verify.make_values(case, j, run.secrets[members[j]]))
        return prints[case.name, j]

    def pattern(case, p, i, calls):
        problem = messages_only(case, p, i, calls)
        if problem:
            return problem
        sends = [c for c in calls if c.kind == "send"]
        n = case.numel
        if p == 1 or n == 0:
            full = [c for c in sends if c.numel]
            return f"sent {len(full)} messages with data, expected none (p = {p}, n = {n})" if full else None
        members = list(case.group) if case.group is not None else list(range(p))
        right = members[(i + 1) % p]
        if len(sends) != p - 1:
            return f"sent {len(sends)} messages, expected p − 1 = {p - 1}"
        if any(c.peer != right for c in sends):
            return f"sent to ranks {[c.peer for c in sends]}, expected only the right neighbour {right}"
        dtype = str(case.dtype)[6:]
        if any(c.numel != n or c.dtype != dtype for c in sends):
            return (f"sent messages of {[(c.numel, c.dtype) for c in sends]} elements, expected the whole tensor "
                    f"each time ({n} {dtype})")
        for step, c in enumerate(sends):
            origin = (i - step) % p
            if abs(c.fingerprint - input_print(case, origin, members)) > 1e-9 * (1 + c.weight):
                held = "its own input" if step == 0 else f"group rank {origin}'s input, as it arrived"
                return f"message {step} did not carry {held}: forward what arrived, unchanged"
        return None
    return pattern


def _judge(task: int):
    def judge(grading: Grading) -> Verdict:
        verdict = Verdict()
        for size in grading.sizes(*SIZES):
            cases = task_cases(task, size)
            run = grading.world(f"{HERE}:probe_ring", size, cases)
            judge_cases(run, cases, verdict, what=NAME, pattern=_ring_pattern(run), same_bits=False)
            if verdict.not_written or verdict.problems:
                break
        if task == 3 and verdict.ok:
            judge_expanded(grading, NAME, verdict)
        return verdict
    return judge


TASKS = [
    GradedTask(3, 1, "the ring loop (SUM, contiguous tensors)", 4, _judge(1), (NAME,), routes=P2P),
    GradedTask(3, 2, "every op and dtype", 3, _judge(2), (NAME,), routes=P2P),
    GradedTask(3, 3, "views, subgroups, tiny tensors, bad input", 3, _judge(3), (NAME,), routes=P2P),
]
