"""The equivalence harness: an implementation against ``dist.all_reduce`` on the same inputs.

Inside a running world, :func:`check_all_reduce` feeds an implementation and
``dist.all_reduce`` identical inputs case by case and compares the results::

    report = verify.check_all_reduce(ring_all_reduce)      # on every rank
    report.raise_if_failed()

From outside a world (a test, the tour), :func:`check_in_world` starts one and merges
every rank's report.

The cases (:func:`default_cases`) cover world sizes 1-4 (the caller's), sizes 0, 1,
fewer elements than ranks, not divisible by the world size and over 1 Mi elements;
float32/64, float16, bfloat16, int32/64; SUM, PRODUCT, MIN, MAX, AVG; non-contiguous
views; subgroups. They are a covering set, not the full cross product: each dtype meets
each op once, each size and layout meets a few dtype/op pairs. The cases and their inputs live in
:mod:`collectives.course.cases`.

Two rules keep the reference honest:

* **integer-valued inputs must match bit for bit**: values are small integers chosen so
  every partial result is exactly representable in the dtype, whatever order an
  algorithm combines them in; random floats are compared within :data:`TOLERANCES`.
* **gloo is never handed a view**: its ``all_reduce`` on a non-contiguous view silently
  reduces the wrong elements, and on an expanded tensor it crashes. The reference is
  always computed on a contiguous copy; the implementation gets the view itself, and the
  harness also checks that the elements *between* the view's elements were left alone.

A third rule holds the result to what ``dist.all_reduce`` promises beyond the values:

* **every rank ends with the same bits.** A random-float case passes only if every rank
  of the group holds bit for bit what the group's first rank holds (the harness
  broadcasts it and compares). The naive ring of lesson 3 is the documented exception:
  each rank adds the p terms in its own order, so its callers pass
  ``identical_bits=False``.

**AVG** is, by the contract, the SUM followed by one division by the group size, and the
reference is built that way on every backend -- never from the backend's own AVG. NCCL
computes a floating-point AVG differently: it multiplies every rank's input by 1/p first
and then sums (a "pre-multiplied sum"). Where 1/p is not exact in the dtype (p = 3, 5, 6,
7, ...) the two round differently in the last bits, so comparing an algorithm that sums and
divides once with NCCL's native AVG bit for bit would fail for no fault of the algorithm.
gloo has no AVG at all. (On integer-valued inputs SUM-then-divide is exact whenever the
mean is representable; NCCL's pre-multiply is not, since x/3 rarely is.)

A mismatch names the case, the rank, the first differing index, expected and got.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from ..core import trace
from ..core.ops import ReduceOp, op_name, rank_device  # noqa: F401  (rank_device: part of this module's interface too)
from .cases import (  # noqa: F401  (the cases and their inputs: part of this module's interface too)
    ALL_DTYPES,
    ALL_OPS,
    FLOAT_DTYPES,
    INT_DTYPES,
    LARGE,
    SENTINEL,
    TOLERANCES,
    Case,
    _generator,
    default_cases,
    make_input,
    make_values,
    tolerance,
)


@dataclass
class CaseResult:
    case: str
    rank: int
    ok: bool
    detail: str = ""


@dataclass
class Report:
    """What one or more ranks saw. ``failures`` holds only the cases that did not match."""

    results: list[CaseResult] = field(default_factory=list)
    reference: str = "the reference"  # what the cases were compared with, for the summary

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.ok]

    @property
    def cases(self) -> int:
        return len({r.case for r in self.results})

    def merge(self, other: "Report") -> "Report":
        return Report(self.results + other.results, self.reference)

    def summary(self, limit: int = 8) -> str:
        bad = self.failures
        if not bad:
            return f"all {self.cases} cases match {self.reference}"
        lines = [f"{len({r.case for r in bad})} of {self.cases} cases differ from {self.reference}:"]
        lines += [f"  [{r.case}] rank {r.rank}: {r.detail}" for r in bad[:limit]]
        if len(bad) > limit:
            lines.append(f"  ... and {len(bad) - limit} more")
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise AssertionError(self.summary())


_TOOLING = (os.sep + os.path.join("collectives", "core") + os.sep,
            os.sep + os.path.join("collectives", "course") + os.sep,
            os.sep + "torch" + os.sep, os.sep + "site-packages" + os.sep, os.sep + "lib" + os.sep + "python")


def where_raised(exc: BaseException) -> str:
    """ " (exercise.py line 87, in ring_all_reduce: flat[lo:hi] += buf)": the deepest frame of
    ``exc`` outside torch and the course's own tooling -- the student's code -- or ""."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not any(t in f.filename for t in _TOOLING)]
    if not frames:
        return ""
    f = frames[-1]
    code = f" `{f.line.strip()}`" if f.line else ""
    return f" ({os.path.basename(f.filename)} line {f.lineno}, in {f.name}:{code})"


