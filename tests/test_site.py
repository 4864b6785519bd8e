"""The course site: it builds with ``mkdocs build --strict``, and every page works in a browser.

The browser check (``tools/check_site.py``) needs Debian's Chromium. Without it the test
is skipped on a workstation, and fails under CI (``CI`` set), where ``.ci/run`` installs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil

import pytest
import yaml

from collectives.course.catalog import LESSONS, ROOT

from .tools_import import tool

check_site = tool("check_site")    # imported by name: its dataclasses look their module up

REFERENCE = ROOT / "docs" / "reference"


mkdocs_hooks = tool("mkdocs_hooks")
_nav_files = mkdocs_hooks._nav_files   # the walk the build's own nav check uses


class _MkdocsYaml(yaml.SafeLoader):
    """mkdocs.yml as YAML: its ``!ENV`` tags (read by mkdocs at build time) read as None."""


_MkdocsYaml.add_constructor("!ENV", lambda loader, node: None)


def _mkdocs_yml() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_MkdocsYaml)


def test_nav_lists_every_lesson_page_and_notebook():
    # mkdocs.yml has no python-specific tags, so the plain YAML loader reads it.
    nav = _nav_files(_mkdocs_yml()["nav"])
    for item in LESSONS:
        assert f"lessons/{item.page.name}" in nav, f"lesson {item.nn}'s page is not in the nav"
        assert f"notebooks/{item.notebook.name}" in nav, f"lesson {item.nn}'s notebook is not in the nav"


def test_nav_reads_lesson_then_its_lab():
    # "Next" from lesson N is lab N, from lab N lesson N + 1: the hook that fails the
    # build otherwise agrees with the nav as written.
    nav = _mkdocs_yml()["nav"]
    assert mkdocs_hooks.nav_problems(nav) == []
    files = _nav_files(nav)
    swapped = list(files)
    i = swapped.index(f"lessons/{LESSONS[0].page.name}")
    swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
    assert mkdocs_hooks.nav_problems(swapped), "a lab before its lesson must be reported"


def test_notebooks_are_reachable_from_docs():
    # docs/notebooks is a symlink to ../notebooks: the notebooks are built as pages
    # without a second copy in git.
    link = ROOT / "docs" / "notebooks"
    assert link.is_dir() and link.resolve() == (ROOT / "notebooks").resolve(), \
        "docs/notebooks must be a symlink to ../notebooks"


def test_site_and_repository_addresses_come_from_the_build_environment(monkeypatch):
    """SITE_URL fills the sitemap, REPO_URL links the repository; unset, the site is offline."""
    from mkdocs.config import load_config

    monkeypatch.setenv("SITE_URL", "https://example.org/course/")
    monkeypatch.setenv("REPO_URL", "https://example.org/course.git")
    config = load_config(str(ROOT / "mkdocs.yml"))
    assert config["site_url"] == "https://example.org/course/"
    assert config["repo_url"] == "https://example.org/course.git"
    monkeypatch.delenv("SITE_URL")
    monkeypatch.delenv("REPO_URL")
    config = load_config(str(ROOT / "mkdocs.yml"))
    assert not config["site_url"] and not config["repo_url"]


def test_every_module_has_a_reference_page():
    documented = set()
    for page in REFERENCE.glob("*.md"):
        documented |= set(re.findall(r"^::: (collectives(?:\.\w+)*)\s*$", page.read_text(), re.M))
    package = ROOT / "collectives"
    modules = set()
    for path in package.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__" or parts[-1] == "__init__" and len(parts) <= 2:
            continue            # the entry point (cli documents it) and the package itself
        if parts[-1] == "__init__":
            parts = parts[:-1]  # a lesson folder: its package docstring says how to read it
        elif parts[-1].startswith("_"):
            continue
        modules.add(".".join(parts))
    modules -= {"collectives.core", "collectives.course"}   # folders of modules, documented one by one
    missing = sorted(modules - documented)
    assert not missing, f"modules with no '::: module' block under docs/reference/: {missing}"


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    try:
        seconds = check_site.build(site)
    except check_site.BuildError as exc:
        pytest.fail(str(exc), pytrace=False)
    return site, seconds


@pytest.mark.slow
def test_site_builds_strictly(built_site):
    site, seconds = built_site
    for item in LESSONS:
        assert (site / "lessons" / item.page.stem / "index.html").exists()
        assert (site / "notebooks" / item.notebook.stem / "index.html").exists()
        assert (site / "notebooks" / item.notebook.stem / item.notebook.name).exists(), \
            "include_source should copy each notebook beside its page for download"


@pytest.mark.slow
def test_every_page_works_in_a_browser(request):
    chromium = check_site.find_chromium()
    if chromium is None or importlib.util.find_spec("playwright") is None:
        missing = "Chromium" if chromium is None else "the playwright package"
        message = f"{missing} not found: apt-get install chromium (the site check opens every page in it)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must install chromium: {message}", pytrace=False)
        pytest.skip(message)
    site, _ = request.getfixturevalue("built_site")  # built once, shared with the build test
    planted = _plant_a_wrong_player(site)
    raw = _plant_raw_math(site)
    try:
        result = check_site.check(site, chromium)
    finally:
        shutil.rmtree(planted)
        shutil.rmtree(raw)
        (site / "traces" / "wrong_ring.player.json").unlink()
    assert result.pages, "no pages were checked"
    problems = [p for p in result.problems if not p.startswith((f"{planted.name}/", f"{raw.name}/"))]
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)
    # math left as its source and a broken image are caught
    shown = " | ".join(p for p in result.problems if p.startswith(f"{raw.name}/"))
    for what in ("math shown as its source, not typeset", "ring costs $(p-1)", "(x + y", "image does not load"):
        assert what in shown, (what, shown)
    # the check can fail: a player whose last step differs from the run's result is caught
    caught = [p for p in result.problems if p.startswith(f"{planted.name}/")]
    assert caught == [f"{planted.name}/: trace player 1 (wrong_ring): the last step is not the "
                      "all-reduce's result recorded with the run"]


def _plant_raw_math(site):
    """A page whose math reached the reader as source ($...$ and \\(...\\) in its text) and
    whose image is missing: the browser check must report all three."""
    page = site / "raw-math"
    page.mkdir()
    (page / "index.html").write_text(
        '<!doctype html><html><head><meta charset="utf-8"><title>Raw math</title></head><body>'
        '<article class="md-content__inner"><h1>Raw math</h1><p>The naive ring costs $(p-1) \\cdot n$ '
        'bytes per rank.</p><p>Inline \\(x + y\\) left alone.</p><p><code>$HOME</code> is code.</p>'
        '<img src="missing.png" alt="a figure"></article></body></html>')
    return page


def _plant_a_wrong_player(site):
    """A page beside the site's own, with a player of the ring whose last step shows one cell
    wrong (rank 0 missing from an element): the browser check must report it, and only it."""
    traces = site / "traces"
    doc = json.loads((traces / "ring.player.json").read_text())
    doc["steps"][-1]["state"][1][0] ^= 1
    doc["trace"] = "ring.trace.json"
    (traces / "wrong_ring.player.json").write_text(json.dumps(doc))
    page = site / "wrong-player"
    page.mkdir()
    (page / "index.html").write_text(
        '<!doctype html><html><head><meta charset="utf-8"><title>A wrong player</title>'
        '<link rel="stylesheet" href="../stylesheets/trace-player.css"></head><body>'
        '<article class="md-content__inner"><h1>A wrong player</h1><p>This page checks the check: its '
        'player shows a last step that is not the recorded result.</p>'
        '<div class="trace-player" data-trace="wrong_ring" data-base="../traces/"></div></article>'
        '<script src="../javascripts/trace-player.js" defer></script></body></html>')
    return page


# --------------------------------------------------------------------------- a claim is data

def _planted_site(tmp_path, caption: str, meta: dict | None = None, placed: bool = True):
    """A docs folder of one lesson page showing one recorded figure, and no labs."""
    from collectives.course.site import claims

    img = tmp_path / "docs" / "img"
    img.mkdir(parents=True)
    (tmp_path / "docs" / "lessons").mkdir()
    (tmp_path / "notebooks").mkdir()
    record = claims.Record("04-pipelining", names={"ring": "the ring", "pipelined_ring": "the pipelined ring"},
                           aliases={"pipelined_ring": ["pipelining"]},
                           meta=meta if meta is not None else
                           {"command": "tools/lesson04_figures.py", "date": "2026-11-24", "device": "16-core host",
                            "torch": "2.13.0"})
    record.times("timed", {"ring": 0.370, "pipelined_ring": 0.810}, baseline="ring", where="4 Mi float32")
    record.image = "04-pipelining.svg"
    (img / "04-pipelining.svg").write_text("<svg xmlns='http://www.w3.org/2000/svg'/>")
    record.save(img / "04-pipelining.json")
    figure = ("{{ figure: 04-pipelining | .venv/bin/python tools/lesson04_figures.py }}" if placed
              else "![the two timelines](../img/04-pipelining.svg)")
    (tmp_path / "docs" / "lessons" / "04-ring.md").write_text(
        f"# 4. The ring\n\n## Pipelining the ring\n\nText.\n\n{figure}\n\n{caption}\n")
    return check_site.claim_problems(tmp_path / "docs", tmp_path / "notebooks")


def test_the_site_holds_every_claim_to_its_record():
    problems = check_site.claim_problems()
    assert not problems, "\n".join(problems)


def test_a_caption_that_contradicts_its_figures_record_fails_the_check(tmp_path):
    # the finding of the review: the caption said pipelining helps, the figure showed it did not
    problems = _planted_site(tmp_path, "The pipelined ring keeps pieces in flight, so pipelining helps.")
    assert len(problems) == 1 and "pipelining helps" in problems[0] and "2.19× as fast" in problems[0], problems
    assert _planted_site(tmp_path / "b", "The pipelined ring is faster than the ring.")
    assert _planted_site(tmp_path / "c", "The ring loses to the pipelined ring.")
    # what the record says, in other words, passes; so does a sentence that compares nothing
    assert _planted_site(tmp_path / "d", "The ring is faster than the pipelined ring: pipelining does not "
                                         "help here. Its pieces are in flight while it adds.") == []


def test_a_figure_needs_a_complete_record_and_its_placeholder(tmp_path):
    problems = _planted_site(tmp_path, "", meta={"command": "x", "date": "2026-11-24"})
    assert any("meta has no 'device'" in p for p in problems) and any("'torch'" in p for p in problems)
    problems = _planted_site(tmp_path / "b", "", placed=False)
    assert any("place it with {{ figure: 04-pipelining" in p for p in problems), problems
    problems = _planted_site(tmp_path / "c", "{{ claim: 04-pipelining one call }}")   # a space in the id
    assert any("not a placeholder the build understands" in p for p in problems), problems


def test_a_placeholder_becomes_the_records_figure_or_says_what_draws_it(tmp_path):
    from collectives.course.site import claims

    page = "{{ figure: 04-pipelining | .venv/bin/python tools/lesson04_figures.py }}"
    assert "no recorded run is in this build" in claims.expand(page, img=tmp_path)
    _planted_site(tmp_path, "")
    shown = claims.expand(page + "\n\n{{ claim: 04-pipelining timed }}", img=tmp_path / "docs" / "img")
    assert shown.startswith("![") and "(../img/04-pipelining.svg)" in shown
    assert "the ring ran 2.19× as fast as the pipelined ring" in shown
    assert "Recorded on a 16-core host, torch 2.13.0, 2026-11-24: `tools/lesson04_figures.py`." in shown


# --------------------------------------------------------------------------- one sitting

# Every lesson page is read in one sitting: its teaching core (what shows with every
# collapsed block closed) within its budget. Lessons being rewritten are listed, once, in
# check_site.LESSONS_PENDING_REWRITE; taking a lesson out of it brings it under the budget.
@pytest.mark.parametrize("item", LESSONS, ids=lambda item: f"lesson{item.nn}")
def test_lesson_teaching_core_fits_one_sitting(item):
    if item.number in check_site.LESSONS_PENDING_REWRITE:
        pytest.skip(f"lesson {item.number} is in check_site.LESSONS_PENDING_REWRITE")
    budget = check_site.WORD_BUDGET.get(item.page.name, check_site.WORD_BUDGET["default"])
    words = check_site.teaching_words(item.page.read_text(encoding="utf-8"))
    assert words <= budget, (f"{item.page.name}: {words} words with the collapsed blocks closed, over the "
                             f"budget of {budget}: move engineering notes to {item.page.stem}-notes.md")


def test_collapsed_blocks_and_code_are_not_counted():
    page = ("# T\n\nOne two three.\n\n```bash\nnot counted here\n```\n\n??? note \"Notes\"\n"
            "    not counted either\n\n    nor this\n\nFour five.\n\n!!! note \"Open\"\n    six\n")
    assert check_site.teaching_words(page) == 9   # T, One two three, Four five, !!! note "Open", six


def test_every_lesson_page_links_its_notes_page_and_the_nav_lists_it():
    nav = _nav_files(_mkdocs_yml()["nav"])
    for item in LESSONS:
        notes = item.page.with_name(f"{item.page.stem}-notes.md")
        if item.number in check_site.LESSONS_PENDING_REWRITE or not notes.exists():
            continue
        assert f"lessons/{notes.name}" in nav, f"{notes.name} is not in the nav"
        assert f"({notes.name})" in item.page.read_text(encoding="utf-8"), \
            f"{item.page.name} does not link {notes.name}"


def test_every_lessons_notes_page_follows_one_rule_in_the_nav():
    # one rule for every lesson: its notes page, where it has one, is listed under "Engineering
    # notes" and nowhere else, in lesson order (never between a lab and the next lesson)
    nav = _mkdocs_yml()["nav"]
    groups = {next(iter(item)): next(iter(item.values())) for item in nav if isinstance(item, dict)}
    reading = _nav_files(groups["Lessons and labs"])
    notes = _nav_files(groups["Engineering notes"])
    assert not [f for f in reading if f.endswith("-notes.md")], reading
    lesson_notes = [f for f in notes if f.startswith("lessons/")]
    have = [f"lessons/{item.page.stem}-notes.md" for item in LESSONS
            if item.page.with_name(f"{item.page.stem}-notes.md").exists()]
    assert lesson_notes == have, (lesson_notes, have)


# --------------------------------------------------------------------------- one way to write things

def _pages_and_labs():
    """(name, markdown) of every page and every lab's markdown, lessons being rewritten left out."""
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if page.is_relative_to(REFERENCE) or check_site._lesson_number(page) in check_site.LESSONS_PENDING_REWRITE:
            continue
        if page.parent.name == "snippets" or page.parent.name == "lessons" or page.parent == ROOT / "docs":
            yield page.relative_to(ROOT).as_posix(), page.read_text(encoding="utf-8")
    for item in LESSONS:
        if item.notebook.exists() and item.number not in check_site.LESSONS_PENDING_REWRITE:
            cells = json.loads(item.notebook.read_text(encoding="utf-8"))["cells"]
            yield item.notebook.name, "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def test_every_command_on_every_page_is_written_one_way():
    problems = [f"{name}: {p}" for name, text in _pages_and_labs() for p in check_site.command_problems(text)]
    assert not problems, ("write commands as .venv/bin/python ..., .venv/bin/torchrun ... or make ...:\n"
                          + "\n".join(problems))


