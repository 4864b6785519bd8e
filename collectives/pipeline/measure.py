"""A measured step read back from its trace: the bubble, what each step cost, and what the
schedule should have idled with those costs.

A trace is, per rank, the spans ``(kind, mb, chunk, start, end)`` of the steps it ran, all
on one clock (the runner's ``spans``, or torch's schedule's, :mod:`.torch_pp`). From it:

* :func:`bubble` -- **the** bubble, one definition for measurements and for the simulator:
  the ranks' idle share of the step, from the first step's start on any rank to the last
  step's end on any rank, ``1 − Σ busy / (p · window)``;
* :func:`unit_times` -- each rank's median F, B, W (and B + W as one backward, ``BW``) of a
  whole stage (a chunk's time × v);
* :func:`message_time` -- the median time from the end of a step to the start of the step on
  another rank that consumes its message, over the steps that did wait for it (their rank
  was ready before the message was sent);
* :func:`overhead` -- the median gap between two steps of a rank that waited for nothing;
* :func:`predict` -- the schedule played by the simulator with those measured costs: the
  bubble a rank's own speeds and the messages' latency leave, beside the textbook formula's
  (equal stages, equal unit steps, messages free).

The difference between the textbook bubble and a measured one is split in three by
:func:`explain`: the fill and drain with the measured step costs, stages that run at
different speeds (the slowest paces the pipe; the others wait), and the messages.
"""

from __future__ import annotations

import statistics

from .schedules import Step
from .simulate import dependency, simulate, split_steps

KINDS = ("F", "B", "W", "BW")


def _spans(trace) -> list[list[tuple[str, int, int, float, float]]]:
    """Spans as tuples, whether ``(Step, start, end)`` or ``(kind, mb, chunk, start, end)``."""
    out = []
    for spans in trace:
        rows = []
        for span in spans:
            if len(span) == 3:
                step, start, end = span
                rows.append((step.kind, step.mb, step.chunk, start, end))
            else:
                rows.append(tuple(span))
        out.append(sorted(rows, key=lambda s: s[3]))
    return out


def bubble(trace) -> float:
    """Idle share of all ranks' time between the step's first start and its last end."""
    spans = _spans(trace)
    every = [s for rank in spans for s in rank]
    if not every:
        return 0.0
    window = max(s[4] for s in every) - min(s[3] for s in every)
    busy = sum(s[4] - s[3] for s in every)
    return 1 - busy / (len(spans) * window) if window > 0 else 0.0


def unit_times(trace, v: int = 1) -> list[dict[str, float]]:
    """Per rank: the median time of each kind of step on a whole stage (v chunks' worth).
    A B whose W is listed is ``B``; a B that is the whole backward is ``BW``."""
    out = []
    for rank in _spans(trace):
        split = {(mb, c) for k, mb, c, _, _ in rank if k == "W"}
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        for k, mb, c, s, e in rank:
            kind = "BW" if k == "B" and (mb, c) not in split else k
            times[kind].append(e - s)
        out.append({k: v * statistics.median(x) for k, x in times.items() if x})
    return out


def _waits(trace, num_chunks: int):
    """(was the step waiting for a message, gap before it, message delay) of every step."""
    spans = _spans(trace)
    ends = {(k, mb, c): e for rank in spans for k, mb, c, _, e in rank}
    for rank in spans:
        for i, (k, mb, c, s, e) in enumerate(rank):
            dep = dependency(Step(k, mb, c), num_chunks)
            sent = ends.get((dep.kind, dep.mb, dep.chunk)) if dep is not None else None
            if i == 0:          # a rank's first step: it had nothing else to do
                if sent is not None:
                    yield True, None, s - sent
                continue
            ready = rank[i - 1][4]
            yield sent is not None and sent > ready, s - ready, None if sent is None else s - sent


def message_time(trace, num_chunks: int) -> float:
    """Median delay from a message's sending step's end to its consumer's start, over the
    steps whose rank was ready first (so the delay is the message's, not the rank's)."""
    delays = [d for waited, _, d in _waits(trace, num_chunks) if waited]
    return statistics.median(delays) if delays else 0.0


def overhead(trace, num_chunks: int) -> float:
    """Median gap between two steps of a rank whose message (if any) was already there."""
    gaps = [g for waited, g, _ in _waits(trace, num_chunks) if not waited]
    return statistics.median(gaps) if gaps else 0.0


def predict(schedule, m: int, trace, num_chunks: int | None = None, *, uniform: bool = False,
            messages: bool = True) -> float:
    """The bubble :func:`.simulate.simulate` plays for ``schedule`` with the trace's measured
    costs: each rank's own F, B, W (``uniform``: every rank the median over the ranks), and
    the measured message time and overhead between steps (``messages=False``: both free)."""
    p = len(schedule)
    C = num_chunks or p
    units = unit_times(trace, C // p)
    if uniform:
        kinds = {k for u in units for k in u}
        units = [{k: statistics.median(u[k] for u in units if k in u) for k in kinds}] * p
    split = split_steps(schedule)
    for u in units:                        # a schedule of whole backwards: W folded into B
        if not split and "BW" not in u and "B" in u:
            u["BW"] = u["B"] + u.get("W", 0.0)
    alpha = message_time(trace, C) if messages else 0.0
    gap = overhead(trace, C) if messages else 0.0
    return simulate(schedule, m, list(units), message=alpha, num_chunks=C, overhead=gap).bubble()


def explain(schedule, m: int, trace, num_chunks: int | None = None) -> dict[str, float]:
    """The measured bubble beside what the schedule idles with equal stages of the measured
    median costs (``fill``), with each rank's own costs (``stages``), and with the measured
    messages and overhead too (``model``)."""
    return dict(measured=bubble(trace),
                fill=predict(schedule, m, trace, num_chunks, uniform=True, messages=False),
                stages=predict(schedule, m, trace, num_chunks, messages=False),
                model=predict(schedule, m, trace, num_chunks))
