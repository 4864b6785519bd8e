"""mkdocs hooks: labs with their outputs, lesson and lab linked both ways, math served locally.

* **Lab pages show a real run.** Notebooks are stored without outputs. Before
  mkdocs-jupyter renders a notebook page, its source is pointed at the executed copy that
  ``collectives.course.site.labs`` keeps under ``build/executed/`` (the test suite makes it;
  when it is missing or stale the notebook is executed here, once). The download link
  still serves the clean notebook from git.
* **Lesson N, lab N, lesson N + 1.** The nav must list each lesson's page followed at once
  by its lab (checked here against the lesson map, ``collectives.course.catalog``); each
  lesson page gets an "Open the lab" link under its title and each lab a "Back to the
  lesson" link, so nothing needs writing by hand when a lesson is added.
* **MathJax from the package, not a CDN.** ``$...$`` is typeset by MathJax 3, copied into
  the built site from the ``django-static-mathjax`` wheel (a plain copy of MathJax's
  files, no Django needed): the site reads offline.
* **Figures from their records.** ``{{ figure: NAME | COMMAND }}``, ``{{ claim: NAME ID }}``
  and ``{{ table: NAME }}`` on any page become the image, caption, sentence or table that
  ``docs/img/NAME.json`` records (:func:`collectives.course.site.claims.expand`); without a
  record the figure and its claims are absent, and the page names the command that draws it.
* **Lab headings in the sidebar as they are on the page**: a notebook's table of contents
  is rebuilt from the rendered headings, so a heading with code keeps it and links to the
  anchor the page really has.
* **Trace players from real runs.** While the pages are built, every player of
  ``collectives.course.site.trace_player`` is recorded in a subprocess (``.venv/bin/python -m collectives
  trace --players``: small worlds, a few seconds; kept under ``build/trace-players/``, keyed
  on the code, so a rebuild of unchanged code reuses them) and copied to ``traces/`` in the
  site. A page shows one with ``<div class="trace-player" data-trace="ring"></div>``
  (several names: a menu); the build fails on a name that was not recorded, gives the div
  the path to ``traces/``, and links the player's script and stylesheet on that page only.
"""

from __future__ import annotations

import fcntl
import hashlib
import html
import importlib.metadata
import importlib.util
import os
import posixpath
import re
import shutil
import subprocess
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from collectives.course.catalog import LESSONS  # noqa: E402
from collectives.course.site import claims, labs  # noqa: E402

MATHJAX_TARGET = "javascripts/mathjax/tex-svg.js"   # named in mkdocs.yml's extra_javascript


def _lesson_src(item) -> str:
    return f"lessons/{item.page.name}"


def _lab_src(item) -> str:
    return f"notebooks/{item.notebook.name}"


def _nav_files(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [f for value in node.values() for f in _nav_files(value)]
    if isinstance(node, list):
        return [f for value in node for f in _nav_files(value)]
    return []


def nav_problems(nav) -> list[str]:
    """Each lesson in the map whose page exists: its page, then at once its lab."""
    files = _nav_files(nav or [])
    problems = []
    for item in LESSONS:
        if not item.page.exists():
            continue                   # a lesson being written: its page lands with it
        page, lab = _lesson_src(item), _lab_src(item)
        if page not in files:
            problems.append(f"lesson {item.nn}: {page} is not in the nav")
        elif item.notebook.exists() and files[files.index(page) + 1:files.index(page) + 2] != [lab]:
            problems.append(f"lesson {item.nn}: the nav entry after {page} must be its lab {lab}")
    return problems


def nav_titles(node, titles: dict | None = None) -> dict[str, str]:
    """Each page's title in the nav: ``{"lessons/04-ring.md": "Lesson 4: The ring and its rivals"}``."""
    titles = {} if titles is None else titles
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, str):
                titles[value] = key
            else:
                nav_titles(value, titles)
    elif isinstance(node, list):
        for value in node:
            nav_titles(value, titles)
    return titles


_TITLES: dict[str, str] = {}


