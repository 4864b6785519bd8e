"""A lesson's target and where the latest record stands against it, for the benchmarks page.

Targets live on the benchmarks page only, each beside its status, and the status is read
from the record every time the site is built, so it cannot go stale::

    | what | target | measured | status |
    |---|---|---|---|
    | ZeRO-3's peak over FSDP2's | {{ target: 10-sharded-agreement rows[*].peak_over_fsdp2 <= 1.05 }} |

``{{ target: RECORD EXPR [OP BOUND] }}`` becomes three table cells: the target, the measured
value and the status.

* RECORD: a record's name, read like every other placeholder's (``docs/img/NAME.json``, else
  ``docs/data/NAME.json``; ``DIR/NAME`` for one under ``docs/data/DIR``).
* EXPR: a field of the record (``comparisons[id=model].measured``: dots between keys,
  ``[n]`` an index, ``[key=value]`` the item whose key has that value, ``[*]`` every item),
  or two of them divided (``A / B``, item by item where both are lists).
* OP BOUND: ``<= 1.05``, ``>= 1.5`` or ``~ 0.1`` (within 10 % of 1). Met when every value
  holds it; without them the cells are the measured value alone.

A missing record is "not measured"; a field the record lacks fails the build (the page and the
record disagree about what was measured). A GPU record (backend ``nccl``, or a device naming a
GPU) that does not name the rule for fair GPU comparisons' ``launch`` and ``inputs``
(``docs/benchmarks.md``; :func:`collectives.course.benchmarks.gpu_timing.fields`) was measured
before the rule: its row is "not measured under the rule", with no value and no status read
from it.
"""

from __future__ import annotations

import re

PLACEHOLDER = re.compile(r"\{\{\s*target:\s*([\w./-]+)\s+(.+?)\s*\}\}")
OPS = {"<=": "≤", ">=": "≥", "~": "within"}


def field(data, path: str) -> list[float] | float:
    """``path`` read out of ``data`` (see the module's docstring); ``[*]`` gives a list."""
    values, many = [data], False
    for part in re.findall(r'"[^"]*"|[^.\[\]"]+|\[[^\]]*\]', path):
        out = []
        for d in values:
            if part == "[*]":
                out += list(d.values()) if isinstance(d, dict) else list(d)
                many = True
            elif part.startswith("[") and "=" in part:
                key, value = part[1:-1].split("=", 1)
                found = [item for item in d if str(item.get(key)) == value]
                if not found:
                    raise KeyError(f"no item with {key} = {value}")
                out.append(found[0])
            elif part.startswith("["):
                out.append(d[int(part[1:-1])])
            else:
                out.append(d[part.strip('"')])
        values = out
    return [float(v) for v in values] if many else float(values[0])


def measure(record: dict, expr: str) -> list[float]:
    """The values EXPR gives for ``record``: one field, or ``A / B`` item by item."""
    parts = [p.strip() for p in expr.split(" / ")]
    if len(parts) > 2:
        raise ValueError(f"target {expr!r}: at most one division")
    try:
        read = [field(record, p) for p in parts]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"record {record.get('figure') or record.get('bench')} has no {expr!r} ({exc})") from exc
    lists = [r if isinstance(r, list) else None for r in read]
    n = max((len(r) for r in lists if r is not None), default=1)
    cols = [r if r is not None else [v] * n for r, v in zip(lists, read)]
    if any(len(c) != n for c in cols):
        raise ValueError(f"target {expr!r}: the two sides have different lengths")
    if len(cols) == 1:
        return cols[0]
    return [a / b for a, b in zip(*cols)]


_GPU = re.compile(r"NVIDIA|\bGPUs?\b|\bcuda\b|\b[AHB]\d00\b")


def under_rule(record: dict) -> bool:
    """Whether ``record`` may be read for a target: any record not made on GPUs (its backend is
    not ``nccl`` and its device names no GPU), or a GPU record that names the rule's ``launch``
    and ``inputs``, at its top, in its ``meta`` or in its ``rule``."""
    meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
    device = str(meta.get("device") or record.get("device") or "")
    if (meta.get("backend") or record.get("backend")) != "nccl" and not _GPU.search(device):
        return True
    rule = record.get("rule") if isinstance(record.get("rule"), dict) else {}
    return any(place.get("launch") and place.get("inputs") for place in (record, meta, rule))


def _ratio(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}×" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}×"


def _holds(value: float, op: str, bound: float) -> bool:
    if op == "<=":
        return value <= bound
    if op == ">=":
        return value >= bound
    return abs(value - 1) <= bound


def cells(name: str, rest: str, load) -> str:
    """The cells ``{{ target: NAME REST }}`` stands for: "target | measured | status", or the
    measured value alone when REST names no bound; ``load(NAME)`` reads the record (None when
    there is none: :func:`collectives.course.site.claim_pages.load`)."""
    m = re.fullmatch(r"(.+?)(?:\s+(<=|>=|~)\s+(\d+(?:\.\d+)?))?", rest.strip())
    expr, op, bound = m.group(1), m.group(2), float(m.group(3)) if m.group(3) else None
    record = load(name)
    if op is None:
        if record is None:
            return "not measured"
        return _ratio(measure(record, expr)) if under_rule(record) else "not measured under the rule"
    target = (f"{OPS[op]} {bound:.2f}×" if op != "~" else f"{1 - bound:.2f}–{1 + bound:.2f}×")
    if record is None:
        return f"{target} | not measured | no record yet (`docs/data/{name}.json`)"
    if not under_rule(record):
        return f"{target} | not measured under the rule | its record (`{name}`) predates the rule"
    values = measure(record, expr)
    held = sum(_holds(v, op, bound) for v in values)
    status = ("**met**" if held == len(values) else
              "**missed**" if len(values) == 1 or held == 0 else f"**missed** ({held} of {len(values)} hold)")
    return f"{target} | {_ratio(values)} | {status}"


def expand(markdown: str, load) -> str:
    """Every ``{{ target: ... }}`` in ``markdown`` as its cells, its records read by ``load``."""
    return PLACEHOLDER.sub(lambda m: cells(m.group(1), m.group(2), load), markdown)
