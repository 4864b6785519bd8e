"""Build the course site strictly and open every page in a headless browser.

    .venv/bin/python tools/check_site.py              # build with mkdocs --strict, then check every page
    .venv/bin/python tools/check_site.py --site site  # check a site built already

Each built HTML page is served from 127.0.0.1 (a free port) and opened in headless
Chromium, with no network beyond that server. A page fails on:

* a console error, an uncaught exception, a failed request or an HTTP error status;
* any request that leaves the local server (a web font, a script from a CDN): the site
  must read offline;
* clipping at 1400 px: a code block (or a notebook cell) that scrolls sideways, a table
  wider than its column; math left untypeset;
* claims that are not data: a figure placed without its record, a record without the
  device, versions, date and command, a hand-written sentence that compares what a
  record compares the other way round (:func:`claim_problems`, which runs without a
  browser and is also a test of its own);
* illegible figures: a code name in a table heading broken over two lines, a figure
  that does not enlarge when tapped, a PNG drawn at less than twice its shown size;
* a trace player (``<div class="trace-player">``, docs/javascripts/trace-player.js) that
  does not load, whose first step does not show the recorded inputs, that does not change
  when stepped with the keyboard or played, whose last step is not the all-reduce's
  result recorded with the run, or that is wider than its column at 1400 px or at 400 px
  (each player page is read again at 400 px, and stepped there; one page's first player
  is also driven by real key presses and its play button);
* missing content: a lesson page without the sections every lesson promises
  (objectives, a diagram, the cost, the exercise tasks as a table with difficulty and
  minutes, how to run it with torchrun and ``make grade``, credits, a link to its
  notebook); a notebook page that does not show every cell of its notebook, that shows
  no outputs for cells that print or plot (the site renders the executed copy) or shows a
  traceback, or whose download link is broken; an API page that documents nothing.

Exit status 0 when every page passes. Chromium is Debian's ``/usr/bin/chromium`` unless
``--chromium`` or the ``CHROMIUM`` environment variable names another; it is driven
through Playwright with that executable, so no browser is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urljoin, urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collectives.course.catalog import LESSONS  # noqa: E402
from collectives.course.site import claims, labs, measured, numbers, targets  # noqa: E402

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]

# The sections every lesson page promises (docs/lessons/NN-topic.md), found by heading.
# Each is a regular expression matched against the page's h2/h3 headings, lower-cased:
# "Objectives", "The cost: α and β", "Exercise", "Credits" pass, and so do variants that
# keep the key word ("Learning objectives", "Exercise tasks").
LESSON_SECTIONS = {
    "objectives": r"objective",
    "cost": r"\bcost",
    "exercise": r"exercise|tasks",
    "measured": r"measured",
    "key takeaways": r"takeaway",
    "credits": r"credit",
}
# Pages are read at this size: nothing may be clipped at it (a code block that scrolls
# sideways, a table wider than the text).
VIEWPORT = {"width": 1400, "height": 900}
DIAGRAM_LANGUAGES = {"", "text", "txt", "plain", "none", "ascii"}


class BuildError(RuntimeError):
    """``mkdocs build --strict`` failed; the message carries its output."""


@dataclass
class PageResult:
    path: str                   # the page's URL path, e.g. "lessons/04-ring/"
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


@dataclass
class SiteResult:
    pages: list[PageResult]
    build_seconds: float = 0.0
    browse_seconds: float = 0.0

    @property
    def problems(self) -> list[str]:
        return [f"{p.path or '/'}: {msg}" for p in self.pages for msg in p.problems]

    @property
    def ok(self) -> bool:
        return bool(self.pages) and not self.problems


# --------------------------------------------------------------------------- build

def build(dest: Path) -> float:
    """``mkdocs build --strict`` into ``dest``; return the seconds it took."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(dest),
         "--config-file", str(ROOT / "mkdocs.yml")],
        cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).splitlines()
        warnings = [line for line in output if line.startswith(("WARNING", "ERROR", "Aborted"))]
        shown = warnings if warnings and "Traceback" not in proc.stderr else output[-40:]
        raise BuildError("mkdocs build --strict failed:\n" + "\n".join(shown))
    return time.perf_counter() - start


def find_chromium(explicit: str | None = None) -> str | None:
    """The Chromium executable to use, or None when there is none."""
    for name in ([explicit] if explicit else []) + [os.environ.get("CHROMIUM", "")] + list(CHROMIUM_CANDIDATES):
        if not name:
            continue
        path = shutil.which(name) or (name if os.access(name, os.X_OK) else None)
        if path:
            return path
    return None


