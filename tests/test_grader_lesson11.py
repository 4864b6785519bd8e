"""Lesson 11's grader fails natural mistakes, each with a message that points at it.

Each ``lesson11_mistakes_*`` fixture in ``tests/mistakes/`` is the exercise's functions with the
reference written in and one realistic mistake planted in every task, so one grading run
judges seven mistakes. Every task must score zero and say what is wrong in words a student
can act on. One more fixture cheats: the answers through files, decoy messages of the right
sizes in the right rounds. (The reference's full marks and the stubs' zero are
``tests/test_grader.py``'s.)
"""

from __future__ import annotations

import pytest

from collectives.course.catalog import ROOT

from .grading_fixtures import grade_fixture, shm_cleared

MISTAKES = ROOT / "tests" / "mistakes"
CHEAT = "lesson11_side_channel_and_decoys"
# fixture -> task -> what its FAIL line must say
EXPECTED = {
    "lesson11_mistakes_a": {
        1: "was not finished (both messages waited for) before the next was posted",
        2: "should hold rank 1's input block 0, but holds rank 2's input block 0",
        3: "(these are this rank's own counts)",
        4: "returned (Tensor, Tensor), expected (a plain torch.Tensor, a list of p ints)",
        5: "into other tokens' rows",
        6: "every token's first choice, in token order, takes its slot before any second choice",
        7: "summed over every rank",
    },
    "lesson11_mistakes_b": {
        1: "holds the output's old contents: it was never written",
        2: "output block 1 (rows 3..5) should hold rank 1's input block 0",
        3: "one count to each other rank, no more and no fewer",
        4: "returned output_split_sizes",
        5: "times, expected once with all its rows",
        6: "at most capacity 2 from each rank",
        7: "(down for overloaded experts)",
    },
}


@pytest.mark.parametrize("name", EXPECTED)
def test_every_planted_mistake_fails_with_a_message_that_names_it(name, tmp_path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_TIMEOUT", "20")
    verdicts = {task: (s.earned, s.result)
                for task, s in grade_fixture(11, MISTAKES / f"{name}.py", tmp_path / "lessons").items()}
    assert set(verdicts) == set(EXPECTED[name])
    for task, words in EXPECTED[name].items():
        earned, result = verdicts[task]
        assert earned == 0, f"{name}: task {task} scored {earned}: {result}"
        assert words in result, f"{name}: task {task} failed without naming its mistake: {result}"


def test_answers_through_a_side_channel_with_decoy_messages_score_zero(tmp_path):
    with shm_cleared("lesson11-decoys"):         # the fixture's files, named by this process (its ranks' parent)
        scores = grade_fixture(11, MISTAKES / f"{CHEAT}.py", tmp_path / "lessons", tasks=[1, 2])
    for s in scores.values():
        assert s.earned == 0 and "did not carry" in s.result, (s.task, s.result)


def test_every_mistake_fixture_is_listed_and_plants_one_mistake_per_task():
    on_disk = {p.stem for p in MISTAKES.glob("lesson11_*.py")} - {"lesson11_given"}   # the helpers they share
    assert on_disk == set(EXPECTED) | {CHEAT}
    for name in EXPECTED:
        header = (MISTAKES / f"{name}.py").read_text().split('"""')[1]
        assert all(f"    task {t}:" in header for t in EXPECTED[name]), name
