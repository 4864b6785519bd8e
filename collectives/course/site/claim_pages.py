"""The page side of the claims: records read back, placeholders expanded, sentences held to them.

:func:`load` reads a figure's record (``docs/img/NAME.json``); :func:`expand` puts its figure,
caption, claims and table where a page has ``{{ figure: NAME | COMMAND }}``, ``{{ claim: NAME ID
}}``, ``{{ table: NAME }}`` or ``{{ if: NAME }} ... {{ end }}``; :func:`expectation` says what the
recorded run showed, for a lab. :func:`contradictions` reads the sentences a page writes by hand
and reports those that compare a record's series the way the record does not. Records are
written by :mod:`collectives.course.site.claims`, which re-exports all of this.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Iterable

from ..catalog import ROOT
from . import tables, targets
from .tables import source_line as _source_line

IMG = ROOT / "docs" / "img"
DATA = ROOT / "docs" / "data"


# --------------------------------------------------------------------------- reading

def load(name: str, img: Path | None = None) -> dict | None:
    """The record ``NAME.json`` under ``docs/img`` (or ``img``), else a benchmark's own record
    ``docs/data/NAME.json`` (one with no figure: its table is drawn by :mod:`.tables`), or None
    when there is none."""
    for folder in (Path(img or IMG), None if img else DATA):
        path = folder / f"{name}.json" if folder else None
        if path is not None and path.exists():
            return json.loads(path.read_text(encoding="utf-8"))
    return None



def expectation(name: str, img: Path | None = None) -> str:
    """What the lesson's recorded run of figure ``name`` showed, for a lab's "what to
    expect": the record's sentences and where it ran; or that there is no record yet."""
    record = load(name, img)
    if record is None:
        return (f"No recorded run of {name} yet: its figure script draws it and writes the "
                "record this cell reads.")
    return f"{record['caption']}\n({_source_line(record).replace('`', '')})"


# {{ if: NAME }} ... {{ end }}: shown only with the record; {{ unless: NAME }} ... {{ end }}: only without
_CONDITION = re.compile(r"\{\{\s*(if|unless):\s*([\w.-]+)\s*\}\}(.*?)\{\{\s*end\s*\}\}", re.S)
# {{ figure: NAME | COMMAND }}  {{ claim: NAME ID }}  {{ table: NAME [ID [a,b]] }}
# {{ value: NAME ID KEY [SIZE] }}  {{ ratio: NAME ID A B [SIZE] }}  (tables.py)
_PLACEHOLDER = re.compile(r"\{\{\s*(figure|claim|table|value|ratio):\s*([\w.-]+)\s*"
                          r"(?:\|\s*(.*?)\s*|([\w.-]+(?:[ \t]+[\w.,-]+)*)\s*)?\}\}")
CAPTION_WORDS = 60      # a longer caption shows the figure's title: its numbers are in the tables


def expand(markdown: str, img_url: str = "../img", img: Path | None = None) -> str:
    """Put each record's figure, caption, claims and table into ``markdown``.

    ``{{ figure: NAME | COMMAND }}``: the image, its caption and where it was measured, from
    ``NAME.json`` (captioned by the record's title when the page shows its table too, or
    when its sentences run long); without a record, one line saying that COMMAND draws it. ``{{ claim: NAME
    ID }}``: that comparison's sentence, or nothing. ``{{ table: NAME }}``: the record's
    table, or nothing. ``{{ if: NAME }} ... {{ end }}``: the text between, only when the
    record exists (a section of takeaways from it); ``{{ unless: NAME }} ... {{ end }}``:
    only when it does not."""
    # a figure whose record's table the page shows too is captioned by its title: the
    # numbers are read once, in the table
    tabled = {m.group(2) for m in _PLACEHOLDER.finditer(markdown) if m.group(1) == "table" and not m.group(4)}

    def condition(m: re.Match) -> str:
        present = load(m.group(2), img) is not None
        return m.group(3) if present == (m.group(1) == "if") else ""

    def replace(m: re.Match) -> str:
        kind, name = m.group(1), m.group(2)
        command, claim_id = m.group(3), m.group(4)
        record = load(name, img)
        if kind == "figure":
            if record is None or not record.get("image"):
                return (f"*The figure of this section is drawn by `{command or 'its figure script'}` "
                        "from a recorded run; no recorded run is in this build yet.*")
            said = record["caption"]
            if (len(said.split()) > CAPTION_WORDS or name in tabled) and record.get("title"):
                said = record["title"].rstrip(".") + "."
            return (f"![{record.get('alt') or record.get('title') or name}]({img_url}/{record['image']})\n\n"
                    f"*{said}* {_source_line(record)}")
        if record is None:
            return ""
        words = (claim_id or "").split()
        if kind == "claim":
            for c in record.get("comparisons", []):
                if c["id"] == claim_id:
                    return c["text"]
            return ""
        if kind == "value":
            return tables.value(record, words[0], words[1:])
        if kind == "ratio":
            return tables.ratio(record, words[0], words[1:])
        series = words[1].split(",") if len(words) > 1 else None
        return tables.table_markdown(record, words[0] if words else None, series)
    markdown = targets.expand(expand_records(markdown), lambda name: load(name, img))
    return _PLACEHOLDER.sub(replace, _CONDITION.sub(condition, markdown))


