"""Start worlds back to back, as tests, notebooks and students do, and count failures and stalls.

    .venv/bin/python tools/back_to_back_worlds.py                 # 300 worlds of 4 gloo ranks
    .venv/bin/python tools/back_to_back_worlds.py --worlds 100 --world-size 2 --gap 0.3

Each world runs a function that returns at once, so the time of a world is the launcher's
own: fork, rendezvous, ``init_process_group``, results back, ranks ended. Prints the
failures (grouped by message), the worlds over ``--slow`` seconds, and the median and
slowest world. Exit status 1 when a world failed.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collectives import launch  # noqa: E402


def returns_at_once() -> int:
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, default=300)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--gap", type=float, default=0.0, help="seconds between worlds")
    parser.add_argument("--slow", type=float, default=1.0, help="a world over this many seconds counts as slow")
    args = parser.parse_args(argv)
    failures: collections.Counter[str] = collections.Counter()
    seconds = []
    for i in range(args.worlds):
        start = time.monotonic()
        try:
            launch.run(returns_at_once, world_size=args.world_size, timeout=60)
        except (launch.RankError, launch.WorldTimeout) as exc:
            failures[str(exc).splitlines()[0][:160]] += 1
        seconds.append(time.monotonic() - start)
        if seconds[-1] > args.slow:
            print(f"world {i}: {seconds[-1]:.2f} s", flush=True)
        if args.gap:
            time.sleep(args.gap)
    slow = sum(s > args.slow for s in seconds)
    print(f"{args.worlds} worlds of {args.world_size} ranks: {sum(failures.values())} failed, "
          f"{slow} over {args.slow:g} s; median {statistics.median(seconds) * 1e3:.0f} ms, "
          f"slowest {max(seconds):.2f} s, all {sum(seconds):.1f} s")
    for message, count in failures.most_common():
        print(f"  {count} x {message}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
