"""Graded all-reduce calls that a student's module cannot talk its way through.

:func:`collectives.course.verify.check_all_reduce` runs inside the ranks, next to the code
it checks: a module can replace it at import, pause the trace around a ``dist.all_reduce``,
or look answers up from its fixed-seed inputs. The graded ring tasks are judged here
instead, in three halves:

* **in each rank** (:func:`run_rank`): every input is drawn from a seed the rank takes from
  ``os.urandom`` before the student's module is imported, so no rank -- and no table of
  answers -- knows another rank's input without communicating. Every message and
  collective is recorded where ``torch.distributed`` hands it to the process group
  (the ``ProcessGroup`` methods themselves), which ``trace.paused()`` does not reach. The
  rank returns, per case: its seed, a fingerprint of the input it was given, its output,
  whether the gaps of a strided input survived, and the messages it sent;
* **in the grading process** (:func:`judge`): the inputs are drawn again from the returned
  seeds, reduced with plain tensor arithmetic, and compared with every rank's output;
  the messages of every call -- not only of a dedicated "pattern" call -- are held to the
  ring's pattern (:func:`ring_pattern`): no collective, every message to the right
  neighbour, the ring's message count and bytes;
* under ``torchrun`` or the exercise runner, :func:`check_in_this_world` gathers the
  records onto every rank and judges them there, with the same code.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..core import ops, trace
from ..core.ops import ReduceOp
from .verify import (
    SENTINEL,
    Case,
    CaseResult,
    Report,
    default_cases,
    is_timeout,
    make_input,
    make_values,
    tolerance,
    where_raised,
)

_PG = dist.ProcessGroup
SEND_METHODS = ("send",)
RECV_METHODS = ("recv", "recv_anysource")
COLLECTIVE_METHODS = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single",
    "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
    "all_to_all_single", "gather", "scatter", "barrier", "monitored_barrier",
)


# ---- the tap: every call that reaches a process group, while one is open ------------

class Tap:
    """Records the calls that reach ``ProcessGroup`` while :attr:`on`; installed once per rank."""

    def __init__(self):
        self.on = False
        self.events: list[tuple] = []   # (kind, global peer or None, numel, sum of |elements| sent)
        self.wrappers: dict[str, Any] = {}

    def install(self) -> "Tap":
        for name in SEND_METHODS + RECV_METHODS + COLLECTIVE_METHODS:
            original = getattr(_PG, name, None)
            if original is None:
                continue
            wrapper = self._wrap(name, original)
            setattr(_PG, name, wrapper)
            self.wrappers[name] = wrapper
        return self

    def intact(self) -> bool:
        """False when something put other methods on ``ProcessGroup`` after :meth:`install`."""
        return all(getattr(_PG, name, None) is w for name, w in self.wrappers.items())

    def _wrap(self, name, original):
        tap = self

        def wrapper(pg, *args, **kwargs):
            if tap.on:
                tensors = args[0] if args else []
                flat = [t for t in (tensors if isinstance(tensors, (list, tuple)) else [tensors])
                        if isinstance(t, torch.Tensor)]
                numel = sum(t.numel() for t in flat)
                peer, weight = None, 0.0
                if name in SEND_METHODS or name == "recv":
                    try:
                        peer = dist.get_process_group_ranks(pg)[args[1]]
                    except Exception:  # noqa: BLE001 - a group this tap cannot map
                        peer = args[1]
                if name in SEND_METHODS and flat:
                    weight = float(sum(t.detach().double().abs().sum() for t in flat))
                kind = "send" if name in SEND_METHODS else "recv" if name in RECV_METHODS else name
                tap.events.append((kind, peer, numel, weight))
            return original(pg, *args, **kwargs)

        wrapper.__name__ = name
        return wrapper


_DIVISIONS = ((torch.Tensor, "div_"), (torch.Tensor, "div"), (torch.Tensor, "__truediv__"),
              (torch.Tensor, "__itruediv__"), (torch.Tensor, "true_divide_"), (torch, "div"),
              (torch, "true_divide"), (torch, "divide"))


class _CountDivisions:
    """Within the block, every tensor division adds its element count to ``events`` as
    ("divide", None, numel, 0): how much of the tensor an AVG divided."""

    def __init__(self, events: list):
        self.events, self.saved = events, []

    def __enter__(self):
        for owner, name in _DIVISIONS:
            original = getattr(owner, name, None)
            if original is None:
                continue
            self.saved.append((owner, name, original))
            setattr(owner, name, self._wrap(original))
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)

    def _wrap(self, original):
        events = self.events

        def divide(first, *args, **kwargs):
            if isinstance(first, torch.Tensor):
                events.append(("divide", None, first.numel(), 0.0))
            return original(first, *args, **kwargs)
        return divide


_tap: Tap | None = None


def tap() -> Tap:
    global _tap
    if _tap is None:
        _tap = Tap().install()
    return _tap


# ---- what a rank does -----------------------------------------------------------------

@dataclass
class CaseRecord:
    """What one rank saw in one case; plain data, judged elsewhere."""

    case: Case
    seed: int
    fingerprint: float = 0.0
    output: torch.Tensor | None = None
    gaps_ok: bool = True
    error: str = ""
    events: list[tuple] = field(default_factory=list)
    tampered: bool = False


def fingerprint(values: torch.Tensor) -> float:
    """An order-sensitive sum: the same for the same elements in the same order."""
    v = values.detach().reshape(-1).double()
    return float((v * torch.arange(1, v.numel() + 1, dtype=torch.float64)).sum()) if v.numel() else 0.0


def run_rank(fn: Callable, cases: list[Case], seed: int | None = None, name: str = "",
             kwargs: dict | None = None) -> list[CaseRecord]:
    """Run ``fn`` on every case this rank takes part in, recording what reaches the process
    group. ``seed`` defaults to one drawn from ``os.urandom``; call :func:`tap` before
    importing the code under test."""
    t = tap()
    seed = int.from_bytes(os.urandom(6), "little") if seed is None else seed
    rank = dist.get_rank()
    world = dist.get_world_size()
    groups = {}
    with trace.paused():
        for case in cases:
            if case.group is not None and case.group not in groups:
                groups[case.group] = dist.new_group(list(case.group))
    records = []
    for case in cases:
        if case.group is not None and rank not in case.group:
            continue
        group = groups.get(case.group)
        grank = rank if case.group is None else case.group.index(rank)
        tensor, base = make_input(case, grank, seed, ops.rank_device())
        record = CaseRecord(case, seed, fingerprint(tensor))
        t.events = []
        extra = dict(kwargs or {})
        if group is not None:
            extra["group"] = group
        with trace.context(f"{name or getattr(fn, '__name__', 'the function')} "
                           f"(case {case.name}, world of {world})"):
            t.on = True
            counting = _CountDivisions(t.events) if case.op == ReduceOp.AVG else contextlib.nullcontext()
            try:
                with counting:
                    fn(tensor, op=case.op, **extra)
            except Exception as exc:  # noqa: BLE001 - judged as a failed case
                if is_timeout(exc):
                    raise
                first = str(exc).splitlines()[0] if str(exc) else ""
                record.error = f"raised {type(exc).__name__}: {first}{where_raised(exc)}"
            finally:
                t.on = False
        record.events = list(t.events)
        record.tampered = not t.intact()
        record.output = tensor.detach().cpu().clone(memory_format=torch.contiguous_format)
        if base is not None and case.layout == "strided":
            record.gaps_ok = not bool((base[1::2] != SENTINEL).any())
        records.append(record)
    return records


# ---- what the grading process does ----------------------------------------------------

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


def _compare(case: Case, expected: torch.Tensor, got: torch.Tensor, p: int) -> str | None:
    from .verify import compare

    exact = case.values == "int" or case.op in (ReduceOp.MIN, ReduceOp.MAX)
    rtol, atol = (0.0, 0.0) if exact else tolerance(case.dtype, p)
    if case.op == ReduceOp.PRODUCT and not exact:
        rtol, atol = rtol * 2, 0.0
    if not exact and case.op == ReduceOp.SUM:
        atol = max(atol, rtol)   # values summed in another order in a low-precision dtype
    return compare(expected, got.reshape(expected.shape), exact=exact, rtol=rtol, atol=atol)


def ring_pattern(case: Case, p: int, rank_in_group: int, events: list[tuple], *,
                 pieces: int | None = None, exact_count: bool = False) -> str | None:
    """The ring's messages for one call, or what is wrong with them.

    No collective; every message to the right neighbour in the group; 2(p − 1) chunks of
    ⌊n/p⌋ or ⌈n/p⌉ elements (``pieces``: each chunk may travel in up to that many pieces);
    2(p − 1)/p·n elements in all, give or take the chunks' rounding.
    """
    colls = sorted({e[0] for e in events if e[0] not in ("send", "recv", "divide")})
    if colls:
        return f"called {', '.join(colls)} on the process group: build it from point-to-point messages"
    if p == 1:
        sends = [e for e in events if e[0] == "send"]
        return f"sent {len(sends)} messages in a world of 1" if sends else None
    ranks = list(case.group) if case.group is not None else list(range(p))
    right = ranks[(rank_in_group + 1) % p]
    sends = [e for e in events if e[0] == "send"]
    if any(e[1] != right for e in sends):
        return f"sent to ranks {sorted({e[1] for e in sends})}, expected only the right neighbour {right}"
    n = case.numel
    small, large = n // p, -(-n // p)
    divided = sum(e[2] for e in events if e[0] == "divide")
    if case.op == ReduceOp.AVG and divided > large:
        return (f"divided {divided} elements for AVG; the ring divides only the chunk this rank "
                f"finished ({large} at most), before the all-gather")
    if (case.values == "int" and case.op in (ReduceOp.SUM, ReduceOp.AVG) and small >= 8
            and sends and all(e[3] == 0 for e in sends)):
        return "every message it sent held only zeros: the data did not travel in the ring's messages"
    total = sum(e[2] for e in sends)
    if total < 2 * (p - 1) * small or total > 2 * (p - 1) * large:
        return (f"sent {total} elements, expected 2(p-1)/p·n = {2 * (p - 1) * n / p:.0f} "
                f"(2(p-1) chunks of {small}{'' if small == large else f' or {large}'})")
    if pieces is None:
        if any(e[2] not in (small, large) for e in sends if e[2]):
            return f"sent messages of {sorted({e[2] for e in sends})} elements, expected chunks of {small} or {large}"
        if len([e for e in sends if e[2]]) > 2 * (p - 1) or (exact_count and len(sends) != 2 * (p - 1)):
            return f"sent {len(sends)} messages, expected 2(p-1) = {2 * (p - 1)}"
    else:
        most = 2 * (p - 1) * min(pieces, max(small, 1))
        if len([e for e in sends if e[2]]) > 2 * (p - 1) * pieces:
            return f"sent {len(sends)} messages, expected at most 2(p-1)·pieces = {2 * (p - 1) * pieces}"
        if exact_count and len(sends) != most:
            return f"sent {len(sends)} messages, expected 2(p-1)·pieces = {most}"
    return None


def judge(per_rank: list[list[CaseRecord]], *, pattern: Callable | None = None,
          what: str = "dist.all_reduce") -> Report:
    """Verdict on every rank's records, computed here from the seeds they returned."""
    report = Report(reference=what)
    by_case: dict[str, dict[int, CaseRecord]] = {}
    cases: dict[str, Case] = {}
    for rank, records in enumerate(per_rank):
        for rec in records:
            by_case.setdefault(rec.case.name, {})[rank] = rec
            cases[rec.case.name] = rec.case
    for name, recs in by_case.items():
        case = cases[name]
        ranks = list(case.group) if case.group is not None else sorted(recs)
        p = len(ranks)
        missing = [r for r in ranks if r not in recs]
        if missing:
            report.results.append(CaseResult(name, missing[0], False, "no result from this rank"))
            continue
        inputs = [make_values(case, i, recs[r].seed) for i, r in enumerate(ranks)]
        expected = expected_output(case, inputs)
        for i, r in enumerate(ranks):
            rec = recs[r]
            problem = None
            if rec.tampered:
                problem = "replaced methods of torch.distributed.ProcessGroup"
            elif abs(rec.fingerprint - fingerprint(inputs[i])) > 1e-6 * (1 + abs(fingerprint(inputs[i]))):
                problem = "the input it was handed is not the one the grader drew"
            elif rec.error:
                problem = rec.error
            else:
                problem = _compare(case, expected, rec.output, p)
                if problem is None and not rec.gaps_ok:
                    problem = "wrote outside the view: the elements between a strided view's changed"
                if problem is None and pattern is not None:
                    problem = pattern(case, p, i, rec.events)
            report.results.append(CaseResult(name, r, problem is None, problem or ""))
    return report


