"""Measured results as a page shows them: tables and single numbers, read from a record.

A lesson's **Measured** section is one compact table per record, at most one figure, and a
short paragraph. Every cell and every number here is the record's value, formatted and
nothing else, so a page cannot show a number its record does not hold:

* ``{{ table: NAME }}``: the record's own table; ``{{ table: NAME ID }}``: comparison ID as a
  table -- a measurement of each contender (rows: contenders; columns: the time and its
  multiple of the baseline's) or a sweep (rows: sizes; columns: each contender's time;
  ``{{ table: NAME ID a,b }}`` keeps contenders a and b). Under each, its caption: what was
  measured, on what hardware, under what load, and the command.
* ``{{ value: NAME ID KEY }}``: one time of comparison ID (``KEY SIZE`` in a sweep, e.g.
  ``ring 4MiB``); a crossover's size with ``at``; a fact's field with ``FIELD FORMAT``
  (``alpha_s time``).
* ``{{ ratio: NAME ID A B }}`` (``A B SIZE`` in a sweep): B's time over A's, "2.30×" -- how
  many times as fast A ran as B.

:mod:`collectives.course.site.claim_pages` expands them with the other placeholders.
"""

from __future__ import annotations

import math
import re


def human(seconds: float) -> str:
    """Seconds as a reader wants them: 370 ms, 1.2 s, 85 µs."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def source_line(record: dict) -> str:
    meta = record.get("meta", {})
    date = str(meta.get("date", ""))[:10]
    versions = f"torch {meta.get('torch', '?')}" + (f", NCCL {meta['nccl']}" if meta.get("nccl") else "")
    commit = f", commit {meta['commit']}" if meta.get("commit") else ""
    load = meta.get("load_average") or meta.get("load_average_before")
    load = f" under a load average of {load[0]:g}" if isinstance(load, list) and load else ""
    return (f"Recorded on a {meta.get('device', 'machine not recorded')}{load}, {versions}, {date}{commit}: "
            f"`{meta.get('command', '')}`.")





def _size(nbytes: float) -> str:
    from ...core.timing import human_bytes
    return human_bytes(nbytes)


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?", text, re.I)
    if not m:
        raise ValueError(f"not a size: {text!r} (write 64KiB, 4MiB)")
    scale = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[(m.group(2) or "")[:1].upper()]
    return int(float(m.group(1)) * scale)


def _call(record: dict, key: str) -> str:
    return record.get("names", {}).get(key, key.replace("_", " "))


def comparison(record: dict, comp_id: str) -> dict | None:
    """Comparison ``comp_id`` of ``record`` (an id written with spaces is named with ``-``)."""
    found = {c.get("id"): c for c in record.get("comparisons", [])}
    return found.get(comp_id) or found.get(comp_id.replace("-", " "))


def _key(c: dict, key: str) -> str:
    """A series of comparison ``c`` (a key written with spaces is named with ``-``)."""
    values = c.get("values") or {}
    return key if key in values else key.replace("-", " ") if key.replace("-", " ") in values else key


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def caption(record: dict, what: str = "") -> str:
    """The line under a table: what it shows, then the hardware, load, versions and command."""
    what = (what or record.get("title") or "").strip().rstrip(".")
    return f"*{_cap(what) + '. ' if what else ''}{source_line(record)}*"


def table(record: dict, comp_id: str | None = None, series: list[str] | None = None) -> dict | None:
    """``{"head", "rows", "what"}``: the record's table, or comparison ``comp_id`` as one;
    None when the record has no such thing to show."""
    if comp_id is None:
        own = record.get("table")
        if own is None and record.get("bench") in BENCH_TABLES:
            return BENCH_TABLES[record["bench"]](record)
        return dict(own, what=own.get("what", "")) if own else None
    c = comparison(record, comp_id)
    if c is None:
        return None
    values = c.get("values") or {}
    keys = [k for k in (series or list(values)) if k in values]
    if c["kind"] == "times" and keys:
        base = c.get("baseline") or c["order"][0]
        head = ["", "time", f"× {_call(record, base)}'s time"]
        rows = [[_cap(_call(record, k)), human(values[k]),
                 f"{values[k] / values[base]:.2f}×" if values[base] > 0 else "n/a"] for k in keys]
        return {"head": head, "rows": rows, "what": c.get("where", "")}
    if c["kind"] == "sweep" and keys:
        head = ["size"] + [_call(record, k) for k in keys]
        rows = [[_size(s)] + [human(values[k][i]) for k in keys] for i, s in enumerate(c["sizes"])]
        return {"head": head, "rows": rows, "what": c.get("label", "")}
    return None


def _agreement(record: dict) -> dict:
    """``bench-sharded-agreement``'s rows: ZeRO-3 against ``fully_shard``, values and peak."""
    mib = lambda b: f"{b / 2 ** 20:.2f}"                                      # noqa: E731
    rows = [[r["contender"], r["policy"],
             "bit for bit" if r.get("bit_equal") else f"within {r['max_abs_diff']:.1e}",
             mib(r["peak_bytes"]), mib(r["fsdp2_peak_bytes"]), f"{r['peak_over_fsdp2']:.2f}×"]
            for r in record.get("rows", [])]
    what = (f"ZeRO-3 against torch's fully_shard, {record['layers']} square layers of {record['width']}, "
            f"{record['world_size']} ranks, {record['steps']} steps: the parameters after them, and the "
            "peak live bytes of a step")
    return {"head": ["contender", "policy", "parameters", "peak MiB", "fully_shard's MiB",
                     "× fully_shard's peak"], "rows": rows, "what": what}


