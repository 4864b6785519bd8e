"""The same faults under torch's own check, ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: what it catches, what it misses.

With ``DETAIL``, torch wraps every gloo process group in a ``ProcessGroupWrapper``: before
each collective the ranks pass a *monitored barrier* (which names the ranks that do not
arrive within the group's timeout) and compare a fingerprint of the call -- sequence
number, operation, shapes, dtypes -- raising "Detected mismatch between collectives" when
they differ. It checks collectives only, and only as they are called: point-to-point
messages, a slow rank and a rank or a link that dies are not its business.

:func:`run_with_detail` runs a fault with ``DETAIL`` on (and the flight recorder too: the
same world is judged by both), on a group whose timeout is short enough for torch's barrier
to fire before the watchdog; :func:`compare` puts what torch said beside what the analyzer
found, and whether each singled out the rank to blame (:func:`~.faults.blame`).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from . import analyze
from .diagnose import diagnose
from .faults import Params, blame
from .scenarios import Outcome, run_scenario

DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
_FINGERPRINT = re.compile(r"CollectiveFingerPrint\(SequenceNumber=(\d+), OpType=(\w+), TensorShape=(\[[^\]]*\]), "
                          r"TensorDtypes=(\w+)")


def run_with_detail(params: Params, directory=None, *, timeout: float = 2.0, group_timeout: float = 0.5,
                    machines: int | None = None) -> Outcome:
    """``params``' fault with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` and the flight recorder on."""
    return run_scenario(params, directory, timeout=timeout, env=DETAIL, group_timeout=group_timeout,
                        machines=machines)


@dataclass
class DetailVerdict:
    """What torch's check said about one run."""

    caught: bool                  # torch's check itself reported (not a gloo timeout or a lost peer)
    named: tuple[int, ...]        # the ranks its messages single out
    message: str                  # its most telling line, shortened


def detail_verdict(outcome: Outcome) -> DetailVerdict:
    """Read torch's messages out of every failed rank's error."""
    errors = outcome.errors
    barrier = [m for m in errors.values() if "failed to pass monitoredBarrier" in m]
    if barrier:
        ranks = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", barrier[0])
        named = tuple(int(r) for r in ranks.group(1).split(",") if r.strip()) if ranks else ()
        return DetailVerdict(True, named, _short(barrier[0]))
    mismatch = {r: m for r, m in errors.items() if "Detected mismatch between collectives" in m}
    if mismatch:
        # each rank says "Rank r is running X, but Rank s is running Y": the rank most pointed at
        pointed = Counter(int(s) for m in mismatch.values() for s in re.findall(r"but Rank (\d+) is running", m))
        top = max(pointed.values(), default=0)
        named = tuple(sorted(r for r, n in pointed.items() if n == top)) if top > 1 or len(pointed) == 1 else ()
        first = mismatch[min(mismatch)]
        calls = _FINGERPRINT.findall(first)
        said = "mismatch: " + " vs ".join(f"{op} {shape} {dtype}" for _, op, shape, dtype in calls[:2])
        return DetailVerdict(True, named, said)
    if errors:
        return DetailVerdict(False, (), _short(errors[min(errors)]))
    if outcome.ended.startswith("timed out"):
        return DetailVerdict(False, (), "nothing: the world hung until the watchdog")
    return DetailVerdict(False, (), "nothing: the loop finished")


def _short(message: str) -> str:
    message = re.sub(r"^RuntimeError: ", "", message)
    message = re.sub(r"\[/?[^\]]*third_party/gloo/[^\]]*\] ", "gloo: ", message)
    message = re.sub(r"\[[\d.]+\]:\d+", "", message)
    return message.split(". This is typically")[0][:110]


@dataclass
class Comparison:
    """One fault, judged by torch's check and by the analyzer, in the same world."""

    kind: str
    blame: tuple[int, ...]        # the ranks the fault was injected into (the truth)
    ended: str
    detail: DetailVerdict
    finding: str                  # the analyzer's first finding, its kind and sentence
    finding_ranks: tuple[int, ...]

    @property
    def detail_names_culprit(self) -> bool:
        return set(self.detail.named) == set(self.blame)

    @property
    def analyzer_names_culprit(self) -> bool:
        return set(self.finding_ranks) == set(self.blame)


def compare(outcome: Outcome, checks=analyze) -> Comparison:
    """Torch's verdict and the analyzer's first finding on one run of :func:`run_with_detail`
    (``checks``: as for :func:`~collectives.debugging.diagnose.diagnose`)."""
    findings = diagnose(outcome.dumps, outcome.world, checks)
    first = findings[0] if findings else None
    return Comparison(outcome.params.kind, blame(outcome.params), outcome.ended.split(":")[0],
                      detail_verdict(outcome), f"{first.kind}: {first.text}" if first else "no problem found",
                      first.ranks if first else ())
