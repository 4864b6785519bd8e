"""``.venv/bin/python -m collectives diagnose``: read every rank's flight recorder dump and name the culprit.

::

    .venv/bin/python -m collectives diagnose DIR                # DIR: where launch.run(..., flight_recorder=DIR) dumped
    .venv/bin/python -m collectives diagnose --run skip      # inject lesson 9's fault "skip" (the lab's), then diagnose
    .venv/bin/python -m collectives diagnose --run order --seed 3 --timeout 2 DIR

Prints one numbered finding per problem -- a rank that never entered collective #k, a
mismatch at #k, a cycle of waits, a dead rank, a link down, a straggler -- each naming
ranks, sequence numbers and source lines (:mod:`collectives.debugging`); a file it cannot
use is one line ("rank 1: unreadable dump, ..."), never a traceback. Exit status 0 when
nothing was found, 1 when something was, 2 when there was nothing to read.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict

from ...debugging import KINDS, LAB, diagnose, draw, read_dumps, report, run_scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives diagnose",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", help="the dump directory (rank<r>.json, world.json)")
    parser.add_argument("--run", choices=KINDS, help="first run this fault with the flight recorder on")
    parser.add_argument("--seed", type=int, default=None, help="with --run: a scenario drawn from this seed "
                        "(default: the lab's own)")
    parser.add_argument("--timeout", type=float, default=2.5, help="with --run: the world's time limit (default 2.5 s)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    if args.run:
        params = LAB[args.run] if args.seed is None else draw(args.run, args.seed, max_world=4)
        directory = args.directory or tempfile.mkdtemp(prefix=f"collectives-{args.run}-")
        print(f"running {params} with the flight recorder in {directory} ...", file=sys.stderr)
        outcome = run_scenario(params, directory, timeout=args.timeout)
        print(f"the world {outcome.ended.splitlines()[0]} ({outcome.seconds:.1f} s)", file=sys.stderr)
        args.directory = directory
    if not args.directory:
        parser.print_usage(sys.stderr)
        print("give a dump directory, or --run FAULT", file=sys.stderr)
        return 2
    try:
        found = read_dumps(args.directory)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        findings = diagnose(found.dumps, found.world, skipped=found.left_out)
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        print(f"could not analyse the dumps of {args.directory}: {type(exc).__name__}: {exc}".splitlines()[0],
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"notes": found.notes, "findings": [asdict(f) for f in findings]}, indent=1))
    else:
        print(report(findings, found.dumps, found.notes))
    return 1 if findings or found.notes else 0
