"""The shape of a lesson's **Measured** section: tables, at most one figure, a short paragraph.

A student reads what was measured as one compact table per record (placed with ``{{ table:
NAME }}`` or ``{{ table: NAME ID }}``, :mod:`collectives.course.site.tables`: cells are the
record's values, and the caption names the hardware, the load and the command), at most one
chart, and a paragraph that quotes at most three numbers, each once, to make the point worth
remembering. A generated sentence per comparison (``{{ claim: }}``) is what the tables are
for; targets and aims belong on the benchmarks page, beside their status. Collapsed blocks
(``??? note``) hold what a curious reader opens: they are not counted.

:func:`problems` says where a page's section departs from that; the site check runs it on
every lesson page.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import claim_pages, numbers

MAX_NUMBERS = 3          # quoted in the paragraph, each once
MAX_FIGURES = 1
MAX_PROSE_WORDS = 200    # the paragraph(s), tables, captions and collapsed blocks not counted
AIMS = re.compile(r"\(aims?\b|\baims?\s*:|\btargets?\s*:|\bwithin the target\b", re.I)


def section(markdown: str, heading: str = "measured") -> str:
    """The text under the ``## ...`` heading that contains ``heading``, up to the next ``## ``."""
    m = re.search(rf"^## +{heading}\b[^\n]*\n(.*?)(?=^## |\Z)", markdown, re.I | re.M | re.S)
    return m.group(1) if m else ""


def _open_text(markdown: str) -> str:
    """What the reader sees unopened: collapsed blocks and fenced code left out."""
    out, skip, fence = [], None, None
    for line in markdown.splitlines():
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if fence is not None:
            fence = None if stripped.startswith(fence) else fence
            continue
        if skip is not None:
            if not stripped or indent > skip:
                continue
            skip = None
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            continue
        if re.match(r"\?\?\?\s", stripped):
            skip = indent
            continue
        out.append(line)
    return "\n".join(out)


def prose(expanded: str) -> str:
    """The paragraph of an expanded section: tables, figures and their captions taken out."""
    keep = []
    for line in expanded.splitlines():
        s = line.strip()
        if s.startswith("|") or s.startswith("![") or (s.startswith("*") and "Recorded on" in s):
            continue
        if s.startswith("*The figure of this section is drawn by"):
            continue
        keep.append(line)
    return "\n".join(keep)


def quoted(text: str, page: str = "lessons/x.md") -> list[str]:
    """The measured numbers a paragraph quotes: those with a unit of time, rate, ``×`` or ``%``,
    less the settings listed under ``definitions`` in hand-claims.json (a 1 Gbit/s link)."""
    import json
    defs = json.loads(numbers.HAND_CLAIMS.read_text(encoding="utf-8")).get("definitions", [])
    out = []
    for i, line in enumerate(numbers._plain(text).splitlines()):
        for m in numbers.NUMBER.finditer(line):
            if numbers._PRODUCT.match(line, m.start()):
                continue
            if not numbers._definition(defs, numbers.Number(page, i + 1, m.group(0), line, "", "")):
                out.append(m.group(0))
    return out


def problems(markdown: str, img: Path | None = None, page: str = "lessons/x.md") -> list[str]:
    """Where the Measured section of lesson page ``markdown`` (``page``: its path under docs/)
    is not a table, a figure and a paragraph, as the records in ``img`` fill it in."""
    raw = section(markdown)
    if not raw.strip():
        return ["no '## Measured' section"]
    found = []
    shown = _open_text(raw)
    figures = len(re.findall(r"\{\{\s*figure:", shown)) + len(re.findall(r"!\[", shown))
    if figures > MAX_FIGURES:
        found.append(f"Measured shows {figures} figures (at most {MAX_FIGURES}: one chart; "
                     "the others go to the notes or the benchmarks page)")
    if re.search(r"\{\{\s*claim:", shown):
        found.append("Measured places generated sentences ({{ claim: }}): show the record as a table "
                     "({{ table: NAME [ID] }}) and quote at most three numbers ({{ value: }}, {{ ratio: }})")
    expanded = claim_pages.expand(shown, img=img)
    text = prose(expanded)
    said = quoted(text, page)
    if len(said) > MAX_NUMBERS:
        found.append(f"Measured's paragraph quotes {len(said)} numbers ({', '.join(said)}): "
                     f"at most {MAX_NUMBERS}, the ones a student should remember")
    repeated = sorted({q for q in said if said.count(q) > 1})
    if repeated:
        found.append(f"Measured's paragraph quotes {', '.join(repeated)} more than once")
    words = len(re.findall(r"[A-Za-z0-9]\S*", re.sub(r"\{\{.*?\}\}", " ", text)))
    if words > MAX_PROSE_WORDS:
        found.append(f"Measured's paragraph runs to {words} words (at most {MAX_PROSE_WORDS}; "
                     "put the rest in a collapsed note or on the notes page)")
    if re.search(r"\{\{\s*target:", markdown):
        found.append("a {{ target: }} shows on the lesson page: targets live on the benchmarks page")
    for m in AIMS.finditer(claim_pages.expand(markdown, img=img)):
        found.append(f"an aim or target shows on the lesson page ({m.group(0)!r}): targets live on "
                     "the benchmarks page")
    return found
