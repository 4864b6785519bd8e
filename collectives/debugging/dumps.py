"""Reading flight recorder dumps: the questions every check asks of them, and what checks answer.

A dump is one rank's ``rank<r>.json`` as a dict (:mod:`collectives.core.flight_recorder`):
``dump["rank"]``, ``dump["reason"]`` ("timeout", "failure", "exit", "recovered from its
ring: killed by SIGKILL", ...), and ``dump["entries"]``, oldest first, each with torch's
Flight Recorder fields::

    {"record_id": 41, "profiling_name": "gloo:all_reduce", "process_group": ["0", "default_pg"],
     "pg_ranks": [0, 1, 2, 3], "collective_seq_id": 5, "p2p_seq_id": 0, "is_p2p": false,
     "peer": null, "input_sizes": [[1000]], "input_dtypes": ["Float"], "state": "started",
     "time_created_ns": ..., "frames": [{"name": "train", "filename": ".../train.py", "line": 42}]}

A **group** is named by its ranks and torch's name for it: ``("0", (0, 1, 2, 3))``.
``#k`` is ``collective_seq_id``: the k-th collective this rank made on that group, from 1.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

Group = tuple[str, tuple[int, ...]]          # (torch's name for the group, its global ranks)


# -- what the checks answer ---------------------------------------------------------------------

@dataclass(frozen=True)
class Missing:
    """Ranks that never entered collective #seq of a group that others wait in."""

    group: tuple[int, ...]        # the group's global ranks
    seq: int                      # the collective they never entered (collective_seq_id)
    op: str                       # what the waiting ranks called ("all_reduce")
    missing: tuple[int, ...]      # never entered it, ascending
    waiting: tuple[int, ...]      # entered it and wait, ascending


@dataclass(frozen=True)
class Mismatch:
    """The first collective of a group where the ranks' calls differ."""

    group: tuple[int, ...]
    seq: int
    field: str                    # "operation", "sizes" or "dtype": the first that differs
    differ: tuple[int, ...]       # the ranks whose value is not the one most ranks have
    values: tuple[tuple[int, str], ...]   # (rank, its value) for every rank of the group


@dataclass(frozen=True)
class WaitCycle:
    """Ranks each waiting for the next, the last for the first: nobody can move."""

    ranks: tuple[int, ...]        # the cycle, from its smallest rank: ranks[i] waits for ranks[i+1]
    waits: tuple[str, ...]        # what each waits in ("rank 0 in send to rank 1 (p2p #3), x.py:12")


@dataclass(frozen=True)
class Straggler:
    """A rank that enters a group's collectives last, most of the time, by a clear margin."""

    group: tuple[int, ...]
    rank: int
    late_in: int                  # collectives it entered last
    of: int                       # collectives every rank of the group entered
    median_lag: float             # seconds the others had already waited when it came (median)
    worst_seq: int                # the collective it kept them waiting longest


# -- questions every check asks ---------------------------------------------------------------------

def group_of(entry: dict) -> Group:
    """The group an entry was made on: ``("0", (0, 1, 2, 3))``."""
    return entry["process_group"][0], tuple(entry["pg_ranks"])


def op_of(entry: dict) -> str:
    """``"gloo:send 0->1"`` -> ``"send"``."""
    return entry["profiling_name"].split(":", 1)[1].split(" ", 1)[0]


def collective_entries(dump: dict, group: Group) -> dict[int, dict]:
    """This rank's collectives on ``group``, by sequence number (the ones still in its ring)."""
    return {e["collective_seq_id"]: e for e in dump["entries"]
            if not e["is_p2p"] and group_of(e) == group}


def last_seq(dump: dict, group: Group) -> int:
    """The last collective this rank entered on ``group`` (0: none)."""
    return max((e["collective_seq_id"] for e in dump["entries"] if not e["is_p2p"] and group_of(e) == group),
               default=0)


def groups(dumps: list[dict]) -> list[Group]:
    """Every group any rank made a call on, in order of name."""
    return sorted({group_of(e) for d in dumps for e in d["entries"]}, key=lambda g: (len(g[0]), g))


def by_rank(dumps: list[dict]) -> dict[int, dict]:
    """Every rank's dump, keyed by its rank."""
    return {d["rank"]: d for d in dumps}


def is_dead(dump: dict) -> bool:
    """The rank did not answer the dump request: its dump was recovered from its ring."""
    return dump["reason"].startswith("recovered")


def blocking_call(dump: dict) -> dict | None:
    """The call this rank was waiting in when it stopped: the call it started waiting in last,
    unless it completed something after that (then it had moved on). A call that failed -- a
    timeout, a lost peer -- still counts: the rank waited in it until then. None for a rank
    that waits in nothing (finished, computing) or died."""
    if is_dead(dump):
        return None
    started = [e for e in dump["entries"] if e["state"] == "started"]
    if not started:
        return None
    last = max(started, key=lambda e: (e["time_discovered_started_ns"] or 0, e["record_id"]))
    since = last["time_discovered_started_ns"] or 0
    if any((e["time_discovered_completed_ns"] or 0) > since for e in dump["entries"]):
        return None
    return last


def pending(dump: dict) -> list[dict]:
    """Calls posted or waited in that never completed (failed ones included)."""
    return [e for e in dump["entries"] if e["state"] != "completed"]


def where(entry: dict) -> str:
    """The line that made the call: ``"faults.py:78 (skipped_collective)"``."""
    if not entry.get("frames"):
        return "(made inside torch: DDP's reducer or another C++ caller)" if entry.get("source") == "torch" \
            else "(no frame)"
    frame = entry["frames"][0]
    path = frame["filename"]
    relative = os.path.relpath(path) if os.path.isabs(path) else path
    shown = relative if not relative.startswith("..") else os.path.basename(path)
    return f"{shown}:{frame['line']} ({frame['name']})"


def describe(entry: dict) -> str:
    """``"all_reduce #5"``, ``"send to rank 1 (p2p #3)"``."""
    op = op_of(entry)
    if entry["is_p2p"]:
        toward = "to" if op in ("send", "isend") else "from"
        return f"{op} {toward} rank {entry['peer']} (p2p #{entry['p2p_seq_id']})"
    return f"{op} #{entry['collective_seq_id']}" + (f" of group {entry['process_group'][0]!r}"
                                                      if entry["process_group"][0] not in ("0", "") else "")


def group_name(ranks: tuple[int, ...], world_size: int | None) -> str:
    if world_size is not None and ranks == tuple(range(world_size)):
        return "the world"
    return "the group of ranks " + ", ".join(map(str, ranks))


def majority(values: dict[int, object]) -> object:
    """The value most ranks have; a tie goes to the value of the lowest rank among the tied."""
    counts = Counter(values.values())
    best = max(counts.values())
    return next(v for r, v in sorted(values.items()) if counts[v] == best)
