"""Lesson 4's graded tasks: the ring's halves, the ring, the pipelined ring and its rivals.

Every value is judged against inputs drawn from secrets, every message recorded at the
process group: the ring and the pipelined ring on worlds of 1 to 6 ranks with every call
held to the ring's pattern; recursive doubling, halving-doubling and the tree on 1 to 4
ranks, messages only, and one counted call each held to its design.
"""

from __future__ import annotations

import math

import torch

from ....core import trace
from ....core.ops import ReduceOp, chunk_bounds
from ... import verify
from ...verify import Case
from . import P2P, GradedTask
from .allreduce import (
    carried_result,
    expected_output,
    judge_cases,
    judge_expanded,
    messages_only,
    probe_cases,
    ring_pattern,
)
from .evidence import carries_blocks, traffic_within
from .world import Grading, Probe, Run, Verdict, outcome_problem, same

HERE = __name__
RING_N = 1000        # the call whose messages are counted exactly: chunks of 334/333 at p = 3
PIPELINE_N = 4000    # ... for the pipelined ring: chunks of 1000 at p = 4, pieces of 250
PIECES = 4
POW2_N = 1024        # halves exactly down to p = 4: halving-doubling's bytes are exact
RING_SIZES = (1, 2, 3, 4, 5, 6)
SIZES = (1, 2, 3, 4)


# ---- tasks 1 and 2: the ring's halves --------------------------------------------------

def _halves_cases(p: int, reduce: bool) -> list[tuple]:
    """(numel, dtype, op, input layout, output layout, subgroup): every dtype, every op
    (reduce-scatter), sizes not divisible by p, empty, views, a subgroup."""
    divisible = 13 * p
    cases = [(divisible, dtype, ReduceOp.SUM, "contiguous", "contiguous", None) for dtype in verify.ALL_DTYPES]
    if reduce:
        cases += [(divisible, dtype, op, "contiguous", "contiguous", None)
                  for dtype in (torch.float32, torch.int64) for op in verify.ALL_OPS
                  if op != ReduceOp.SUM and not (op == ReduceOp.AVG and dtype == torch.int64)]
    cases += [(1001, torch.float32, ReduceOp.SUM, "contiguous", "contiguous", None),
              (1001, torch.int64, ReduceOp.MAX, "contiguous", "contiguous", None),
              (max(p - 1, 1), torch.float32, ReduceOp.SUM, "contiguous", "contiguous", None),
              (0, torch.float32, ReduceOp.SUM, "contiguous", "contiguous", None),
              (1001, torch.int32, ReduceOp.SUM, "transposed", "strided", None),
              (100 * p + 1, torch.float32, ReduceOp.SUM, "contiguous", "contiguous", None)]
    if p >= 3:
        cases.append((1001, torch.int64, ReduceOp.SUM, "contiguous", "contiguous", tuple(range(p - 1))))
    return cases


def _key(case) -> str:
    numel, dtype, op, src, out, group = case
    return (f"n={numel} {str(dtype)[6:]} {verify.op_name(op)} input {src}, output {out}"
            + ("" if group is None else f", group {group}"))


def _values(case, rank: int, secret: int) -> torch.Tensor:
    numel, dtype, op, *_ = case
    return verify.make_values(Case(numel, dtype, op), rank, secret)


def _laid_out(values: torch.Tensor, layout: str):
    if layout == "contiguous":
        return values.clone(), None
    tensor, base = verify.make_input(Case(values.numel(), values.dtype, layout=layout), 0)
    tensor.copy_(values.view(tensor.shape) if layout == "transposed" else values)
    return tensor, base