def test_every_table_on_every_page_is_one_table():
    pages = sorted(p for p in (ROOT / "docs").rglob("*.md") if not p.is_relative_to(REFERENCE))
    problems = [f"{p.relative_to(ROOT)}: {problem}" for p in pages
                for problem in check_site.table_problems(p.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)
    # the benchmarks page's GPU ring table, as it was: header at the margin, rows in a note's indent
    assert check_site.table_problems("| p | ratio |\n    |---|---|\n    | 4 | 0.77 |\n") == [
        "line 2: a table row indented unlike the row above ('|---|---|')"]


def test_the_command_check_catches_the_other_ways():
    text = ("```bash\npython -m collectives bench\nsudo PYTHONPATH=. torchrun --nproc-per-node 2 x.py\n"
            "make test\n.venv/bin/python -m pytest\n# python in a comment\n```\n"
            "Run `python3 tools/gpu_one.py` or `.venv/bin/torchrun --nnodes 2`.\n")
    problems = check_site.command_problems(text)
    assert len(problems) == 3 and [p.split(": write ")[1] for p in problems] == \
        [".venv/bin/python", ".venv/bin/torchrun", ".venv/bin/python3"], problems


def test_lab_titles_and_links_read_like_the_nav():
    titles = mkdocs_hooks.nav_titles(_mkdocs_yml()["nav"])
    for item in LESSONS:
        lesson, lab = titles.get(f"lessons/{item.page.name}"), titles.get(f"notebooks/{item.notebook.name}")
        if lesson is None or lab is None:
            continue
        assert lesson.startswith(f"Lesson {item.number}: ") and lab.startswith(f"Lab {item.number}: ")
        assert lesson.split(": ", 1)[1] == lab.split(": ", 1)[1], f"lesson {item.number} and its lab are named apart"
        if item.number in check_site.LESSONS_PENDING_REWRITE:
            continue
        cells = json.loads(item.notebook.read_text(encoding="utf-8"))["cells"]
        h1 = "".join(cells[0]["source"]).splitlines()[0]
        assert h1 == f"# {lab}", f"{item.notebook.name} opens with {h1!r}, the nav calls it {lab!r}"



def test_lesson_pages_point_at_lab_sections_that_exist():
    for item in LESSONS:
        if item.number in check_site.LESSONS_PENDING_REWRITE or not item.notebook.exists():
            continue
        cells = json.loads(item.notebook.read_text(encoding="utf-8"))["cells"]
        sections = {int(m) for c in cells if c["cell_type"] == "markdown"
                    for m in re.findall(r"^## (\d+)\.", "".join(c["source"]), re.M)}
        for section in re.findall(r"§\s*(\d+) of the lab", item.page.read_text(encoding="utf-8")):
            assert int(section) in sections, f"{item.page.name} points at §{section} of lab {item.number}"


def test_lab_sidebar_is_rebuilt_from_the_rendered_headings():
    content = ('<h1 id="lab-1">Lab 1</h1><h2 id="3-immediates-isend-irecv-wait">3. Immediates: '
               '<code>isend</code>, <code>irecv</code>, <code>wait</code><a class="anchor-link" href="#x">¶</a></h2>')
    assert mkdocs_hooks.heading_anchors(content)[1] == (2, "3-immediates-isend-irecv-wait",
                                                        "3. Immediates: isend, irecv, wait")


# --------------------------------------------------------------------------- measured sections

def test_every_lessons_measured_section_is_tables_a_figure_and_a_paragraph():
    problems = check_site.measured_problems()
    assert not problems, "\n".join(problems)


def test_a_measured_section_of_generated_sentences_aims_or_many_numbers_fails(tmp_path):
    from collectives.course.site import claims, measured

    img = tmp_path / "img"
    img.mkdir()
    record = claims.Record("07-x", names={"flat": "the flat ring", "hier": "the hierarchy"},
                           meta={"command": "tools/x.py", "date": "2026-11-29", "device": "16-core host",
                                 "torch": "2.11.0", "load_average": [0.2, 0.1, 0.1]}, title="Two rings")
    record.times("one", {"flat": 0.8, "hier": 0.5}, baseline="flat", where="64 MiB, 2 × 2")
    record.sweep("sweep", [1 << 20, 4 << 20], {"flat": [0.01, 0.04], "hier": [0.02, 0.03]})
    record.fact("target", "The hierarchy ran at 1.6× the flat ring's speed (aim: at least 2×).")
    record.caption = record.text("one")      # a caption that named the aim would fail too
    record.image = "07-x.svg"
    record.save(img / "07-x.json")
    good = ("## Measured\n\n{{ figure: 07-x | tools/x.py }}\n\n{{ table: 07-x one }}\n\n"
            "The hierarchy took {{ ratio: 07-x one flat hier }} the flat ring's time, "
            "{{ value: 07-x sweep hier 4MiB }} at 4 MiB.\n\n## Key takeaways\n")
    assert measured.problems(good, img) == []
    shown = claims.expand(good, img=img)
    # the table's cells are the record's values, its caption names hardware, load and command
    assert "| The hierarchy | 500 ms | 0.62× |" in shown and "took 0.62× the flat ring's time, 30 ms" in shown
    assert "16-core host under a load average of 0.2, torch 2.11.0, 2026-11-29: `tools/x.py`" in shown
    bad = good.replace("{{ table: 07-x one }}", "{{ claim: 07-x one }} {{ claim: 07-x target }}\n\n"
                       "{{ figure: 07-x | tools/x.py }}\n\nIt took 0.5 s, 0.8 s and 0.3 s, 0.5 s again.")
    found = " | ".join(measured.problems(bad, img))
    for what in ("2 figures", "generated sentences", "quotes 11 numbers", "0.5 s more than once", "aim"):
        assert what in found, (what, found)
    with pytest.raises(ValueError, match="no size 2MiB"):
        claims.expand("{{ value: 07-x sweep hier 2MiB }}", img=img)


# --------------------------------------------------------------------------- figures that read

def test_the_figure_check_finds_overlapping_sticking_out_and_unfitting_labels():
    from collectives.course.site import plots

    fig = plots._figure(4, 2)
    fig.set_layout_engine("none")               # no layout to make room for a label that sticks out
    ax = fig.subplots()
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.5, 0.5)
    ax.barh(0, 0.05, left=0.1, height=0.5)
    ax.text(0.12, 0, "a label wider than its bar", fontsize=9)       # written on a thin bar
    ax.text(0.6, 0.3, "one", fontsize=9)
    ax.text(0.61, 0.3, "two", fontsize=9)                           # on top of "one"
    ax.text(0.95, -0.3, "past the right edge of the figure", fontsize=9)
    found = " | ".join(plots.text_problems(fig))
    for what in ("does not fit in the bar", "'one' overlaps 'two'", "sticks out of the figure"):
        assert what in found, (what, found)
    with pytest.raises(ValueError, match="labels that cannot be read"):
        plots.check_readable(fig)


