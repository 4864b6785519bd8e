"""Lesson 14's grader fails the natural mistakes, each with a message that names it.

Every fixture in ``tests/mistakes/`` is the whole exercise written as the reference writes
it, with one mistake a student makes in one task: the shape sent before every activation, a
stage's input sent on as its output, the loss gradient not divided by m, the backward run
last micro-batch first, a warm-up that deadlocks, one forward too many, the full backward
where the schedule splits it, blocking sends that hang under 1F1B, W's that fill no gap,
every forward first. Each must score nothing on its task, with the judge saying why; the
fixture without its mistake (``tests/solutions/lesson14_written.py``) passes every task.
"""

import pytest

from collectives.course.catalog import ROOT

from .grading_fixtures import grader, with_exercise

MISTAKES = ROOT / "tests" / "mistakes"
# fixture -> (task, what the judge's message must say)
EXPECTED = {
    "lesson14_t1_shape_before_every_activation": (1, "sent the shape 4 times"),
    "lesson14_t1_input_sent_on": (1, "is this stage's input, not its output"),
    "lesson14_t2_loss_not_divided_by_m": (2, "the loss gradient was not divided by the m micro-batches"),
    "lesson14_t2_backward_in_reverse": (2, "ran the backward on micro-batches [3, 2, 1, 0]"),
    "lesson14_t3_warmup_of_rank_forwards": (3, "the schedule deadlocks: stage 0 waits at step 1"),
    "lesson14_t3_one_forward_too_many": (3, "forwards before its first backward"),
    "lesson14_t4_full_backward_at_b": (4, "ran the full backward (stage.backward) at a B whose W"),
    "lesson14_t4_blocking_sends": (4, "waiting in send to rank"),
    "lesson14_t5_w_right_after_b": (5, "the W's do not fill the gaps"),
    "lesson14_t5_every_forward_first": (5, "awaiting their B at once"),
}


def test_every_mistake_fixture_is_listed():
    assert {p.stem for p in MISTAKES.glob("lesson14_*.py")} == set(EXPECTED)


@pytest.mark.parametrize("name", EXPECTED)
def test_each_natural_mistake_scores_nothing_and_is_named(name, tmp_path, monkeypatch):
    task, says = EXPECTED[name]
    if name == "lesson14_t4_blocking_sends":
        monkeypatch.setenv("COLLECTIVES_TIMEOUT", "5")      # it hangs: the world is stopped, the task fails
    student = with_exercise(14, MISTAKES / f"{name}.py", tmp_path / "lessons")
    passed, result = grader(14, exercises=student, tasks=[task])[task]
    assert not passed and says in result, f"{name}: task {task}: {result}"


def test_the_fixtures_without_their_mistakes_pass_every_task(tmp_path):
    student = with_exercise(14, ROOT / "tests" / "solutions" / "lesson14_written.py", tmp_path / "lessons")
    verdicts = grader(14, exercises=student)
    assert sorted(verdicts) == [1, 2, 3, 4, 5] and all(ok for ok, _ in verdicts.values()), verdicts
