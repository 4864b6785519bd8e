"""Graded all-reduce calls: the harness's cases, run in the ranks, judged here.

Every lesson that writes an all-reduce (3, 4, 7, 8) grades it the same way:

* :func:`probe_cases` (in each rank): the harness's cases (``verify.default_cases``),
  each input drawn from the rank's secret, handed to the student's function; the rank
  returns each output, and whether the elements between a strided view's were left alone;
* :func:`judge_cases` (here): every input drawn again from the secrets, reduced with plain
  tensor arithmetic, compared with every rank's output -- bit for bit on integer-valued
  data -- and, with ``pattern``, each call's recorded messages held to the algorithm's
  design (:func:`ring_pattern` is the ring's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ....core.ops import ReduceOp
from ... import verify
from ...verify import SENTINEL, Case
from .tap import Call
from .world import Grading, Outcome, Probe, Run, Verdict, outcome_problem


@dataclass
class CaseRecord:
    """What one rank returned for one case; plain data."""

    outcome: Outcome
    output: torch.Tensor | None = None
    gaps_ok: bool = True


def probe_cases(probe: Probe, name: str, cases: list[Case], kwargs: dict | None = None,
                fn: Callable | None = None, count_divisions: bool = False) -> dict[str, CaseRecord]:
    """Run the student's ``name`` on every case this rank takes part in (``count_divisions``:
    record the elements an AVG case divides, see :class:`CountDivisions`)."""
    import contextlib

    import torch.distributed as dist

    fn = fn or probe.student(name)
    groups = {}
    for case in cases:              # every rank makes every group, in the same order
        if case.group is not None and case.group not in groups:
            groups[case.group] = dist.new_group(list(case.group))
    records = {}
    for case in cases:
        if case.group is not None and probe.rank not in case.group:
            continue
        grank = probe.rank if case.group is None else case.group.index(probe.rank)
        tensor, base = verify.make_input(case, grank, probe.secret, verify.rank_device())
        extra = dict(kwargs or {})
        if case.group is not None:
            extra["group"] = groups[case.group]
        counting = CountDivisions(probe._sink) if count_divisions and case.op == ReduceOp.AVG \
            else contextlib.nullcontext()
        with counting:
            outcome = probe.call(case.name, fn, tensor, op=case.op, **extra)
        outcome.value = None          # what counts is the tensor, in place
        record = CaseRecord(outcome, tensor.detach().cpu().clone(memory_format=torch.contiguous_format))
        if base is not None and case.layout == "strided":
            record.gaps_ok = not bool((base[1::2] != SENTINEL).any())
        records[case.name] = record
    return records


def expected_output(case: Case, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The all-reduce of ``inputs`` (group-rank order), computed with plain tensor arithmetic."""
    stack = torch.stack([x.double() for x in inputs]) if inputs else torch.zeros(0)
    op = case.op
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        out = stack.sum(0)
    elif op == ReduceOp.PRODUCT:
        out = stack.prod(0)
    elif op == ReduceOp.MIN:
        out = stack.min(0).values
    else:
        out = stack.max(0).values
    out = out.to(case.dtype)
    if op == ReduceOp.AVG:
        out.div_(len(inputs))   # in the dtype: what SUM then one division gives
    return out


def compare_case(case: Case, expected: torch.Tensor, got: torch.Tensor, p: int) -> str | None:
    exact = case.values == "int" or case.op in (ReduceOp.MIN, ReduceOp.MAX)
    rtol, atol = (0.0, 0.0) if exact else verify.tolerance(case.dtype, p)
    if case.op == ReduceOp.PRODUCT and not exact:
        rtol, atol = rtol * 2, 0.0
    if not exact and case.op == ReduceOp.SUM:
        atol = max(atol, rtol)   # values summed in another order in a low-precision dtype
    return verify.compare(expected, got.reshape(expected.shape), exact=exact, rtol=rtol, atol=atol)


Pattern = Callable[[Case, int, int, list[Call]], "str | None"]


