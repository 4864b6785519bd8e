"""Every command printed for a reader runs from a fresh clone as written.

Commands are collected from the README, CONTRIBUTING, every page of the site, every lab's
text, and every docstring of the package and the exercises: fenced code blocks, inline
code and docstring lines that start like a command. Each is held to what it names --

* Python and torchrun as the clone has them (``.venv/bin/python``, ``.venv/bin/torchrun``),
  never a bare ``python`` that may not be the pinned one;
* ``-m collectives CMD``: CMD is a command of the CLI, and every ``--flag`` is one it takes
  (read from its own ``--help``); ``-m pytest`` / a script / torchrun: the files exist;
  an exercise script: only the runner's flags;
* ``make TARGET VAR=...``: the target and the variables are the Makefile's.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import shlex

import pytest

from collectives.course.catalog import ROOT
from collectives.course.cli import main as cli

PREFIXES = (".venv/bin/python", ".venv/bin/torchrun", "make ", "python ", "python3 ", "torchrun ",
            "pytest ", "pip ")
BARE = ("python", "python3", "torchrun", "pytest", "pip")
# Commands shown for another machine or as an example of what not to do: (source, text start)
ELSEWHERE = ("python3 -m venv", "python3 -m pip download")


def _page_sources():
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for path in files:
        yield path.relative_to(ROOT).as_posix(), path.read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        yield path.relative_to(ROOT).as_posix(), "\n\n".join(
            "".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _docstring_sources():
    for path in sorted([*(ROOT / "collectives").rglob("*.py"), *(ROOT / "lessons").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    yield path.relative_to(ROOT).as_posix(), doc


def _commands(text: str) -> list[str]:
    found = []
    in_block = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            in_block = not in_block
            continue
        candidates = [stripped] if in_block or line.startswith("    ") else []
        candidates += re.findall(r"``([^`]+)``", line) + re.findall(r"(?<!`)`([^`]+)`(?!`)", line)
        for c in candidates:
            c = c.strip().lstrip("$ ").split(" # ")[0].split("  #")[0].strip()
            if c.startswith(PREFIXES) and not c.startswith(ELSEWHERE):
                found.append(c)
    return found


def all_commands() -> list[tuple[str, str]]:
    seen = set()
    out = []
    for source, text in [*_page_sources(), *_docstring_sources()]:
        for command in _commands(text):
            if (source, command) not in seen:
                seen.add((source, command))
                out.append((source, command))
    return out


_HELP: dict[str, str] = {}


def _help_of(command: str) -> str:
    """What ``python -m collectives COMMAND --help`` prints, run in this process."""
    if command not in _HELP:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            cli.main([command, "--help"])
        _HELP[command] = out.getvalue()
    return _HELP[command]


def _makefile() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", text, re.M))
    variables = set(re.findall(r"\$\((\w+)\)", text)) | set(re.findall(r"^(\w+)\s*\?=", text, re.M))
    return targets, variables


def _placeholder(path: str) -> bool:
    """``lessons/NN_topic/exercise.py``, ``<file>.py``: a pattern for the reader to fill in."""
    return bool(re.search(r"(^|/)NN_|<|\.\.\.", path))


RUNNER_FLAGS = {"--world", "--task", "--timeout", "--verbose", "-v", "--impl", "--help"}


def problem_with(command: str) -> str | None:
    try:
        words = shlex.split(command.replace("\\", " "))
    except ValueError:
        return None                                  # a fragment, not a whole command
    words = [w for w in words if not re.match(r"^[A-Z_]+=", w)] if words and words[0] != "make" else words
    if not words:
        return None
    head = words[0]
    if head in BARE:
        return f"starts with a bare `{head}`: from a fresh clone it is `.venv/bin/{head}`" \
            if head != "pip" else "starts with a bare `pip`: `.venv/bin/pip`"
    if head == "make":
        if any("[" in w or "..." in w for w in words):
            return None                              # a pattern: "make grade [LESSON=04]", "make ..."
        targets, variables = _makefile()
        for word in words[1:]:
            if "=" in word:
                if word.split("=", 1)[0] not in variables:
                    return f"make has no variable {word.split('=', 1)[0]}"
            elif not word.startswith("-") and word not in targets:
                return f"make has no target {word}"
        return None
    if head == ".venv/bin/torchrun":
        files = [w for w in words[1:] if w.endswith(".py")]
        missing = [f for f in files if not (ROOT / f).exists() and not _placeholder(f)]
        return f"no file {missing[0]}" if missing else None
    if head != ".venv/bin/python":
        return None
    rest = words[1:]
    if rest[:2] == ["-m", "collectives"] and len(rest) > 2:
        name = rest[2]
        if "<" in name or "..." in name:
            return None                              # a pattern: "<command>", "bench-..."
        if name not in cli.COMMANDS:
            return f"`python -m collectives` has no command {name}"
        if name == "cluster" and "--" in rest:
            rest = rest[: rest.index("--")]
        helptext = _help_of(name)
        for flag in [w.split("=")[0] for w in rest[3:] if w.startswith("--")]:
            if flag not in helptext:
                return f"`collectives {name}` has no flag {flag}"
        return None
    if rest[:2] == ["-m", "pytest"]:
        paths = [w.split("::")[0] for w in rest[2:] if w.startswith("tests")]
        missing = [p for p in paths if not (ROOT / p).exists()]
        return f"no test file {missing[0]}" if missing else None
    scripts = [w for w in rest if w.endswith(".py")]
    if scripts:
        script = scripts[0]
        if not (ROOT / script).exists() and not script.startswith(("/", "path/")) and not _placeholder(script):
            return f"no file {script}"
        if script.endswith("exercise.py"):
            bad = [w for w in rest if w.startswith("-") and w.split("=")[0] not in RUNNER_FLAGS]
            return f"the exercise runner has no flag {bad[0]}" if bad else None
    return None


COMMANDS = all_commands()


def test_the_collector_finds_the_commands_readers_are_shown():
    texts = {c for _, c in COMMANDS}
    assert "make tour" in texts and "make test" in texts
    assert any(c.startswith(".venv/bin/torchrun --nproc-per-node 4 lessons/04_ring/exercise.py") for c in texts)
    assert any(c.startswith(".venv/bin/python -m collectives") for c in texts)
    assert len(COMMANDS) > 50


def test_a_wrong_command_is_caught():
    assert "bare `python`" in problem_with("python lessons/04_ring/exercise.py")
    assert "no command" in problem_with(".venv/bin/python -m collectives bench-nothing")
    assert "no flag --sizez" in problem_with(".venv/bin/python -m collectives bench --sizez 1M")
    assert "no target" in problem_with("make tours")
    assert "no file" in problem_with(".venv/bin/torchrun --nproc-per-node 4 lessons/99_x/exercise.py")
    assert "runner has no flag" in problem_with(".venv/bin/python lessons/04_ring/exercise.py --lesson 4")


@pytest.mark.parametrize("source", sorted({s for s, _ in COMMANDS}))
def test_every_printed_command_runs_as_written(source):
    bad = [f"{command!r}: {problem}" for s, command in COMMANDS if s == source
           for problem in [problem_with(command)] if problem]
    assert not bad, f"{source}:\n  " + "\n  ".join(bad)
