"""Lesson 10's grader fails natural mistakes and cheats, and says which.

Each fixture in ``tests/mistakes/lesson10_*.py`` is a whole exercise file: the reference,
with a slip a student makes (or a cheat) planted in some tasks' own functions (its
docstring lists them). One grading run judges all six tasks of a fixture; every planted
task must score 0 with its first problem naming the slip -- the words a student needs to
find it -- and every other task full marks (the fixture is the reference there).
"""

from __future__ import annotations

import pytest

from collectives.course.catalog import ROOT

from .grading_fixtures import grade_fixture, shm_cleared

MISTAKES = ROOT / "tests" / "mistakes"

# fixture -> task -> words its first problem must hold
NAMED = {
    "lesson10_bounds_packing_data_limit_sum_stale": {
        1: "expected a ValueError",
        2: "the rows of rank",
        3: "`.data = torch.empty(0)`",
        4: "more than max_alive = 1",
        5: "p times the mean",
        6: "zero it after each step",
    },
    "lesson10_floor_library_rebind_late_kept_cast": {
        1: "ceil(rows / p)",
        2: "called all_gather_single: this task allows",
        3: "autograd saved still do not see the weights",
        4: "after layer 0 finished",
        5: "free a layer once its gradients are reduce-scattered",
        6: "masters Adam steps stay float32",
    },
    # files in /dev/shm carry the data, zero-filled messages of the ring's sizes the traffic
    "lesson10_side_channels_and_decoys": {
        2: "carries none of the blocks",
        3: "carries none of the blocks",
    },
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_every_planted_mistake_fails_its_task_with_a_message_naming_it(name, tmp_path):
    with shm_cleared("lesson10-side"):        # the side channel's files, named after this process
        verdicts = grade_fixture(10, MISTAKES / f"{name}.py", tmp_path / "lessons")
    for task, score in verdicts.items():
        earned, result = score.earned, score.result
        if task in NAMED[name]:
            assert earned == 0, f"{name}: task {task} scored {earned}: {result}"
            assert NAMED[name][task] in result.splitlines()[0], f"{name}: task {task} said: {result}"
        else:
            assert result == "pass", f"{name}: task {task} is the reference's and must pass: {result}"


def test_every_lesson10_fixture_is_listed():
    assert {p.stem for p in MISTAKES.glob("lesson10_*.py")} == set(NAMED)
