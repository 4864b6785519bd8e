"""Every measured number on the site from a record: ``.venv/bin/python -m collectives claims``.

A page states a measurement -- a time (ns, µs, ms, s), a rate (GB/s, Gbit/s, TFLOP/s), a
multiple (``×``) or a share (``%``) -- in one of two ways:

* through the placeholders of :mod:`collectives.course.site.claims` (``{{ claim: ... }}``,
  ``{{ table: ... }}``, ``{{ figure: ... }}``), which write it from its record; or
* by hand, listed in ONE reviewed file, ``docs/data/hand-claims.json``: the page, the text
  as written, the record and the field it was read from. The check reads the field back and
  holds the text to it, at the rounding the text is written with (or ``tolerance``).

Everything else that carries such a unit must be recognisably not a measurement: the givens
and answers of worked problems and check-your-understanding questions, products such as
``2 × 2`` (machines × ranks), and the settings listed under ``definitions`` in the same file
(a link shaped to 1 Gbit/s, a density of 1 %, a 30 s timeout). Run logs that left no record
are shown only inside an ``??? unrecorded "..."`` block on a notes page, which says so to
the reader; snippets written by a script from its records are listed under ``generated``.

Conventions are held by the words around a number: a column headed ``× baseline`` (or a
sentence saying "× X's time") holds multiples of time, below 1 faster; a column headed
"speed-up" (or "N× as fast") holds speed ratios, above 1 faster. A ratio's record entry says
which it is (``as``); a header or sentence that means the other is read the other way, so a
header cannot contradict its values without the check saying so.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..catalog import ROOT

HAND_CLAIMS = ROOT / "docs" / "data" / "hand-claims.json"

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"        # 7, 0.82, 1,024
_UNITS = {  # unit -> (kind, factor to the base unit: seconds, bytes/s, ratio, percent)
    "ns": ("time", 1e-9), "µs": ("time", 1e-6), "μs": ("time", 1e-6), "us": ("time", 1e-6),
    "ms": ("time", 1e-3), "s": ("time", 1.0),
    "TB/s": ("rate", 1e12), "GB/s": ("rate", 1e9), "Gb/s": ("rate", 1.25e8), "MB/s": ("rate", 1e6), "GiB/s": ("rate", 2.0 ** 30), "MiB/s": ("rate", 2.0 ** 20),
    "Gbit/s": ("rate", 1.25e8), "Mbit/s": ("rate", 1.25e5),
    "TFLOP/s": ("flops", 1e12), "GFLOP/s": ("flops", 1e9),
    "%": ("percent", 1.0), "×": ("ratio", 1.0),
}
_UNIT = "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
NUMBER = re.compile(rf"(?<![\w.,/]){_NUM}(?:\s?[–-]\s?{_NUM})?\s?(?:{_UNIT})(?![\w/])")
_PRODUCT = re.compile(rf"{_NUM}\s×\s\d|{_NUM}\s?×\s?(?:NVIDIA|H100|H200|A100|GPUs?)\b")   # 2 × 2, 4× H200
_EXERCISE = re.compile(r"^#{2,3} +(worked problems|check your understanding)", re.I | re.M)
_ADMONITION = re.compile(r'^( *)(\?\?\?\+?|!!!) *(\w+)(?: *"[^"]*")? *$')
_INCLUDE = re.compile(r'--8<--\s*"([^"]+)"')
_SPEED = re.compile(r"^\s*(as fast|faster|quicker|the speed|speed-?up)", re.I)
_TIME = re.compile(r"^\s*(?:as long|slower|the time|of the time|[^.;:|]{0,40}?'s (?:time|step))\b", re.I)


@dataclass
class Number:
    page: str          # relative to docs/ (or notebooks/NAME.ipynb, cell N)
    line: int
    text: str          # as written: "1.47×", "275 ms", "0.82–1.04×"
    context: str       # the line
    header: str        # its table column's header, or ""
    after: str         # the words after it

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _blank(m: re.Match) -> str:
    return re.sub(r"[^\n]", " ", m.group(0))


def _plain(markdown: str) -> str:
    """The markdown with code, math, placeholders, comments and link targets blanked out,
    lines kept where they were."""
    text = re.sub(r"^( *)(```|~~~).*?^\1\2[ \t]*$", _blank, markdown, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", _blank, text, flags=re.S)
    text = re.sub(r"\{\{.*?\}\}", _blank, text, flags=re.S)        # placeholders: from records
    text = re.sub(r"\$\$.*?\$\$|\$[^$\n]*\$", _blank, text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", _blank, text)
    text = re.sub(r"\]\([^)\n]*\)", _blank, text)
    return text


def _exempt_lines(markdown: str, notes_page: bool) -> tuple[set[int], list[str], list[str]]:
    """Lines whose numbers are not measurements (worked problems, check-your-understanding and
    their answers) or unrecorded history (``??? unrecorded`` blocks); the snippets included in
    those blocks; problems (an unrecorded block outside a notes page)."""
    lines = markdown.split("\n")
    exempt, unrecorded_includes, problems = set(), [], []
    in_exercise = False
    block_indent: int | None = None
    for i, line in enumerate(lines, 1):
        if re.match(r"^#{1,3} ", line):
            in_exercise = bool(_EXERCISE.match(line))
        if in_exercise:
            exempt.add(i)
        if block_indent is not None:
            if line.strip() and len(line) - len(line.lstrip()) <= block_indent:
                block_indent = None
            else:
                exempt.add(i)
                unrecorded_includes += _INCLUDE.findall(line)
                continue
        m = _ADMONITION.match(line)
        if m and m.group(3) == "unrecorded":
            if not notes_page:
                problems.append(f"line {i}: an unrecorded block belongs on a notes page, not here")
            block_indent = len(m.group(1))
            exempt.add(i)
    return exempt, unrecorded_includes, problems


def _headers(lines: list[str]) -> dict[int, list[str]]:
    """Line number -> the column headers of the table that line is a row of."""
    out, head = {}, None
    for i, line in enumerate(lines, 1):
        s = line.strip()
        if s.startswith("|") and i < len(lines) and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i]):
            head = [c.strip() for c in s.strip("|").split("|")]
        elif s.startswith("|") and head is not None:
            out[i] = head
        elif not s.startswith("|"):
            head = None
    return out


def numbers(markdown: str, page: str, exempt: set[int] = frozenset()) -> list[Number]:
    """Every number with a unit of time, rate, ``×`` or ``%`` written by hand in ``markdown``."""
    raw = markdown.split("\n")
    plain = _plain(markdown).split("\n")
    headers = _headers(raw)         # as written: "× `dist.all_reduce`" names its baseline
    found = []
    for i, line in enumerate(plain, 1):
        if i in exempt:
            continue
        products = [m.span() for m in _PRODUCT.finditer(line)]
        for m in NUMBER.finditer(line):
            if any(a <= m.start() < b for a, b in products):
                continue
            header = ""
            if i in headers and line.strip().startswith("|"):
                column = line[:m.start()].count("|") - 1
                if 0 <= column < len(headers[i]):
                    header = headers[i][column]
            found.append(Number(page, i, m.group(0), raw[i - 1].strip(), header, line[m.end():m.end() + 60]))
    return found


# --------------------------------------------------------------------------- holding them to records

def _norm(text: str) -> str:
    return re.sub(r"\s+", "", text.replace("–", "-").replace("μ", "µ"))


def _parse(text: str) -> tuple[list[float], str, list[int]]:
    """"0.82–1.04×" -> ([0.82, 1.04], "×", [2, 2]): the values, the unit, their decimals."""
    values = re.findall(_NUM, text)
    unit = re.search(rf"(?:{_UNIT})$", text.strip()).group(0)
    values = [v.replace(",", "") for v in values]
    return [float(v) for v in values], unit, [len(v.split(".")[1]) if "." in v else 0 for v in values]


def field(data, path: str):
    """``comparisons[id=one-size].values.hier`` read out of ``data``: dots between keys,
    ``[n]`` an index, ``[key=value]`` the list item whose ``key`` is ``value``, and a key
    with dots in it in double quotes (``data."12-bench-gpu.json".world``)."""
    for part in re.findall(r'"[^"]*"|[^.\[\]"]+|\[[^\]]*\]', path):
        if part.startswith('"'):
            data = data[part[1:-1]]
        elif part.startswith("["):
            inner = part[1:-1]
            if "=" in inner:
                key, value = inner.split("=", 1)
                data = next(item for item in data if str(item.get(key)) == value)
            else:
                data = data[int(inner)]
        else:
            data = data[part]
    return data


def convention(number: Number) -> str | None:
    """"time-multiple", "speed-up" or None, from the column header or the words after."""
    head = number.header.lower()
    if head:
        if re.search(r"speed-?up|as fast", head):
            return "speed-up"
        if head.startswith("×") or " × " in f" {head}" or "÷" in head or re.search(r"\btime multiple", head):
            return "time-multiple"
    if number.text.endswith("×"):
        if _SPEED.match(number.after):
            return "speed-up"
        if _TIME.match(number.after):
            return "time-multiple"
    return None


_RECORDS: dict[Path, object] = {}


def _record(path: str):
    full = ROOT / path
    if full not in _RECORDS:
        _RECORDS[full] = json.loads(full.read_text(encoding="utf-8"))
    return _RECORDS[full]


def expected(entry: dict, number: Number) -> tuple[list[float], str]:
    """The values the record gives for ``number``, in the number's unit, and how it was read."""
    shown, unit, _ = _parse(number.text)
    record = _record(entry["record"])
    paths = entry["field"] if isinstance(entry["field"], list) else [entry["field"]]
    values = [float(field(record, p)) for p in paths]
    if entry.get("reciprocal"):                         # 1/β from β
        values = [1 / v for v in values]
    if "of" in entry:                                   # a ratio of two times: field / of
        base = float(field(record, entry["of"]))
        values = [v / base for v in values]
    kind, factor = _UNITS[unit]
    scale = entry.get("scale", 1.0)                     # record unit -> base unit (e.g. 1e-3 for ms)
    values = [v * scale / factor for v in values]
    said = entry.get("as")
    if kind == "ratio" and said in ("speed-up", "time-multiple"):
        meant = convention(number) or said
        if meant != said:
            values = [1 / v for v in values]
        said = meant
    values = sorted(values)
    if len(shown) == 2:
        values = [values[0], values[-1]]
    return values, said or kind