def on_config(config):
    problems = nav_problems(config.get("nav"))
    if problems:
        raise PluginError("nav: lesson N is followed by lab N (see docs/writing-pages.md):\n  "
                          + "\n  ".join(problems))
    _TITLES.clear()
    _TITLES.update(nav_titles(config.get("nav") or []))
    start_recording_players()
    return config


def link_title(src: str, fallback: str) -> str:
    """What a link to ``src`` says: its title in the nav, so links and nav read alike."""
    return _TITLES.get(src, fallback)


# ---- trace players --------------------------------------------------------------------

PLAYERS_CACHE = ROOT / "build" / "trace-players"
PLAYERS_SITE_DIR = "traces"
PLAYER_TAG = re.compile(r'<div\b[^>]*\bclass="trace-player"[^>]*>')
_players: dict = {"folder": None, "recording": None, "wanted": {}}


def _players_key() -> str:
    """What the recordings depend on: the package's code and torch's version."""
    digest = hashlib.sha256(importlib.metadata.version("torch").encode())
    for path in sorted((ROOT / "collectives").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def start_recording_players() -> None:
    """Record the players for this code in a subprocess that runs while the pages are built
    (small worlds; a few seconds), unless an earlier build of the same code did.

    Two processes may want them at once (the site's build and the trace tests, on two pytest
    workers): the first takes the cache's lock until its recording is in place, the second
    waits for it and then finds the recording done."""
    folder = PLAYERS_CACHE / _players_key()
    _players.update(folder=folder, recording=None, wanted={}, lock=None)
    PLAYERS_CACHE.mkdir(parents=True, exist_ok=True)
    lock = open(PLAYERS_CACHE / ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    if (folder / "done").exists():
        lock.close()
        return
    for old in PLAYERS_CACHE.iterdir():                      # older code's recordings
        if old.name != ".lock":
            shutil.rmtree(old, ignore_errors=True)
    partial = PLAYERS_CACHE / (folder.name + ".partial")
    _players["lock"] = lock
    _players["recording"] = subprocess.Popen(
        [sys.executable, "-m", "collectives", "trace", "--players", str(partial)], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def finish_recording_players() -> Path:
    """Wait for the recording; the folder of players."""
    folder, proc, lock = _players["folder"], _players["recording"], _players.get("lock")
    try:
        if proc is not None:
            output, _ = proc.communicate()
            _players["recording"] = None
            if proc.returncode != 0:
                raise PluginError("recording the trace players failed:\n" + output[-3000:])
            partial = folder.with_name(folder.name + ".partial")
            (partial / "done").write_text(output)
            partial.rename(folder)
    finally:
        if lock is not None:
            lock.close()
            _players["lock"] = None
    return folder


def _relative(page, target: str) -> str:
    """``target`` (a site path) relative to ``page``'s folder."""
    here = posixpath.dirname(page.url.rstrip("/") + "/x") or "."
    return posixpath.relpath(target, here)


def _players_on(content: str, page) -> str:
    """Note the runs each player names (checked once they are recorded); tell it where they are."""
    def fix(match):
        tag = match.group(0)
        names = re.search(r'data-trace="([^"]*)"', tag)
        for name in (names.group(1).split() if names else []) or ["(none given)"]:
            _players["wanted"].setdefault(name, []).append(page.file.src_uri)
        return tag[:-1] + f' data-base="{_relative(page, PLAYERS_SITE_DIR)}/">'
    return PLAYER_TAG.sub(fix, content)


def _copy_players(site_dir: str) -> None:
    folder = finish_recording_players()
    recorded = {p.name[: -len(".player.json")] for p in folder.glob("*.player.json")}
    missing = {name: pages for name, pages in _players["wanted"].items() if name not in recorded}
    if missing:
        raise PluginError("no recorded trace player " + "; ".join(
            f"{name} (on {', '.join(pages)})" for name, pages in missing.items())
            + f"; recorded: {', '.join(sorted(recorded))}")
    traces = Path(site_dir) / PLAYERS_SITE_DIR
    shutil.rmtree(traces, ignore_errors=True)
    shutil.copytree(folder, traces, ignore=shutil.ignore_patterns("done"))


def _by_src():
    lessons = {_lesson_src(item): item for item in LESSONS}
    notebooks = {_lab_src(item): item for item in LESSONS}
    return lessons, notebooks


@event_priority(100)   # before mkdocs-jupyter reads the notebook
def on_pre_page(page, config, files):
    _, notebooks = _by_src()
    item = notebooks.get(page.file.src_uri)
    if item is not None:
        clean = Path(page.file.abs_src_path)
        try:
            copy = labs.executed(clean)
        except Exception as exc:   # a failing lab fails the build, naming the notebook
            raise PluginError(f"{clean.name} does not run top to bottom:\n{exc}") from exc
        page.file.clean_src_path = str(clean)
        page.file.abs_src_path = str(copy)
    return page


def _url(page, target_src: str, files) -> str | None:
    target = files.get_file_from_path(target_src)
    if target is None:
        return None
    return posixpath.relpath(target.url or ".", posixpath.dirname(page.url.rstrip("/") + "/x"))


_CODE = re.compile(r"^( *)(```|~~~).*?^\1\2[ \t]*$|`[^`\n]+`", re.S | re.M)


def expand_records(markdown: str, img_url: str) -> str:
    """:func:`collectives.course.site.claims.expand` on the page's prose; code blocks and code
    spans are left as written (a page about placeholders shows them, it does not fill them)."""
    kept: list[str] = []

    def hide(m: re.Match) -> str:
        kept.append(m.group(0))
        return f"\x00{len(kept) - 1}\x00"
    prose = claims.expand(_CODE.sub(hide, markdown), img_url=img_url)
    return re.sub(r"\x00(\d+)\x00", lambda m: kept[int(m.group(1))], prose)


def on_page_markdown(markdown: str, page, config, files) -> str:
    img_url = posixpath.relpath("img", posixpath.dirname(page.file.src_uri) or ".")
    markdown = expand_records(markdown, img_url)
    lessons, _ = _by_src()
    item = lessons.get(page.file.src_uri)
    if item is None or not item.notebook.exists():
        return markdown
    lab = f"../notebooks/{item.notebook.name}"
    lab_title = link_title(_lab_src(item), f"Lab {item.number}")
    bar = (f'[Open {lab_title} →]({lab}){{ .md-button .md-button--primary }} '
           f'*The lab runs this lesson\'s code and shows what it measures.*\n')
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("# "):
            lines.insert(i + 1, "\n" + bar)
            break
    else:
        lines.insert(0, bar)
    tail = (f"\n\n---\n\n[Open {lab_title} →]({lab}){{ .md-button .md-button--primary }}\n")
    return "\n".join(lines) + tail


# A lab's markdown reaches the page through nbconvert, which leaves $...$ as text; the site's
# MathJax typesets only what arithmatex marks (docs/javascripts/mathjax-config.js).
_VERBATIM = re.compile(r"(<(pre|code|script|style|textarea)\b.*?</\2>)", re.S | re.I)
_DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.S)
_INLINE_MATH = re.compile(r"(?<![\\$\w])\$(?=\S)([^$\n]+?)(?<=\S)\$(?![\w$])")


def lab_math(content: str) -> str:
    """``$...$`` and ``$$...$$`` in a rendered notebook's text (never in code, output or
    scripts) marked for MathJax as arithmatex marks a page's math."""
    def text(part: str) -> str:
        part = _DISPLAY_MATH.sub(lambda m: f'<span class="arithmatex">\\[{m.group(1)}\\]</span>', part)
        return _INLINE_MATH.sub(lambda m: f'<span class="arithmatex">\\({m.group(1)}\\)</span>', part)
    out = []
    for i, chunk in enumerate(_VERBATIM.split(content)):
        if i % 3 == 2:            # the group's tag name
            continue
        if i % 3 == 1:            # <pre>, <code>, <script>...: as they are
            out.append(chunk)
            continue
        out += [p if p.startswith("<") else text(p) for p in re.split(r"(<[^>]*>)", chunk)]
    return "".join(out)


def on_page_content(content: str, page, config, files) -> str:
    if 'class="trace-player"' in content:
        content = _players_on(content, page)
    _, notebooks = _by_src()
    item = notebooks.get(page.file.src_uri)
    if item is None:
        return content
    content = lab_math(content)
    # rendered from the executed copy: from here on the page's file is the clean notebook
    # again, which mkdocs-jupyter copies beside the page for download
    page.file.abs_src_path = getattr(page.file, "clean_src_path", page.file.abs_src_path)
    name = posixpath.basename(page.file.src_uri)
    back = _url(page, _lesson_src(item), files)
    lesson_title = link_title(_lesson_src(item), f"Lesson {item.number}: {item.title}")
    _toc_from_headings(page, content)
    links = []
    if back:
        links.append(f'<a class="md-button" href="{html.escape(back)}">← Back to '
                     f'{html.escape(lesson_title)}</a>')
    links.append(f'<a href="{html.escape(name)}" download>Download {html.escape(name)}</a> '
                 "(stored without outputs) and run it with Jupyter from the "
                 "<code>notebooks/</code> folder of your checkout. The outputs below are "
                 "from a run made when this site was built.")
    top = f'<p class="nb-download">{" ".join(links)}</p>\n'
    bottom = ""
    if back:
        bottom = (f'<hr><p class="nb-back"><a class="md-button" href="{html.escape(back)}">'
                  f"← Back to {html.escape(lesson_title)}</a></p>\n")
    return top + content + bottom


_HEADING = re.compile(r"<h([1-6])[^>]*\bid=\"([^\"]+)\"[^>]*>(.*?)</h\1>", re.S)


def heading_anchors(content: str) -> list[tuple[int, str, str]]:
    """(level, id, text) of each heading of rendered HTML, code kept as text, the ¶ link dropped."""
    found = []
    for level, anchor, inner in _HEADING.findall(content):
        inner = re.sub(r'<a class="anchor-link"[^>]*>.*?</a>|<a class="headerlink"[^>]*>.*?</a>', "", inner, flags=re.S)
        text = html.unescape(re.sub(r"<[^>]+>", "", inner)).replace("¶", "").strip()
        found.append((int(level), anchor, text))
    return found


def _toc_from_headings(page, content: str) -> None:
    """A notebook page's sidebar entries from its rendered headings, in order: mkdocs-jupyter
    builds them from the Markdown, where a heading's code is dropped from the text and its
    anchor differs from the one nbconvert writes."""
    headings = heading_anchors(content)
    items = []

    def walk(nodes):
        for node in nodes:
            items.append(node)
            walk(getattr(node, "children", []))
    walk(list(page.toc or []))
    if len(items) != len(headings):
        headings = [h for h in headings if h[0] > 1]       # the notebook's h1 is the nav's title
    if len(items) != len(headings):
        return                                             # not the same headings: leave them be
    for item, (_, anchor, text) in zip(items, headings):
        item.id, item.title = anchor, text


def on_post_page(output: str, page, config) -> str:
    if 'class="trace-player"' in output:     # the player's script and style, on its pages only
        root = _relative(page, ".")
        output = output.replace("</head>", f'<link rel="stylesheet" href="{root}/stylesheets/trace-player.css">\n'
                                "</head>", 1)
        output = output.replace("</body>", f'<script src="{root}/javascripts/trace-player.js" defer></script>\n'
                                "</body>", 1)
    # MathJax (2 MB) only where there is math to typeset: most API pages have none.
    if 'class="arithmatex"' in output:
        return output
    return re.sub(r'<script src="[^"]*javascripts/(mathjax-config\.js|mathjax/tex-svg\.js)"></script>\s*',
                  "", output)


def _mathjax_source() -> Path | None:
    spec = importlib.util.find_spec("mathjax")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "static" / "mathjax" / "es5" / "tex-svg.js"
        if candidate.exists():
            return candidate
    return None


def on_post_build(config):
    source = _mathjax_source()
    if source is None:
        raise PluginError("MathJax not found: pip install django-static-mathjax "
                          "(it is in the docs extra of pyproject.toml)")
    target = Path(config["site_dir"]) / MATHJAX_TARGET
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    if _players["folder"] is not None:
        _copy_players(config["site_dir"])
