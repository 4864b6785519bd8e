"""The helper sheet in every exercise is what the code says today, and every stub names what it may call.

Each exercise's docstring lists the course functions its tasks may call, with their
signatures and first docstring lines (``collectives.course.grading.helpers``); a renamed argument
or a changed default in ``collectives.core`` must show up there, or students are told to
call something that no longer exists. Each stub's ``CALLS:`` line names the entries its
task needs, all of them on the sheet.
"""

import ast

import pytest

from collectives.course.catalog import LESSONS
from collectives.course.grading import helpers


def _doc(item) -> str:
    return ast.get_docstring(ast.parse(item.exercise.read_text())) or ""


def _stubs(item) -> list[str]:
    """Every function of the exercise whose body is ``raise NotImplementedError("Lesson N, task k: ...")``."""
    names = []
    for node in ast.walk(ast.parse(item.exercise.read_text())):
        if isinstance(node, ast.FunctionDef):
            last = node.body[-1]
            if (isinstance(last, ast.Raise) and isinstance(last.exc, ast.Call)
                    and getattr(last.exc.func, "id", "") == "NotImplementedError"):
                names.append(node.name)
    return names


@pytest.mark.parametrize("item", LESSONS, ids=lambda item: f"lesson{item.number:02d}")
def test_the_sheet_is_what_the_code_says_and_every_stub_names_its_calls(item):
    doc = _doc(item)
    names = helpers.names_in(doc)
    assert names, f"{item.exercise}: no '{helpers.HEADER}' block"
    fresh = helpers.sheet(names)
    assert helpers.block_in(doc) == fresh, (
        f"{item.exercise}: the helper sheet is out of date; replace it with what "
        f"`.venv/bin/python -m collectives helpers --lesson {item.number}` prints:\n{fresh}")

    calls = helpers.calls_of(item.exercise)
    stubs = _stubs(item)
    assert stubs, f"{item.exercise}: no stubs found"
    for stub in stubs:
        assert stub in calls, f"{item.exercise}: stub {stub} has no CALLS: line"
        listed = [n for n in calls[stub] if n != "none"]
        off_sheet = [n for n in listed if n not in names]
        assert not off_sheet, f"{item.exercise}: {stub} names {off_sheet}, which the sheet does not list"


def test_a_changed_signature_or_a_name_that_is_gone_is_caught():
    doc = _doc(LESSONS[3])
    assert "ops.sendrecv(send_buf, dst" in doc
    stale = doc.replace("ops.sendrecv(send_buf, dst", "ops.sendrecv(buf, dst")
    assert helpers.block_in(stale) != helpers.sheet(helpers.names_in(stale))
    with pytest.raises(AttributeError):
        helpers.sheet(["ops.no_such_helper"])


def test_the_helpers_command_prints_a_lessons_sheet(capsys):
    assert helpers.main(["--lesson", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(helpers.HEADER) and "ops.chunk_bounds(numel, parts)" in out