def _agrees(shown: list[float], decimals: list[int], values: list[float], tolerance: float | None) -> bool:
    if len(shown) != len(values):
        return False
    for s, d, v in zip(shown, decimals, values):
        slack = tolerance * abs(v) if tolerance is not None else 0.5 * 10 ** -d + 1e-9
        if abs(s - v) > slack:
            return False
    return True


def _matches(entry: dict, number: Number) -> bool:
    return (fnmatch.fnmatch(number.page, entry["page"]) and _norm(entry["text"]) == _norm(number.text)
            and (not entry.get("context") or entry["context"] in number.context))


def _definition(defs: list[dict], number: Number) -> bool:
    for d in defs:
        if not any(fnmatch.fnmatch(number.page, glob) for glob in d.get("pages", ["*"])):
            continue
        for m in re.finditer(d["pattern"], number.context):
            if _norm(number.text) in _norm(m.group(0)):
                return True
    return False


def check_number(number: Number, hand: dict) -> str | None:
    """None when ``number`` comes from its record (or is a listed setting), else the problem."""
    entries = [e for e in hand.get("claims", []) if _matches(e, number)]
    if not entries:
        if _definition(hand.get("definitions", []), number):
            return None
        return (f"{number.where}: {number.text!r} has no record behind it: place it from its record, "
                f"list it in docs/data/hand-claims.json, or remove it ({number.context[:90]!r})")
    entry = entries[0]
    shown, unit, decimals = _parse(number.text)
    try:
        values, said = expected(entry, number)
    except (KeyError, IndexError, StopIteration, TypeError, ValueError, OSError) as exc:
        return f"{number.where}: {number.text!r}: cannot read {entry['record']} {entry['field']}: {exc!r}"
    if len(shown) == 1 and len(values) > 1:
        values = [values[0]] if values[0] == values[-1] else values
    if not _agrees(shown, decimals, values, entry.get("tolerance")):
        got = " to ".join(f"{v:.4g}" for v in values)
        return (f"{number.where}: {number.text!r} disagrees with {entry['record']} {entry['field']}: "
                f"the record gives {got} {unit} read as a {said}"
                + (f" (the column is headed {number.header!r})" if number.header else "")
                + f" ({number.context[:90]!r})")
    return None