def is_timeout(exc: BaseException) -> bool:
    """A gloo timeout (under torchrun there is no watchdog): the world is stuck, and the next
    case would wait as long again, so the checks stop instead of reporting a failed case."""
    text = str(exc).lower()
    return any(k in text for k in ("timed out", "connection closed", "connection reset", "transport/tcp"))


def reference_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """``dist.all_reduce`` of a contiguous copy of ``tensor``; returns the copy. Not traced.

    Never the view itself: gloo reduces the wrong elements of a non-contiguous view and
    crashes on an expanded one. AVG is always SUM then one division by the group size, as
    the contract states -- not the backend's own AVG, which on NCCL pre-multiplies each
    input by 1/p and rounds differently (see the module's docstring).
    """
    buf = tensor.clone(memory_format=torch.contiguous_format)
    with trace.paused():
        if op == ReduceOp.AVG:
            dist.all_reduce(buf, op=ReduceOp.SUM, group=group)
            buf.div_(dist.get_world_size(group))
        else:
            dist.all_reduce(buf, op=op, group=group)
    return buf


def same_bits_problem(tensor: torch.Tensor, group=None) -> str | None:
    """None when every rank of ``group`` holds ``tensor`` bit for bit, else what differs.

    Collective (every rank of the group must call it): the group's first rank broadcasts
    its tensor, every rank compares bitwise (NaN with the same payload is equal)."""
    mine = tensor.detach().reshape(-1).contiguous()
    first = mine.clone()
    with trace.paused():
        root = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(first, root, group=group)
    if first.element_size() in (2, 4, 8) and first.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[first.element_size()]
        differ = mine.view(bits) != first.view(bits)
    else:
        differ = mine != first
    if not bool(differ.any()):
        return None
    i = int(differ.nonzero()[0])
    return (f"ranks disagree: {int(differ.sum())} elements differ in their bits from the group's "
            f"first rank; first at index {i}: {first[i].item()!r} there, {mine[i].item()!r} here")


def compare(expected: torch.Tensor, got: torch.Tensor, *, exact: bool = True,
            rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """None when ``got`` matches ``expected``, else a one-line description of the first mismatch."""
    if tuple(got.shape) != tuple(expected.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if got.dtype != expected.dtype:
        return f"dtype {got.dtype}, expected {expected.dtype}"
    e = expected.detach().reshape(-1).cpu()
    g = got.detach().reshape(-1).cpu()
    if exact:
        bad = (e != g) & ~(torch.isnan(e) & torch.isnan(g)) if e.is_floating_point() else e != g
    else:
        bad = ~torch.isclose(g.double(), e.double(), rtol=rtol, atol=atol)
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0])
    return (f"{int(bad.sum())} of {e.numel()} elements differ; first at index {i}: "
            f"expected {e[i].item()!r}, got {g[i].item()!r}")


def _make_groups(cases: Iterable[Case]) -> dict[tuple[int, ...], object]:
    """Create every subgroup the cases need -- collectively, in the same order on every rank."""
    groups = {}
    world = dist.get_world_size()
    with trace.paused():
        for case in cases:
            if case.group is not None and case.group not in groups:
                if max(case.group) >= world:
                    raise ValueError(f"case {case.name} names ranks outside a world of {world}")
                groups[case.group] = dist.new_group(list(case.group))
    return groups


