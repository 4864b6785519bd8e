"""Load the implementation under test: the reference module or a student's exercise file.

Targets are strings, so they cross process boundaries: ``"collectives.ring"`` (a module),
``"lessons/04_ring/exercise.py"`` (a file), or either with ``":function"`` appended.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
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


class Lab:
    """What a lab notebook's cells call, chosen by the switch at its top.

    ``lab = Lab(4, "exercise")``: ``lab.ring_all_reduce`` is the function of YOUR
    ``lessons/04_ring/exercise.py`` (``"reference"``: the course's), and
    ``lab.target("ring_all_reduce")`` its spec for a world's ranks, so a notebook runs and
    draws your code. Names your exercise does not define itself (demos, helpers) come
    from the reference.
    """

    def __init__(self, number: int, impl: str = "reference"):
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
        if name.startswith("__") or name in ("impl", "spec", "reference_spec", "_module", "_reference"):
            raise AttributeError(name)
        return getattr(self._module if self._own(name) else self._reference, name)

    def written(self, *names: str) -> bool:
        """True when every one of ``names`` (``"DGCState.start_"`` for a method) is written;
        with the switch on "exercise", a stub's name is printed instead ("Lesson 8, task 3:
        sparse_all_reduce is not written yet"), so that a cell can skip what needs it
        rather than run the reference in its place."""
        if self.impl != "exercise":
            return True
        for name in names:
            message = stub_message(self._module, name)
            if message:
                print(f"{message} is not written yet: this cell runs your {self.spec} once it is "
                      "(or set IMPL = \"reference\")")
                return False
        return True

    def target(self, name: str) -> str:
        """``"spec:name"``, for :func:`resolve` in the ranks of a world."""
        return f"{self.spec if self._own(name) else self.reference_spec}:{name}"

    def __repr__(self) -> str:
        return f"<lab {self.impl}: {self.spec}>"


def stub_message(module, name: str) -> str | None:
    """The ``NotImplementedError`` message of ``module``'s ``name`` when its body is only that
    (a stub: ``raise NotImplementedError("Lesson 8, task 3: sparse_all_reduce")``), else None."""
    import ast
    import inspect
    import textwrap

    obj = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
    if obj is None or getattr(obj, "__module__", None) != module.__name__:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = [node for node in tree.body[0].body
            if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    if len(body) == 1 and isinstance(body[0], ast.Raise) and isinstance(body[0].exc, ast.Call) \
            and getattr(body[0].exc.func, "id", "") == "NotImplementedError":
        args = body[0].exc.args
        return args[0].value if args and isinstance(args[0], ast.Constant) else name
    return None
