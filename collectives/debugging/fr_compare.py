"""The same dumps read by torch's ``fr_trace``: what it says of each fault, beside the analyzer.

torch's analyzer (``.venv/bin/python -m torch.distributed.flight_recorder.fr_trace DIR``) reads one
pickled dump per rank, ``<prefix><rank>``, in the format of torch's own Flight Recorder.
:func:`export` writes the course's dumps in that format (the fields are the same; the
group's ranks become the string torch writes, an ``isend`` a ``send``), :func:`fr_trace_says`
runs ``fr_trace`` on them in this process and reads its report: the first collective it
finds at fault, the ranks it names ("missing ranks", "Culprit rank"), and the kind of error.

::

    fault      fr_trace                                   the analyzer
    skip       #5: missing ranks {2}                       missing: rank 2
    order      #5: rank 1, COLLECTIVE_TYPE_MISMATCH        mismatch: rank 1
    deadlock   p2p sends and receives matched pairwise ... cycle: ranks 0, 1, 2, 3

(:func:`compare` makes such a row from one scenario's dumps; ``tools/lesson09_fr_trace.py``
the page's table.)
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .diagnose import diagnose

PREFIX = "rank_"
TORCH_VERSION = "2.10"         # the dump format version fr_trace reads


def export(dumps: list[dict], directory: str | Path) -> Path:
    """Write ``dumps`` as torch's Flight Recorder pickles, ``DIR/rank_<r>``; the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for dump in dumps:
        entries, groups = [], {}
        for e in dump["entries"]:
            e = dict(e)
            e["profiling_name"] = e["profiling_name"].replace(":isend", ":send").replace(":irecv", ":recv")
            e["output_sizes"] = e.get("output_sizes") if e.get("output_sizes") is not None else e["input_sizes"]
            e["output_dtypes"] = e.get("output_dtypes") if e.get("output_dtypes") is not None else e["input_dtypes"]
            name, desc = e["process_group"][0], e["process_group"][1]
            e["pg_id"] = int(name) if name.isdigit() else 0
            groups[name] = {"name": name, "desc": desc, "ranks": str(list(e["pg_ranks"]))}
            entries.append(e)
        with open(directory / f"{PREFIX}{dump['rank']}", "wb") as f:
            pickle.dump({"entries": entries, "version": TORCH_VERSION, "pg_config": groups, "pg_status": {}}, f)
    return directory


@dataclass(frozen=True)
class FrVerdict:
    named: tuple[int, ...]       # the ranks its first report names
    said: str                    # its first report, in a line
    report: str                  # everything it printed


_MISSING = re.compile(r"missing ranks: \{([\d, ]*)\}")
_CULPRIT = re.compile(r"Culprit rank (\d+); Error type: (\w+)")
_SEQ = re.compile(r"sequence number:? (\d+)")


def fr_trace_says(dumps: list[dict]) -> FrVerdict:
    """Run torch's ``fr_trace`` on ``dumps`` (exported) and read its first report."""
    from torch.distributed.flight_recorder import fr_trace

    out = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="collectives-fr-trace-") as directory:
        export(dumps, directory)
        logger = logging.getLogger("Flight Recorder")      # fr_trace reports through it
        saved = (logger.handlers[:], logger.propagate)
        logger.handlers, logger.propagate = [logging.StreamHandler(out)], False
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                fr_trace.main([directory, "-p", PREFIX])
        except BaseException as exc:  # noqa: BLE001 - what it said is the verdict
            return FrVerdict((), f"stopped: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                             out.getvalue())
        finally:
            logger.handlers, logger.propagate = saved
    text = out.getvalue()
    blocks = [b for b in re.split(r"\n(?=Not all ranks joining|Collective sequence number)", text) if b.strip()]
    for block in blocks:
        seq = _SEQ.search(block)
        where = f"#{seq.group(1)}: " if seq else ""
        missing = _MISSING.search(block)
        if missing and missing.group(1).strip():
            ranks = tuple(sorted(int(r) for r in missing.group(1).split(",")))
            return FrVerdict(ranks, f"{where}missing ranks {', '.join(map(str, ranks))}", text)
        culprits = _CULPRIT.findall(block)
        if culprits:
            ranks = tuple(sorted({int(r) for r, _ in culprits}))
            kinds = sorted({k for _, k in culprits})
            return FrVerdict(ranks, f"{where}rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}, "
                             f"{', '.join(kinds)}", text)
    return FrVerdict((), "no error found" if "No errors found" in text or not text.strip() else
                     text.strip().splitlines()[-1][:120], text)


@dataclass(frozen=True)
class Row:
    fault: str
    culprit: tuple[int, ...]
    fr_trace: FrVerdict
    analyzer: str
    analyzer_ranks: tuple[int, ...]


def compare(fault: str, culprit: tuple[int, ...], dumps: list[dict], world: dict | None = None) -> Row:
    """What ``fr_trace`` and the analyzer each say first of one scenario's dumps."""
    findings = diagnose(dumps, world)
    first = findings[0] if findings else None
    return Row(fault, culprit, fr_trace_says(dumps),
               f"{first.kind}: {', '.join(map(str, first.ranks)) or '-'}" if first else "no problem found",
               first.ranks if first else ())


__all__ = ["export", "fr_trace_says", "compare", "FrVerdict", "Row", "PREFIX"]
