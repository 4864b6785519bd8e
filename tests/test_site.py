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
import sys

import pytest
import yaml

from collectives.course.catalog import LESSONS, ROOT

_spec = importlib.util.spec_from_file_location("check_site", ROOT / "tools" / "check_site.py")
check_site = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("check_site", check_site)  # its dataclasses look their module up
_spec.loader.exec_module(check_site)

REFERENCE = ROOT / "docs" / "reference"


_hooks_spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "tools" / "mkdocs_hooks.py")
mkdocs_hooks = importlib.util.module_from_spec(_hooks_spec)
_hooks_spec.loader.exec_module(mkdocs_hooks)
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
    _spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "tools" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(hooks)
    nav = _mkdocs_yml()["nav"]
    assert hooks.nav_problems(nav) == []
    files = _nav_files(nav)
    swapped = list(files)
    i = swapped.index(f"lessons/{LESSONS[0].page.name}")
    swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
    assert hooks.nav_problems(swapped), "a lab before its lesson must be reported"


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
    try:
        result = check_site.check(site, chromium)
    finally:
        shutil.rmtree(planted)
        (site / "traces" / "wrong_ring.player.json").unlink()
    assert result.pages, "no pages were checked"
    problems = [p for p in result.problems if not p.startswith(f"{planted.name}/")]
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)
    # the check can fail: a player whose last step differs from the run's result is caught
    caught = [p for p in result.problems if p.startswith(f"{planted.name}/")]
    assert caught == [f"{planted.name}/: trace player 1 (wrong_ring): the last step is not the "
                      "all-reduce's result recorded with the run"]


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
