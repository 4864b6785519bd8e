"""Traces in the ecosystem's format: Chrome Trace Event JSON, and the steps of a recorded run.

:func:`chrome_trace` turns every rank's :class:`~collectives.core.trace.Trace` into the JSON
that Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open::

    process "rank r"          one per rank (pid r + 1: Perfetto treats pid 0 as the kernel's)
      thread "world · sends"  one track per group and role (sends, receives, collectives);
      thread "world · recvs"  a second lane ("#2") where a role's calls overlap in time
      X event               each send, receive and collective, from posting to completion
    flow s -> f             an arrow from each send to the receive that took it

Each X event carries the arguments torch's profiler (Kineto) gives a collective --
``Collective name``, ``In msg nelems``, ``Out msg nelems``, ``Group size``, ``dtype``,
``Process Group Ranks``, ``Src Rank``/``Dst Rank`` -- so tools that read torch traces
(Holistic Trace Analysis, say) read these. :func:`validate` checks a document against the
format; :func:`match_messages` pairs sends with receives (the flows).

What the site's trace player needs beyond the format -- each message's payload and the
causal steps of a run -- is in :mod:`collectives.core.trace_steps`.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

from . import trace as _trace
from .trace import COLLECTIVES, Event, Trace

# torch's names (c10::toString of the ScalarType, and the c10d op names of record_param_comms)
KINETO_DTYPES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
                 "int64": "Long", "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte",
                 "bool": "Bool", "complex64": "ComplexFloat", "complex128": "ComplexDouble"}
KINETO_NAMES = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv",
                "all_reduce": "allreduce", "all_gather": "allgather",
                "all_gather_into_tensor": "_allgather_base", "reduce_scatter": "reduce_scatter",
                "reduce_scatter_tensor": "_reduce_scatter_base", "all_to_all": "alltoall",
                "all_to_all_single": "alltoall_base", "broadcast": "broadcast", "reduce": "reduce",
                "gather": "gather", "scatter": "scatter", "barrier": "barrier"}
PHASES = {"X", "B", "E", "i", "I", "s", "t", "f", "M", "C", "b", "e", "n"}
METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index", "process_labels"}


@dataclass
class Flow:
    """One message: the sender's event and the receiver's."""

    send: Event
    recv: Event


def _group_key(event: Event):
    return event.group or "world"


def match_messages(traces: list[Trace]) -> tuple[list[Flow], list[Event]]:
    """Pair every send with the receive that took it; return ``(flows, unmatched)``.

    Messages between two ranks on one group and tag arrive in the order they were posted
    (torch.distributed's point-to-point order), so the k-th send from a to b pairs with
    the k-th receive on b from a.
    """
    sends: dict[tuple, deque] = defaultdict(deque)
    recvs: dict[tuple, deque] = defaultdict(deque)
    for t in traces:
        for e in sorted(t.events, key=lambda e: e.seq):
            if e.is_send:
                sends[(_group_key(e), e.rank, e.peer, e.tag)].append(e)
            elif e.is_recv:
                recvs[(_group_key(e), e.peer, e.rank, e.tag)].append(e)
    flows, unmatched = [], []
    for key in sorted(set(sends) | set(recvs), key=str):
        out, into = sends.get(key, deque()), recvs.get(key, deque())
        while out and into:
            flows.append(Flow(out.popleft(), into.popleft()))
        unmatched += list(out) + list(into)
    flows.sort(key=lambda f: (f.send.t0, f.send.rank, f.send.seq))
    return flows, unmatched


def _role(e: Event) -> str:
    return "sends" if e.is_send else "recvs" if e.is_recv else "collectives"


def _group_name(e: Event) -> str:
    return "world" if e.group is None else "group " + ",".join(map(str, e.group))


def kineto_args(e: Event, world_size: int) -> dict[str, Any]:
    """The arguments torch's profiler records for a communication call, for ``e``."""
    ranks = list(e.group) if e.group is not None else list(range(world_size))
    size = len(ranks)
    out_nelems = e.numel
    if e.kind in ("all_gather", "all_gather_into_tensor"):
        out_nelems = e.numel * size
    elif e.kind in ("reduce_scatter", "reduce_scatter_tensor"):
        out_nelems = e.numel // size
    args = {"Collective name": KINETO_NAMES.get(e.kind, e.kind), "In msg nelems": e.numel,
            "Out msg nelems": out_nelems, "Group size": size,
            "dtype": KINETO_DTYPES.get(e.dtype, e.dtype), "Process Group Name": _group_name(e),
            "Process Group Ranks": "[" + ", ".join(map(str, ranks)) + "]", "Rank": e.rank,
            "Seq": e.seq}
    if e.is_send:
        args["Dst Rank"] = e.peer
    elif e.is_recv:
        args["Src Rank"] = e.peer
    elif e.peer is not None:
        args["Root Rank"] = e.peer
    args.update(bytes=e.nbytes, label=e.label, completed=e.t1 is not None)
    return args


def _us(seconds: float, origin: float) -> float:
    return round((seconds - origin) * 1e6, 3)


def chrome_trace(traces: list[Trace], *, metadata: dict | None = None) -> dict:
    """The Chrome Trace Event JSON document of ``traces`` (one per rank, rank 0 first)."""
    world = len(traces)
    events = [e for t in traces for e in t.events]
    origin = min((e.t0 for e in events), default=0.0)
    out: list[dict] = []
    where: dict[tuple[int, int], tuple[int, float, float]] = {}   # (rank, seq) -> (tid, ts, dur)
    for t in traces:
        pid = t.rank + 1
        out += [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": f"rank {t.rank}"}},
                {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": t.rank}}]
        lanes: dict[tuple, list[float]] = {}    # (group, role) -> end of the last event of each lane
        tids: dict[tuple, int] = {}
        for e in sorted(t.events, key=lambda e: (e.t0, e.seq)):
            ts = _us(e.t0, origin)
            dur = max(round(_us(e.t1 if e.t1 is not None else e.t0, origin) - ts, 3), 0.001)
            key = (_group_name(e), _role(e))
            ends = lanes.setdefault(key, [])
            lane = next((i for i, end in enumerate(ends) if end <= ts), len(ends))
            if lane == len(ends):
                ends.append(0.0)
            ends[lane] = ts + dur
            if (key, lane) not in tids:
                tid = tids[(key, lane)] = len(tids) + 1
                name = f"{key[0]} · {key[1]}" + (f" #{lane + 1}" if lane else "")
                out += [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}},
                        {"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                         "args": {"sort_index": tid}}]
            tid = tids[(key, lane)]
            where[(e.rank, e.seq)] = (tid, ts, dur)
            name = _trace._describe(e.kind, e.peer) + (f" · {e.label}" if e.label else "")
            out.append({"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name,
                        "cat": "collective" if e.kind in COLLECTIVES else "p2p",
                        "args": kineto_args(e, world)})
    flows, _ = match_messages(traces)
    for n, flow in enumerate(flows, start=1):
        for phase, e in (("s", flow.send), ("f", flow.recv)):
            tid, ts, dur = where[(e.rank, e.seq)]
            inset = min(dur / 4, 0.5)     # inside the slice: the arrow leaves as the send is
            at = ts + inset if phase == "s" else ts + dur - inset   # posted, lands as the receive ends
            mark = {"ph": phase, "id": n, "pid": e.rank + 1, "tid": tid, "ts": round(at, 3),
                    "cat": "message", "name": "message"}
            if phase == "f":
                mark["bp"] = "e"       # bind to the receive that encloses it, not the next slice
            out.append(mark)
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {k: str(v) for k, v in (metadata or {}).items()}}


def write(path, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))


# ---------------------------------------------------------------------------------- validate

def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def validate(doc) -> list[str]:
    """What in ``doc`` breaks the Chrome Trace Event format as Perfetto and chrome://tracing read
    it; an empty list when nothing does. Checks each event's fields for its phase, that X
    events on one track nest (no partial overlap), and that every flow has one start and
    one end, each inside an X event of its track."""
    problems: list[str] = []
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        return ["no traceEvents list"]
    if isinstance(doc, dict) and doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append(f"displayTimeUnit {doc['displayTimeUnit']!r} is not 'ms' or 'ns'")
    slices: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    flows: dict[Any, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for i, e in enumerate(events):
        where = f"event {i}"
        if not isinstance(e, dict) or e.get("ph") not in PHASES:
            problems.append(f"{where}: no known phase 'ph'")
            continue
        ph = e["ph"]
        for key in ("pid", "tid"):
            if not isinstance(e.get(key), int) or isinstance(e.get(key), bool):
                problems.append(f"{where} ({ph}): {key} must be an integer")
        if not isinstance(e.get("name"), str):
            problems.append(f"{where} ({ph}): name must be a string")
        if ph != "M" and not (_number(e.get("ts")) and e["ts"] >= 0):
            problems.append(f"{where} ({ph}): ts must be a number >= 0 (microseconds)")
        if "args" in e and not isinstance(e["args"], dict):
            problems.append(f"{where} ({ph}): args must be an object")
        if ph == "X":
            if not (_number(e.get("dur")) and e["dur"] >= 0):
                problems.append(f"{where} (X): dur must be a number >= 0")
            else:
                slices[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))
        elif ph == "M":
            if e.get("name") not in METADATA:
                problems.append(f"{where} (M): unknown metadata {e.get('name')!r}")
            elif "sort_index" in e["name"] and not isinstance(e.get("args", {}).get("sort_index"), int):
                problems.append(f"{where} (M): {e['name']} needs an integer args.sort_index")
            elif e["name"].endswith("_name") and not isinstance(e.get("args", {}).get("name"), str):
                problems.append(f"{where} (M): {e['name']} needs a string args.name")
        elif ph in ("s", "t", "f"):
            if "id" not in e or not isinstance(e.get("cat"), str):
                problems.append(f"{where} ({ph}): a flow event needs an id and a cat")
            else:
                flows[(e["cat"], e["name"], e["id"])][ph].append(e)
    for track, spans in slices.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[float] = []
        for start, end in spans:
            while stack and stack[-1] <= start:
                stack.pop()
            if stack and end > stack[-1] + 1e-9:
                problems.append(f"pid {track[0]} tid {track[1]}: X events overlap without nesting "
                                f"(one ends at {stack[-1]}, the next runs {start}..{end})")
                break
            stack.append(end)

    def inside(e) -> bool:
        return any(a <= e["ts"] <= b for a, b in slices.get((e["pid"], e["tid"]), []))

    for key, parts in flows.items():
        if len(parts["s"]) != 1 or len(parts["f"]) != 1:
            problems.append(f"flow {key[2]}: {len(parts['s'])} starts and {len(parts['f'])} ends, not one of each")
            continue
        start, end = parts["s"][0], parts["f"][0]
        if end["ts"] < start["ts"]:
            problems.append(f"flow {key[2]}: ends before it starts")
        if not inside(start):
            problems.append(f"flow {key[2]}: its start is inside no X event of its track")
        if not inside(end) or end.get("bp") != "e":
            problems.append(f"flow {key[2]}: its end must sit inside an X event of its track, with bp 'e'")
    return problems
