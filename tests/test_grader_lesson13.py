"""Lesson 13's grader fails natural mistakes, naming them, and passes a student's own solution.

``tests/mistakes/lesson13_*.py`` are whole exercises: ``lesson13_none`` every task solved
the way a student would write it (not the reference's code); ``lesson13_mistakes_a`` and
``_b`` import it and redefine every task's functions with one natural mistake in each. Each mistake must cost its task,
with a message that names it; the student's solution must score in full.
(``tests/test_grader.py`` checks the stubs, the reference and every partial solution.)
"""

from __future__ import annotations

import pytest

from collectives.course.catalog import ROOT

from .grading_fixtures import grade_fixture

MISTAKES = ROOT / "tests" / "mistakes"

EXPECTED = {
    "lesson13_none": {},
    "lesson13_mistakes_a": {
        1: "the gradient passes unchanged",
        2: "the bias counted",
        3: "gather on the sequence (dim 1), not flat",
        4: "subtract the vocabulary's max before exp",
        5: "ran one after the other",
    },
    "lesson13_mistakes_b": {
        1: "the gradient of x summed over the group",
        2: "enter through f",
        3: "every rank's gradient piece",
        4: "must never travel",
        5: "the right blocks in the wrong places",
    },
}


@pytest.mark.parametrize("name", EXPECTED)
def test_each_natural_mistake_costs_its_task_with_a_message_naming_it(name, tmp_path):
    got = grade_fixture(13, MISTAKES / f"{name}.py", tmp_path / "lessons")
    assert sorted(got) == [1, 2, 3, 4, 5]
    for task, score in got.items():
        if task not in EXPECTED[name]:
            assert score.earned == score.points > 0, f"{name}: task {task} lost points: {score.result}"
            continue
        assert score.earned == 0, f"{name}: task {task} scored {score.earned}: {score.result}"
        assert EXPECTED[name][task] in score.result, f"{name}: task {task}'s message does not name it: {score.result}"


def test_every_fixture_is_listed():
    assert {p.stem for p in MISTAKES.glob("lesson13_*.py")} == set(EXPECTED)