# {{ records: DIR }}: every record under docs/data/DIR/ (runs added as files, GPU runs say)
_RECORDS = re.compile(r"\{\{\s*records:\s*([\w.-]+)\s*\}\}")


def _table_lines(table: dict) -> list[str]:
    lines = ["| " + " | ".join(table["head"]) + " |", "|" + "---|" * len(table["head"])]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]


def _rows_table(rows: list) -> dict | None:
    """A list of flat dicts as a table (the keys of the first row as its head), or None."""
    if not rows or not all(isinstance(r, dict) for r in rows):
        return None
    head = [k for k, v in rows[0].items() if isinstance(v, (str, int, float, bool))][:8]
    cells = [[_cell(r.get(k, "")) for k in head] for r in rows]
    return {"head": head, "rows": cells} if head else None


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def expand_records(markdown: str, data: Path | None = None) -> str:
    """``{{ records: DIR }}``: for every JSON record ``docs/data/DIR/*.json``, its title, its
    sentences, its table and the line naming its device, versions, date, commit and command;
    one line saying that none is recorded yet when the folder is empty or absent.

    A record is a :class:`~collectives.course.site.claims.Record` (``meta``, ``comparisons``,
    ``caption``, ``table``) or a flat one (``device``, ``torch``, ``date``, ``command`` at the
    top, and ``rows``, a list of flat dicts, shown as a table)."""
    def replace(m: re.Match) -> str:
        folder = Path(data or DATA) / m.group(1)
        parts = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
            except ValueError:
                parts.append(f"*`{path.name}` is not JSON.*")
                continue
            if not isinstance(record, dict):
                continue
            meta = record.get("meta") if isinstance(record.get("meta"), dict) else record
            title = record.get("title") or record.get("figure") or record.get("bench") or path.stem
            text = record.get("caption") or " ".join(c.get("text", "") for c in record.get("comparisons", [])
                                                      if isinstance(c, dict))
            parts.append(f"**{title}** " + (text + " " if text else "") + _source_line({"meta": meta})
                         + f" (`docs/data/{m.group(1)}/{path.name}`)"
                         + (f" *{record['commit_note']}*" if isinstance(record.get("commit_note"), str) else ""))
            table = record.get("table") if isinstance(record.get("table"), dict) else _rows_table(record.get("rows"))
            if table and table.get("head"):
                parts.append("\n".join(_table_lines(table)))
        if not parts:
            return (f"*No run of this kind is recorded in this build: its records go under "
                    f"`docs/data/{m.group(1)}/`.*")
        return "\n\n".join(parts)
    return _RECORDS.sub(replace, markdown)


def placeholders(markdown: str) -> list[tuple[str, str, str | None]]:
    """Every ``{{ kind: NAME ... }}`` in ``markdown``: (kind, name, claim id or None). Names
    and claim ids are letters, digits, ``_``, ``.`` and ``-``."""
    return [(m.group(1), m.group(2), m.group(4)) for m in _PLACEHOLDER.finditer(markdown)]


# -- hand-written sentences, held against the records -------------------------------------

# "X is faster than Y": needs its Y; "X wins": measured against the winner or the record's baseline
_BETTER_THAN = r"faster than|quicker than|beats?|outperforms?|ahead of|less time than"
_WORSE_THAN = r"slower than|behind|loses to|lost to|more time than"
_BETTER = r"wins?|won|helps?|pays off|pays for itself|buys|gains?|saves time|speeds? up|is fastest|the fastest"
_WORSE = r"loses|lose|hurts?|is slowest|the slowest"
_NEGATION = re.compile(r"\b(not|never|no|n't|neither|nor|without)\b")
_EVERY = re.compile(r"\b(every size|all sizes|everywhere|always|at every|throughout)\b")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|KB|MB|GB)\b")


def _strip_markdown(text: str) -> str:
    text = re.sub(r"```.*?```", " ", text, flags=re.S)            # code blocks
    text = _PLACEHOLDER.sub(" ", _CONDITION.sub(lambda m: m.group(3), targets.PLACEHOLDER.sub(" ", text)))   # generated: right by construction
    text = re.sub(r"`[^`]*`", " ", text)                           # code spans: names you type
    text = re.sub(r"\$\$.*?\$\$|\$[^$]*\$", " ", text, flags=re.S)  # math
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)        # links, images: their text
    text = re.sub(r"<[^>]+>", " ", text)                           # html tags
    return text.replace("*", "").replace("_", " ")


def sentences(text: str) -> list[str]:
    """The sentences of markdown ``text``, code and math left out."""
    plain = _strip_markdown(text)
    out = []
    for para in re.split(r"\n\s*\n", plain):
        para = " ".join(line.strip(" |#>-") for line in para.splitlines())
        out += [s.strip() for s in re.split(r"(?<=[.!?;:])\s+", para) if s.strip()]
    return out


