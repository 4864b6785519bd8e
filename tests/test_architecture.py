"""The package's layers, read from the source: tooling -> lessons -> infrastructure, no cycles.

``collectives/core`` is the infrastructure, ``collectives/course`` the tooling, and every other
module or folder of the package belongs to one lesson of the lesson map. A lesson may import
the infrastructure and earlier lessons, never a later lesson and never the tooling (the tour
and the benchmarks find the lessons, not the other way round). These tests parse every
``import`` in the package, so a broken layer fails here before anyone reads the code.
"""

import ast
from pathlib import Path

import pytest

from collectives.course.catalog import LESSONS, ROOT

PACKAGE = ROOT / "collectives"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package modules ``path`` imports (``from x import y`` counts x.y when that is a module)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    return {name: _imports(path, name, known) for name, path in files.items()}


def _layer(module: str) -> tuple[str, int]:
    """("core", 0), ("course", 0), ("root", 0) or ("lesson", its number)."""
    for layer in ("core", "course"):
        if module == f"collectives.{layer}" or module.startswith(f"collectives.{layer}."):
            return layer, 0
    if module in ("collectives", "collectives.__main__"):
        return "root", 0
    for item in LESSONS:
        for owned in (item.module, *item.also):
            if module == owned or module.startswith(owned + "."):
                return "lesson", item.number
    raise AssertionError(f"{module} belongs to no layer: put it in core/, course/ or a lesson of the map")


GRAPH = _graph()


def test_every_module_belongs_to_a_layer():
    for module in GRAPH:
        _layer(module)


def test_the_import_graph_has_no_cycle():
    state: dict[str, int] = {}      # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _layer(m)[0] == "core"))
def test_infrastructure_imports_only_infrastructure(module):
    bad = sorted(d for d in GRAPH[module] if _layer(d)[0] != "core")
    assert not bad, f"{module} (infrastructure) imports {bad}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _layer(m)[0] == "lesson"))
def test_a_lesson_imports_only_earlier_lessons_and_the_infrastructure(module):
    _, number = _layer(module)
    for dep in GRAPH[module]:
        layer, other = _layer(dep)
        assert layer != "course", f"{module} (lesson {number}) imports the tooling module {dep}"
        assert layer != "root", \
            f"{module} (lesson {number}) imports the package root {dep}: import core modules directly"
        assert layer != "lesson" or other <= number, \
            f"{module} (lesson {number}) imports {dep}, which belongs to the later lesson {other}"


def test_the_checks_see_a_broken_layer(tmp_path):
    """A lesson that imports the tour, relatively or absolutely, is seen doing so."""
    known = set(GRAPH)
    fake = tmp_path / "ring.py"
    fake.write_text("from .course import tour\nfrom .core import ops\nimport collectives.course.verify\n")
    found = _imports(fake, "collectives.ring", known)
    assert found == {"collectives.course.tour", "collectives.core.ops", "collectives.course.verify"}
    assert [_layer(m)[0] for m in sorted(found)] == ["core", "course", "course"]


# The tooling's own order, by concern (collectives/course/__init__.py states it): the command
# line may import anything below it; grading and the benchmarks import the site and the top
# modules but not each other; the site imports only the top modules; the top modules (the
# lesson map, the implementation switch, the harness and the tour) import no concern folder.
CONCERNS = {"cli": 3, "grading": 2, "benchmarks": 2, "site": 1}


def _concern(module: str) -> tuple[str, int]:
    """("cli", 3) ... ("top", 0) for a tooling module: its folder under collectives/course."""
    parts = module.split(".")
    if module == "collectives.course.runner":     # the old name of grading's runner, kept for old copies
        return "grading", CONCERNS["grading"]
    if len(parts) > 2 and parts[2] in CONCERNS:
        return parts[2], CONCERNS[parts[2]]
    return "top", 0


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _layer(m)[0] == "course"))
def test_the_tooling_imports_only_down_its_concerns(module):
    name, rank = _concern(module)
    for dep in GRAPH[module]:
        if _layer(dep)[0] != "course":
            continue
        other, other_rank = _concern(dep)
        if other == name:
            continue
        assert other_rank < rank, (
            f"{module} ({name}) imports {dep} ({other}): the tooling's folders import only downwards "
            "(cli -> grading, benchmarks -> site -> the top modules)")


def test_every_concern_folder_exists_and_the_top_stays_small():
    """The tooling's top holds the shared modules only; each concern has its folder."""
    course = PACKAGE / "course"
    for folder in CONCERNS:
        assert (course / folder / "__init__.py").is_file(), f"collectives/course/{folder}/ is missing"
    top = sorted(p.stem for p in course.glob("*.py") if p.stem != "__init__")
    assert top == ["cases", "catalog", "impl", "runner", "tour", "verify"], (
        f"collectives/course/ holds {top}: a benchmark, a grading task, a site helper or a command "
        "belongs in its concern's folder")


def test_the_concern_check_sees_a_benchmark_imported_by_the_site():
    assert _concern("collectives.course.site.claims") == ("site", 1)
    assert _concern("collectives.course.benchmarks.fused") == ("benchmarks", 2)
    assert _concern("collectives.course.verify") == ("top", 0)
    assert not CONCERNS["benchmarks"] < CONCERNS["site"]
