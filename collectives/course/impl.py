"""Load the implementation under test: the reference module or a student's exercise file.

Targets are strings, so they cross process boundaries: ``"collectives.ring"`` (a module),
``"lessons/04_ring/exercise.py"`` (a file), or either with ``":function"`` appended.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import os
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

from .catalog import ROOT, lesson

_cache: dict[str, ModuleType] = {}


def load_module(spec: str) -> ModuleType:
    """Import a module by dotted name, or a ``.py`` file by path (relative to the repo root)."""
    if spec in _cache:
        return _cache[spec]
    if spec.endswith(".py"):
        path = Path(spec)
        if not path.is_absolute():
            path = ROOT / path
        if not path.exists():
            raise FileNotFoundError(f"no exercise file at {path}")
        name = "exercise_" + path.parent.name
        mod_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(spec)
    _cache[spec] = module
    return module


def resolve(target: str) -> Any:
    """``"module:attr"`` or ``"path.py:attr"`` -> the attribute; a bare module or path -> the module."""
    if ":" in target:
        spec, attr = target.rsplit(":", 1)
        module = load_module(spec)
        try:
            return getattr(module, attr)
        except AttributeError:
            raise AttributeError(f"{spec} has no {attr!r}") from None
    return load_module(target)


def spec_for(number: int, kind: str = "reference") -> str:
    """The module spec of lesson ``number``: its reference module or its exercise file."""
    item = lesson(number)
    if kind == "reference":
        return item.module
    if kind == "exercise":
        # An instructor grades a student's copy of lessons/ with --exercises DIR.
        other = os.environ.get("COLLECTIVES_EXERCISE_DIR")
        if other:
            return str(Path(other).resolve() / item.exercise.parent.name / "exercise.py")
        return str(item.exercise.relative_to(ROOT))
    raise ValueError(f"kind must be 'reference' or 'exercise', got {kind!r}")


_STUB = re.compile(r"Lesson (\d+), task (\d+): (\w+)")
_RAISED = re.compile(r"NotImplementedError\W*" + _STUB.pattern)   # the stub's own message, not its docstring
_TOLD = re.compile(r"(\w+) is not written yet \(Lesson (\d+), task (\d+)\)")   # a TaskNotWritten's, from a rank


class TaskNotWritten(NotImplementedError):
    """A lab cell needs a task of the exercise that is still a stub.

    Shown in a notebook as its one-line message, not as a traceback, in the stub's own words:
    ``recursive_doubling_all_reduce is not written yet (Lesson 4, task 5): write it or set
    IMPL = 'reference'``."""

    def __init__(self, lesson: int | str, task: int | str | None, name: str):
        self.lesson, self.task, self.name = lesson, task, name
        where = f"Lesson {lesson}, task {task}" if task is not None else f"Lesson {lesson}"
        super().__init__(f"{name} is not written yet ({where}): write it or set IMPL = 'reference'")

    def _render_traceback_(self) -> list[str]:     # IPython shows these lines instead of a traceback
        return [f"{type(self).__name__}: {self}"]

    @classmethod
    def from_text(cls, text: str, lesson: int, name: str = "") -> "TaskNotWritten":
        """From a stub's message ("Lesson 4, task 5: recursive_doubling_all_reduce") found in
        ``text``; without one, naming ``name``."""
        told = _TOLD.search(text)
        if told:
            return cls(told.group(2), told.group(3), told.group(1))
        m = _RAISED.search(text) or _STUB.search(text)
        return cls(m.group(1), m.group(2), m.group(3)) if m else cls(lesson, None, name or "a function")


def is_stub(fn: Any) -> bool:
    """Whether ``fn`` is an exercise stub: its body, after the docstring, is only
    ``raise NotImplementedError(...)``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = [b for b in node.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    called = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(called, ast.Name) and called.id == "NotImplementedError"


class Lab:
    """What a lab notebook's cells call, chosen by the switch at its top.

    ``lab = Lab(4, "exercise")``: ``lab.ring_all_reduce`` is the function of YOUR
    ``lessons/04_ring/exercise.py`` (``"reference"``: the course's), and
    ``lab.target("ring_all_reduce")`` its spec for a world's ranks, so a notebook runs and
    draws your code. Names your exercise does not define itself (demos, helpers) come
    from the reference.

    A task you have not written yet stops the cell that needs it with one line, not a
    traceback (:class:`TaskNotWritten`): ``lab.target(name)`` checks before a world starts,
    ``lab.ring_all_reduce(...)`` when it is called, and ``lab.run(fn, p)`` -- the lab's
    :func:`collectives.core.launch.run` -- when a rank hits a stub.
    """

    def __init__(self, number: int, impl: str = "reference"):
        self.number = number
        self.impl = impl
        self.spec = spec_for(number, impl)
        self.reference_spec = lesson(number).module
        self._module = load_module(self.spec)
        self._reference = load_module(self.reference_spec)

    def _own(self, name: str) -> bool:
        obj = getattr(self._module, name, None)
        return (self.impl == "exercise" and obj is not None and not name.startswith("_")
                and getattr(obj, "__module__", None) == self._module.__name__)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("impl", "spec", "reference_spec", "_module", "_reference", "number"):
            raise AttributeError(name)
        if not self._own(name):
            return getattr(self._reference, name)
        obj = getattr(self._module, name)
        if not inspect.isfunction(obj):
            return obj
        number = self.number

        @functools.wraps(obj)
        def checked(*args, **kwargs):
            try:
                return obj(*args, **kwargs)
            except TaskNotWritten:
                raise
            except NotImplementedError as exc:
                if _STUB.search(str(exc)) or is_stub(obj):
                    raise TaskNotWritten.from_text(str(exc), number, name) from None
                raise
        return checked

    def target(self, name: str) -> str:
        """``"spec:name"``, for :func:`resolve` in the ranks of a world. Raises
        :class:`TaskNotWritten` when the exercise's ``name`` is still a stub."""
        if self._own(name):
            fn = getattr(self._module, name)
            if is_stub(fn):
                try:
                    source = inspect.getsource(fn)
                except (OSError, TypeError):
                    source = ""
                raise TaskNotWritten.from_text(source, self.number, name)
            return f"{self.spec}:{name}"
        return f"{self.reference_spec}:{name}"

    def run(self, fn, world_size: int = 4, *args, **kwargs):
        """:func:`collectives.core.launch.run`, where a rank that runs into a stub of the
        exercise stops the cell with :class:`TaskNotWritten` instead of its traceback."""
        from ..core import launch

        try:
            return launch.run(fn, world_size, *args, **kwargs)
        except launch.RankError as exc:
            if "NotImplementedError" in exc.remote_traceback or "TaskNotWritten" in exc.remote_traceback:
                if _STUB.search(exc.remote_traceback) or "TaskNotWritten" in exc.remote_traceback:
                    raise TaskNotWritten.from_text(exc.remote_traceback, self.number) from None
            raise

    def __repr__(self) -> str:
        return f"<lab {self.impl}: {self.spec}>"
