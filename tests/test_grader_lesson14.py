"""Lesson 14's grader fails the natural mistakes, each with a message that names it.

``lesson14_mistakes_a`` and ``_b`` in ``tests/mistakes/`` import the exercise written as the
reference writes it (``tests/solutions/lesson14_written.py``) and redefine every task's
function with one mistake a student makes planted in it, so that
one grading run judges five: the shape sent before every activation, a stage's input sent
on as its output, the loss gradient not divided by m, the backward run last micro-batch
first, a warm-up that deadlocks, one forward too many, the full backward where the schedule
splits it, blocking sends that hang under 1F1B, W's that fill no gap, every forward first.
Each must score nothing on its task, with the judge saying why; the solution they import
passes every task.
"""

import pytest

from collectives.course.catalog import ROOT

from .grading_fixtures import grader, with_exercise

MISTAKES = ROOT / "tests" / "mistakes"
# fixture -> task -> what the judge's message must say
EXPECTED = {
    "lesson14_mistakes_a": {
        1: "sent the shape 4 times",
        2: "the loss gradient was not divided by the m micro-batches",
        3: "the schedule deadlocks: stage 0 waits at step 1",
        4: "ran the full backward (stage.backward) at a B whose W",
        5: "the W's do not fill the gaps",
    },
    "lesson14_mistakes_b": {
        1: "is this stage's input, not its output",
        2: "ran the backward on micro-batches [3, 2, 1, 0]",
        3: "forwards before its first backward",
        4: "waiting in send to rank",
        5: "awaiting their B at once",
    },
}
HANGS = {"lesson14_mistakes_b"}       # task 4's blocking sends: the world is stopped, that task fails


def test_every_mistake_fixture_is_listed_and_plants_one_mistake_per_task():
    assert {p.stem for p in MISTAKES.glob("lesson14_*.py")} == set(EXPECTED)
    for name in EXPECTED:
        header = (MISTAKES / f"{name}.py").read_text().split('"""')[1]
        assert all(f"    task {t}:" in header for t in EXPECTED[name]), name


@pytest.mark.parametrize("name", EXPECTED)
def test_each_natural_mistake_scores_nothing_and_is_named(name, tmp_path, monkeypatch):
    if name in HANGS:
        monkeypatch.setenv("COLLECTIVES_TIMEOUT", "5")
    verdicts = grader(14, exercises=with_exercise(14, MISTAKES / f"{name}.py", tmp_path / "lessons"))
    assert sorted(verdicts) == [1, 2, 3, 4, 5], verdicts
    for task, says in EXPECTED[name].items():
        passed, result = verdicts[task]
        assert not passed and says in result, f"{name}: task {task}: {result}"


def test_the_fixtures_without_their_mistakes_pass_every_task(tmp_path):
    student = with_exercise(14, ROOT / "tests" / "solutions" / "lesson14_written.py", tmp_path / "lessons")
    verdicts = grader(14, exercises=student)
    assert sorted(verdicts) == [1, 2, 3, 4, 5] and all(ok for ok, _ in verdicts.values()), verdicts
