"""torch's own Flight Recorder, merged into ours: the calls that never pass through Python.

DDP's reducer, ``all_gather_object`` and torch's other internals call the process group from
C++ (or below ``torch.distributed``'s public functions): the course's wrappers
(:mod:`collectives.core.trace`) never see them. torch records every call a process group
makes -- on gloo as on NCCL; torch 2.13 does so by default, ``TORCH_FR_BUFFER_SIZE`` sets
how many calls it keeps -- and hands them over as JSON. It keeps two recorders: NCCL's calls
go into one timed with CUDA events (``torch._C._distributed_c10d._dump_nccl_trace_json``),
every other backend's into the other (``_dump_fr_trace_json``); :func:`torch_entries` reads
both. At every dump the recorder merges them into its own entries, group by group::

    torch's, per group:  #1 all_gather  #2 broadcast  #3 all_reduce  #4 all_reduce  #5 all_reduce
    ours (Python):                                    all_reduce @t3              all_reduce @t5
    merged:              #1 (torch)     #2 (torch)    #3 ours        #4 (torch)   #5 ours

Each of our collectives is matched with the first of torch's on its group made at or after
it (torch makes its entry inside the call); it takes torch's sequence number, since torch
counts every call of the group and ours only the ones made from Python. torch's entries
that nothing matched are added with ``"source": "torch"`` and no source line; on gloo torch
knows only whether a call was retired (``completed``) or not (``scheduled``). On NCCL, with
``TORCH_NCCL_ENABLE_TIMING=1`` (the recorder sets it), torch times each call with CUDA
events: a matched call's ``duration_ms`` is then torch's (``"duration_source": "cuda
events"``), the time the GPU spent, not the time the host waited.

A call of ours that torch never made (it failed before) keeps its own number, marked
``"seq_source": "own"``. Point-to-point calls keep our numbering (gloo's Flight Recorder
does not record them). A rank that died is read from its ring only: its numbers are its
own, and where torch made calls Python did not see (DDP's), they differ from the others'.
"""

from __future__ import annotations

import json
import os

__all__ = ["ENV_BUFFER", "enable", "torch_entries", "merge"]

ENV_BUFFER = "TORCH_FR_BUFFER_SIZE"


