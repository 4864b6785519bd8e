"""The site's trace players: small real runs, recorded with their payloads and buffers.

Each :class:`Player` is an all-reduce run once on a small world with **symbolic inputs**:
every element of rank r starts as 2^r, so every value the run ever holds is a sum of
distinct powers of two, and its bits say whose inputs it contains (a partial sum over
ranks 0 and 2 is 0b101 = 5). The run is recorded twice over: by the trace (every message,
with its causal step, :func:`collectives.core.trace_steps.step_levels`) and by a
:class:`~collectives.core.trace_steps.Capture` (every payload, and the rank's buffer at
every call). The player file holds, for each step, the messages with their payloads and
each rank's buffer after it -- read from the run, never recomputed -- and the result
``dist.all_reduce`` gives on the same inputs, which the last step must equal.

Sparse all-reduce selects by magnitude, so its inputs carry a rank-dependent weight above
the bits: element i of rank r is 2^r + 2^p·((i + r) mod n), and rank r keeps its k
largest. The bits of a sum (its value mod 2^p) still name its contributors.

``.venv/bin/python -m collectives trace --players DIR`` writes ``NAME.player.json`` (what the widget
plays) and ``NAME.trace.json`` (the same run as a Chrome trace, for Perfetto) for every
player; the site build calls it (``tools/mkdocs_hooks.py``).
"""

from __future__ import annotations

import datetime
import inspect
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ...core import launch, ops, trace, trace_export, trace_steps
from ..impl import resolve

SPARSE = "collectives.sparse:sparse_all_reduce"


@dataclass(frozen=True)
class Player:
    name: str                      # the file stem, and what a page names: data-trace="ring"
    title: str
    target: str                    # "module:function", an all-reduce
    world: int
    numel: int
    options: dict = field(default_factory=dict)   # keyword arguments of the call
    groups: str = "none"           # how the buffer is drawn: "chunks" (p), "blocks" (2^⌊log2 p⌋), "slices"

    @property
    def sparse(self) -> bool:
        return self.target == SPARSE


PLAYERS = [
    Player("naive_ring", "Naive ring, 4 ranks: whole tensors round the ring",
           "collectives.naive_ring:naive_ring_all_reduce", 4, 4),
    Player("ring", "Ring, 4 ranks: reduce-scatter, then all-gather", "collectives.ring:ring_all_reduce", 4, 4,
           groups="chunks"),
    Player("recursive_doubling_p4", "Recursive doubling, 4 ranks",
           "collectives.topologies:recursive_doubling_all_reduce", 4, 4),
    Player("recursive_doubling_p3", "Recursive doubling, 3 ranks (fold in, fold out)",
           "collectives.topologies:recursive_doubling_all_reduce", 3, 3),
    Player("halving_doubling_p4", "Halving-doubling, 4 ranks",
           "collectives.topologies:halving_doubling_all_reduce", 4, 4, groups="blocks"),
    Player("halving_doubling_p3", "Halving-doubling, 3 ranks (fold in, fold out)",
           "collectives.topologies:halving_doubling_all_reduce", 3, 3, groups="blocks"),
    Player("tree", "Binary tree, 4 ranks: reduce up, broadcast down",
           "collectives.topologies:tree_all_reduce", 4, 4),
    Player("hierarchical", "Hierarchical, 2 machines × 2 ranks, two slices in flight",
           "collectives.hierarchical:hierarchical_all_reduce", 4, 8,
           dict(layout=(2, 2), slice_numel=4), groups="slices"),
    Player("sparse_allgather", "Sparse, top-2 of 8 per rank, all-gather of (index, value) pairs", SPARSE, 4, 8,
           dict(density=0.25, transport="allgather", selection="topk")),
    Player("sparse_split", "Sparse, top-2 of 8 per rank, split: scatter pairs to owners, gather pieces",
           SPARSE, 4, 8, dict(density=0.25, transport="split", selection="topk"), groups="chunks"),
]