def judge_cases(run: Run, cases: list[Case], verdict: Verdict, *, what: str,
                pattern: Pattern | None = None, same_bits: bool = True, divisions: dict | None = None) -> None:
    """Judge every rank's records of ``cases`` (from :func:`probe_cases`) into ``verdict``.

    ``pattern(case, p, group_rank, calls)`` returns what is wrong with one rank's calls of
    one case, or None. ``same_bits``: random-float results must be the same bits on every
    rank of the group (``dist.all_reduce`` promises it; the naive ring does not).
    """
    for case in cases:
        ranks = list(case.group) if case.group is not None else list(range(run.size))
        p = len(ranks)
        inputs = [verify.make_values(case, i, run.secrets[r]) for i, r in enumerate(ranks)]
        expected = expected_output(case, inputs)
        outputs = []
        for i, r in enumerate(ranks):
            where = f"{what}, world of {run.size}, rank {r}, case {case.name}"
            record = run.results[r].get(case.name) if isinstance(run.results[r], dict) else None
            if record is None:
                verdict.add(f"{where}: no result from this rank")
                continue
            if outcome_problem(where, record.outcome, verdict):
                continue
            problem = compare_case(case, expected, record.output, p)
            if problem is None and not record.gaps_ok:
                problem = "wrote outside the view: the elements between a strided view's changed"
            if problem is None and pattern is not None:
                problem = pattern(case, p, i, run.of(r, case.name))
            if problem:
                verdict.add(f"{where}: {problem}")
            outputs.append(record.output)
        if same_bits and case.values == "random" and len(outputs) == p and p > 1 and not verdict.problems:
            first = outputs[0].reshape(-1)
            for r, out in zip(ranks[1:], outputs[1:]):
                if not _same_bits(first, out.reshape(-1)):
                    verdict.add(f"{what}, world of {run.size}, case {case.name}: rank {r} does not hold the "
                                f"same bits as rank {ranks[0]} (dist.all_reduce leaves every rank identical)")
                    break


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.is_floating_point() and a.element_size() in (2, 4, 8):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return bool(torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)))
    return bool(torch.equal(a, b))


# ---- patterns ---------------------------------------------------------------------------

def collectives_in(calls: list[Call]) -> list[str]:
    """The library collectives among ``calls`` (the store and the backend are judged by
    :meth:`Run.problems`: check mode's own store traffic is not the student's)."""
    return sorted({c.kind for c in calls if c.kind not in ("send", "recv", "divide")
                   and not c.kind.startswith(("store.", "backend."))})


def messages_only(case: Case, p: int, rank: int, calls: list[Call]) -> str | None:
    """The pattern of every hand-written algorithm: messages, no library collective."""
    colls = collectives_in(calls)
    if colls:
        return f"called {', '.join(colls)} on the process group: build it from point-to-point messages"
    return None


def ring_pattern(case: Case, p: int, rank: int, calls: list[Call], *, pieces: int | None = None,
                 exact_count: bool = False) -> str | None:
    """The ring's messages for one call, or what is wrong with them.

    No collective; every message to the right neighbour in the group; 2(p − 1) chunks of
    ⌊n/p⌋ or ⌈n/p⌉ elements (``pieces``: each chunk may travel in up to that many pieces);
    2(p − 1)/p·n elements in all, give or take the chunks' rounding; real data in them.
    """
    problem = messages_only(case, p, rank, calls)
    if problem:
        return problem
    sends = [c for c in calls if c.kind == "send"]
    if p == 1:
        return f"sent {len(sends)} messages in a world of 1" if sends else None
    ranks = list(case.group) if case.group is not None else list(range(p))
    right = ranks[(rank + 1) % p]
    if any(c.peer != right for c in sends):
        return f"sent to ranks {sorted({c.peer for c in sends})}, expected only the right neighbour {right}"
    n = case.numel
    small, large = n // p, -(-n // p)
    if (case.values == "int" and case.op in (ReduceOp.SUM, ReduceOp.AVG) and small >= 8
            and sends and all(c.weight == 0 for c in sends)):
        return "every message it sent held only zeros: the data did not travel in the ring's messages"
    total = sum(c.numel for c in sends)
    if total < 2 * (p - 1) * small or total > 2 * (p - 1) * large:
        return (f"sent {total} elements, expected 2(p-1)/p·n = {2 * (p - 1) * n / p:.0f} "
                f"(2(p-1) chunks of {small}{'' if small == large else f' or {large}'})")
    if pieces is None:
        if any(c.numel not in (small, large) for c in sends if c.numel):
            sizes = sorted({c.numel for c in sends})
            return f"sent messages of {sizes} elements, expected chunks of {small} or {large}"
        if len([c for c in sends if c.numel]) > 2 * (p - 1) or (exact_count and len(sends) != 2 * (p - 1)):
            return f"sent {len(sends)} messages, expected 2(p-1) = {2 * (p - 1)}"
    else:
        most = 2 * (p - 1) * min(pieces, max(small, 1))
        if len([c for c in sends if c.numel]) > 2 * (p - 1) * pieces:
            return f"sent {len(sends)} messages, expected at most 2(p-1)·pieces = {2 * (p - 1) * pieces}"
        if exact_count and len(sends) != most:
            return f"sent {len(sends)} messages, expected 2(p-1)·pieces = {most}"
    return None


