"""Lesson 8's graded tasks: selection, SINGA's all-gather of pairs, the contract, SparCML's
split, and the asynchronous DDP hook.

Every input is drawn from the ranks' secrets: integer-valued tensors whose magnitudes are
distinct (the k largest are unambiguous, sums exact in float32/64 and the integers) and
small integer residuals. The judge rebuilds what each rank must send -- its top-k or the
elements over the threshold of ``tensor + residual`` -- and every expected sum and residual
with plain tensor arithmetic, and holds each call's messages, read from the tap, to its
transport's design: the all-gather moves ``p·width`` packed pairs in ONE all-gather (and
threshold mode's counts), never a dense all-reduce of the masked tensor; split sends each
owner exactly its pairs; the dense transport is one all-reduce (the contract's cases,
probe and judge: :mod:`.lesson08_contract`). The hook is held to DDP simulated rank by rank
in the grading process (:mod:`.lesson08_hook`).
"""

from __future__ import annotations

import math

import torch

from . import ANY, P2P, GradedTask
from .lesson08_contract import judge_contract
from .lesson08_dgc import judge_dgc
from .lesson08_hook import judge_async
from .lesson08_inputs import draw, pg_calls, split_sends
from .world import Grading, Probe, Verdict, outcome_problem, same

HERE = __name__


# ---- task 1: selection -------------------------------------------------------------------

SELECTIONS = ("topk", "sort", "kthvalue", "reuse", "sample", "auto")
SEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int32)


def _selection_inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    small = torch.rand(700, generator=g, dtype=torch.float64) * 2 - 1     # all |g| < 1
    out["small"] = small.float()
    ties = torch.randint(0, 4, (12,), generator=g).double() * (torch.randint(0, 2, (12,), generator=g) * 2 - 1)
    out["ties"] = ties.float()
    special = torch.randn(9, generator=g)
    where = torch.randperm(9, generator=g)[:3]
    special[where] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    out["special"] = special
    for dtype in SEL_DTYPES:
        x, r = draw(seed + 1 + len(out), 120, dtype)
        out[f"distinct {str(dtype)[6:]}"] = x + r
    ints = torch.randint(-50, 50, (20,), generator=g, dtype=torch.int32)
    ints[int(torch.randint(0, 20, (1,), generator=g))] = -2**31
    out["int32 with INT_MIN"] = ints
    return out


