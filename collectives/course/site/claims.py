"""A claim is data: what a figure shows, recorded beside it, and the sentences that say it.

A figure script measures, draws, and writes beside the image a *record* (``NAME.json``
next to ``NAME.svg`` in ``docs/img/``): the comparisons the figure shows -- which is
faster and by how much, the winner at each size, where the winner changes -- with the
device, the versions, the date and the command that made it::

    record = claims.Record("04-pipelining", names={"ring": "the ring",
                                                    "pipelined_ring": "the pipelined ring"})
    record.times("one call", {"ring": 0.37, "pipelined_ring": 0.81}, baseline="ring",
                 where="4 Mi float32 on 4 ranks")
    record.caption = record.text("one call")        # "... the ring ran 2.19× as fast as ..."
    plots.save(fig, IMG / "04-pipelining", record)   # the image and the record, together

A page never states a comparison ahead of the data. It places the figure with
``{{ figure: 04-pipelining | COMMAND }}`` and the build writes the image, the caption
and the line naming the device, versions, date and command from the record
(:func:`expand`); without a record the figure and its claims are absent, and the page
says which command draws it. A sentence written by hand that compares two series of a
record ("the pipelined ring is faster than the ring") is read by :func:`contradictions`,
which the site check runs over every page and every lab: it fails when the record says
otherwise. Labs print their conclusions from their own run with :func:`compare_line`
and :func:`winners_line`, and what to expect from the lesson's record with
:func:`expectation`.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Sequence

from ..catalog import ROOT
from .tables import human  # noqa: F401  (part of this module's interface)
from .claim_pages import (  # noqa: F401  (reading records and pages: part of this module's interface too)
    _BETTER_THAN,
    _CONDITION,
    _PLACEHOLDER,
    IMG,
    contradictions,
    expand,
    expectation,
    load,
    placeholders,
    sentences,
)

__all__ = ["IMG", "Record", "environment", "host", "load", "expand", "contradictions", "compare_line",
           "winners_line", "crossover", "expectation", "human"]

VERSION = 1
META_FIELDS = ("command", "date", "device", "torch")     # every record names these


# --------------------------------------------------------------------------- writing

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command() -> str:
    exe = Path(sys.executable)
    try:
        python = str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else ".venv/bin/python"
    except ValueError:
        python = ".venv/bin/python"
    args = list(sys.argv)
    if args and args[0].endswith(".py") and Path(args[0]).is_absolute():
        try:
            args[0] = str(Path(args[0]).resolve().relative_to(ROOT))
        except ValueError:
            pass
    sudo = "sudo " if os.environ.get("SUDO_USER") and hasattr(os, "geteuid") and os.geteuid() == 0 else ""
    return sudo + " ".join([python] + args)


def commit() -> str:
    """The course's git commit (with "+dirty" when tracked files other than the records --
    docs/data, docs/img: what a run writes -- differ from it), or "" outside a checkout.
    ``COLLECTIVES_COMMIT`` wins when set: a copy of the tree on another machine (the GPU lane's)
    may carry no repository, or an older one."""
    import os
    import subprocess
    if os.environ.get("COLLECTIVES_COMMIT"):
        return os.environ["COLLECTIVES_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)docs/data", ":(exclude)docs/img"], cwd=ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if head and dirty else "")


def host() -> dict:
    """The host a timing ran on, for every benchmark's record: ``cpus`` (its cores),
    ``load_average`` (1, 5 and 15 minutes, read when the record is made: a loaded host says
    so) and ``torch``. A page names both beside the numbers (:func:`expand`)."""
    import torch

    out = {"cpus": os.cpu_count() or 1, "torch": torch.__version__}
    try:
        out["load_average"] = [round(x, 1) for x in os.getloadavg()]
    except (OSError, AttributeError):
        pass
    return out


def environment(backend: str = "gloo", command: str | None = None, **extra) -> dict:
    """Where and how a measurement was made: the record's ``meta``.

    ``device`` names the hardware ("16-core x86_64 host (AMD EPYC ...)", or the GPUs under
    NCCL); ``command`` is the command line that ran (``sys.argv``), unless given."""
    import torch

    cpus = os.cpu_count() or 1
    device = f"{cpus}-core {platform.machine()} host ({_cpu_model()})"
    meta = {"command": command or _command(), "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "device": device, "torch": torch.__version__, "python": platform.python_version(),
            "backend": backend, "cpus": cpus}
    if backend == "nccl" and torch.cuda.is_available():
        count = torch.cuda.device_count()
        meta["device"] = f"{count}x {torch.cuda.get_device_name(0)}"
        meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    meta.update(host())
    meta.update(extra)
    return meta



def _size(nbytes: float) -> str:
    from ...core.timing import human_bytes
    return human_bytes(nbytes)


class Record:
    """The comparisons one figure shows; :meth:`save` writes them as JSON beside it.

    ``names``: series key -> how the text calls it ("pipelined_ring" -> "the pipelined
    ring"); ``aliases``: further words a page may call it by ("pipelining"), which the
    check of hand-written sentences recognises too.
    """

    def __init__(self, name: str, *, names: dict[str, str], aliases: dict[str, list[str]] | None = None,
                 title: str = "", alt: str = "", meta: dict | None = None):
        self.name, self.names, self.title, self.alt = name, dict(names), title, alt or title
        self.aliases = {k: list(v) for k, v in (aliases or {}).items()}
        self.meta = meta if meta is not None else environment()
        self.comparisons: list[dict] = []
        self.caption = ""
        self.table: dict | None = None
        self.image = ""

    def _call(self, key: str) -> str:
        return self.names.get(key, key.replace("_", " "))

    def times(self, id: str, values: dict[str, float], *, baseline: str | None = None,
              where: str = "") -> dict:
        """One measurement of each series (seconds): which is fastest, by how much."""
        order = sorted(values, key=lambda k: values[k])
        entry = {"id": id, "kind": "times", "where": where, "values": dict(values),
                 "baseline": baseline, "order": order}
        entry["text"] = compare_line(values, self.names, where=where, baseline=baseline)
        self.comparisons.append(entry)
        return entry

    def sweep(self, id: str, sizes: Sequence[int], values: dict[str, Sequence[float]], *,
              label: str = "measured") -> dict:
        """Times of each series at each size: the winner per size, said in one sentence."""
        winners = [min(values, key=lambda k: values[k][i]) for i in range(len(sizes))]
        entry = {"id": id, "kind": "sweep", "label": label, "sizes": list(sizes),
                 "values": {k: list(v) for k, v in values.items()}, "winners": winners}
        entry["text"] = winners_line(sizes, winners, self.names, label=label)
        self.comparisons.append(entry)
        return entry

    def crossover(self, id: str, sizes: Sequence[int], first: str, then: str,
                  values: dict[str, Sequence[float]], *, label: str = "measured",
                  at: float | None = None) -> dict:
        """Where ``then`` starts to beat ``first`` (``at``: given, or interpolated from the
        two sizes between which the order changes); ``None`` when it does not within the sweep."""
        if at is None:
            at = crossover(sizes, values[first], values[then])
        entry = {"id": id, "kind": "crossover", "label": label, "between": [first, then],
                 "at": at, "range": [min(sizes), max(sizes)]}
        if at is None:
            entry["text"] = (f"{_cap(label)}: {self._call(then)} does not overtake {self._call(first)} "
                             f"between {_size(min(sizes))} and {_size(max(sizes))}.")
        else:
            entry["text"] = (f"{_cap(label)}: {self._call(then)} overtakes {self._call(first)} "
                             f"at about {_size(at)}.")
        self.comparisons.append(entry)
        return entry

    def fact(self, id: str, text: str, **data) -> dict:
        """A statement with no ordering in it (counts of messages, bytes): recorded as said."""
        entry = {"id": id, "kind": "fact", "text": text, **data}
        self.comparisons.append(entry)
        return entry

    def text(self, *ids: str) -> str:
        """The sentences of the comparisons ``ids`` (all, when none is named), joined."""
        chosen = [c for c in self.comparisons if not ids or c["id"] in ids]
        return " ".join(c["text"] for c in chosen)

    def to_dict(self) -> dict:
        return {"version": VERSION, "figure": self.name, "image": self.image, "title": self.title,
                "alt": self.alt, "meta": self.meta, "names": self.names, "aliases": self.aliases,
                "comparisons": self.comparisons, "caption": self.caption or self.text(),
                "table": self.table}

    def save(self, path: Path) -> Path:
        path = Path(path).with_suffix(".json")
        path.write_text(json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        return path


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def compare_line(values: dict[str, float], names: dict[str, str] | None = None, *, where: str = "",
                 baseline: str | None = None) -> str:
    """One sentence from one measurement of each series: the times, and the fastest's margin.

    >>> compare_line({"ring": 0.37, "pipelined_ring": 0.81}, where="at 16 MiB")
    'At 16 MiB: ring 370 ms, pipelined ring 810 ms; ring ran 2.19× as fast as pipelined ring.'
    """
    names = names or {}
    call = lambda k: names.get(k, k.replace("_", " "))   # noqa: E731
    order = sorted(values, key=lambda k: values[k])
    times = ", ".join(f"{call(k)} {human(values[k])}" for k in values)
    head = f"{_cap(where)}: " if where else ""
    if len(order) < 2:
        return f"{head}{times}."
    best, other = order[0], (baseline if baseline and baseline != order[0] else order[1])
    ratio = values[other] / values[best] if values[best] > 0 else float("inf")
    return f"{head}{times}; {call(best)} ran {ratio:.2f}× as fast as {call(other)}."


def winners_line(sizes: Sequence[int], winners: Sequence[str], names: dict[str, str] | None = None, *,
                 label: str = "measured") -> str:
    """"Measured, the fastest: the tree from 1 KiB to 64 KiB, the ring from 256 KiB to 64 MiB.\""""
    names = names or {}
    runs: list[list] = []
    for size, who in zip(sizes, winners):
        if runs and runs[-1][0] == who:
            runs[-1][2] = size
        else:
            runs.append([who, size, size])
    parts = []
    for who, lo, hi in runs:
        span = f"at {_size(lo)}" if lo == hi else f"from {_size(lo)} to {_size(hi)}"
        parts.append(f"{names.get(who, who.replace('_', ' '))} {span}")
    if len(runs) == 1:
        return f"{_cap(label)}, the fastest at every size: {names.get(runs[0][0], runs[0][0].replace('_', ' '))}."
    return f"{_cap(label)}, the fastest: " + ", ".join(parts) + "."


def crossover(sizes: Sequence[float], first: Sequence[float], then: Sequence[float]) -> float | None:
    """The size where ``then`` becomes faster than ``first`` and stays so, interpolated on
    log scales between the two sizes around the change; ``None`` if it never does, or does
    from the smallest size on."""
    faster = [b < a for a, b in zip(first, then)]
    if not any(faster) or all(faster):
        return None
    last_slow = max(i for i, f in enumerate(faster) if not f)
    if last_slow + 1 >= len(sizes):
        return None
    i, j = last_slow, last_slow + 1
    d0 = math.log(then[i] / first[i])        # > 0: then slower
    d1 = math.log(then[j] / first[j])        # < 0: then faster
    share = d0 / (d0 - d1) if d0 != d1 else 0.5
    return math.exp(math.log(sizes[i]) + share * (math.log(sizes[j]) - math.log(sizes[i])))


def record_problems(record: dict) -> list[str]:
    """What a record lacks: the meta fields, its comparisons' sentences."""
    problems = [f"record {record.get('figure')}: meta has no {f!r}" for f in META_FIELDS
                if not record.get("meta", {}).get(f)]
    for c in record.get("comparisons", []):
        if not c.get("text"):
            problems.append(f"record {record.get('figure')}: comparison {c.get('id')!r} has no sentence")
    return problems