def probe_halves(probe: Probe, reduce: bool) -> dict:
    import torch.distributed as dist

    name = "ring_reduce_scatter" if reduce else "ring_all_gather"
    fn = probe.student(name)
    cases = _halves_cases(probe.size, reduce)
    groups = {c[5]: dist.new_group(list(c[5])) for c in cases if c[5] is not None}
    out = {}
    for case in cases:
        numel, dtype, op, src_layout, out_layout, group = case
        if group is not None and probe.rank not in group:
            continue
        grank = probe.rank if group is None else group.index(probe.rank)
        p = probe.size if group is None else len(group)
        values = _values(case, grank, probe.secret)
        lo, hi = chunk_bounds(numel, p)[grank]
        extra = {} if group is None else {"group": groups[group]}
        if reduce:
            source, _ = _laid_out(values, src_layout)
            target, base = _laid_out(torch.full((hi - lo,), 55, dtype=dtype), out_layout)
            outcome = probe.call(_key(case), fn, target, source, op=op, **extra)
            untouched = bool(torch.equal(source.reshape(-1), values))
        else:
            mine = values[lo:hi].clone()
            source = mine
            if src_layout != "contiguous":
                holder = torch.zeros(2 * mine.numel(), dtype=dtype)
                source = holder[::2]
                source.copy_(mine)
            target, base = _laid_out(torch.full((numel,), 55, dtype=dtype), out_layout)
            outcome = probe.call(_key(case), fn, target, source, **extra)
            untouched = True
        gaps_ok = base is None or out_layout != "strided" or not bool((base[1::2] != verify.SENTINEL).any())
        out[_key(case)] = (outcome, target.detach().reshape(-1).clone(), gaps_ok, untouched)
    return out


def _judge_halves(grading: Grading, reduce: bool) -> Verdict:
    verdict = Verdict()
    what = "ring_reduce_scatter" if reduce else "ring_all_gather"
    for size in grading.sizes(*SIZES):
        run = grading.world(f"{HERE}:probe_halves", size, reduce)
        for case in _halves_cases(size, reduce):
            numel, dtype, op, _, _, group = case
            ranks = list(group) if group is not None else list(range(size))
            p = len(ranks)
            inputs = [_values(case, i, run.secrets[r]) for i, r in enumerate(ranks)]
            if reduce:
                whole = expected_output(Case(numel, dtype, op), inputs)
            else:
                whole = torch.cat([x[lo:hi] for x, (lo, hi) in zip(inputs, chunk_bounds(numel, p))])
            for i, r in enumerate(ranks):
                where = f"{what}, world of {size}, rank {r}, case {_key(case)}"
                outcome, got, gaps_ok, untouched = run.results[r][_key(case)]
                if outcome_problem(where, outcome, verdict):
                    continue
                lo, hi = chunk_bounds(numel, p)[i]
                expected = whole[lo:hi] if reduce else whole
                problem = same(expected, got)
                if problem is None and not gaps_ok:
                    problem = "wrote between the elements of a strided output"
                if problem is None and not untouched:
                    problem = "modified its input"
                if problem is None:
                    problem = _p_minus_1_chunks(run.of(r, _key(case)), numel, p, ranks[(i + 1) % p])
                if problem is None:
                    problem = _carried(run.of(r, _key(case)), case, inputs, i, reduce)
                verdict.add(problem and f"{where}: {problem}")
        if verdict.not_written or len(verdict.problems) > 20:
            break
    return verdict