def test_lesson_10s_timeline_and_lesson_12s_chart_read():
    """The two figures a student could not read: the timeline's unit labels on thin bars and
    side by side, and the GPU chart's long names in narrow cells."""
    from collectives.course.site import claims, plots

    events, t = [], 0.0                       # transfers of neighbouring units close together, thin bars
    for unit in range(4):
        events += [dict(what="all_gather", unit=unit, start=t, end=t + 0.0015),
                   dict(what="forward", unit=unit, start=t + 0.0016, end=t + 0.0216)]
        t += 0.0217
    for unit in reversed(range(4)):
        events += [dict(what="backward", unit=unit, start=t, end=t + 0.02),
                   dict(what="all_gather", unit=unit, start=t + 0.0002, end=t + 0.0008),
                   dict(what="all_gather", unit=unit, start=t + 0.0009, end=t + 0.0012),
                   dict(what="reduce_scatter", unit=unit, start=t + 0.02, end=t + 0.0203)]
        t += 0.0205
    assert plots.text_problems(tool("lesson10_figures").draw(events)) == []
    record = claims.load("12-bench-gpu")
    assert record is not None
    assert plots.text_problems(tool("lesson12_figures").draw(record)) == []


# --------------------------------------------------------------------------- records from a quiet host

def _what_ran(command: str) -> str:
    """The script, or the collectives subcommand (and its suite), a record's command ran."""
    words = command.replace("sudo ", "").split()
    script = next((w for w in words if w.endswith(".py")), None)
    if script:
        return script
    at = words.index("collectives") + 1
    return "collectives " + " ".join(words[at:at + (2 if words[at] in ("bench-hier", "bench-alltoall") else 1)])


