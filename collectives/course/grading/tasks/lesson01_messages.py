"""Lesson 1's judges share these: inputs drawn from secrets, and how a message is read.

A message *holds* a tensor when the tap's fingerprint of what it carried is that tensor's;
which kind of call made it (a blocking ``dist.send`` or an immediate ``dist.isend``) only
the course's trace tells, so a probe records it beside the tap.
"""

from __future__ import annotations

import torch

from ....core import trace
from .tap import Call, fingerprint
from .world import Probe, Verdict


def _draw(seed: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).round().div(4).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def _laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` as handed over: itself, or (for ``transposed``) the transpose of a 2-D draw."""
    return values.t() if layout == "transposed" else values


def _members(p: int, group) -> list[int]:
    return list(group) if group is not None else list(range(p))


_WEIGHTS: dict[int, torch.Tensor] = {}


def fingerprint_of(values: torch.Tensor) -> float:
    """:func:`~collectives.course.grading.tasks.tap.fingerprint`, its weights computed once per length
    (the judge takes the fingerprints of many tensors of a few lengths)."""
    v = values.detach().reshape(-1).to("cpu", torch.float64)
    n = v.numel()
    if n < 4096:
        return fingerprint(v)
    if n not in _WEIGHTS:
        _WEIGHTS[n] = torch.arange(1, n + 1, dtype=torch.float64).sin_()
    return float((torch.nan_to_num(v) * _WEIGHTS[n]).sum())


def holds(call: Call, values: torch.Tensor) -> bool:
    """The message holds ``values``, element for element (by the tap's fingerprint)."""
    return (call.numel == values.numel()
            and abs(call.fingerprint - fingerprint_of(values)) <= 1e-9 * (1 + call.weight))


def _messages(calls: list[Call]) -> tuple[list[Call], list[Call]]:
    return [c for c in calls if c.kind == "send"], [c for c in calls if c.kind == "recv"]


def _describe(calls: list[Call]) -> str:
    return "[" + ", ".join(f"{c.kind} {'to' if c.kind == 'send' else 'from'} {c.peer} ({c.numel})"
                           for c in calls) + "]" if calls else "nothing"


def _traced_call(probe: Probe, key: str, fn, *args, **kwargs):
    """``probe.call``, with the kinds of the messages the course's trace saw (send or isend)."""
    with trace.recording() as t:
        outcome = probe.call(key, fn, *args, **kwargs)
    return outcome, [(e.kind, e.peer) for e in t if e.is_send or e.is_recv]


def refused(where: str, outcome, verdict: Verdict) -> None:
    """Bad input must be refused with ValueError."""
    if outcome.not_written:
        verdict.not_written = verdict.not_written or outcome.not_written
    elif not outcome.error.startswith("raised ValueError"):
        verdict.add(f"{where}: expected ValueError, got {outcome.error or 'no error'}")
