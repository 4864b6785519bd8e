"""Lesson 9's page table: torch's ``fr_trace`` and the analyzer on the same faults, side by side.

    .venv/bin/python tools/lesson09_fr_trace.py --record docs/img

For each of the eight graded faults (the lab's scenario: its dumps as ``dumps_for`` writes
them, which match a real run's call for call) and each of the further faults of
``collectives.debugging.more_faults`` (run for real, on gloo), the dumps are handed to both:
torch's ``fr_trace`` (through :func:`collectives.debugging.fr_compare.export`) and
``diagnose``. The record ``09-fr-trace.json`` holds one row per fault -- the ranks the fault
was put into, what each said first, whether each named exactly those ranks -- and a count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectives.course.site import claims  # noqa: E402
from collectives.debugging import KINDS, LAB, blame, dumps_for, run_scenarios  # noqa: E402
from collectives.debugging.fr_compare import compare  # noqa: E402
from collectives.debugging.more_faults import FIRST, LAB_MORE, limit  # noqa: E402


def rows() -> list:
    out = [compare(kind, blame(LAB[kind]), dumps_for(LAB[kind])) for kind in KINDS]
    kinds = list(LAB_MORE)
    for kind, outcome in zip(kinds, run_scenarios([(LAB_MORE[k], dict(timeout=limit(k))) for k in kinds],
                                                  parallel=len(kinds))):
        first = FIRST[kind](outcome.params)
        out.append(compare(kind, first[1] if first else (), outcome.dumps, outcome.world))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", default="docs/img", help="directory for 09-fr-trace.json")
    args = parser.parse_args(argv)
    table = rows()
    record = claims.Record("09-fr-trace", names={"fr_trace": "torch's fr_trace", "analyzer": "the analyzer"},
                           title="fr_trace and the analyzer on the same dumps")
    yes = lambda ok: "yes" if ok else "no"   # noqa: E731
    record.table = {"head": ["fault", "put into", "fr_trace says first", "names them", "the analyzer says first",
                             "names them"],
                    "rows": [[r.fault, ", ".join(map(str, r.culprit)) or "nobody", r.fr_trace.said,
                              yes(r.fr_trace.named == r.culprit), r.analyzer, yes(r.analyzer_ranks == r.culprit)]
                             for r in table]}
    fr = sum(r.fr_trace.named == r.culprit for r in table)
    ours = sum(r.analyzer_ranks == r.culprit for r in table)
    record.fact("count", f"Of {len(table)} faults, torch's fr_trace named exactly the ranks the fault was put into "
                f"in {fr}, the analyzer in {ours}.", fr_trace=fr, analyzer=ours, faults=len(table))
    path = record.save(Path(args.record) / "09-fr-trace")
    for row in record.table["rows"]:
        print(" | ".join(row))
    print(record.text("count"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
