"""Lesson 12's grader against natural mistakes: each fixture FAILS each task with a message naming it.

Each fixture in ``tests/mistakes/`` is the exercise's functions with the reference's
approach filled in and one realistic mistake planted per graded task, so that one grading
run judges three mistakes. As ``tests/test_grader.py`` runs the cheats: the fixture replaces
the exercise in a copy of ``lessons/``, and the grader judges it.
"""

from __future__ import annotations

import pytest

from collectives.course.catalog import ROOT

from .grading_fixtures import grade_fixture

MISTAKES = ROOT / "tests" / "mistakes"
# fixture -> task -> what the failure message must say (the mistake, named)
NAMED = {
    "lesson12_equal_epochs_no_barrier_chunk_kept": {
        1: "wait for every flag to be at least the epoch (>=), not equal to it",
        2: "passed 0 barriers, expected 1: without the barrier a rank reads slots its peers have not written yet",
        3: "does not hold the reduced chunk",
    },
    "lesson12_epoch_uncounted_mine_first_one_barrier": {
        1: "ws.epoch is 0 after 8 barriers; count them in ws.epoch",
        2: "not its own first",
        3: "passed 1 barriers, expected 2: the gather must wait until every chunk is reduced",
    },
}
# cheat fixtures (issue classes of lesson 12) -> task -> what the failure must say
CHEATS = {
    "lesson12_cheat_functional_collectives": {2: "functional collectives (torch.ops._c10d_functional",
                                              3: "send nothing"},    # the fence, or the case's calls
    "lesson12_cheat_nap_once_frozen_clock": {1: "before the last rank entered"},
    "lesson12_cheat_answer_cache_and_mock_any": {2: "one_shot_all_reduce, world of", 3: "began None calls"},
}


@pytest.mark.parametrize("name", NAMED)
def test_every_natural_mistake_fails_its_task_with_a_message_naming_it(name, tmp_path):
    got = {task: (s.earned, s.result)
           for task, s in grade_fixture(12, MISTAKES / f"{name}.py", tmp_path / name, sorted(NAMED[name])).items()}
    for task, words in NAMED[name].items():
        earned, result = got[task]
        assert earned == 0, f"{name}: task {task} scored {earned}: {result}"
        assert words in result, f"{name}: task {task}'s message does not name the mistake: {result}"


@pytest.mark.parametrize("name", CHEATS)
def test_every_cheat_scores_zero_and_says_why(name, tmp_path):
    got = {task: (s.earned, s.result)
           for task, s in grade_fixture(12, MISTAKES / f"{name}.py", tmp_path / name, sorted(CHEATS[name])).items()}
    for task, words in CHEATS[name].items():
        earned, result = got[task]
        assert earned == 0, f"{name}: task {task} scored {earned}: {result}"
        assert words in result, f"{name}: task {task}: {result}"


def test_every_mistake_fixture_is_listed():
    on_disk = {p.stem for p in MISTAKES.glob("lesson12_*.py")}
    assert on_disk == set(NAMED) | set(CHEATS), on_disk ^ (set(NAMED) | set(CHEATS))