def run_case(fn: Callable, case: Case, group=None, seed: int = 0, *,
             identical_bits: bool = True) -> CaseResult:
    """Run one case on this rank: reference on a copy, ``fn`` in place, compare; for random
    floats (``identical_bits``) also check that every rank of the group ends with the
    same bits (collective: every rank of the group runs the case)."""
    rank = dist.get_rank()
    group_rank = rank if case.group is None else case.group.index(rank)
    p = dist.get_world_size(group)
    tensor, base = make_input(case, group_rank, seed, rank_device())
    expected = reference_all_reduce(tensor, case.op, group)
    where = f"{getattr(fn, '__name__', 'the function')} (case {case.name}, world of {dist.get_world_size()})"
    try:
        with trace.context(where):
            if group is None:
                fn(tensor, op=case.op)
            else:
                fn(tensor, op=case.op, group=group)
    except NotImplementedError as exc:
        return CaseResult(case.name, rank, False, f"not implemented: {exc}")
    except Exception as exc:  # noqa: BLE001 - reported, not raised: other cases still run
        if is_timeout(exc):
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        return CaseResult(case.name, rank, False, f"raised {type(exc).__name__}: {first}{where_raised(exc)}")
    exact = case.values == "int" or case.op in (ReduceOp.MIN, ReduceOp.MAX)
    rtol, atol = (0.0, 0.0) if exact else tolerance(case.dtype, p)
    if case.op == ReduceOp.PRODUCT and not exact:
        rtol, atol = rtol * 2, 0.0
    problem = compare(expected, tensor, exact=exact, rtol=rtol, atol=atol)
    if identical_bits and case.values == "random":   # exact cases agree by being exact
        problem = same_bits_problem(tensor, group) or problem
    if problem is None and base is not None and case.layout == "strided":
        gaps = base[1::2]
        if bool((gaps != SENTINEL).any()):
            i = int((gaps != SENTINEL).nonzero()[0])
            problem = (f"wrote outside the view: element {2 * i + 1} of the underlying buffer "
                       f"changed from {SENTINEL} to {gaps[i].item()!r}")
    return CaseResult(case.name, rank, problem is None, problem or "")


def check_all_reduce(fn: Callable, cases: list[Case] | None = None, *, seed: int = 0,
                     quick: bool = False, identical_bits: bool = True) -> Report:
    """On every rank of the world: run ``fn`` and ``dist.all_reduce`` on each case, compare.

    ``fn(tensor, op=..., group=...)`` must reduce ``tensor`` in place. Returns this rank's
    :class:`Report`; exceptions from ``fn`` become failed cases, so one unfinished task
    does not hide the others. ``identical_bits=False`` waives the same-bits-on-every-rank
    rule (for the naive ring, whose ranks add in different orders).
    """
    world = dist.get_world_size()
    cases = default_cases(world, quick=quick) if cases is None else cases
    groups = _make_groups(cases)
    rank = dist.get_rank()
    report = Report(reference="dist.all_reduce")
    for case in cases:
        if case.group is not None and rank not in case.group:
            continue
        report.results.append(run_case(fn, case, groups.get(case.group), seed,
                                       identical_bits=identical_bits))
    return report


def check_expanded_rejected(fn: Callable) -> CaseResult:
    """An expanded tensor (elements sharing memory) must get a clear ValueError, not a crash."""
    rank = dist.get_rank()
    tensor = torch.ones(1, device=rank_device()).expand(8)
    name = "expanded tensor is rejected"
    try:
        fn(tensor, op=ReduceOp.SUM)
    except ValueError as exc:
        return CaseResult(name, rank, "memory" in str(exc) or "expand" in str(exc),
                          f"ValueError without saying why: {exc}")
    except Exception as exc:  # noqa: BLE001
        return CaseResult(name, rank, False, f"raised {type(exc).__name__} instead of ValueError: {exc}")
    return CaseResult(name, rank, False, "accepted an expanded tensor without an error")


def _check_in_rank(target: str, quick: bool, seed: int, identical_bits: bool = True) -> Report:
    from .impl import resolve

    return check_all_reduce(resolve(target), quick=quick, seed=seed, identical_bits=identical_bits)


def _expanded_in_rank(target: str) -> CaseResult:
    from .impl import resolve

    return check_expanded_rejected(resolve(target))


def check_in_world(target: str, world_size: int, *, quick: bool = False, seed: int = 0,
                   expanded: bool = True, identical_bits: bool = True, **launch_kwargs) -> Report:
    """Start a world, check ``target`` (``"module:function"`` or ``"path/file.py:function"``)
    on every rank, and return the merged report.

    The expanded-tensor check runs in a world of its own: an implementation that hands
    such a tensor to gloo crashes the process (SIGABRT/SIGSEGV), and that crash must cost
    one failed case, not every result of the world.
    """
    from ..core import launch

    merged = Report(reference="dist.all_reduce")
    for r in launch.run(_check_in_rank, world_size, args=(target, quick, seed, identical_bits),
                        **launch_kwargs):
        merged = merged.merge(r)
    if expanded:
        name = "expanded tensor is rejected"
        try:
            results = launch.run(_expanded_in_rank, world_size, args=(target,), **launch_kwargs)
            merged.results.extend(results)
        except launch.RankError as exc:
            merged.results.append(CaseResult(name, exc.rank, False, f"crashed: {exc.summary}"))
        except launch.WorldTimeout:
            merged.results.append(CaseResult(name, -1, False, "hung on an expanded tensor"))
    return merged