def ring_cases(p: int, *, large: bool = False, quick: bool = False) -> list[Case]:
    """The harness's covering cases, plus sizes every group size divides."""
    cases = default_cases(p, large=large, quick=quick)
    cases += [Case(60 * p, torch.float32, ReduceOp.SUM), Case(60 * p, torch.int64, ReduceOp.MAX),
              Case(60 * p, torch.float64, ReduceOp.AVG), Case(60 * p, torch.float32, ReduceOp.SUM, values="random"),
              Case(60 * p, torch.int32, ReduceOp.PRODUCT, layout="strided")]
    for case in list(cases):
        if case.group is not None and len(case.group) > 1 and case.numel == 1001:
            cases.append(Case(60 * len(case.group), torch.int64, ReduceOp.SUM, group=case.group))
    return list({c.name: c for c in cases}.values())


# ---- lesson 4's ring tasks: the cases and the pattern the grader and the runner share ----

RING_N = 1000        # the call whose messages are counted exactly: chunks of 334/333 at p = 3
PIPELINE_N = 4000    # ... for the pipelined ring: chunks of 1000 at p = 4, pieces of 250
PIECES = 4


def ring_task_cases(p: int, pipelined: bool = False) -> list[Case]:
    """Task 3: the whole covering set on 2-4 ranks (the 1 Mi-element case on 4), the quick one
    on 1, 5 and 6 ranks; task 4 (``pipelined``), whose pieces make many more messages: the
    quick one. Both: sizes every group size divides, and the counted call."""
    cases = ring_cases(p, large=(p == 4 and not pipelined), quick=pipelined or p not in (2, 3, 4))
    return cases + [Case(PIPELINE_N if pipelined else RING_N)]


