"""The flight recorder's ring file: its layout, and reading it back (the dump of a rank that died).

One file per rank, ``DIR/rank<r>.ring``, mapped into memory by the recorder
(:mod:`collectives.core.flight_recorder`); the kernel keeps its pages when the process dies,
so a rank killed by SIGKILL or by gloo's SIGABRT still leaves its last calls::

    offset 0        header: magic "CFR2", slot bytes, slots, rank, world size, pid, start ns, run id
    offset 512·(s+1) slot s: record_id, collective and p2p seq ids, created / started /
                    completed (ns), state, failed, the length of the text that follows
                    (the call's description, JSON, cached per call site)

A call's ``record_id`` picks its slot (``record_id % slots``): the ring keeps the last
``slots`` calls. :func:`read_ring` turns a ring into the dump the rank would have written;
a file that is not a ring, or is cut short, raises :class:`ValueError` with one line saying so.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time

import torch

__all__ = ["SLOT_BYTES", "STATES", "VERSION", "RUN_ENV", "read_ring", "ring_entries", "dump_header",
           "network", "run_id", "dtype_name"]

VERSION = "collectives-fr-2"
RUN_ENV = "COLLECTIVES_RUN_ID"      # the run a dump belongs to; the launcher sets it (torchrun: TORCHELASTIC_RUN_ID)
SLOT_BYTES = 512
HEAD = struct.Struct("<qqqqqqBBH")
ID = struct.Struct("<q")
STARTED_AT, COMPLETED_AT, STATE_AT = 32, 40, 48
FILE = struct.Struct("<4sIIiiiq16s")   # magic, slot bytes, slots, rank, world size, pid, start ns, run id
MAGIC = b"CFR2"
SCHEDULED, STARTED, COMPLETED = 1, 2, 3
STATES = {SCHEDULED: "scheduled", STARTED: "started", COMPLETED: "completed"}

_DTYPES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
           torch.bfloat16: "BFloat16", torch.int32: "Int", torch.int64: "Long", torch.int16: "Short",
           torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool"}


_REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
# collectives whose output is not their input: the argument that holds it
_OUTPUT_ARG = {"all_gather": "tensor_list", "all_gather_into_tensor": "output_tensor", "gather": "gather_list",
               "reduce_scatter": "output", "reduce_scatter_tensor": "output", "all_to_all": "output_tensor_list",
               "all_to_all_single": "output", "scatter": "tensor"}


def shapes_of(tensors) -> tuple[tuple, object]:
    if isinstance(tensors, torch.Tensor):
        return (tuple(tensors.shape),), tensors.dtype
    flat = [t for t in (tensors or ()) if isinstance(t, torch.Tensor)]
    return tuple(tuple(t.shape) for t in flat), (flat[0].dtype if flat else None)


def call_details(kind: str, arguments) -> tuple:
    """What the call's other arguments add to its description: the reduce op, the output's
    sizes and dtype, an all-to-all's splits (a tuple: part of the site's cache key)."""
    if not arguments:
        return ()
    op = arguments.get("op", "SUM" if kind in _REDUCING else None)   # not given: the default, SUM
    out = arguments.get(_OUTPUT_ARG.get(kind, ""))
    out_shapes, out_dtype = shapes_of(out) if out is not None else ((), None)
    splits = (tuple(arguments.get("input_split_sizes") or ()), tuple(arguments.get("output_split_sizes") or ()))
    return (str(op).rsplit(".", 1)[-1] if op is not None else None, out_shapes, out_dtype,
            splits if any(splits) else None)


def dtype_name(dtype) -> str:
    """torch's Flight Recorder name of a dtype: ``torch.float32`` -> ``"Float"``."""
    return _DTYPES.get(dtype, str(dtype).replace("torch.", ""))


def run_id() -> str:
    """This run's id: ``COLLECTIVES_RUN_ID`` (the launcher's), else torchrun's, else ``""``."""
    return os.environ.get(RUN_ENV) or os.environ.get("TORCHELASTIC_RUN_ID", "")


def create(ring, slots: int, rank: int, world_size: int) -> None:
    """Write an empty ring's header and mark every slot free."""
    FILE.pack_into(ring, 0, MAGIC, SLOT_BYTES, slots, rank, world_size, os.getpid(), time.time_ns(),
                   run_id().encode()[:16])
    for slot in range(slots):
        ID.pack_into(ring, SLOT_BYTES * (slot + 1), -1)


