"""Reading a dump directory whatever it holds: what cannot be used is said in one line, never a traceback.

``DIR`` as ``launch.run(..., flight_recorder=DIR)`` or ``torchrun`` left it: ``rank<r>.json``
(a rank's dump), ``rank<r>.ring`` (its ring: read back when the rank did not dump) and
``world.json`` (the launcher's: how each rank ended, and the run's id). A directory seen in
the wild may hold more, or less::

    rank1.json  not JSON, not UTF-8, cut short     ->  "rank 1: unreadable dump, ..."
    rank1.json  JSON of something else             ->  "rank 1: not a flight recorder dump (...)"
    rank1.ring  another format, cut short          ->  "rank 1: unreadable ring, ..."
    rank2.json  another run's (its run id)         ->  "rank 2: a dump of another run (...), left out"
    rank3.json  missing, world.json says it dumped ->  said as missing by the diagnosis, not as a death

Each entry is checked for the fields the analyzer reads; an optional field a dump lacks
(``peer``, ``frames``, ...) gets its empty value.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..core.flight_ring import read_ring

NEEDED = {"collective_seq_id": int, "p2p_seq_id": int, "profiling_name": str, "process_group": list,
          "pg_ranks": list, "is_p2p": bool, "state": str, "time_created_ns": int}
OPTIONAL = {"peer": None, "input_sizes": [], "input_dtypes": [], "output_sizes": None, "output_dtypes": None,
            "frames": [], "error": None, "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
            "duration_ms": None, "retired": False}
_RANK_FILE = re.compile(r"^rank(\d+)\.(json|ring)$")


@dataclass
class Dumps:
    """What a directory gave: the usable dumps (rank order), ``world.json``, and one line per problem."""

    dumps: list[dict]
    world: dict | None
    notes: list[str] = field(default_factory=list)
    left_out: set[int] = field(default_factory=set)      # ranks whose dump exists but could not be used


def _check_dump(data, rank: int) -> str | None:
    """Why ``data`` is not a usable dump of ``rank`` (None: it is); fills optional fields in."""
    if not isinstance(data, dict):
        return f"not a flight recorder dump (a JSON {type(data).__name__})"
    if "entries" not in data or not isinstance(data["entries"], list):
        return "not a flight recorder dump (no list of entries)" + (
            "; torch's own Flight Recorder dump? read it with torch's fr_trace" if "pg_config" in data else "")
    if data.get("rank", rank) != rank:
        return f"it says it is rank {data.get('rank')}'s"
    data.setdefault("rank", rank)
    for name in ("world_size", "entries_recorded", "buffer_size", "machine"):
        if data.get(name) is not None and type(data[name]) is not int:
            return f"its {name!r} is not an integer"
    for name in ("exception", "run_id", "hostname"):
        if data.get(name) is not None and not isinstance(data[name], str):
            return f"its {name!r} is not text"
    network = data.get("network")
    if network is not None and not (isinstance(network, dict) and isinstance(network.get("up"), bool)
                                    and isinstance(network.get("running"), bool)):
        return "its 'network' is not the recorder's"
    data.setdefault("reason", "unknown")
    if not isinstance(data["reason"], str):
        data["reason"] = str(data["reason"])
    for i, entry in enumerate(data["entries"]):
        if not isinstance(entry, dict):
            return f"entry {i} is not an object"
        for name, kind in NEEDED.items():
            value = entry.get(name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                return f"entry {i} has no valid {name!r}"
        if len(entry["process_group"]) < 1 or ":" not in entry["profiling_name"]:
            return f"entry {i} has no valid process group or profiling name"
        if not all(isinstance(r, int) for r in entry["pg_ranks"]):
            return f"entry {i} has no valid 'pg_ranks'"
        entry["process_group"] = [str(entry["process_group"][0]),
                                  str(entry["process_group"][1]) if len(entry["process_group"]) > 1 else ""]
        for name, empty in OPTIONAL.items():
            entry.setdefault(name, empty)
        entry.setdefault("record_id", i)
        problem = _check_fields(entry)
        if problem:
            return f"entry {i} {problem}"
    return None


def _sizes(value) -> bool:
    return isinstance(value, list) and all(isinstance(s, list) and all(type(n) is int for n in s) for s in value)


def _check_fields(entry: dict) -> str | None:
    """Why the optional fields the analyzer reads are unusable (None: they are usable)."""
    if not _sizes(entry["input_sizes"]) or not (entry["output_sizes"] is None or _sizes(entry["output_sizes"])):
        return "has sizes that are not lists of integers"
    for name in ("input_dtypes", "output_dtypes"):
        value = entry[name]
        if not (value is None and name == "output_dtypes") and not (
                isinstance(value, list) and all(isinstance(d, str) for d in value)):
            return f"has no valid {name!r}"
    if entry["peer"] is not None and type(entry["peer"]) is not int:
        return "has a peer that is not a rank"
    if not isinstance(entry["frames"], list) or not all(
            isinstance(f, dict) and isinstance(f.get("filename"), str) and isinstance(f.get("name"), str)
            and type(f.get("line")) is int for f in entry["frames"]):
        return "has frames without a file, a function and a line"
    for name in ("time_discovered_started_ns", "time_discovered_completed_ns"):
        if entry[name] is not None and type(entry[name]) is not int:
            return f"has no valid {name!r}"
    if entry["error"] is not None and not isinstance(entry["error"], str):
        entry["error"] = str(entry["error"])
    return None


def _is_world(world) -> bool:
    """Is ``world`` what the launcher writes (the fields the diagnosis reads, of their types)?"""
    return (isinstance(world, dict) and type(world.get("world_size")) is int
            and isinstance(world.get("ranks", {}), dict)
            and all(isinstance(v, dict) for v in world.get("ranks", {}).values())
            and isinstance(world.get("stderr_tail", "") or "", str)
            and (world.get("failed_rank") is None or type(world["failed_rank"]) is int)
            and (world.get("run_id") is None or isinstance(world["run_id"], str))
            and all(isinstance(v.get(k), (str, type(None))) for v in world.get("ranks", {}).values()
                    for k in ("end", "exception", "exit")))


def read_dumps(directory: str | Path) -> Dumps:
    """Every usable dump of ``directory`` and its ``world.json``; :class:`FileNotFoundError`
    only when there is no directory or nothing in it to read."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no dump directory at {directory}")
    notes: list[str] = []
    world = None
    world_path = directory / "world.json"
    if world_path.exists():
        try:
            world = json.loads(world_path.read_text())
            if not _is_world(world):
                raise ValueError("not the launcher's record")
        except (OSError, ValueError) as exc:
            notes.append(f"world.json: unreadable, {_short(exc)}; read without it")
            world = None
    files = {}
    for path in sorted(directory.iterdir()):
        match = _RANK_FILE.match(path.name)
        if match:
            files.setdefault(int(match.group(1)), {})[match.group(2)] = path
    dumps: dict[int, dict] = {}
    left_out: set[int] = set()
    for rank, paths in sorted(files.items()):
        data, problem = None, None
        if "json" in paths:
            try:
                data = json.loads(paths["json"].read_bytes().decode("utf-8"))
                problem = _check_dump(data, rank)
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                problem = f"unreadable dump, {_short(exc)}"
            if problem:
                notes.append(f"rank {rank}: {problem}" if problem.startswith(("unreadable", "not a")) else
                             f"rank {rank}: unreadable dump, {problem}")
                data = None
        if data is None and "ring" in paths:
            try:
                data = read_ring(paths["ring"], reason="recovered from its ring: the rank did not dump"
                                 if "json" not in paths else "recovered from its ring: its dump was unreadable")
                problem = _check_dump(data, rank)
            except (OSError, ValueError) as exc:
                notes.append(f"rank {rank}: unreadable ring, {str(exc) if type(exc) is ValueError else _short(exc)}")
                data, problem = None, "ring"
        if data is None or problem:
            left_out.add(rank)
            continue
        dumps[rank] = data
    _one_run(dumps, world, notes, left_out)
    if not dumps and not notes:
        raise FileNotFoundError(f"no flight recorder dumps (rank<r>.json) in {directory}")
    return Dumps([dumps[r] for r in sorted(dumps)], world, notes, left_out)


def _one_run(dumps: dict[int, dict], world: dict | None, notes: list[str], left_out: set[int]) -> None:
    """Leave out the dumps of another run than the directory's (``world.json``'s, else most dumps')."""
    runs = {r: d.get("run_id") or "" for r, d in dumps.items()}
    known = Counter(v for v in runs.values() if v)
    if world and world.get("run_id"):
        run = world["run_id"]
    elif known:
        run = known.most_common(1)[0][0]
    else:
        return
    for rank, value in sorted(runs.items()):
        if value and value != run:
            notes.append(f"rank {rank}: a dump of another run (run {value}, the directory's is {run}), left out")
            left_out.add(rank)
            del dumps[rank]


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


__all__ = ["Dumps", "read_dumps", "NEEDED", "OPTIONAL"]
