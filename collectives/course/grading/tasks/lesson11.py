"""Lesson 11's graded tasks: pairwise and Bruck all-to-all, the sizes' exchange, the uneven
all-to-all, and a top-1 MoE dispatch and combine.

Every input is drawn from the ranks' secrets; the judge rebuilds each and transposes the
blocks itself (rank r's output block s is rank s's input block r), so nothing a rank
computes is taken as the answer. Returned tensors must be plain ``torch.Tensor`` and are
copied out in the rank; returned sizes are read as ints. Every call is held to messages
only (no library collective, read from the tap), and one counted call per world to its
design: the pairwise exchange's p − 1 rounds, one partner each way per round, in the
schedule's order, each finished before the next is posted (one rank starts late: a round
posted before the late rank's block arrived shows in the tap's clock); Bruck's ⌈log2 p⌉
messages to rank + 2^k carrying the blocks whose bit k is set; the sizes' exchange one
integer per pair; the uneven all-to-all the rows it owes and the counts, nothing more.
The MoE task records what each expert was handed: every row routed to it, from every
rank, in source order, in one call. A wrong output names the block and the rank whose
data belongs there. Tasks 6 and 7 (top-k with a capacity, and balancing) are
:mod:`.lesson11_moe`'s.
"""

from __future__ import annotations

import torch

from ... import verify
from . import P2P, GradedTask
from .allreduce import messages_only
from .lesson11_messages import (
    COUNTED,
    COUNTED_ROWS,
    COUNTED_WIDTH,
    LATE,
    bruck_pattern,
    carried,
    pairwise_pattern,
    posted_early,
)
from .lesson11_moe import TASKS as MOE_TASKS
from .lesson11_moe import own_tensor
from .lesson11_moe import values as _values
from .world import Grading, Probe, Verdict, outcome_problem, same

HERE = __name__
FLAT_SIZES = (1, 2, 3, 4, 5, 6)
SIZES = (1, 2, 3, 4)
MAX_PROBLEMS = 20


# ---- inputs ---------------------------------------------------------------------------

def public_splits(p: int, key: str) -> list[list[int]]:
    """``splits[s][d]``: rows rank s sends rank d in an uneven case of tasks 1 and 2; public (the
    caller passes both split lists), with empty blocks. The values are secret."""
    salt = sum(map(ord, key))
    return [[0 if (s + 2 * d + salt) % 3 == 0 else 1 + (s * 7 + d * 5 + salt) % 4 for d in range(p)]
            for s in range(p)]


def flat_cases(p: int, uneven: bool) -> list[tuple]:
    """(key, dtype, rows per block (None: uneven), width, output layout)."""
    cases = [(f"equal {str(dt)[6:]}, 3 rows of 2", dt, 3, 2, "contiguous") for dt in verify.ALL_DTYPES]
    cases += [("equal float32, empty blocks", torch.float32, 0, 3, "contiguous"),
              ("equal int64, strided output", torch.int64, 2, 3, "strided"),
              ("equal int32, 1 row of 1", torch.int32, 1, 1, "contiguous"),
              (COUNTED, torch.float32, COUNTED_ROWS, COUNTED_WIDTH, "contiguous")]
    if uneven:
        cases += [("uneven int64, empty blocks", torch.int64, None, 3, "contiguous"),
                  ("uneven float64, strided output", torch.float64, None, 2, "strided")]
    return cases


def _rows_in(case, p: int, s: int) -> list[int]:
    key, _, rows, *_ = case
    return public_splits(p, key)[s] if rows is None else [rows] * p


def _flat_input(case, p: int, s: int, seed: int) -> torch.Tensor:
    _, dtype, _, width, _ = case
    n = sum(_rows_in(case, p, s))
    return _values(seed, n * width, dtype).view(n, width)


def _transpose(inputs: list[torch.Tensor], rows_in: list[list[int]], r: int) -> torch.Tensor:
    return torch.cat([x.split(rows)[r] for x, rows in zip(inputs, rows_in)])


# ---- tasks 1 and 2: pairwise and Bruck ------------------------------------------------

def probe_flat(probe: Probe, name: str, uneven: bool, late: float = 0.0) -> dict:
    import time
    fn = probe.student(name)
    p, r = probe.size, probe.rank
    out = {}
    for case in flat_cases(p, uneven):
        key, dtype, rows, width, layout = case
        if key == COUNTED and late and p >= 3 and r == p - 1:
            time.sleep(late)
        x = _flat_input(case, p, r, probe.seed(key))
        pristine = x.clone()
        rows_out = [_rows_in(case, p, s)[r] for s in range(p)]
        total = sum(rows_out)
        output = (torch.full((width, total), 55, dtype=dtype).t() if layout == "strided"
                  else torch.full((total, width), 55, dtype=dtype))
        args = (rows_out, _rows_in(case, p, r)) if rows is None else ()
        outcome = probe.call(key, fn, output, x, *args)
        outcome.value = None
        out[key] = (outcome, output.detach().clone(memory_format=torch.contiguous_format), torch.equal(x, pristine))
    return out