def test_quiet_records_remakes_every_cpu_record_a_page_shows():
    """tools/quiet_records.sh runs, among its parts, whatever made each CPU or simulated-cluster
    record that a page places (GPU records come from the GPU lane)."""
    from collectives.course.site import claims

    script = (ROOT / "tools" / "quiet_records.sh").read_text(encoding="utf-8")
    table = script.split("PARTS_TABLE='", 1)[1].split("'", 1)[0]
    from collectives.course.site import targets

    pages = [page.read_text(encoding="utf-8") for page in (ROOT / "docs").rglob("*.md") if "snippets" not in page.parts]
    names = {name for text in pages for _, name, _ in claims.placeholders(text)}
    names |= {name for text in pages for name, _ in targets.PLACEHOLDER.findall(text)}   # a target's status
    missing = []
    for name in sorted(names):
        record = claims.load(name)
        if record is None or "NVIDIA" in record.get("meta", {}).get("device", "") \
                or record.get("meta", {}).get("backend") == "nccl":
            continue
        for command in record["meta"]["command"].split(" (")[0].split(";"):   # " (before: ...)": a note
            if not re.search(re.escape(_what_ran(command)) + r"(?![\w-])", table):
                missing.append(f"{name}: {command.strip()}")
    assert not missing, "records no part of quiet_records.sh remakes:\n" + "\n".join(missing)
    assert "09-fr-trace" in names and "12-bench-cpu" in names and "14-pipeline-local" in names


def test_a_figure_shown_with_its_records_table_is_captioned_by_its_title(tmp_path):
    """The numbers are read once, in the table: the figure's caption is then the record's title."""
    from collectives.course.site import claims

    _planted_site(tmp_path, "")
    img = tmp_path / "docs" / "img"
    record = claims.load("04-pipelining", img)
    figure = "{{ figure: 04-pipelining | tools/x.py }}"
    assert "2.19×" in claims.expand(figure, img=img).split("\n\n")[1]          # alone: the sentences
    record["title"], record["table"] = "Two rings, one size", {"head": ["ring", "time"], "rows": [["ring", "1 ms"]]}
    (img / "04-pipelining.json").write_text(json.dumps(record))
    shown = claims.expand(figure + "\n\n{{ table: 04-pipelining }}", img=img).split("\n\n")
    assert shown[1].startswith("*Two rings, one size.*") and "2.19×" not in shown[1], shown[1]
    assert shown[2].startswith("| ring | time |")