def ring_entries(ring, slots: int) -> list[dict]:
    """The calls in a ring (a mapped file or its bytes), oldest first, with torch's field names."""
    rows = []
    for slot in range(slots):
        offset = SLOT_BYTES * (slot + 1)
        if offset + HEAD.size > len(ring):
            break
        record_id, cseq, pseq, created, started, completed, state, failed, length = HEAD.unpack_from(ring, offset)
        if record_id < 0 or state not in STATES:
            continue
        try:
            what = json.loads(bytes(ring[offset + HEAD.size:offset + HEAD.size + length]))
        except ValueError:       # a slot being written as we read it
            continue
        name = what["process_group"][0]
        entry = {"record_id": record_id, "pg_id": int(name) if name.isdigit() else -1,
                 "collective_seq_id": cseq, "p2p_seq_id": pseq, "op_id": record_id}
        entry.update(what)
        entry.update(state=STATES[state], time_created_ns=created,
                     time_discovered_started_ns=started or None, time_discovered_completed_ns=completed or None,
                     duration_ms=(completed - started) / 1e6 if completed and started else None,
                     retired=state == COMPLETED)
        entry.setdefault("error", None)
        rows.append(entry)
    return sorted(rows, key=lambda e: e["record_id"])


def dump_header(rank, world_size, pid, reason, buffer_size, recorded, run: str | None = None) -> dict:
    return {"version": VERSION, "run_id": run_id() if run is None else run, "rank": rank,
            "world_size": world_size, "pid": pid, "hostname": socket.gethostname(), "machine": _int_env("GROUP_RANK"),
            "reason": reason, "time_dumped_ns": time.time_ns(), "buffer_size": buffer_size,
            "entries_recorded": recorded}


def pg_config(entries: list[dict]) -> dict:
    """The process groups the entries name (an entry without one names none)."""
    return {e["process_group"][0]: {"name": e["process_group"][0], "desc": e["process_group"][1],
                                    "ranks": e.get("pg_ranks")}
            for e in entries if isinstance(e.get("process_group"), (list, tuple)) and len(e["process_group"]) >= 2}


def _int_env(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def read_ring(path: str | os.PathLike, reason: str = "recovered") -> dict:
    """A dump made from a ring file, as the rank would have dumped it: for a rank that died.
    :class:`ValueError` (one line) for a file that is not a ring or is cut short."""
    with open(path, "rb") as f:
        ring = f.read()
    if len(ring) < FILE.size or ring[:4] != MAGIC:
        raise ValueError(f"{os.path.basename(path)} is not a flight recorder ring"
                         + (" (an older format)" if ring[:3] == b"CFR" else ""))
    magic, slot_bytes, slots, rank, world_size, pid, _, run = FILE.unpack_from(ring, 0)
    if slot_bytes != SLOT_BYTES or len(ring) < SLOT_BYTES * (slots + 1):
        raise ValueError(f"{os.path.basename(path)} is cut short ({len(ring)} bytes of "
                         f"{SLOT_BYTES * (slots + 1)})")
    entries = ring_entries(ring, slots)
    data = {"request_id": None}
    data.update(dump_header(rank, world_size, pid, reason, slots,
                            max((e["record_id"] for e in entries), default=-1) + 1,
                            run=run.rstrip(b"\0").decode(errors="replace")))
    data.update(machine=None, hostname=None, network=None, entries=entries, pg_config=pg_config(entries))
    return data


def network() -> dict | None:
    """The state of the interface this rank's messages leave by (``GLOO_SOCKET_IFNAME``), as
    this rank's network namespace sees it: ``up`` (set up), ``running`` (it has a carrier)."""
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    if not name:
        return None
    import fcntl
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = struct.pack("16sH14s", name.encode()[:15], 0, b"")
            flags = struct.unpack("16sH14s", fcntl.ioctl(s.fileno(), 0x8913, request))[1]  # SIOCGIFFLAGS
    except OSError as exc:
        return {"interface": name, "up": False, "running": False, "error": str(exc)}
    return {"interface": name, "up": bool(flags & 0x1), "running": bool(flags & 0x40)}