def carried_result(expected: torch.Tensor, calls: list[Call], at_least: int) -> str | None:
    """At least ``at_least`` of this rank's messages carried a contiguous piece of the result
    itself, element for element (compared by fingerprint with every window of the result
    of the message's length): what a ring's all-gather half sends. A message of the right
    size with other data in it does not pass for one."""
    flat = expected.reshape(-1).to(torch.float64).nan_to_num()
    carried = 0
    for c in calls:
        if c.kind != "send" or not c.numel or c.numel > flat.numel():
            continue
        weights = torch.arange(1, c.numel + 1, dtype=torch.float64).sin_()
        windows = flat.unfold(0, c.numel, 1) @ weights
        if bool((windows - c.fingerprint).abs().le(1e-6 * (1 + abs(c.fingerprint))).any()):
            carried += 1
    if carried < at_least:
        return (f"{carried} of its messages carried a piece of the result; an all-gather half forwards "
                f"at least {at_least}")
    return None


class CountDivisions:
    """Within the block, every tensor division is recorded as a ``Call("divide", ...)`` with
    its element count: how much of the tensor an AVG divided."""

    _DIVISIONS = ((torch.Tensor, "div_"), (torch.Tensor, "div"), (torch.Tensor, "__truediv__"),
                  (torch.Tensor, "__itruediv__"), (torch.Tensor, "true_divide_"), (torch, "div"),
                  (torch, "true_divide"), (torch, "divide"))

    def __init__(self, sink):
        self.sink, self.saved = sink, []

    def __enter__(self):
        for owner, name in self._DIVISIONS:
            original = getattr(owner, name, None)
            if original is not None:
                self.saved.append((owner, name, original))
                setattr(owner, name, self._wrap(original))
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)

    def _wrap(self, original):
        sink = self.sink

        def divide(first, *args, **kwargs):
            if isinstance(first, torch.Tensor):
                sink(Call("divide", None, first.numel(), "", 0.0, 0.0, ()))
            return original(first, *args, **kwargs)
        return divide


# ---- an expanded tensor: refused ------------------------------------------------------------

def probe_expanded(probe: Probe, name: str) -> Outcome:
    return probe.call("expanded", probe.student(name), torch.ones(1).expand(8))


def judge_expanded(grading: Grading, name: str, verdict: Verdict) -> None:
    """An expanded tensor (elements sharing memory) on the whole world of 2: ValueError, and
    not a crash (gloo's own all_reduce crashes on one)."""
    try:
        run = grading.world(f"{__name__}:probe_expanded", 2, name)
    except Exception as exc:  # noqa: BLE001 - a crash or a hang on an expanded tensor is this check's failure
        verdict.add(f"{name} on an expanded tensor: {str(exc).splitlines()[0]}")
        return
    for rank, outcome in enumerate(run.results):
        if outcome.not_written:
            verdict.not_written = verdict.not_written or outcome.not_written
        elif "ValueError" not in outcome.error:
            verdict.add(f"{name}, world of 2, rank {rank}, case expanded tensor: an expanded tensor (elements "
                        f"sharing memory) must be refused with ValueError, got {outcome.error or 'no error'}")