def _thresholds(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = float(torch.randint(20, 200, (1,), generator=g)) + 0.3
    return {"distinct float32": t, "distinct bfloat16": t, "distinct int32": t, "special": 0.5,
            "int32 with INT_MIN": float(2**31), "small": 0.0, "ties": 2.0}


def probe_selection(probe: Probe) -> dict:
    topk = probe.student("topk_indices")
    threshold = probe.student("threshold_indices")
    inputs = _selection_inputs(probe.seed("selection"))
    g = torch.Generator().manual_seed(probe.seed("k"))
    out = {}
    for name, x in inputs.items():
        k = int(torch.randint(1, max(2, x.numel() // 8), (1,), generator=g))
        for selection in SELECTIONS:
            state: dict = {}
            picks = [probe.call(f"top-{k} of {name}, {selection}, call {i}", topk, x, k, selection, state)
                     for i in range(2)]              # "reuse" filters with the first call's threshold
            out[("topk", name, selection)] = (k, picks)
    for name, t in _thresholds(probe.seed("threshold")).items():
        out[("threshold", name)] = (t, probe.call(f"threshold {t} of {name}", threshold, inputs[name], t))
    out["refusals"] = [probe.call("selection 'bogus'", topk, inputs["small"], 3, "bogus", {}),
                       probe.call("'reuse' without a state", topk, inputs["small"], 3, "reuse", None)]
    return out


def _magnitudes(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x.double().abs(), nan=math.inf)


def _judge_selection(grading: Grading) -> Verdict:
    verdict = Verdict()
    run = grading.world(f"{HERE}:probe_selection", 1)
    inputs = _selection_inputs(run.seed(0, "selection"))
    got = run.results[0]
    for key, value in got.items():
        if key == "refusals":
            continue
        if key[0] == "topk":
            _, name, selection = key
            k, picks = value
            x = inputs[name]
            truth = torch.sort(torch.topk(_magnitudes(x), k).values).values
            for i, outcome in enumerate(picks):
                where = f"topk_indices, world of 1, rank 0, case top-{k} of {name} ({selection}, call {i + 1})"
                if outcome_problem(where, outcome, verdict):
                    break
                idx = outcome.value
                if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64:
                    verdict.add(f"{where}: expected an int64 tensor of indices, got {getattr(idx, 'dtype', type(idx))}")
                elif idx.numel() != k or idx.unique().numel() != k:
                    verdict.add(f"{where}: {idx.numel()} indices ({idx.unique().numel()} distinct), "
                                f"expected exactly {k}")
                elif not torch.equal(torch.sort(_magnitudes(x)[idx]).values, truth):
                    verdict.add(f"{where}: not the {k} largest magnitudes")
        else:
            _, name = key
            t, outcome = value
            where = f"threshold_indices, world of 1, rank 0, case |x| >= {t} of {name}"
            if outcome_problem(where, outcome, verdict):
                continue
            expected = torch.nonzero(~(inputs[name].double().abs() < t)).view(-1)
            verdict.add((problem := same(expected, outcome.value)) and f"{where}: {problem}")
    for outcome, what in zip(got["refusals"], ("selection='bogus'", "'reuse' without a state dict")):
        if not outcome_problem(f"topk_indices, {what}", outcome, Verdict()) or "ValueError" not in outcome.error:
            if not outcome.not_written:
                verdict.add(f"topk_indices, world of 1, rank 0, case {what}: must raise ValueError, got "
                            f"{outcome.error or 'no error'}")
    return verdict


# ---- task 2: all-gather of (index, value) pairs ----------------------------------------------

AG_N = 241


def _ag_cases(p: int) -> list[tuple]:
    """(name, dtype, counts given, how many pairs each rank has)."""
    return [("top-k float32", torch.float32, False, [17] * p),
            ("top-k int64", torch.int64, False, [9] * p),
            ("counts differ float64", torch.float64, True, [5 + 7 * r for r in range(p)]),
            ("zero on some int32", torch.int32, True, [0 if r % 2 else 11 for r in range(p)]),
            ("zero on all float32", torch.float32, True, [0] * p)]


def _ag_pairs(seed: int, count: int, dtype):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(AG_N, generator=g)[:count]
    vals = (torch.randint(-99, 100, (count,), generator=g)).to(dtype)
    return idx, vals


def probe_allgather(probe: Probe) -> dict:
    pack = probe.student("pack_pairs")
    gather = probe.student("allgather_sum_")
    out = {}
    idx, vals = _ag_pairs(probe.seed("pack"), 6, torch.float32)
    out["pack"] = probe.call("pack", pack, idx, vals, 9)
    for name, dtype, given, counts in _ag_cases(probe.size):
        i, v = _ag_pairs(probe.seed(name), counts[probe.rank], dtype)
        target = torch.full((AG_N,), 55, dtype=dtype)
        out[name] = (probe.call(name, gather, target, i, v, counts=counts if given else None), target)
    return out


def _judge_allgather(grading: Grading) -> Verdict:
    from collectives.sparse import pack_pairs as reference_pack
    verdict = Verdict()
    for size in grading.sizes(1, 2, 4):
        run = grading.world(f"{HERE}:probe_allgather", size)
        for r in range(size):
            idx, vals = _ag_pairs(run.seed(r, "pack"), 6, torch.float32)
            where = f"pack_pairs, world of {size}, rank {r}, case 6 pairs in width 9"
            outcome = run.results[r]["pack"]
            if not outcome_problem(where, outcome, verdict):
                verdict.add((problem := same(reference_pack(idx, vals, 9), outcome.value)) and f"{where}: {problem}")
        for name, dtype, given, counts in _ag_cases(size):
            total = torch.zeros(AG_N, dtype=torch.float64)
            for r in range(size):
                i, v = _ag_pairs(run.seed(r, name), counts[r], dtype)
                total.index_add_(0, i, v.double())
            e = torch.empty((), dtype=dtype).element_size()
            for r in range(size):
                where = f"allgather_sum_, world of {size}, rank {r}, case {name}"
                outcome, target = run.results[r][name]
                if outcome_problem(where, outcome, verdict):
                    continue
                problem = same(total.to(dtype), target)
                if problem is None:
                    kinds = [(c.kind, c.numel) for c in pg_calls(run.of(r, name))]
                    width = max(counts)
                    want = [("allgather", size * width * (4 + e))] if width else []
                    if kinds not in (want, [] if size == 1 else want):
                        problem = (f"made {kinds or 'no collective'}; expected ONE all-gather of "
                                   f"p·width·(4 + {e}) = {size * width * (4 + e)} bytes" if want
                                   else f"made {kinds}; with no pairs anywhere nothing is sent")
                verdict.add(problem and f"{where}: {problem}")
        if verdict.not_written or len(verdict.problems) > 20:
            break
    return verdict


# ---- task 3: sparse_all_reduce's contract (:mod:`.lesson08_contract`), on two transports --------

def _judge_contract3(grading: Grading) -> Verdict:
    return judge_contract(grading, "sparse_all_reduce", ("allgather", "dense"), (1, 2, 3))


# ---- task 4: split ---------------------------------------------------------------------------

SPLIT_N = 241


def _split_cases(p: int) -> list[tuple]:
    """(name, dtype, pairs per rank): sparse pieces (pairs gathered), and full ones (dense)."""
    return [("sparse float32", torch.float32, [4 + 3 * r for r in range(p)]),
            ("sparse int64", torch.int64, [10] * p),
            ("full float64", torch.float64, [200 - r for r in range(p)]),
            ("none anywhere", torch.float32, [0] * p)]


def probe_split(probe: Probe) -> dict:
    fn = probe.student("split_sum_")
    out = {}
    for name, dtype, counts in _split_cases(probe.size):
        i, v = _ag_pairs(probe.seed(name), counts[probe.rank], dtype)
        target = torch.full((SPLIT_N,), 55, dtype=dtype)
        out[name] = (probe.call(name, fn, target, i, v), target)
    if probe.size > 1:
        n = SPLIT_N + probe.rank
        out["sizes differ"] = probe.call("sizes differ", fn, torch.zeros(n), torch.tensor([0, 5]), torch.ones(2))
    return out


def _judge_split(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(2, 3):
        run = grading.world(f"{HERE}:probe_split", size)
        for name, dtype, counts in _split_cases(size):
            total = torch.zeros(SPLIT_N, dtype=torch.float64)
            pairs = {}
            for r in range(size):
                pairs[r] = _ag_pairs(run.seed(r, name), counts[r], dtype)
                total.index_add_(0, pairs[r][0], pairs[r][1].double())
            e = torch.empty((), dtype=dtype).element_size()
            for r in range(size):
                where = f"split_sum_, world of {size}, rank {r}, case {name}"
                outcome, target = run.results[r][name]
                if outcome_problem(where, outcome, verdict):
                    continue
                problem = same(total.to(dtype), target)
                if problem is None:
                    sent = torch.zeros(SPLIT_N, dtype=torch.float64)
                    sent[pairs[r][0]] = 1.0
                    problem = split_sends(run.of(r, name), sent, list(range(size)), r, e)
                verdict.add(problem and f"{where}: {problem}")
        if size > 1:
            for r in range(size):
                outcome = run.results[r]["sizes differ"]
                if not outcome.not_written and "ValueError" not in outcome.error:
                    verdict.add(f"split_sum_, world of {size}, rank {r}, case ranks passing different sizes: "
                                f"must raise ValueError on every rank, got {outcome.error or 'no error'}")
        if verdict.not_written or verdict.problems:
            break
    if verdict.ok:
        judge_contract(grading, "sparse_all_reduce", ("split", "auto"), (2, 3), with_refusals=False,
                       verdict=verdict)
    return verdict


TASKS = [
    GradedTask(8, 1, "selection: threshold and top-k", 4, _judge_selection, ("threshold_indices", "topk_indices"),
               routes=P2P),
    GradedTask(8, 2, "all-gather of (index, value) pairs", 5, _judge_allgather, ("pack_pairs", "allgather_sum_"),
               routes=ANY),
    GradedTask(8, 3, "sparse_all_reduce: the contract", 5, _judge_contract3, ("sparse_all_reduce",), routes=ANY),
    GradedTask(8, 4, "split: sparse reduce-scatter, densify", 6, _judge_split, ("split_sum_",), routes=ANY),
    GradedTask(8, 5, "DDP communication hook", 5, judge_async, ("sparse_all_reduce_async", "sparse_hook_async"),
               routes=ANY),
    GradedTask(8, 6, "DGC's corrections", 4, judge_dgc, ("topk_per_segment", "DGCState.start_"), routes=ANY),
]