def _p_minus_1_chunks(calls, n: int, p: int, right: int) -> str | None:
    """Each rank sends p − 1 chunks of ⌊n/p⌋ or ⌈n/p⌉ elements, all to its right neighbour."""
    problem = messages_only(None, p, 0, calls)
    if problem:
        return problem
    sends = [c for c in calls if c.kind == "send" and c.numel]
    if p == 1:
        return f"sent {len(sends)} messages in a world of 1" if sends else None
    if any(c.peer != right for c in sends):
        return f"sent to ranks {sorted({c.peer for c in sends})}, expected only the right neighbour {right}"
    if n >= p and len(sends) != p - 1:
        return f"sent {len(sends)} messages, expected p − 1 = {p - 1}"
    if any(c.numel not in (n // p, -(-n // p)) for c in sends):
        return f"sent messages of {sorted({c.numel for c in sends})} elements, expected chunks of ⌊n/p⌋ or ⌈n/p⌉"
    # every chunk but one leaves the rank: n less one chunk, no fewer elements and no more
    return traffic_within(calls, n - -(-n // p), n - n // p) if n >= p else None


def _carried(calls, case, inputs: list[torch.Tensor], i: int, reduce: bool) -> str | None:
    """Each message carries a block of the ring's: a chunk of an input (the all-gather), or a
    chunk reduced over a run of consecutive ranks ending at the sender (the reduce-scatter)."""
    numel, dtype, op, *_ = case
    p = len(inputs)
    bounds = chunk_bounds(numel, p)
    if not reduce:
        return carries_blocks(calls, [x[lo:hi] for x, (lo, hi) in zip(inputs, bounds)], "a chunk of the inputs")
    if op == ReduceOp.PRODUCT or dtype in (torch.float16, torch.bfloat16):
        return None                       # partial products and half sums round by order: not compared
    base = ReduceOp.SUM if op == ReduceOp.AVG else op
    blocks = [expected_output(Case(hi - lo, dtype, base), [inputs[(i - k) % p][lo:hi] for k in range(length)])
              for lo, hi in bounds for length in range(1, p)]
    return carries_blocks(calls, blocks, "a chunk reduced over the ranks before it in the ring")


# ---- tasks 3 to 7: the all-reduces ------------------------------------------------------

def few_cases(p: int) -> list[Case]:
    """A handful: an uneven size in SUM, MAX and AVG, fewer elements than ranks, nothing, a
    strided view and the first p − 1 ranks as a subgroup."""
    cases = [Case(1001, torch.float32, ReduceOp.SUM), Case(1001, torch.int64, ReduceOp.MAX),
             Case(1001, torch.float64, ReduceOp.AVG), Case(max(p - 1, 1)), Case(0),
             Case(1001, torch.int32, ReduceOp.PRODUCT, layout="strided")]
    if p >= 3:
        cases.append(Case(1001, torch.int64, ReduceOp.SUM, group=tuple(range(p - 1))))
    return cases


def _covering(p: int, depth: str) -> list[Case]:
    if depth == "full":
        return verify.default_cases(p, large=p == 4)
    if depth == "quick":
        return verify.default_cases(p, quick=True, large=False)
    return few_cases(p)


# How much of the harness each world size gets: the whole covering set where it matters
# most -- 3 ranks (uneven chunks, not a power of two) and 4 (the 1 Mi-element case) -- the
# quick set or a handful elsewhere, so that every task is judged in seconds.
RING_DEPTH = {1: "quick", 2: "quick", 3: "full", 4: "full", 5: "few", 6: "few"}
PIPELINED_DEPTH = {1: "quick", 2: "few", 3: "quick", 4: "quick", 5: "few", 6: "few"}
RIVAL_DEPTH = {1: "few", 2: "quick", 3: "full", 4: "quick"}


def ring_cases(p: int, pipelined: bool = False) -> list[Case]:
    """The ring's cases at ``p`` ranks (:data:`RING_DEPTH`), sizes every group size divides,
    and the counted call."""
    cases = _covering(p, (PIPELINED_DEPTH if pipelined else RING_DEPTH)[p])
    cases += [Case(60 * p, torch.float32, ReduceOp.SUM), Case(60 * p, torch.int64, ReduceOp.MAX),
              Case(60 * p, torch.float64, ReduceOp.AVG), Case(60 * p, torch.float32, ReduceOp.SUM, values="random")]
    for case in list(cases):
        if case.group is not None and len(case.group) > 1 and case.numel == 1001:
            cases.append(Case(60 * len(case.group), torch.int64, ReduceOp.SUM, group=case.group))
    cases.append(Case(PIPELINE_N if pipelined else RING_N))
    return list({c.name: c for c in cases}.values())


def rival_cases(p: int) -> list[Case]:
    return _covering(p, RIVAL_DEPTH[p]) + [Case(POW2_N), Case(RING_N)]


def probe_all_reduce(probe: Probe, name: str, cases: list[Case], kwargs: dict | None,
                     timed_key: str | None = None) -> dict:
    records = probe_cases(probe, name, cases, kwargs, count_divisions=True)
    out = {"records": records}
    if timed_key is not None:
        # the times of one call's messages (posted, completed), from the course's trace: only
        # whether the pipeline overlaps is read from them, never a value
        fn = probe.student(name)
        with trace.recording() as t:
            probe.call(timed_key, fn, torch.ones(PIPELINE_N), pieces=PIECES)
        out["timed"] = [(e.kind, e.t0, e.t1) for e in t if e.kind in ("isend", "irecv")]
    return out


def _ring_task_pattern(pipelined: bool):
    counted_n = PIPELINE_N if pipelined else RING_N

    def pattern(case, p, rank, calls):
        counted = case.numel == counted_n and case.group is None and case.layout == "contiguous" \
            and case.values == "int" and case.op == ReduceOp.SUM and case.dtype == torch.float32
        problem = ring_pattern(case, p, rank, calls, pieces=PIECES if pipelined else None, exact_count=counted)
        divided = sum(c.numel for c in calls if c.kind == "divide")
        large = -(-case.numel // p)
        if problem is None and case.op == ReduceOp.AVG and divided > large:
            problem = (f"divided {divided} elements for AVG; the ring divides only the chunk this rank "
                       f"finished ({large} at most), before the all-gather")
        return problem
    return pattern


def _judge_all_reduce(grading: Grading, name: str, sizes, cases_for, pattern, *,
                      counted=None, timed: bool = False, content=None) -> Verdict:
    verdict = Verdict()
    kwargs = {"pieces": PIECES} if name == "pipelined_ring_all_reduce" else None
    for size in grading.sizes(*sizes):
        cases = cases_for(size)
        run = grading.world(f"{HERE}:probe_all_reduce", size, name, cases, kwargs,
                            "timed" if timed and size >= 3 else None)
        timing = [r.get("timed") for r in run.results]
        run.results = [r["records"] for r in run.results]
        judge_cases(run, cases, verdict, what=name, pattern=pattern if content is None else
                    (lambda case, p, i, calls, run=run: pattern(case, p, i, calls) or content(run, case, i, calls)))
        if timed and size >= 3 and not verdict.problems and not verdict.not_written:
            verdict.add(_overlap_problem(timing, size))
        if counted is not None and not verdict.problems and not verdict.not_written:
            for rank in range(size):
                verdict.add(counted(run, rank, size))
        if verdict.not_written or verdict.problems:
            break
    if not verdict.not_written and not verdict.problems:
        judge_expanded(grading, name, verdict)
    return verdict


def _overlap_problem(timing, p: int) -> str | None:
    """A pipelined ring sends piece j of step s on before the pieces of step s − 1 have all
    arrived: at least one reduce-scatter step overlaps the previous one on every rank."""
    for rank, events in enumerate(timing):
        if not events:
            continue
        sends = [e for e in events if e[0] == "isend"]
        recvs = [e for e in events if e[0] == "irecv"]
        k = PIECES
        overlapped = [s for s in range(1, p - 1)
                      if len(sends) >= (s + 1) * k and len(recvs) >= s * k
                      and min(e[1] for e in sends[s * k:(s + 1) * k])
                      < max(e[2] or math.inf for e in recvs[(s - 1) * k:s * k])]
        if not overlapped:
            return (f"pipelined_ring_all_reduce, world of {p}, rank {rank}: every reduce-scatter step waited "
                    "for all its pieces before sending the first piece on: nothing is pipelined")
    return None


CONTENT_N = 4096     # calls up to this size have every message's content checked


def _ring_content(run: Run, case: Case, i: int, calls, pieces: int = 1) -> str | None:
    """Each message of the ring carries a chunk reduced over a run of consecutive ranks ending
    at the sender (the reduce-scatter) or a chunk of the result (the all-gather); with
    ``pieces``, one of the chunk's 1 to ``pieces`` nearly equal pieces."""
    if case.numel > CONTENT_N or case.values != "int" or case.op == ReduceOp.PRODUCT \
            or case.dtype in (torch.float16, torch.bfloat16):
        return None
    ranks = list(case.group) if case.group is not None else list(range(run.size))
    p = len(ranks)
    inputs = [verify.make_values(case, j, run.secrets[r]) for j, r in enumerate(ranks)]
    bounds = chunk_bounds(case.numel, p)
    base = ReduceOp.SUM if case.op == ReduceOp.AVG else case.op
    result = expected_output(case, inputs)
    blocks = [expected_output(Case(hi - lo, case.dtype, base), [inputs[(i - k) % p][lo:hi] for k in range(length)])
              for lo, hi in bounds for length in range(1, p)] + [result[lo:hi] for lo, hi in bounds]
    blocks = [b[lo:hi] for b in blocks for k in range(1, pieces + 1) for lo, hi in chunk_bounds(b.numel(), k)]
    return carries_blocks(calls, blocks, "a chunk reduced over the ranks before it, or a chunk of the result"
                          + (" (or a piece of one)" if pieces > 1 else ""))


def _pipelined_content(run: Run, case: Case, i: int, calls) -> str | None:
    """The counted call's messages: pieces of the ring's chunks (:func:`_ring_content`)."""
    if case.numel != PIPELINE_N or case.group is not None or case.op != ReduceOp.SUM:
        return None
    return _ring_content(run, case, i, calls, PIECES)


def _counted_ring(run: Run, rank: int, p: int) -> str | None:
    """The counted call's all-gather half forwards pieces of the result itself."""
    if p == 1:
        return None
    case = Case(RING_N)
    inputs = [verify.make_values(case, i, run.secrets[i]) for i in range(p)]
    expected = expected_output(case, inputs)
    problem = carried_result(expected, run.of(rank, case.name), p - 1)
    return problem and f"ring_all_reduce, world of {p}, rank {rank}, case {case.name}: {problem}"


def _rival_pattern(kind: str):
    def pattern(case, p, rank, calls):
        problem = messages_only(case, p, rank, calls)
        if problem or case.group is not None or case.layout != "contiguous" or case.values != "int" \
                or case.op != ReduceOp.SUM or case.dtype != torch.float32:
            return problem
        sends = [c for c in calls if c.kind == "send"]
        if kind == "recursive doubling" and case.numel == POW2_N and p in (2, 4):
            peers = sorted(c.peer for c in sends)
            if peers != sorted(rank ^ (1 << k) for k in range(int(math.log2(p)))):
                return f"swapped with ranks {peers}, expected rank XOR 2^k for k < log2 p"
            if any(c.numel != POW2_N for c in sends):
                return "a swap must carry the whole tensor"
        if kind == "halving-doubling" and case.numel == POW2_N and p in (2, 4):
            steps = int(math.log2(p))
            if len(sends) != 2 * steps:
                return f"sent {len(sends)} messages, expected 2·log2 p = {2 * steps}"
            if sorted(c.peer for c in sends) != sorted(rank ^ (1 << k) for k in range(steps) for _ in (0, 1)):
                return f"exchanged with ranks {sorted(c.peer for c in sends)}, expected rank XOR 2^k, twice each"
            if sorted(c.numel for c in sends) != sorted(POW2_N >> k for k in range(1, steps + 1) for _ in (0, 1)):
                return f"sent {sorted(c.numel for c in sends)} elements per message, expected n/2, n/4, ... each twice"
        if kind == "tree" and case.numel == RING_N and p > 1:
            parent = (rank - 1) // 2
            expected = sorted(([parent] if rank else []) + [c for c in (2 * rank + 1, 2 * rank + 2) if c < p])
            if sorted(c.peer for c in sends) != expected:
                return f"sent to ranks {sorted(c.peer for c in sends)}, expected its parent and children {expected}"
            if any(c.numel != RING_N for c in sends):
                return "every message of the tree carries the whole tensor"
        return None
    return pattern


def _ring(grading: Grading) -> Verdict:
    return _judge_all_reduce(grading, "ring_all_reduce", RING_SIZES, ring_cases, _ring_task_pattern(False),
                             counted=_counted_ring, content=_ring_content)


def _pipelined(grading: Grading) -> Verdict:
    return _judge_all_reduce(grading, "pipelined_ring_all_reduce", RING_SIZES,
                             lambda p: ring_cases(p, pipelined=True), _ring_task_pattern(True), timed=True,
                             content=_pipelined_content)


def _rival(name: str, kind: str):
    def judge(grading: Grading) -> Verdict:
        return _judge_all_reduce(grading, name, SIZES, rival_cases, _rival_pattern(kind))
    return judge


TASKS = [
    GradedTask(4, 1, "ring reduce-scatter", 3, lambda g: _judge_halves(g, True), ("ring_reduce_scatter",), routes=P2P),
    GradedTask(4, 2, "ring all-gather", 3, lambda g: _judge_halves(g, False), ("ring_all_gather",), routes=P2P),
    GradedTask(4, 3, "ring all-reduce", 5, _ring, ("ring_all_reduce",), routes=P2P),
    GradedTask(4, 4, "pipelined ring", 4, _pipelined, ("pipelined_ring_all_reduce",), routes=P2P),
    GradedTask(4, 5, "recursive doubling", 3, _rival("recursive_doubling_all_reduce", "recursive doubling"),
               ("recursive_doubling_all_reduce",), routes=P2P),
    GradedTask(4, 6, "halving-doubling", 4, _rival("halving_doubling_all_reduce", "halving-doubling"),
               ("halving_doubling_all_reduce",), routes=P2P),
    GradedTask(4, 7, "binary tree", 3, _rival("tree_all_reduce", "tree"), ("tree_all_reduce",), routes=P2P),
]
