"""The grader can fail: pristine stubs score 0, the reference scores full, partial work scores in between."""

import re
import shutil
import subprocess
import sys

from collectives.course.catalog import LESSONS, ROOT


def grade(*args, timeout=400):
    proc = subprocess.run([sys.executable, "-m", "collectives", "grade", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    match = re.search(r"SCORE (\d+)/(\d+)", proc.stdout)
    assert match, f"no score line in the grader's output:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.returncode, int(match.group(1)), int(match.group(2)), proc.stdout


def test_the_pristine_stubs_score_zero_and_the_grade_fails():
    code, earned, total, out = grade()
    assert earned == 0, out[-3000:]
    assert total > 0
    assert code != 0


def test_the_reference_scores_full_marks():
    code, earned, total, out = grade("--impl", "reference")
    assert earned == total > 0, out[-4000:]
    assert code == 0
    for lesson in LESSONS:  # every lesson contributes graded tasks
        assert re.search(rf"│\s+{lesson.nn}\s+│", out), f"lesson {lesson.nn} has no graded task"


def test_one_solved_task_earns_its_points_and_no_more(tmp_path):
    # A student's copy of lessons/ where only lesson 1's exercise functions come from the
    # reference: lesson 1 scores full, and the grade as a whole still fails.
    first = LESSONS[0]
    student = tmp_path / "lessons"
    shutil.copytree(ROOT / "lessons", student)
    solved = student / first.exercise.parent.name / "exercise.py"
    solved.write_text(solved.read_text() + f"\n\nfrom {first.module} import *  # noqa\n")
    code, earned, total, out = grade("--exercises", str(student), "--lesson", first.nn)
    assert earned == total > 0, out[-3000:]
    code, earned, total, out = grade("--exercises", str(student), "--lesson", first.nn,
                                     "--lesson", LESSONS[1].nn)
    assert 0 < earned < total and code != 0