# --------------------------------------------------------------------------- serve

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the browser check reports what matters
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # a tab closed while a file was still being sent: not the site's fault
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextmanager
def serve(site: Path):
    """Serve ``site`` on 127.0.0.1 at a port the kernel picks; yield the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="site-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def page_paths(site: Path) -> list[str]:
    """URL paths of every built HTML page: "" for the home page, "setup/", "404.html"."""
    paths = []
    for html in sorted(site.rglob("*.html")):
        rel = html.relative_to(site).as_posix()
        paths.append(rel[: -len("index.html")] if rel.endswith("index.html") else rel)
    return paths


# --------------------------------------------------------------------------- content

# Runs in the page once it has loaded: what a reader sees, as plain data.
_INSPECT = r"""
async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;            // typeset before anything is measured
  }
  const article = document.querySelector("article.md-content__inner") || document.body;
  const outermost = (sel) => [...article.querySelectorAll(sel)]
      .filter(e => !e.parentElement.closest(sel));
  const codeLanguage = (pre) => {
    const holder = pre.closest("[class*=language-]") || pre.querySelector("code[class*=language-]");
    const m = holder && holder.className.match(/language-([\w+-]+)/);
    return m ? m[1] : "";
  };
  return {
    title: (article.querySelector("h1") || {}).textContent || "",
    text: article.innerText,
    textLength: article.innerText.trim().length,
    headings: [...article.querySelectorAll("h2, h3")].map(h => h.textContent.replace("¶", "").trim()),
    pres: [...article.querySelectorAll("pre")].filter(p => !p.closest(".jp-Cell"))
        .map(p => ({lang: codeLanguage(p), lines: p.innerText.trim().split("\n").length})),
    images: [...article.querySelectorAll("img")].map(i => ({src: i.currentSrc || i.src,
        ok: i.complete && i.naturalWidth > 0})),
    tables: [...article.querySelectorAll("table")].map(t => ({
        head: [...t.querySelectorAll("th")].map(th => th.textContent.trim().toLowerCase()),
        text: t.innerText})),
    links: [...article.querySelectorAll("a[href]")].map(a => a.href),
    codeCells: outermost(".jp-CodeCell").map(c => (c.querySelector(".jp-InputArea pre, pre") || {}).textContent || ""),
    markdownCells: outermost(".jp-MarkdownCell").length,
    download: [...article.querySelectorAll(".nb-download a[download]")].map(a => a.href),
    docObjects: article.querySelectorAll(".doc-heading, .doc-object").length,
    // what does not fit its column: a code block that scrolls sideways, a table wider
    // than the text (Material wraps tables in a scrolling div)
    clipped: [...article.querySelectorAll("pre")].filter(p => !p.closest("details:not([open])")).filter(p => {
        const box = p.querySelector(":scope > code") || p;
        return box.clientWidth > 0 && box.scrollWidth > box.clientWidth + 1;   // shown, and scrolls
      }).map(p => (p.closest(".jp-Cell") ? "notebook cell: " : "code block: ")
        + p.innerText.trim().split("\n").reduce((a, b) => a.length >= b.length ? a : b, "").slice(0, 60))
      .concat([...article.querySelectorAll("table")].filter(t => t.offsetParent !== null && !t.closest("details:not([open])")).filter(t => {
        const wrap = t.closest(".md-typeset__scrollwrap") || t.parentElement;
        return t.scrollWidth > wrap.clientWidth + 1 || t.getBoundingClientRect().right
            > article.getBoundingClientRect().right + 1;
      }).map(t => "table: " + (t.querySelector("th, td") || {}).textContent.trim().slice(0, 40))),
    // labs: for each code cell, whether it shows an output (a figure, a table, a printed line)
    cellOutput: outermost(".jp-CodeCell").map(c =>
        [...c.querySelectorAll(".jp-OutputArea-output")].some(o => o.innerText.trim() || o.querySelector("img, svg"))),
    errorOutputs: article.querySelectorAll(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] .ansi-red-fg, .jp-OutputArea-output .traceback").length,
    players: article.querySelectorAll(".trace-player").length,
    // math: every formula typeset by MathJax, none left as \( ... \) text
    math: article.querySelectorAll(".arithmatex").length,
    mathUntypeset: [...article.querySelectorAll(".arithmatex")].filter(m => !m.querySelector("mjx-container")).length,
    // math a reader sees as source: $...$ or \( left in the text (outside code and outputs)
    rawMath: (() => {
      const walk = document.createTreeWalker(article, NodeFilter.SHOW_TEXT), out = [];
      for (let n = walk.nextNode(); n && out.length < 5; n = walk.nextNode()) {
        const p = n.parentElement;
        if (!p || p.closest("pre, code, script, style, mjx-container, .arithmatex, .jp-OutputArea")) continue;
        const m = n.textContent.match(/\$(?=\S)[^$\n]*?\S\$|\$\$|\\\(|\\\[/);
        if (m) out.push(n.textContent.slice(Math.max(0, m.index - 20), m.index + 40).trim());
      }
      return out;
    })(),
  };
}
"""


def _lesson_for(path: str):
    for item in LESSONS:
        if path.rstrip("/") == f"lessons/{item.page.stem}":
            return item
    return None


def _notebook_for(path: str):
    for item in LESSONS:
        if path.rstrip("/") == f"notebooks/{item.notebook.stem}":
            return item
    return None


def check_lesson_page(item, seen: dict, base: str) -> list[str]:
    """The promised sections of a lesson page, from what the browser shows."""
    problems = []
    headings = [h.lower() for h in seen["headings"]]
    for section, pattern in LESSON_SECTIONS.items():
        if not any(re.search(pattern, h) for h in headings):
            problems.append(f"lesson {item.nn}: no section heading for {section!r} "
                            f"(headings: {', '.join(seen['headings']) or 'none'})")
    diagrams = [p for p in seen["pres"] if p["lang"] in DIAGRAM_LANGUAGES and p["lines"] >= 3]
    if not diagrams and not seen["images"]:
        problems.append(f"lesson {item.nn}: no diagram (an image, or a text code block of 3+ lines)")
    task_tables = [t for t in seen["tables"] if "★" in t["text"]]
    if not task_tables:
        problems.append(f"lesson {item.nn}: no exercise task table with difficulty (★)")
    elif not any(any(re.search(r"min|time", h) for h in t["head"]) for t in task_tables):
        problems.append(f"lesson {item.nn}: the task table has no minutes column")
    if ".venv/bin/torchrun --nproc-per-node" not in seen["text"]:
        problems.append(f"lesson {item.nn}: no torchrun command for the exercise")
    if not re.search(rf"make grade LESSON=0?{item.number}\b", seen["text"]):
        problems.append(f"lesson {item.nn}: no 'make grade LESSON={item.nn}' command")
    text = seen["text"].lower()
    if not re.search(r"\bhints?\b", text):
        problems.append(f"lesson {item.nn}: no hints for the tasks (??? tip \"Hints, task by task\")")
    if "check your understanding" not in text:
        problems.append(f"lesson {item.nn}: no 'Check your understanding' questions")
    if not seen["math"]:
        problems.append(f"lesson {item.nn}: no typeset formula (cost formulas are math: $...$)")
    for aim in re.findall(measured.AIMS, seen["text"]):
        problems.append(f"lesson {item.nn}: an aim or target shows ({aim!r}): targets live on the benchmarks page")
    notebook_url = urljoin(base, f"notebooks/{item.notebook.stem}/")
    if not any(link.split("#")[0] == notebook_url for link in seen["links"]):
        problems.append(f"lesson {item.nn}: no link to its lab notebook {item.notebook.name}")
    return problems


def _shows_output(source: str) -> bool:
    """Whether a cell is expected to show something: it prints, displays or plots, or
    ends on an expression. Imports and definitions alone show nothing."""
    lines = [line for line in source.strip().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        return False
    if re.search(r"\b(print|display|plt\.|plots\.)", source):
        return True
    last = lines[-1]
    return not (last[:1].isspace() or re.match(r"(import|from|def|class|return|for|if|with|%)\b|\w+\s*=[^=]", last))


def _visible(output: dict) -> bool:
    """Whether a cell output of an executed notebook shows something on a page."""
    if output.get("output_type") == "stream":
        return bool("".join(output.get("text", "")).strip())
    return output.get("output_type") in ("display_data", "execute_result", "error")


def check_notebook_page(item, seen: dict, fetch) -> list[str]:
    """Every cell of the notebook is on its page, and the download link works."""
    problems = []
    if not item.notebook.exists():
        return [f"notebook {item.notebook.name} is not in the repository"]
    cells = json.loads(item.notebook.read_text(encoding="utf-8"))["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    markdown = [c for c in cells if c["cell_type"] == "markdown"]
    if len(seen["codeCells"]) != len(code):
        problems.append(f"shows {len(seen['codeCells'])} code cells, the notebook has {len(code)}")
    else:
        for i, (cell, shown) in enumerate(zip(code, seen["codeCells"])):
            source = "".join(cell["source"]).strip()
            first = source.splitlines()[0].strip() if source else ""
            if first and first not in shown:
                problems.append(f"code cell {i + 1} does not show its source (expected {first[:40]!r})")
                break
    # Each lab shows a real run: every code cell that printed or drew something when the
    # notebook was executed (the copy the build renders, collectives.course.site.labs) shows it,
    # and none shows a traceback. Without an executed copy, every cell that looks as if it
    # prints must show something.
    shown = seen["cellOutput"]
    executed = labs.cached_path(item.notebook)
    if executed.exists():
        run = [c for c in json.loads(executed.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
        expected = [i for i, c in enumerate(run) if any(_visible(o) for o in c.get("outputs", []))]
        what = "printed or drew something when the lab was run"
    else:
        expected = [i for i, c in enumerate(code) if _shows_output("".join(c["source"]))]
        what = "look as if they print"
    missing = [i + 1 for i in expected if i < len(shown) and not shown[i]]
    if missing:
        problems.append(f"code cells {missing} {what}, and show no output on the page: is it rendered "
                        "from the executed copy?")
    if seen["errorOutputs"]:
        problems.append("shows a traceback in its outputs")
    if seen["markdownCells"] != len(markdown):
        problems.append(f"shows {seen['markdownCells']} markdown cells, the notebook has {len(markdown)}")
    if not seen["download"]:
        problems.append("no download link for the notebook")
    for url in seen["download"]:
        status, body = fetch(url)
        try:
            ok = status == 200 and json.loads(body).get("cells") is not None
        except ValueError:
            ok = False
        if not ok:
            problems.append(f"download link {url} does not return the notebook (HTTP {status})")
    return problems


# --------------------------------------------------------------------------- legibility

# Runs in the page once it has loaded: what a reader on a phone or a wide screen cannot read.
_INSPECT_LEGIBILITY = r"""
() => {
  const article = document.querySelector("article.md-content__inner") || document.body;
  return {
    // a code name in a table heading that the browser broke over two lines
    wrappedHeadCode: [...article.querySelectorAll("th code")]
        .filter(c => c.getClientRects().length > 1).map(c => c.textContent.trim()),
    // every figure can be tapped to see it large (docs/javascripts/lightbox.js marks them)
    images: [...article.querySelectorAll("img")].filter(i => i.offsetParent !== null).map(i => ({
        src: i.currentSrc || i.src, zoom: i.dataset.zoom === "1", shown: i.clientWidth,
        natural: i.naturalWidth, png: /\.png($|\?)/.test(i.currentSrc || i.src),
        inCell: !!i.closest(".jp-OutputArea-output")})),
  };
}
"""


def check_legibility(seen: dict) -> list[str]:
    """Problems a reader would have with what :data:`_INSPECT_LEGIBILITY` saw."""
    problems = [f"table heading breaks the name {name!r} over two lines (th code must not wrap)"
                for name in seen["wrappedHeadCode"]]
    for img in seen["images"]:
        name = img["src"].rsplit("/", 1)[-1]
        if not img["zoom"]:
            problems.append(f"figure {name} does not enlarge when tapped (lightbox.js)")
        if img["png"] and not img["inCell"] and img["shown"] and img["natural"] < 1.5 * img["shown"]:
            problems.append(f"figure {name} is a PNG of {img['natural']} px shown at {img['shown']} px: "
                            "draw it as SVG (plots.save) or at twice its size")
    return problems


# --------------------------------------------------------------------------- a claim is data

# Lessons whose pages, labs and figures are being rewritten now: the word budget, the rule
# that every figure on a lesson page has a record and the one way to write commands hold
# them once they leave this set. One edit brings a lesson in.
LESSONS_PENDING_REWRITE: tuple[int, ...] = ()
# The words a student reads on a lesson page with every collapsed block closed (the
# teaching core: objectives, picture, algorithm, cost, exercise, takeaways).
WORD_BUDGET = {"default": 2500}
DOCS = ROOT / "docs"


def _collapsed_and_code_removed(markdown: str) -> str:
    """``markdown`` without fenced code, HTML comments, placeholders, and the bodies of
    collapsed blocks (``??? note``: closed until the reader opens them)."""
    text = re.sub(r"<!--.*?-->", " ", markdown, flags=re.S)
    out, skip_indent, fence = [], None, None
    for line in text.splitlines():
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            continue
        if skip_indent is not None:
            if not stripped or indent > skip_indent:
                continue
            skip_indent = None
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            continue
        if re.match(r"\?\?\?\+?\s", stripped) and not stripped.startswith("???+"):
            skip_indent = indent
            continue
        out.append(line)
    return claims._PLACEHOLDER.sub(" ", "\n".join(out))


def teaching_words(markdown: str) -> int:
    """Words a student reads on a page with every collapsed block closed: prose, tables,
    open notes and headings; not code blocks, link targets, or what is collapsed."""
    text = _collapsed_and_code_removed(markdown)
    text = re.sub(r"\]\([^)]*\)", "]", text)                 # link targets
    text = re.sub(r"\{[^}]*\}", " ", text)                    # attribute lists
    return sum(1 for token in text.split() if re.search(r"[A-Za-z0-9]", token))


def _lesson_number(path: Path) -> int | None:
    m = re.match(r"(\d\d)[-_]", path.name)
    return int(m.group(1)) if m else None


def _records(img: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(img.glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            out[path.stem] = {"figure": path.stem, "broken": str(exc)}
    return out


def _sections(markdown: str) -> list[str]:
    return re.split(r"\n(?=#{1,3} )", markdown)


def claim_problems(docs: Path = DOCS, notebooks: Path | None = None) -> list[str]:
    """A claim is data: every figure with its record, every record complete, and no
    hand-written sentence comparing what a record compares the other way round.

    * a record (``docs/img/NAME.json``) names its device, versions, date and command, and
      its image exists;
    * a page places a recorded figure with ``{{ figure: NAME | COMMAND }}`` (the caption
      comes from the record), names records that exist or say which command draws them,
      and asks only for comparisons its records have;
    * every figure on a lesson page has a record (lessons in :data:`LESSONS_PENDING_REWRITE`
      excepted);
    * the sentences of a page's sections that show a record, and every markdown cell of a
      lab, agree with the records they show or their lesson's records
      (:func:`collectives.course.site.claims.contradictions`).
    """
    img = docs / "img"
    notebooks = notebooks or ROOT / "notebooks"
    records = _records(img)
    problems = []
    for name, record in records.items():
        if "broken" in record:
            problems.append(f"img/{name}.json is not JSON: {record['broken']}")
            continue
        problems += [f"img/{name}.json: {p}" for p in claims.record_problems(record)]
        if record.get("image") and not (img / record["image"]).exists():
            problems.append(f"img/{name}.json: its image {record['image']} is missing")
    for page in sorted(docs.rglob("*.md")):
        rel = page.relative_to(docs).as_posix()
        if rel.startswith(("snippets/", "reference/")):
            continue
        markdown = re.sub(r"^( *)(```|~~~).*?^\1\2[ \t]*$|`[^`\n]+`", " ", page.read_text(encoding="utf-8"),
                          flags=re.S | re.M)              # code shows placeholders, it does not use them
        lesson = _lesson_number(page) if rel.startswith("lessons/") else None
        understood = claims._PLACEHOLDER.sub("", re.sub(r"\{\{\s*(if|unless|records):\s*[\w.-]+\s*\}\}|\{\{\s*end\s*\}\}",
                                                       "", markdown))
        if rel == "benchmarks.md":          # targets and their status live there alone (site.targets)
            understood = targets.PLACEHOLDER.sub("", understood)
        for stray in re.findall(r"\{\{[^}]*\}\}", understood):
            problems.append(f"{rel}: {stray} is not a placeholder the build understands "
                            "(figure:, claim:, table:, value:, ratio:, records:, if:, unless:, end; target: on "
                            "the benchmarks page; "
                            "names and ids are [\\w.-]+)")
        for kind, name, claim_id in claims.placeholders(markdown):
            record = records.get(name)
            if kind in ("figure", "claim") and claim_id and " " in claim_id:
                problems.append(f"{rel}: {{{{ {kind}: {name} {claim_id} }}}} is not a placeholder the build "
                                "understands (ids are [\\w.-]+, without spaces)")
                continue
            if kind in ("table", "value", "ratio") and record is not None:
                try:
                    words = (claim_id or "").split()
                    shown = (claims.expand(f"{{{{ {kind}: {name} {claim_id or ''} }}}}",
                                           img=img) if kind != "table" or words else "x")
                    if not shown.strip():
                        problems.append(f"{rel}: {{{{ table: {name} {claim_id} }}}} shows nothing: "
                                        "no such comparison of times or sweep in the record")
                except (ValueError, KeyError, IndexError, ZeroDivisionError) as exc:
                    problems.append(f"{rel}: {{{{ {kind}: {name} {claim_id} }}}}: {exc}")
            if kind == "figure" and not re.search(r"\{\{\s*figure:\s*" + re.escape(name) + r"\s*\|", markdown):
                problems.append(f"{rel}: {{{{ figure: {name} }}}} does not name the command that draws it "
                                f"({{{{ figure: {name} | COMMAND }}}})")
            if record is None:
                continue
            if kind == "claim" and not any(c.get("id") == claim_id for c in record.get("comparisons", [])):
                problems.append(f"{rel}: record {name} has no comparison {claim_id!r}")
        for m in re.finditer(r"!\[[^\]]*\]\((?:\.\./)?img/([\w.-]+)\.(svg|png)\)", markdown):
            stem = m.group(1)
            if stem in records:
                problems.append(f"{rel}: img/{stem} has a record; place it with "
                                f"{{{{ figure: {stem} | COMMAND }}}} so its caption comes from the record")
            elif lesson is not None and lesson not in LESSONS_PENDING_REWRITE:
                problems.append(f"{rel}: img/{m.group(1)}.{m.group(2)} has no record: draw it with a script "
                                "that writes one (plots.save(fig, path, record))")
        for section in _sections(markdown):
            shown = [records[n] for _, n, _ in claims.placeholders(section) if n in records]
            shown += [records[s] for s in re.findall(r"img/([\w.-]+)\.(?:svg|png)", section) if s in records]
            problems += [f"{rel}: {p}" for p in claims.contradictions(section, shown)]
    for notebook in sorted(notebooks.glob("*.ipynb")):
        number = _lesson_number(notebook)
        mine = [r for n, r in records.items() if number is not None and _lesson_number(Path(n + ".json")) == number
                and "broken" not in r]
        if not mine:
            continue
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "markdown":
                problems += [f"notebooks/{notebook.name}, cell {i + 1}: {p}"
                             for p in claims.contradictions("".join(cell["source"]), mine)]
    return problems


def measured_problems(docs: Path = DOCS) -> list[str]:
    """Every lesson page's **Measured** section: one compact table per record, at most one
    figure, a paragraph of at most three numbers, no aims (:mod:`collectives.course.site.measured`)."""
    problems = []
    for item in LESSONS:
        page = docs / "lessons" / item.page.name
        if page.exists() and item.number not in LESSONS_PENDING_REWRITE:
            problems += [f"lessons/{page.name}: {p}" for p in
                         measured.problems(page.read_text(encoding="utf-8"), docs / "img", f"lessons/{page.name}")]
    return problems


# Programs that run in the course's virtual environment: a page writes them as
# .venv/bin/NAME so that one copied line works in a fresh checkout (or make TARGET).
VENV_PROGRAMS = ("python", "python3", "torchrun", "pytest", "mkdocs", "jupyter", "pip", "ruff")
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "text"}


def _command_program(line: str) -> str | None:
    """The program a shell line runs, past ``sudo`` and ``VAR=value`` (None for a comment)."""
    words = line.strip().lstrip("$ ").split()
    while words and (words[0] == "sudo" or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0])):
        words = words[1:]
    if not words or words[0].startswith("#"):
        return None
    return words[0]


def table_problems(markdown: str) -> list[str]:
    """Table rows indented unlike the row above: Markdown then reads them as one paragraph
    of pipes (a header left at the margin over rows moved into a note, or the other way)."""
    problems = []
    lines = markdown.splitlines()
    for number, (above, line) in enumerate(zip(lines, lines[1:]), start=2):
        if above.lstrip().startswith("|") and line.lstrip().startswith("|"):
            if len(above) - len(above.lstrip()) != len(line) - len(line.lstrip()):
                problems.append(f"line {number}: a table row indented unlike the row above ({line.strip()[:40]!r})")
    return problems


def command_problems(markdown: str) -> list[str]:
    """Commands written another way than ``.venv/bin/python ...``, ``.venv/bin/torchrun
    ...`` or ``make ...``: in shell code blocks and in inline code."""
    problems = []
    for lang, body in re.findall(r"^\s*```(\w*)[^\n]*\n(.*?)^\s*```", markdown, flags=re.S | re.M):
        if lang.lower() not in SHELL_LANGUAGES:
            continue
        for line in body.splitlines():
            program = _command_program(line)
            if program in VENV_PROGRAMS and not re.match(r"\s*python3? -m venv\b", line):   # making the venv
                problems.append(f"command {line.strip()[:70]!r}: write .venv/bin/{program}")
    prose = re.sub(r"^\s*```.*?^\s*```", " ", markdown, flags=re.S | re.M)
    for span in re.findall(r"`([^`\n]+)`", prose):
        program = _command_program(span)
        if program in VENV_PROGRAMS and len(span.split()) > 1:
            problems.append(f"command `{span[:70]}`: write .venv/bin/{program}")
    return problems


# --------------------------------------------------------------------------- browse

class _Tab:
    """One browser tab that checks page after page; its listeners report to ``result``.

    Reusing a tab (one per worker) keeps one renderer process per worker instead of one
    per page, which is most of the cost on a small machine.
    """

    def __init__(self, page, base: str, driven: dict | None = None):
        self.page, self.base = page, base
        self.driven = {"done": False} if driven is None else driven   # shared by the tabs: see check_players
        self.result = PageResult("")
        page.on("console", self._on_console)
        page.on("pageerror", lambda exc: self.result.problems.append(f"uncaught exception: {exc}"))
        page.on("request", self._on_request)
        page.on("requestfailed", self._on_failed)
        page.on("response", self._on_response)

    def _on_console(self, msg):
        if msg.type == "error" and "ERR_BLOCKED_BY_CLIENT" not in msg.text:  # blocked: see _on_request
            where = msg.location.get("url", "") if msg.location else ""
            self.result.problems.append(f"console error: {msg.text}" + (f" ({where})" if where else ""))

    def _on_request(self, req):
        if urlparse(req.url).scheme in ("http", "https") and not req.url.startswith(self.base):
            self.result.problems.append(f"request leaves the local server: {req.url}")

    def _on_failed(self, req):
        # Requests to the outside were blocked by us and named already; ERR_ABORTED is a
        # load the previous page still had running when the tab moved on (a missing file
        # is an HTTP 404, reported by _on_response).
        if req.url.startswith(self.base) and "ERR_ABORTED" not in (req.failure or ""):
            self.result.problems.append(f"request failed: {req.url} ({req.failure})")

    def _on_response(self, resp):
        if resp.status >= 400:
            self.result.problems.append(f"HTTP {resp.status}: {resp.url}")

    async def check(self, path: str, settle_ms: int) -> PageResult:
        from playwright.async_api import Error as PlaywrightError

        result = self.result = PageResult(path)
        start = time.perf_counter()
        try:
            response = await self.page.goto(self.base + path, wait_until="load", timeout=20_000)
            if response is None or response.status != 200:
                result.problems.append(f"page answered HTTP {response.status if response else '-'}")
            await self.page.wait_for_timeout(settle_ms)  # late scripts (search worker) report too
            seen = await self.page.evaluate(_INSPECT)
        except PlaywrightError as exc:
            result.problems.append(f"could not load: {str(exc).splitlines()[0]}")
            result.seconds = time.perf_counter() - start
            return result
        result.problems += await _check_content(self.page.context, self.base, path, seen)
        result.problems += check_legibility(await self.page.evaluate(_INSPECT_LEGIBILITY))
        if seen["players"]:
            drive, self.driven["done"] = not self.driven["done"], True
            try:
                result.problems += await check_players(self.page, drive=drive)
            except PlaywrightError as exc:
                result.problems.append(f"trace player: {str(exc).splitlines()[0]}")
            finally:
                await self.page.set_viewport_size(VIEWPORT)
        result.seconds = time.perf_counter() - start
        return result


# --------------------------------------------------------------------------- trace players

NARROW = {"width": 400, "height": 900}

# In the page, for every trace player and every run of its menu: the recorded file, and what
# the player shows at the start, after the → key, after End and after Home (each rank's
# cells, as data-bits). One call for the whole page: a round trip to the browser is the cost.
_PLAYERS_WALK = r"""
async () => {
  const article = document.querySelector("article.md-content__inner") || document.body;
  const shows = (root) => {
    const box = root.getBoundingClientRect();
    return {
      state: root.dataset.state || "", step: Number(root.dataset.step),
      rows: [...root.querySelectorAll(".tp-cells[data-rank]")].map(row =>
          [...row.querySelectorAll(".tp-cell")].map(c => Number(c.dataset.bits))),
      messages: (root.querySelector(".tp-messages") || {}).innerText || "",
      wide: root.scrollWidth > root.clientWidth + 1
          || box.right > Math.min(window.innerWidth, article.getBoundingClientRect().right) + 1,
    };
  };
  const key = (root, k) => root.dispatchEvent(new KeyboardEvent("keydown", {key: k, bubbles: true}));
  const ready = (root, name) => new Promise((resolve, reject) => {
    const until = Date.now() + 10000;
    const poll = () => (root.dataset.current === name && root.dataset.state === "ready") ? resolve()
        : Date.now() > until ? reject(new Error("the menu did not load " + name)) : setTimeout(poll, 20);
    poll();
  });
  const out = [];
  for (const [i, root] of [...document.querySelectorAll(".trace-player")].entries()) {
    const names = (root.dataset.trace || "").split(/\s+/).filter(Boolean);
    if (root.dataset.state !== "ready") { out.push({i, names, loaded: false}); continue; }
    for (const [j, name] of names.entries()) {
      if (j > 0) {
        const menu = root.querySelector("select");
        menu.value = name;
        menu.dispatchEvent(new Event("change"));
        await ready(root, name);
      }
      const doc = await (await fetch(root.dataset.base + name + ".player.json")).json();
      const start = shows(root);
      key(root, "ArrowRight");
      const one = shows(root);
      key(root, "End");
      const end = shows(root);
      key(root, "Home");
      out.push({i, name, loaded: true, start, one, end, home: shows(root),
                doc: {start: doc.start, expected: doc.expected, steps: doc.steps.length}});
    }
  }
  return out;
}
"""
_ALL_LOADED = """() => [...document.querySelectorAll(".trace-player")]
    .every(p => p.dataset.state === "ready" || p.dataset.state === "error")"""
_FIRST = "() => { const p = document.querySelector('.trace-player'); " \
         "return {step: Number(p.dataset.step), playing: p.dataset.playing === 'true'}; }"


def _player_findings(run: dict) -> list[str]:
    """What is wrong with one recorded run as its player showed it."""
    where = f"trace player {run['i'] + 1} ({run['name']})"
    doc, problems = run["doc"], []
    if run["start"]["rows"] != doc["start"]:
        problems.append(f"{where}: the first step does not show the recorded inputs")
    one = run["one"]
    if one["step"] != 1 or (one["rows"] == run["start"]["rows"] and one["messages"] == run["start"]["messages"]):
        problems.append(f"{where}: the → key did not move it one step on (step {one['step']})")
    if run["end"]["step"] != doc["steps"]:
        problems.append(f"{where}: End went to step {run['end']['step']}, not {doc['steps']}")
    if run["end"]["rows"] != doc["expected"]:
        problems.append(f"{where}: the last step is not the all-reduce's result recorded with the run")
    if run["home"]["step"] != 0:
        problems.append(f"{where}: Home did not go back to the start")
    if run["start"]["wide"]:
        problems.append(f"{where}: wider than its column at {VIEWPORT['width']} px")
    return problems


async def _player_plays(page, root) -> list[str]:
    """The first player, as a reader drives it: a real key press, the play and pause button."""
    problems = []
    await root.press("ArrowRight")
    if (await page.evaluate(_FIRST))["step"] != 1:
        problems.append("trace player 1: a key press (→) does not step it")
    button = root.locator(".tp-play")
    await root.evaluate("p => { p.dataset.interval = '10000'; }")
    await button.click()
    if not (await page.evaluate(_FIRST))["playing"]:
        problems.append("trace player 1: the play button does not start it")
    await button.click()
    if (await page.evaluate(_FIRST))["playing"]:
        problems.append("trace player 1: the button does not pause it")
    await root.evaluate("p => { p.dataset.interval = '30'; }")
    await button.click()
    try:
        await page.wait_for_function(
            "() => { const p = document.querySelector('.trace-player'), s = p.querySelector('.tp-slider');"
            " return p.dataset.playing === 'false' && s.value === s.max; }", timeout=5_000)
    except Exception:   # noqa: BLE001 - a timeout is the finding
        problems.append("trace player 1: playing does not run to the last step and stop there")
    await root.press("Home")
    return problems


async def check_players(page, drive: bool = True) -> list[str]:
    """Every trace player on the page, every run of its menu; then again at 400 px. With
    ``drive``, the first player is also driven as a reader drives it (real key presses, the
    play button): the same script runs every player, so the site check drives one page's."""
    await page.wait_for_function(_ALL_LOADED, timeout=10_000)
    problems = []
    for run in await page.evaluate(_PLAYERS_WALK):
        if not run["loaded"]:
            problems.append(f"trace player {run['i'] + 1} ({' '.join(run['names'])}): did not load")
        else:
            problems += _player_findings(run)
    first = page.locator(".trace-player").first
    if drive:
        problems += await _player_plays(page, first)
    await page.set_viewport_size(NARROW)             # a phone: nothing sticks out, the keys still step
    for run in await page.evaluate(_PLAYERS_WALK):
        if run["loaded"] and run["start"]["wide"]:
            problems.append(f"trace player {run['i'] + 1} ({run['name']}): wider than its column "
                            f"at {NARROW['width']} px")
        elif run["loaded"] and run["one"]["step"] != 1:
            problems.append(f"trace player {run['i'] + 1} ({run['name']}): → does not step it at "
                            f"{NARROW['width']} px")
    if drive:
        await first.press("ArrowRight")
        if (await page.evaluate(_FIRST))["step"] != 1:
            problems.append(f"trace player 1: a key press (→) does not step it at {NARROW['width']} px")
    return list(dict.fromkeys(problems))


async def _check_content(context, base: str, path: str, seen: dict) -> list[str]:
    problems = []
    if not seen["title"].strip() and not path.endswith("404.html"):
        problems.append("no h1 title")
    if seen["textLength"] < 40 and not path.endswith("404.html"):
        problems.append("the page is (nearly) empty")
    for what in seen["clipped"]:
        problems.append(f"wider than its column at {VIEWPORT['width']} px: {what}")
    if seen["mathUntypeset"]:
        problems.append(f"{seen['mathUntypeset']} of {seen['math']} formulas not typeset (MathJax)")
    for raw in seen["rawMath"]:
        problems.append(f"math shown as its source, not typeset: {raw!r}")
    for img in seen["images"]:
        if not img["ok"]:
            problems.append(f"image does not load: {img['src']}")
    if (lesson := _lesson_for(path)) is not None:
        problems += check_lesson_page(lesson, seen, base)
    elif (nb := _notebook_for(path)) is not None:
        fetched = {}
        for url in seen["download"]:
            resp = await context.request.get(url)
            fetched[url] = (resp.status, await resp.text())
        problems += [f"notebook {nb.nn}: {p}" for p in check_notebook_page(nb, seen, fetched.get)]
    elif path.startswith("reference/") and path != "reference/" and seen["docObjects"] == 0:
        problems.append("API page documents nothing (no mkdocstrings object)")
    return problems


async def _browse(base: str, paths: list[str], chromium: str, jobs: int, settle_ms: int) -> list[PageResult]:
    from playwright.async_api import async_playwright

    async def only_local(route):
        # The site must read offline: whatever leaves the local server is blocked here
        # (and reported by the tab that asked for it).
        if route.request.url.startswith(base):
            await route.continue_()
        else:
            await route.abort("blockedbyclient")

    todo = list(paths)
    results: dict[str, PageResult] = {}
    with tempfile.TemporaryDirectory(prefix="check-site-profile-") as profile:
        async with async_playwright() as pw:
            context = await pw.chromium.launch_persistent_context(
                profile, executable_path=chromium, headless=True, args=CHROMIUM_FLAGS,
                service_workers="block", viewport=VIEWPORT)
            try:
                await context.route("**/*", only_local)

                driven = {"done": False}      # one page's first trace player is driven by real input

                async def worker(page):
                    tab = _Tab(page, base, driven)
                    while todo:
                        path = todo.pop(0)
                        results[path] = await tab.check(path, settle_ms)

                pages = list(context.pages[:1])
                while len(pages) < max(1, min(jobs, len(paths))):
                    pages.append(await context.new_page())
                await asyncio.gather(*(worker(p) for p in pages))
            finally:
                await context.close()
    return [results[p] for p in paths]


def browse(site: Path, chromium: str, jobs: int = 4, settle_ms: int = 150) -> list[PageResult]:
    """Open every page of ``site`` in Chromium; return one result per page."""
    paths = page_paths(site)
    with serve(site) as base:
        return asyncio.run(_browse(base, paths, chromium, jobs, settle_ms))


def check(site: Path | None = None, chromium: str | None = None, jobs: int = 4) -> SiteResult:
    """Build (unless ``site`` is given) and browse; raises :class:`BuildError` on a failed build."""
    exe = find_chromium(chromium)
    if exe is None:
        raise FileNotFoundError("no Chromium found (apt-get install chromium, or set CHROMIUM)")
    with tempfile.TemporaryDirectory(prefix="check-site-") as tmp:
        build_seconds = 0.0
        if site is None:
            site = Path(tmp) / "site"
            build_seconds = build(site)
        start = time.perf_counter()
        pages = browse(Path(site), exe, jobs=jobs)
        pages.append(PageResult("(claims and records)", problems=claim_problems()))
        pages.append(PageResult("(hand-written numbers)", problems=numbers.problems()))
        pages.append(PageResult("(measured sections)", problems=measured_problems()))
        return SiteResult(pages, build_seconds, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, help="check this built site instead of building one")
    parser.add_argument("--chromium", help="Chromium executable (default: /usr/bin/chromium)")
    parser.add_argument("--jobs", type=int, default=4, help="pages open at once (default 4)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every page")
    args = parser.parse_args(argv)
    try:
        result = check(args.site, args.chromium, args.jobs)
    except (BuildError, FileNotFoundError) as exc:
        print(exc, file=sys.stderr)
        return 1
    for page in result.pages:
        if args.verbose or page.problems:
            print(f"{'FAIL' if page.problems else 'ok  '} {page.path or '/'} ({page.seconds:.2f} s)")
            for msg in page.problems:
                print(f"     {msg}")
    bad = sum(1 for p in result.pages if p.problems)
    print(f"{len(result.pages)} pages, {bad} with problems; build {result.build_seconds:.1f} s, "
          f"browser {result.browse_seconds:.1f} s")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