def player(name: str) -> Player:
    for p in PLAYERS:
        if p.name == name:
            return p
    raise KeyError(f"no trace player named {name!r}; known: {', '.join(p.name for p in PLAYERS)}")


def symbolic_input(pl: Player, rank: int) -> torch.Tensor:
    """Rank r's input: 2^r everywhere; for sparse, plus a weight 2^p·((i + r) mod n) to select by."""
    x = torch.full((pl.numel,), float(1 << rank))
    if pl.sparse:
        x += float(1 << pl.world) * ((torch.arange(pl.numel) + rank) % pl.numel).float()
    return x


def _bits(values, p: int) -> list[int]:
    return [int(round(v)) % (1 << p) for v in values]


def _describe(p: int, sparse: bool):
    """How a payload is shown: contributors of each value, (index, contributors) pairs, or numbers."""
    def describe(t: torch.Tensor):
        if t.dtype == torch.uint8 and sparse:          # pack_pairs: int32 indices, then float32 values
            width = t.numel() // 8
            idx = t[: 4 * width].view(torch.int32).tolist()
            val = t[4 * width:].view(torch.float32).tolist()
            return {"pairs": [[i, b] for i, b in zip(idx, _bits(val, p))]}
        if t.is_floating_point():
            return {"bits": _bits(t.tolist(), p)}
        return {"numbers": t.tolist()}
    return describe


def sparse_call(fn, tensor, residual, transport: str, **mode):
    """``sparse_all_reduce`` with its transport ("allgather", "split", "dense") passed under
    the name the function takes: ``transport=`` or, in earlier versions, ``method=``."""
    params = inspect.signature(fn).parameters
    key = "transport" if "transport" in params else "method"
    return fn(tensor, residual, **{key: transport}, **mode)


def _call(pl: Player, fn, x: torch.Tensor, residual):
    options = dict(pl.options)
    if pl.sparse:
        return sparse_call(fn, x, residual, options.pop("transport"), **options)
    return fn(x, **options)


def _record_rank(players: list[Player]) -> list[dict]:
    """On every rank of a world: each player's run, traced and captured."""
    rank, p = dist.get_rank(), dist.get_world_size()
    out = []
    for pl in players:
        fn = resolve(pl.target)
        with trace.paused():
            _call(pl, fn, symbolic_input(pl, rank), torch.zeros(pl.numel))   # groups, buffers: made once
            dist.barrier()
        x, residual = symbolic_input(pl, rank), torch.zeros(pl.numel)
        with trace.recording() as t, trace_steps.Capture(x, t) as cap:
            _call(pl, fn, x, residual)
        sent = symbolic_input(pl, rank) - residual if pl.sparse else symbolic_input(pl, rank)
        with trace.paused():
            dist.all_reduce(sent)                  # what the all-reduce must give everywhere
            dist.barrier()
        out.append(dict(events=t.to_dicts(), capture=cap.to_dict(_describe(p, pl.sparse)),
                        expected=_bits(sent.tolist(), p)))
    return out


def _groups(pl: Player) -> list[dict]:
    if pl.groups == "chunks":
        name = "piece" if pl.sparse else "c"
        return [{"lo": lo, "hi": hi, "name": f"{name}{i}" if not pl.sparse else f"piece {i}"}
                for i, (lo, hi) in enumerate(ops.chunk_bounds(pl.numel, pl.world))]
    if pl.groups == "blocks":
        pof2 = 1 << (pl.world.bit_length() - 1)
        return [{"lo": lo, "hi": hi, "name": f"b{i}"} for i, (lo, hi) in enumerate(ops.chunk_bounds(pl.numel, pof2))]
    if pl.groups == "slices":
        step = pl.options["slice_numel"]
        return [{"lo": lo, "hi": min(lo + step, pl.numel), "name": f"slice {i}"}
                for i, lo in enumerate(range(0, pl.numel, step))]
    return []


