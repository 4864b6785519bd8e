"""A claim is data: what a figure shows, recorded beside it, and the sentences that say it.

A figure script measures, draws, and writes beside the image a *record* (``NAME.json``
next to ``NAME.svg`` in ``docs/img/``): the comparisons the figure shows -- which is
faster and by how much, the winner at each size, where the winner changes -- with the
device, the versions, the date and the command that made it::

    record = claims.Record("04-pipelining", names={"ring": "the ring",
                                                    "pipelined_ring": "the pipelined ring"})
    record.times("one call", {"ring": 0.37, "pipelined_ring": 0.81}, baseline="ring",
                 where="4 Mi float32 on 4 ranks")
    record.caption = record.text("one call")        # "... the ring ran 2.19× as fast as ..."
    plots.save(fig, IMG / "04-pipelining", record)   # the image and the record, together

A page never states a comparison ahead of the data. It places the figure with
``{{ figure: 04-pipelining | COMMAND }}`` and the build writes the image, the caption
and the line naming the device, versions, date and command from the record
(:func:`expand`); without a record the figure and its claims are absent, and the page
says which command draws it. A sentence written by hand that compares two series of a
record ("the pipelined ring is faster than the ring") is read by :func:`contradictions`,
which the site check runs over every page and every lab: it fails when the record says
otherwise. Labs print their conclusions from their own run with :func:`compare_line`
and :func:`winners_line`, and what to expect from the lesson's record with
:func:`expectation`.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import sys
from pathlib import Path
from typing import Iterable, Sequence

from .catalog import ROOT

__all__ = ["IMG", "Record", "environment", "load", "expand", "contradictions", "compare_line",
           "winners_line", "crossover", "expectation", "human"]

IMG = ROOT / "docs" / "img"
VERSION = 1
META_FIELDS = ("command", "date", "device", "torch")     # every record names these


# --------------------------------------------------------------------------- writing

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command() -> str:
    exe = Path(sys.executable)
    try:
        python = str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else ".venv/bin/python"
    except ValueError:
        python = ".venv/bin/python"
    args = list(sys.argv)
    if args and args[0].endswith(".py") and Path(args[0]).is_absolute():
        try:
            args[0] = str(Path(args[0]).resolve().relative_to(ROOT))
        except ValueError:
            pass
    sudo = "sudo " if os.environ.get("SUDO_USER") and hasattr(os, "geteuid") and os.geteuid() == 0 else ""
    return sudo + " ".join([python] + args)


def environment(backend: str = "gloo", command: str | None = None, **extra) -> dict:
    """Where and how a measurement was made: the record's ``meta``.

    ``device`` names the hardware ("16-core x86_64 host (AMD EPYC ...)", or the GPUs under
    NCCL); ``command`` is the command line that ran (``sys.argv``), unless given."""
    import torch

    cpus = os.cpu_count() or 1
    device = f"{cpus}-core {platform.machine()} host ({_cpu_model()})"
    meta = {"command": command or _command(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "device": device, "torch": torch.__version__, "python": platform.python_version(),
            "backend": backend, "cpus": cpus}
    if backend == "nccl" and torch.cuda.is_available():
        count = torch.cuda.device_count()
        meta["device"] = f"{count}x {torch.cuda.get_device_name(0)}"
        meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        meta["load_average"] = [round(x, 1) for x in os.getloadavg()]
    except OSError:
        pass
    meta.update(extra)
    return meta


def human(seconds: float) -> str:
    """Seconds as a reader wants them: 370 ms, 1.2 s, 85 µs."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def _size(nbytes: float) -> str:
    from ..core.timing import human_bytes
    return human_bytes(nbytes)