def enable(buffer_size: int) -> bool:
    """Ask torch to keep ``buffer_size`` calls where nobody said otherwise (it reads the
    variables as it starts: call this before ``init_process_group``), and, on NCCL, to time
    them with CUDA events. False when the user turned it off (``TORCH_FR_BUFFER_SIZE=0``)."""
    os.environ.setdefault(ENV_BUFFER, os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", str(buffer_size)))
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    return os.environ[ENV_BUFFER] not in ("", "0")


_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")   # other backends' recorder, NCCL's (CUDA events)


def torch_entries(settle: float = 1.0) -> list[dict]:
    """Every entry torch's Flight Recorders hold in this process, NCCL's and the others', oldest
    first (none when they are off or fail). An entry found in both (one recorder behind both
    names) is kept once. NCCL's watchdog writes a call's CUDA-event duration when it retires the
    call, up to a tenth of a second after the call completed: calls the GPU finished but the
    watchdog has not yet retired are waited for, at most ``settle`` seconds."""
    import time

    deadline = time.monotonic() + settle
    while True:
        entries = _read_recorders()
        pending = [e for e in entries if str(e.get("profiling_name", "")).startswith("nccl:")
                   and e.get("state") == "completed" and not e.get("retired")]
        if not pending or time.monotonic() >= deadline:
            return entries
        time.sleep(0.02)


def _read_recorders() -> list[dict]:
    import torch

    seen, out = set(), []
    for name in _DUMPS:
        dump = getattr(torch._C._distributed_c10d, name, None)
        if dump is None:                      # a CPU build has no NCCL recorder
            continue
        try:
            entries = json.loads(dump(True, False)).get("entries") or []
        except Exception:  # noqa: BLE001 - recorder off, no process group yet: nothing from this one
            continue
        for e in entries:
            key = (str(e.get("process_group")), e.get("record_id"), e.get("collective_seq_id"),
                   e.get("p2p_seq_id"), e.get("profiling_name"), e.get("time_created_ns"))
            if key not in seen:
                seen.add(key)
                out.append(e)
    return sorted(out, key=lambda e: int(e.get("time_created_ns") or 0))


# the names torch gives the calls the course's wrappers name otherwise (gloo's fallbacks included)
_ALIASES = {"all_gather_into_tensor": {"all_gather", "_allgather_base", "all_gather_into_tensor"},
            "reduce_scatter_tensor": {"reduce_scatter", "_reduce_scatter_base", "all_reduce"},
            "reduce_scatter": {"reduce_scatter", "all_reduce"},
            "all_to_all_single": {"all_to_all", "alltoall_base", "all_to_all_single"}}


def _op(entry: dict) -> str:
    return str(entry.get("profiling_name", "")).split(":", 1)[-1].split(" ", 1)[0]


def _same_kind(ours: dict, theirs: dict) -> bool:
    mine = _op(ours)
    return _op(theirs) in _ALIASES.get(mine, {mine})


def _state(entry: dict) -> str:
    if entry.get("retired") or entry.get("state") == "completed":
        return "completed"
    return entry.get("state") or "scheduled"


def merge(ours: list[dict], theirs: list[dict], wrapped: bool) -> tuple[list[dict], int]:
    """Our entries with torch's merged in (see the module's docstring), oldest first, numbered
    again; and how many of torch's were added. ``wrapped``: our ring came round (torch's
    entries older than our oldest are then left out: we know nothing of that time)."""
    if not theirs:
        return ours, 0
    oldest = min((e["time_created_ns"] for e in ours), default=0) if wrapped else 0
    by_group: dict[str, list[dict]] = {}
    # two recorders number their entries apart: order by the time torch made each call
    for t in sorted(theirs, key=lambda t: (int(t.get("time_created_ns") or 0), t.get("record_id", 0))):
        if not t.get("is_p2p") and int(t.get("time_created_ns") or 0) >= oldest:
            by_group.setdefault(str(t["process_group"][0]), []).append(t)
    merged = [dict(e) for e in ours]
    added = 0
    for name, torch_calls in by_group.items():
        mine = sorted((e for e in merged if not e["is_p2p"] and e["process_group"][0] == name),
                      key=lambda e: e["record_id"])
        used = [False] * len(torch_calls)
        at = 0
        for i, e in enumerate(mine):
            # the first of torch's calls made at or after ours, of a kind ours can be, before our next call
            until = mine[i + 1]["time_created_ns"] if i + 1 < len(mine) else None
            while at < len(torch_calls) and int(torch_calls[at]["time_created_ns"]) < e["time_created_ns"]:
                at += 1
            match = next((j for j in range(at, len(torch_calls))
                          if (until is None or int(torch_calls[j]["time_created_ns"]) < until)
                          and _same_kind(e, torch_calls[j])), None)
            if match is None:
                e["seq_source"] = "own"       # torch has no such call (it failed before it was made)
                continue
            t = torch_calls[match]
            used[match] = True
            at = match + 1
            e["collective_seq_id"] = int(t["collective_seq_id"])
            if t.get("duration_ms") is not None and "nccl" in str(t.get("profiling_name", "")):
                e["duration_ms"], e["duration_source"] = float(t["duration_ms"]), "cuda events"
        ranks = next((e["pg_ranks"] for e in mine), None)
        for t, taken in zip(torch_calls, used):
            if taken:
                continue
            added += 1
            merged.append({
                "record_id": -1, "pg_id": t.get("pg_id", -1), "collective_seq_id": int(t["collective_seq_id"]),
                "p2p_seq_id": int(t.get("p2p_seq_id") or 0), "op_id": t.get("op_id"),
                "profiling_name": t["profiling_name"], "process_group": list(t["process_group"]),
                "pg_ranks": ranks if ranks is not None else _ranks(t), "is_p2p": False, "peer": None,
                "input_sizes": t.get("input_sizes"), "input_dtypes": t.get("input_dtypes"),
                "output_sizes": t.get("output_sizes"), "output_dtypes": t.get("output_dtypes"),
                "frames": [], "state": _state(t), "time_created_ns": int(t["time_created_ns"]),
                "time_discovered_started_ns": t.get("time_discovered_started_ns") or None,
                "time_discovered_completed_ns": t.get("time_discovered_completed_ns") or None,
                "duration_ms": t.get("duration_ms"), "retired": bool(t.get("retired")), "error": None,
                "source": "torch"})
    merged.sort(key=lambda e: (e["time_created_ns"], e["record_id"]))
    # point-to-point entries carry the collective count as it stood: torch's, now
    counts: dict[str, int] = {}
    for i, e in enumerate(merged):
        e["record_id"] = e["op_id"] = i
        name = e["process_group"][0]
        if e["is_p2p"]:
            e["collective_seq_id"] = counts.get(name, 0)
        else:
            counts[name] = e["collective_seq_id"]
    return merged, added


def _ranks(entry: dict) -> list[int]:
    import torch.distributed as dist

    try:
        for pg in [dist.distributed_c10d._get_default_group(), *dist.distributed_c10d._world.pg_map]:
            if str(getattr(pg, "group_name", "")) == str(entry["process_group"][0]):
                return list(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - no group: the ranks are unknown
        pass
    return []
