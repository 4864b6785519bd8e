"""What an exercise gives the student (its constants and helpers), taken from the exercise
itself, for the fixtures that stand in for it: ``SHAPE_SLOTS, shape_from = given(14,
"SHAPE_SLOTS", "shape_from")``."""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

from collectives.course.catalog import lesson


@functools.cache
def _exercise(number: int) -> ModuleType:
    """Lesson ``number``'s exercise as shipped (never a copy the grader judges), loaded once."""
    spec = importlib.util.spec_from_file_location(f"lesson{number:02d}_exercise_as_given", lesson(number).exercise)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def given(number: int, *names: str):
    """The exercise's ``names``: one value for one name, else a tuple in their order."""
    values = tuple(getattr(_exercise(number), name) for name in names)
    return values[0] if len(values) == 1 else values