class Record:
    """The comparisons one figure shows; :meth:`save` writes them as JSON beside it.

    ``names``: series key -> how the text calls it ("pipelined_ring" -> "the pipelined
    ring"); ``aliases``: further words a page may call it by ("pipelining"), which the
    check of hand-written sentences recognises too.
    """

    def __init__(self, name: str, *, names: dict[str, str], aliases: dict[str, list[str]] | None = None,
                 title: str = "", alt: str = "", meta: dict | None = None):
        self.name, self.names, self.title, self.alt = name, dict(names), title, alt or title
        self.aliases = {k: list(v) for k, v in (aliases or {}).items()}
        self.meta = meta if meta is not None else environment()
        self.comparisons: list[dict] = []
        self.caption = ""
        self.table: dict | None = None
        self.image = ""

    def _call(self, key: str) -> str:
        return self.names.get(key, key.replace("_", " "))

    def times(self, id: str, values: dict[str, float], *, baseline: str | None = None,
              where: str = "") -> dict:
        """One measurement of each series (seconds): which is fastest, by how much."""
        order = sorted(values, key=lambda k: values[k])
        entry = {"id": id, "kind": "times", "where": where, "values": dict(values),
                 "baseline": baseline, "order": order}
        entry["text"] = compare_line(values, self.names, where=where, baseline=baseline)
        self.comparisons.append(entry)
        return entry

    def sweep(self, id: str, sizes: Sequence[int], values: dict[str, Sequence[float]], *,
              label: str = "measured") -> dict:
        """Times of each series at each size: the winner per size, said in one sentence."""
        winners = [min(values, key=lambda k: values[k][i]) for i in range(len(sizes))]
        entry = {"id": id, "kind": "sweep", "label": label, "sizes": list(sizes),
                 "values": {k: list(v) for k, v in values.items()}, "winners": winners}
        entry["text"] = winners_line(sizes, winners, self.names, label=label)
        self.comparisons.append(entry)
        return entry

    def crossover(self, id: str, sizes: Sequence[int], first: str, then: str,
                  values: dict[str, Sequence[float]], *, label: str = "measured",
                  at: float | None = None) -> dict:
        """Where ``then`` starts to beat ``first`` (``at``: given, or interpolated from the
        two sizes between which the order changes); ``None`` when it does not within the sweep."""
        if at is None:
            at = crossover(sizes, values[first], values[then])
        entry = {"id": id, "kind": "crossover", "label": label, "between": [first, then],
                 "at": at, "range": [min(sizes), max(sizes)]}
        if at is None:
            entry["text"] = (f"{_cap(label)}: {self._call(then)} does not overtake {self._call(first)} "
                             f"between {_size(min(sizes))} and {_size(max(sizes))}.")
        else:
            entry["text"] = (f"{_cap(label)}: {self._call(then)} overtakes {self._call(first)} "
                             f"at about {_size(at)}.")
        self.comparisons.append(entry)
        return entry

    def fact(self, id: str, text: str, **data) -> dict:
        """A statement with no ordering in it (counts of messages, bytes): recorded as said."""
        entry = {"id": id, "kind": "fact", "text": text, **data}
        self.comparisons.append(entry)
        return entry

    def text(self, *ids: str) -> str:
        """The sentences of the comparisons ``ids`` (all, when none is named), joined."""
        chosen = [c for c in self.comparisons if not ids or c["id"] in ids]
        return " ".join(c["text"] for c in chosen)

    def to_dict(self) -> dict:
        return {"version": VERSION, "figure": self.name, "image": self.image, "title": self.title,
                "alt": self.alt, "meta": self.meta, "names": self.names, "aliases": self.aliases,
                "comparisons": self.comparisons, "caption": self.caption or self.text(),
                "table": self.table}

    def save(self, path: Path) -> Path:
        path = Path(path).with_suffix(".json")
        path.write_text(json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        return path


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def compare_line(values: dict[str, float], names: dict[str, str] | None = None, *, where: str = "",
                 baseline: str | None = None) -> str:
    """One sentence from one measurement of each series: the times, and the fastest's margin.

    >>> compare_line({"ring": 0.37, "pipelined_ring": 0.81}, where="at 16 MiB")
    'At 16 MiB: ring 370 ms, pipelined ring 810 ms; ring ran 2.19× as fast as pipelined ring.'
    """
    names = names or {}
    call = lambda k: names.get(k, k.replace("_", " "))   # noqa: E731
    order = sorted(values, key=lambda k: values[k])
    times = ", ".join(f"{call(k)} {human(values[k])}" for k in values)
    head = f"{_cap(where)}: " if where else ""
    if len(order) < 2:
        return f"{head}{times}."
    best, other = order[0], (baseline if baseline and baseline != order[0] else order[1])
    ratio = values[other] / values[best] if values[best] > 0 else float("inf")
    return f"{head}{times}; {call(best)} ran {ratio:.2f}× as fast as {call(other)}."


def winners_line(sizes: Sequence[int], winners: Sequence[str], names: dict[str, str] | None = None, *,
                 label: str = "measured") -> str:
    """"Measured, the fastest: the tree from 1 KiB to 64 KiB, the ring from 256 KiB to 64 MiB.\""""
    names = names or {}
    runs: list[list] = []
    for size, who in zip(sizes, winners):
        if runs and runs[-1][0] == who:
            runs[-1][2] = size
        else:
            runs.append([who, size, size])
    parts = []
    for who, lo, hi in runs:
        span = f"at {_size(lo)}" if lo == hi else f"from {_size(lo)} to {_size(hi)}"
        parts.append(f"{names.get(who, who.replace('_', ' '))} {span}")
    if len(runs) == 1:
        return f"{_cap(label)}, the fastest at every size: {names.get(runs[0][0], runs[0][0].replace('_', ' '))}."
    return f"{_cap(label)}, the fastest: " + ", ".join(parts) + "."


def crossover(sizes: Sequence[float], first: Sequence[float], then: Sequence[float]) -> float | None:
    """The size where ``then`` becomes faster than ``first`` and stays so, interpolated on
    log scales between the two sizes around the change; ``None`` if it never does, or does
    from the smallest size on."""
    faster = [b < a for a, b in zip(first, then)]
    if not any(faster) or all(faster):
        return None
    last_slow = max(i for i, f in enumerate(faster) if not f)
    if last_slow + 1 >= len(sizes):
        return None
    i, j = last_slow, last_slow + 1
    d0 = math.log(then[i] / first[i])        # > 0: then slower
    d1 = math.log(then[j] / first[j])        # < 0: then faster
    share = d0 / (d0 - d1) if d0 != d1 else 0.5
    return math.exp(math.log(sizes[i]) + share * (math.log(sizes[j]) - math.log(sizes[i])))


# --------------------------------------------------------------------------- reading

def load(name: str, img: Path | None = None) -> dict | None:
    """The record ``NAME.json`` under ``docs/img`` (or ``img``), or None when there is none."""
    path = Path(img or IMG) / f"{name}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _source_line(record: dict) -> str:
    meta = record.get("meta", {})
    date = str(meta.get("date", ""))[:10]
    versions = f"torch {meta.get('torch', '?')}" + (f", NCCL {meta['nccl']}" if meta.get("nccl") else "")
    return (f"Recorded on a {meta.get('device', 'machine not recorded')}, {versions}, {date}: "
            f"`{meta.get('command', '')}`.")


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
# {{ figure: NAME | COMMAND }}  {{ claim: NAME ID }}  {{ table: NAME }}
_PLACEHOLDER = re.compile(r"\{\{\s*(figure|claim|table):\s*([\w.-]+)\s*(?:\|\s*(.*?)\s*|([\w.-]+)\s*)?\}\}")


def expand(markdown: str, img_url: str = "../img", img: Path | None = None) -> str:
    """Put each record's figure, caption, claims and table into ``markdown``.

    ``{{ figure: NAME | COMMAND }}``: the image, its caption and where it was measured, from
    ``NAME.json``; without a record, one line saying that COMMAND draws it. ``{{ claim: NAME
    ID }}``: that comparison's sentence, or nothing. ``{{ table: NAME }}``: the record's
    table, or nothing. ``{{ if: NAME }} ... {{ end }}``: the text between, only when the
    record exists (a section of takeaways from it); ``{{ unless: NAME }} ... {{ end }}``:
    only when it does not."""
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
            return (f"![{record.get('alt') or record.get('title') or name}]({img_url}/{record['image']})\n\n"
                    f"*{record['caption']}* {_source_line(record)}")
        if record is None:
            return ""
        if kind == "claim":
            for c in record.get("comparisons", []):
                if c["id"] == claim_id:
                    return c["text"]
            return ""
        table = record.get("table")
        if not table:
            return ""
        lines = ["| " + " | ".join(table["head"]) + " |", "|" + "---|" * len(table["head"])]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table["rows"]]
        return "\n".join(lines)
    return _PLACEHOLDER.sub(replace, _CONDITION.sub(condition, markdown))


def placeholders(markdown: str) -> list[tuple[str, str, str | None]]:
    """Every ``{{ kind: NAME ... }}`` in ``markdown``: (kind, name, claim id or None). Names
    and claim ids are letters, digits, ``_``, ``.`` and ``-``."""
    return [(m.group(1), m.group(2), m.group(4)) for m in _PLACEHOLDER.finditer(markdown)]


def record_problems(record: dict) -> list[str]:
    """What a record lacks: the meta fields, its comparisons' sentences."""
    problems = [f"record {record.get('figure')}: meta has no {f!r}" for f in META_FIELDS
                if not record.get("meta", {}).get(f)]
    for c in record.get("comparisons", []):
        if not c.get("text"):
            problems.append(f"record {record.get('figure')}: comparison {c.get('id')!r} has no sentence")
    return problems


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
    text = _PLACEHOLDER.sub(" ", _CONDITION.sub(lambda m: m.group(3), text))   # generated: right by construction
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