# --------------------------------------------------------------------------- the site

def _notebook_text(path: Path) -> list[tuple[str, str]]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return [(f"notebooks/{path.name}, cell {i + 1}", "".join(c["source"]))
            for i, c in enumerate(cells) if c["cell_type"] == "markdown"]


def problems(docs: Path | None = None, notebooks: Path | None = None, hand_claims: Path | None = None) -> list[str]:
    """Every hand-written number of every page and lab that no record backs, or that disagrees
    with the record it is listed with; every listed claim that no longer matches a number."""
    docs = Path(docs or ROOT / "docs")
    notebooks = Path(notebooks or docs.parent / "notebooks")
    hand = json.loads(Path(hand_claims or HAND_CLAIMS).read_text(encoding="utf-8"))
    _RECORDS.clear()                    # records read afresh on every run
    generated = {g["page"] for g in hand.get("generated", [])}
    pages = sorted(p for p in docs.rglob("*.md") if "reference" not in p.relative_to(docs).parts)
    found: list[Number] = []
    out: list[str] = []
    unrecorded: set[str] = set()
    texts = {}
    for page in pages:
        rel = page.relative_to(docs).as_posix()
        text = page.read_text(encoding="utf-8")
        exempt, includes, bad = _exempt_lines(text, rel.endswith("-notes.md"))
        out += [f"{rel}: {b}" for b in bad]
        unrecorded |= {f"snippets/{name}" for name in includes}
        texts[rel] = (text, exempt)
    included_elsewhere = {f"snippets/{n}" for rel, (t, ex) in texts.items()
                          for i, line in enumerate(t.split("\n"), 1) if i not in ex for n in _INCLUDE.findall(line)}
    for rel, (text, exempt) in texts.items():
        if rel in generated or (rel in unrecorded and rel not in included_elsewhere):
            continue
        found += numbers(text, rel, exempt)
    for notebook in sorted(notebooks.glob("*.ipynb")):
        for name, text in _notebook_text(notebook):
            exempt, _, bad = _exempt_lines(text, False)
            out += [f"{name}: {b}" for b in bad]
            found += numbers(text, name, exempt)
    used = set()
    for number in found:
        problem = check_number(number, hand)
        if problem:
            out.append(problem)
        used |= {i for i, e in enumerate(hand.get("claims", [])) if _matches(e, number)}
    for i, entry in enumerate(hand.get("claims", [])):
        if i not in used:
            out.append(f"docs/data/hand-claims.json: claim {entry['text']!r} on {entry['page']} "
                       "matches no number on that page (remove the entry)")
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import time

    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives claims",
                                     description="Hold every hand-written number on the site to its record.")
    parser.add_argument("--docs", type=Path, help="the docs folder (default: the course's)")
    parser.add_argument("--hand-claims", type=Path, help="the reviewed list (default: docs/data/hand-claims.json)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    found = problems(args.docs, None, args.hand_claims)
    for p in found:
        print(p)
    print(f"{len(found)} number(s) without a record or disagreeing with it "
          f"({time.perf_counter() - start:.2f} s)" if found else
          f"every hand-written number agrees with its record ({time.perf_counter() - start:.2f} s)")
    return 1 if found else 0