def _mentions(sentence: str, record: dict) -> list[tuple[int, str]]:
    """(position, series key) of each series the sentence names, longest phrase first."""
    low = sentence.lower()
    phrases = []
    for key, call in record.get("names", {}).items():
        words = {call.lower().removeprefix("the "), key.replace("_", " ").lower()}
        words |= {a.lower() for a in record.get("aliases", {}).get(key, [])}
        phrases += [(w, key) for w in words if w]
    taken: list[tuple[int, int]] = []
    found = []
    for phrase, key in sorted(phrases, key=lambda pk: -len(pk[0])):
        for m in re.finditer(rf"(?<![\w-]){re.escape(phrase)}(?![\w-])", low):
            if any(a < m.end() and m.start() < b for a, b in taken):
                continue
            taken.append((m.start(), m.end()))
            found.append((m.start(), key))
    return sorted(found)


def _size_in(sentence: str) -> float | None:
    m = _SIZE.search(sentence)
    if not m:
        return None
    scale = {"B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    return float(m.group(1)) * scale[m.group(2).upper()]


def _holds(record: dict, better: str, worse: str | None, size: float | None, every: bool) -> bool | None:
    """Whether the record has ``better`` ahead of ``worse`` (``worse`` None: ``better`` is the
    winner, or ahead of the comparison's baseline). None: the record does not compare them."""
    verdicts = []
    for c in record.get("comparisons", []):
        values = c.get("values") or {}
        if better not in values:
            continue
        if c["kind"] == "times":
            other = worse or c.get("baseline") or (c["order"][0] if c["order"][0] != better else None)
            if other is None:
                verdicts.append(c["order"][0] == better)
            elif other in values and other != better:
                verdicts.append(values[better] < values[other])
        elif c["kind"] == "sweep":
            sizes = c["sizes"]
            index = range(len(sizes))
            if size is not None:
                near = min(index, key=lambda i: abs(math.log(sizes[i] / size)))
                if abs(math.log(sizes[near] / size)) < math.log(1.6):
                    index = [near]
            if worse is None:
                wins = [c["winners"][i] == better for i in index]
            elif worse in values:
                wins = [values[better][i] < values[worse][i] for i in index]
            else:
                continue
            verdicts.append(all(wins) if every else any(wins))
    if not verdicts:
        return None
    return any(verdicts)


def contradictions(text: str, records: Iterable[dict]) -> list[str]:
    """Sentences of ``text`` that compare series of a record the way the record does not.

    A sentence is read when it names a series of a record and says it is faster or slower
    ("X is faster than Y", "X beats Y", "Y loses to X", "X helps", "X wins at 1 MiB"; a
    "not" or "never" turns it round; "at every size" asks for every size). It contradicts
    the record when none of the record's comparisons of those series agrees with it.
    Statements about the crossover ("the crossover falls inside this sweep") are held
    against the record's crossovers."""
    records = list(records)
    problems = []
    for sentence in sentences(text):
        low = sentence.lower()
        for record in records:
            if "crossover" in low and re.search(r"\b(inside|within|in) (the|this) sweep\b", low):
                crossings = [c for c in record.get("comparisons", []) if c["kind"] == "crossover"]
                negated = bool(_NEGATION.search(low))
                if crossings and all((c["at"] is not None) == negated for c in crossings):
                    problems.append(f"{sentence!r}: record {record['figure']} has "
                                    + "; ".join(c["text"] for c in crossings))
            mentions = _mentions(sentence, record)
            if not mentions:
                continue
            cue = re.search(rf"\b(?:({_BETTER_THAN})|({_WORSE_THAN})|({_BETTER})|({_WORSE}))\b", low)
            if not cue:
                continue
            positive = cue.group(1) is not None or cue.group(3) is not None
            transitive = cue.group(1) is not None or cue.group(2) is not None
            clause_start = max(low.rfind(",", 0, cue.start()), low.rfind(";", 0, cue.start())) + 1
            subjects = [k for pos, k in mentions if clause_start <= pos < cue.start()]
            objects = [k for pos, k in mentions if pos > cue.start()]
            if _NEGATION.search(low[clause_start:cue.start()]) or re.match(r"\s*nothing\b", low[cue.end():]):
                positive = not positive       # "does not help", "never beats", "buys nothing"
            if not subjects or (transitive and not objects):
                continue                      # compared with something the record does not name
            other = objects[0] if transitive else None
            for subject in dict.fromkeys(subjects):
                if subject == other:
                    continue
                better, worse = (subject, other) if positive else (other, subject)
                if better is None:            # "X loses", "X is slowest": X behind the rest
                    ok = _holds(record, worse, None, _size_in(sentence), False)
                    ok = None if ok is None else not ok
                else:
                    ok = _holds(record, better, worse, _size_in(sentence), bool(_EVERY.search(low)))
                if ok is False:
                    said = " ".join(c["text"] for c in record.get("comparisons", [])
                                    if better in (c.get("values") or {}) or worse in (c.get("values") or {}))
                    problems.append(f"{sentence!r}: record {record['figure']} says {said}")
                    break
    return problems