def block_problem(inputs: list[torch.Tensor], rows_in: list[list[int]], r: int, got) -> str | None:
    """Rank r's output against the transpose, block by block: the first wrong block named with
    the rank whose input block r belongs there, and what it holds instead."""
    expected = _transpose(inputs, rows_in, r)
    problem = same(expected, got)
    if problem is None or not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return problem
    rows_out = [rows[r] for rows in rows_in]
    at = 0
    for s, n in enumerate(rows_out):
        want, have = expected[at:at + n], got[at:at + n]
        if not torch.equal(want, have):
            holds = "values no rank sent"
            if bool((have == 55).all()):
                holds = "the output's old contents: it was never written"
            else:
                for q, (x, rows) in enumerate(zip(inputs, rows_in)):
                    for b, block in enumerate(x.split(rows)):
                        if block.shape == have.shape and torch.equal(block, have):
                            holds = f"rank {q}'s input block {b}"
            return (f"output block {s} (rows {at}..{at + n - 1}) should hold rank {s}'s input block {r}, "
                    f"but holds {holds}")
        at += n
    return problem


def _flat_bytes(case, p: int, rank: int, calls, rows_in) -> str | None:
    sent = sum(c.numel for c in calls if c.kind == "send")
    owed = sum(rows for d, rows in enumerate(rows_in) if d != rank) * case[3]
    if case[0] != COUNTED and sent < owed:
        return f"sent {sent} elements, but {owed} had to leave this rank"
    return None


def _judge_flat(grading: Grading, name: str, uneven: bool, pattern, late: float = 0.0) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(*FLAT_SIZES):
        run = grading.world(f"{HERE}:probe_flat", size, name, uneven, late)
        for case in flat_cases(size, uneven):
            key = case[0]
            inputs = [_flat_input(case, size, s, run.seed(s, key)) for s in range(size)]
            rows_in = [_rows_in(case, size, s) for s in range(size)]
            for r in range(size):
                where = f"{name}, world of {size}, rank {r}, case {key}"
                outcome, got, untouched = run.results[r][key]
                if outcome_problem(where, outcome, verdict):
                    continue
                calls = run.of(r, key)
                problem = (block_problem(inputs, rows_in, r, got)
                           or (None if untouched else "modified its input")
                           or messages_only(None, size, r, calls)
                           or _flat_bytes(case, size, r, calls, rows_in[r])
                           or pattern(case, size, r, calls)
                           or (carried(name, inputs, size, r, calls) if key == COUNTED else None)
                           or (posted_early(run, size, r) if late and key == COUNTED else None))
                verdict.add(problem and f"{where}: {problem}")
        if verdict.not_written or verdict.problems:
            break
    return verdict


# ---- task 3: the sizes' exchange -------------------------------------------------------

SPLIT_KEYS = ("counts with zeros", "counts again")


def _counts(seed: int, p: int) -> list[int]:
    return [int(v) for v in _values(seed, p, torch.int64) % 7]


def _as_ints(value, p: int):
    if not isinstance(value, (list, tuple)) or len(value) != p:
        return None
    try:
        return [int(v) for v in value]
    except (TypeError, ValueError):
        return None


def probe_splits(probe: Probe) -> dict:
    fn = probe.student("exchange_splits")
    out = {}
    for key in SPLIT_KEYS:
        outcome = probe.call(key, fn, _counts(probe.seed(key), probe.size))
        got = _as_ints(outcome.value, probe.size)
        outcome.value = None
        out[key] = (outcome, got)
    return out