def _step_label(labels: list[str]) -> str:
    """One name for a step: its label if every message shares it, else the shared part before
    ": " ("reduce-scatter 0" for "reduce-scatter 0: c3", "...: c0"), else all of them."""
    distinct = list(dict.fromkeys(label for label in labels if label))
    if len(distinct) <= 1:
        return distinct[0] if distinct else ""
    heads = {label.split(": ", 1)[0] for label in distinct}
    return heads.pop() if len(heads) == 1 else " · ".join(distinct)


def build(pl: Player, per_rank: list[dict]) -> tuple[dict, dict]:
    """The player document and the Chrome trace of one recorded run (``per_rank``: :func:`_record_rank`'s)."""
    p = pl.world
    traces = [trace.Trace.from_dicts(r, d["events"]) for r, d in enumerate(per_rank)]
    caps = [d["capture"] for d in per_rank]
    levels = trace_steps.step_levels(traces, [c["log"] for c in caps])
    flows, unmatched = trace_export.match_messages(traces)
    if unmatched:
        raise RuntimeError(f"{pl.name}: {len(unmatched)} messages without their other end")
    n_steps = max(levels.values(), default=0)
    steps = [{"messages": [], "collectives": [], "labels": []} for _ in range(n_steps)]
    for f in flows:
        step = steps[levels[(f.send.rank, f.send.seq)] - 1]
        step["messages"].append({"src": f.send.rank, "dst": f.recv.rank, "label": f.send.label,
                                 "bytes": f.send.nbytes, "payload": caps[f.send.rank]["payloads"][f.send.seq]})
        step["labels"].append(f.send.label)
    calls: dict[tuple, dict] = {}              # one collective call, all its members
    for t in traces:
        for e in t.collectives():
            level = levels[(e.rank, e.seq)]
            call = calls.setdefault((level, e.kind, e.group), {"step": level, "kind": e.kind, "label": e.label,
                                                               "ranks": [], "payloads": {}})
            call["ranks"].append(e.rank)
            call["payloads"][str(e.rank)] = caps[e.rank]["payloads"].get(e.seq)
    for call in calls.values():
        step = steps[call.pop("step") - 1]
        step["collectives"].append(call)
        step["labels"].append(call["label"])
    for r, (t, cap) in enumerate(zip(traces, caps)):
        events = {e.seq: e for e in t.events}
        for k, step in enumerate(steps, start=1):
            state = trace_steps.buffer_after(cap, events, r, levels, k)
            step.setdefault("state", []).append(_bits(state, p))
    for step in steps:
        step["label"] = _step_label(step.pop("labels"))
        step["messages"].sort(key=lambda m: (m["src"], m["dst"]))
    doc = dict(name=pl.name, title=pl.title, target=pl.target, world=p, numel=pl.numel,
               options={k: list(v) if isinstance(v, tuple) else v for k, v in pl.options.items()},
               groups=_groups(pl), trace=f"{pl.name}.trace.json",
               start=[_bits(c["start"], p) for c in caps], steps=steps,
               final=[_bits(c["end"], p) for c in caps], expected=[d["expected"] for d in per_rank])
    meta = dict(player=pl.name, target=pl.target, world_size=p, numel=pl.numel, backend="gloo",
                device=platform.processor() or platform.machine() or "cpu", torch=torch.__version__,
                date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                command=".venv/bin/python -m collectives trace --players DIR")
    doc["meta"] = meta
    return doc, trace_export.chrome_trace(traces, metadata=meta)


def record_all(dest: Path, players: list[Player] | None = None) -> list[str]:
    """Record ``players`` (all of them by default), one world per world size; write their files."""
    players = players or PLAYERS
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for world in sorted({pl.world for pl in players}):
        mine = [pl for pl in players if pl.world == world]
        per_rank = launch.run(_record_rank, world, args=(mine,), timeout=120)
        for i, pl in enumerate(mine):
            doc, chrome = build(pl, [rows[i] for rows in per_rank])
            (dest / f"{pl.name}.player.json").write_text(json.dumps(doc, separators=(",", ":")))
            trace_export.write(dest / f"{pl.name}.trace.json", chrome)
            written.append(pl.name)
    return written