# A benchmark's own record (docs/data/NAME.json, no figure) as a table, by its "bench".
BENCH_TABLES = {"bench-sharded-agreement": _agreement}


def table_markdown(record: dict, comp_id: str | None = None, series: list[str] | None = None) -> str:
    shown = table(record, comp_id, series)
    if not shown:
        return ""
    lines = ["| " + " | ".join(shown["head"]) + " |", "|" + "---|" * len(shown["head"])]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in shown["rows"]]
    return "\n".join(lines) + "\n\n" + caption(record, shown.get("what", ""))


def _at(c: dict, key: str, size: str | None) -> float:
    value = c["values"][key]
    if c["kind"] != "sweep":
        return value
    if size is None:
        raise ValueError(f"comparison {c['id']} is a sweep: name the size ({key} 4MiB)")
    want = _parse_size(size)
    i = min(range(len(c["sizes"])), key=lambda j: abs(math.log(c["sizes"][j] / want)))
    if c["sizes"][i] != want:
        raise ValueError(f"comparison {c['id']} has no size {size}")
    return value[i]


def value(record: dict, comp_id: str, args: list[str]) -> str:
    """``{{ value: NAME ID KEY [SIZE] }}`` as text; ``at`` for a crossover's size."""
    c = comparison(record, comp_id)
    if c is None:
        raise ValueError(f"record {record.get('figure')} has no comparison {comp_id!r}")
    if c["kind"] == "crossover":
        return "no size in the sweep" if c.get("at") is None else _size(c["at"])
    if c["kind"] == "fact":
        return _fact(c, args)
    if not args or _key(c, args[0]) not in (c.get("values") or {}):
        raise ValueError(f"comparison {comp_id} has no series {args[:1]}")
    return human(_at(c, _key(c, args[0]), args[1] if len(args) > 1 else None))


def _times(r: float) -> str:
    """A ratio as a page writes it: two decimals below 10 ("1.04×", "0.96×"), whole above."""
    return f"{r:.2f}×" if r < 10 else f"{r:.0f}×"


FORMATS = {"time": human, "us": lambda x: human(x * 1e-6), "size": _size, "count": lambda x: f"{x:g}",
           "ratio": lambda x: _times(x), "rate": lambda x: f"{x / 1e9:.3g} GB/s",
           "bandwidth": lambda x: f"{1 / x / 1e9:.3g} GB/s",      # 1/β from β (seconds per byte)
           "share": lambda x: f"{x:.2f}"}


def _fact(c: dict, args: list[str]) -> str:
    """``{{ value: NAME ID FIELD FORMAT }}`` of a fact: FIELD (``a.b`` for a nested one) read
    from the comparison and written as a ``time`` (seconds), ``us``, ``size``, ``ratio``,
    ``rate`` (bytes per second), ``bandwidth`` (1/β from seconds per byte), ``share`` (a fraction,
    0.37) or ``count``."""
    if len(args) != 2 or args[1] not in FORMATS:
        raise ValueError(f"fact {c['id']}: write FIELD FORMAT, FORMAT one of {sorted(FORMATS)}")
    data = c
    for part in args[0].split("."):
        if not isinstance(data, dict) or part not in data:
            raise ValueError(f"fact {c['id']} has no field {args[0]!r}")
        data = data[part]
    return FORMATS[args[1]](float(data))


def ratio(record: dict, comp_id: str, args: list[str]) -> str:
    """``{{ ratio: NAME ID A B [SIZE] }}``: B's time over A's, as "2.3×"."""
    c = comparison(record, comp_id)
    keys = [_key(c, a) for a in args[:2]] if c else []
    if c is None or len(keys) < 2 or not all(k in (c.get("values") or {}) for k in keys):
        raise ValueError(f"record {record.get('figure')}: no comparison {comp_id!r} of {args[:2]}")
    size = args[2] if len(args) > 2 else None
    r = _at(c, keys[1], size) / _at(c, keys[0], size)
    return _times(r)