def _judge_splits(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(*SIZES):
        run = grading.world(f"{HERE}:probe_splits", size)
        for key in SPLIT_KEYS:
            counts = [_counts(run.seed(s, key), size) for s in range(size)]
            for r in range(size):
                where = f"exchange_splits, world of {size}, rank {r}, case {key}"
                outcome, got = run.results[r][key]
                if outcome_problem(where, outcome, verdict):
                    continue
                expected = [counts[s][r] for s in range(size)]
                calls = run.of(r, key)
                sends = [c for c in calls if c.kind == "send" and c.numel]
                problem = None
                if got != expected:
                    problem = (f"returned {got if got is not None else 'something else'}, expected {expected}: "
                               f"result[s] is rank s's input_split_sizes[{r}]"
                               + (" (these are this rank's own counts)" if got == counts[r] else ""))
                problem = problem or messages_only(None, size, r, calls)
                if problem is None and (len(sends) != size - 1 or any(c.numel != 1 for c in sends)
                                        or len({c.peer for c in sends}) != len(sends)):
                    problem = (f"sent {[(c.peer, c.numel) for c in sends]} (rank, elements): one count to each "
                               "other rank, no more and no fewer, is what an exchange of sizes sends")
                verdict.add(problem and f"{where}: {problem}")
        if verdict.not_written or verdict.problems:
            break
    return verdict


# ---- task 4: the uneven all-to-all ----------------------------------------------------

UNEVEN = (("uneven int64, width 3", torch.int64, 3), ("uneven float32, width 1", torch.float32, 1),
          ("uneven bfloat16, width 2", torch.bfloat16, 2))


def _uneven_input(key: str, dtype, width: int, p: int, seed: int):
    splits = [0 if v < 2 else int(v) - 2 for v in (_values(seed ^ 0x5A5A, p, torch.int64) % 7).tolist()]
    return _values(seed, sum(splits) * width, dtype).view(sum(splits), width), splits


def probe_uneven(probe: Probe) -> dict:
    fn = probe.student("all_to_all_uneven")
    out = {}
    for key, dtype, width in UNEVEN:
        x, splits = _uneven_input(key, dtype, width, probe.size, probe.seed(key))
        outcome = probe.call(key, fn, x, list(splits))
        got, sizes, kinds = None, None, type(outcome.value).__name__
        if isinstance(outcome.value, tuple) and len(outcome.value) == 2:
            got, sizes = own_tensor(outcome.value[0]), _as_ints(outcome.value[1], probe.size)
            kinds = f"({type(outcome.value[0]).__name__}, {type(outcome.value[1]).__name__})"
        outcome.value = None
        out[key] = (outcome, got, sizes, kinds)
    return out


def _judge_uneven(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(*SIZES):
        run = grading.world(f"{HERE}:probe_uneven", size)
        for key, dtype, width in UNEVEN:
            made = [_uneven_input(key, dtype, width, size, run.seed(s, key)) for s in range(size)]
            for r in range(size):
                where = f"all_to_all_uneven, world of {size}, rank {r}, case {key}"
                outcome, got, sizes, kinds = run.results[r][key]
                if outcome_problem(where, outcome, verdict):
                    continue
                expected_sizes = [made[s][1][r] for s in range(size)]
                calls = run.of(r, key)
                problem = None
                if got is None or sizes is None:
                    problem = f"returned {kinds}, expected (a plain torch.Tensor, a list of p ints)"
                elif sizes != expected_sizes:
                    problem = f"returned output_split_sizes {sizes}, expected {expected_sizes}"
                problem = (problem or block_problem([m[0] for m in made], [m[1] for m in made], r, got)
                           or messages_only(None, size, r, calls))
                owed = sum(n for d, n in enumerate(made[r][1]) if d != r) * width
                sent = sum(c.numel for c in calls if c.kind == "send")
                if problem is None and sent != owed + size - 1:
                    problem = (f"sent {sent} elements; the rows this rank owes others are {owed}, and the counts "
                               f"{size - 1}: {owed + size - 1} in all")
                verdict.add(problem and f"{where}: {problem}")
        if verdict.not_written or verdict.problems:
            break
    return verdict


# ---- task 5: MoE dispatch and combine --------------------------------------------------

MOE_CASES = (("routed at random", 7), ("all to the last expert", 5), ("no tokens on some ranks", 0))
HIDDEN = 3


def _moe_input(key: str, p: int, s: int, seed: int):
    tokens = dict(MOE_CASES)[key]
    if key == "no tokens on some ranks" and s % 2 == 0:
        tokens = 4
    E = 2 * p
    x = _values(seed, tokens * HIDDEN, torch.float32).view(tokens, HIDDEN)
    expert_of = (_values(seed ^ 0x77, tokens, torch.int64) % E) if key != "all to the last expert" \
        else torch.full((tokens,), E - 1, dtype=torch.int64)
    return x, expert_of, E


def _expert_value(e: int, rows: torch.Tensor) -> torch.Tensor:
    return rows * (e + 2) - e


def probe_moe(probe: Probe) -> dict:
    fn = probe.student("moe_dispatch_combine")
    out = {}
    for key, _ in MOE_CASES:
        x, expert_of, E = _moe_input(key, probe.size, probe.rank, probe.seed(key))
        seen = []

        def expert_fn(e, rows, seen=seen):
            seen.append((int(e), own_tensor(rows)))
            return _expert_value(int(e), rows)

        outcome = probe.call(key, fn, x.clone(), expert_of.clone(), E, expert_fn)
        got = own_tensor(outcome.value)
        outcome.value = None
        out[key] = (outcome, got, seen)
    return out


def _judge_moe(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(*SIZES):
        run = grading.world(f"{HERE}:probe_moe", size)
        for key, _ in MOE_CASES:
            made = [_moe_input(key, size, s, run.seed(s, key)) for s in range(size)]
            E = 2 * size
            for r in range(size):
                where = f"moe_dispatch_combine, world of {size}, rank {r}, case {key}"
                outcome, got, seen = run.results[r][key]
                if outcome_problem(where, outcome, verdict):
                    continue
                x, expert_of, _ = made[r]
                expected = torch.stack([_expert_value(int(e), row) for row, e in zip(x, expert_of)]) \
                    if x.shape[0] else x.clone()
                problem = None if got is not None else "returned something other than a plain torch.Tensor"
                problem = problem or _unpermuted(expected, got) or _batches(seen, made, r, size, E) \
                    or messages_only(None, size, r, run.of(r, key)) or _moe_traffic(made, r, size, E, run.of(r, key))
                verdict.add(problem and f"{where}: {problem}")
        if verdict.not_written or verdict.problems:
            break
    return verdict


def _moe_traffic(made, r: int, p: int, E: int, calls) -> str | None:
    """No fewer elements sent than the rows for other ranks' experts and the results owed back."""
    home = lambda e: int(e) // (E // p)                                                  # noqa: E731
    out_rows = sum(1 for e in made[r][1] if home(e) != r)
    back_rows = sum(1 for s, m in enumerate(made) if s != r for e in m[1] if home(e) == r)
    owed = (out_rows + back_rows) * HIDDEN
    sent = sum(c.numel for c in calls if c.kind == "send" and c.numel > E // p)
    if sent < owed:
        return (f"sent {sent} elements of rows, but the tokens for other ranks' experts and the results owed "
                f"back come to {owed}: the rows travel as messages")
    return None


def _unpermuted(expected: torch.Tensor, got: torch.Tensor) -> str | None:
    problem = same(expected, got)
    if problem is None or got.shape != expected.shape or not expected.numel():
        return problem
    if sorted(map(tuple, expected.tolist())) == sorted(map(tuple, got.tolist())):
        return ("every token's result came back, but into other tokens' rows: put each one in the row of "
                "its token (un-permute with the inverse of the sort, argsort(order))")
    return problem


def _batches(seen, made, rank: int, p: int, E: int) -> str | None:
    """Each local expert called once with its rows from every source, in source order."""
    local = range(rank * (E // p), (rank + 1) * (E // p))
    for e, rows in seen:
        if e not in local:
            return f"called expert {e} on rank {rank}, which holds experts {list(local)}"
        if rows is None:
            return f"handed expert {e} something other than a plain tensor"
    for e in local:
        calls = [rows for ee, rows in seen if ee == e]
        expected = torch.cat([x[expert_of == e] for x, expert_of, _ in made])
        if not calls and expected.shape[0] == 0:
            continue
        if len(calls) != 1:
            return f"called expert {e} {len(calls)} times, expected once with all its rows"
        problem = same(expected, calls[0])
        if problem:
            return (f"expert {e} was handed rows that are not every rank's tokens for it in source order "
                    f"({problem})")
    return None


TASKS = [
    GradedTask(11, 1, "pairwise all-to-all", 4, lambda g: _judge_flat(g, "pairwise_all_to_all", True,
                                                                      pairwise_pattern, LATE),
               ("pairwise_all_to_all",), routes=P2P),
    GradedTask(11, 2, "Bruck all-to-all", 4, lambda g: _judge_flat(g, "bruck_all_to_all", False, bruck_pattern),
               ("bruck_all_to_all",), routes=P2P),
    GradedTask(11, 3, "exchange of split sizes", 2, _judge_splits, ("exchange_splits",), routes=P2P),
    GradedTask(11, 4, "uneven all-to-all", 3, _judge_uneven, ("all_to_all_uneven",), routes=P2P),
    GradedTask(11, 5, "MoE dispatch and combine", 5, _judge_moe, ("moe_dispatch_combine",), routes=P2P),
    *MOE_TASKS,
]