def ring_task_pattern(pipelined: bool = False) -> Callable:
    """:func:`ring_pattern` for every call, with the exact message count on the counted call."""
    def pattern(case, p, rank, events):
        counted = (case.numel == (PIPELINE_N if pipelined else RING_N) and case.group is None
                   and case.layout == "contiguous")
        return ring_pattern(case, p, rank, events, pieces=PIECES if pipelined else None, exact_count=counted)
    return pattern


# ---- inside one world (the exercise runner, torchrun) ----------------------------------

def check_in_this_world(fn: Callable, cases: list[Case] | None = None, *, pattern: Callable | None = None,
                        name: str = "", kwargs: dict | None = None) -> Report:
    """:func:`run_rank` on every rank, then :func:`judge` on the gathered records, on every rank."""
    cases = default_cases(dist.get_world_size()) if cases is None else cases
    records = run_rank(fn, cases, name=name, kwargs=kwargs)
    gathered: list[Any] = [None] * dist.get_world_size()
    with trace.paused():
        dist.all_gather_object(gathered, records)
    return judge(gathered, pattern=pattern)


def _graded_rank(target: str, cases: list[Case], name: str, kwargs: dict | None) -> list[CaseRecord]:
    tap()                          # before the student's module is imported
    seed = int.from_bytes(os.urandom(6), "little")
    from .impl import resolve  # noqa: PLC0415

    fn = resolve(target)
    return run_rank(fn, cases, seed=seed, name=name, kwargs=kwargs)


def check_graded(target: str, world_size: int, cases: list[Case], *, pattern: Callable | None = None,
                 kwargs: dict | None = None, timeout: float = 30.0) -> Report:
    """Start a world, run ``target`` on ``cases`` there, judge what came back here.

    Raises :class:`collectives.core.launch.WorldTimeout` (with the function and case in
    ``where``) when the world hangs, :class:`~collectives.core.launch.RankError` when a rank dies.
    """
    from ..core import launch

    name = target.rsplit(":", 1)[-1]
    # check=False: the audit records every collective at the process group, check mode's own
    # all-gather of the arguments included; here the grader draws every rank's inputs and
    # judges them itself, so ranks cannot disagree by the grader's doing.
    per_rank = launch.run(_graded_rank, world_size, args=(target, cases, name, kwargs), timeout=timeout,
                          check=False)
    return judge(per_rank, pattern=pattern)
