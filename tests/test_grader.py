"""The grader can fail: pristine stubs score 0, the reference scores full, partial work scores in between."""

import re
import shutil
import subprocess
import sys

from collectives.course.catalog import LESSONS, ROOT


def grade(*args, timeout=900):
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


CHEATS = ROOT / "tests" / "cheats"


def _row(out, lesson, task):
    """(earned, points, the row's text) of one task in the grade table."""
    match = re.search(rf"│\s+{lesson:02d} │\s+{task} │[^│]*│\s+(\d+)/(\d+) │(.*)", out)
    assert match, f"no row for lesson {lesson} task {task}:\n{out[-3000:]}"
    return int(match.group(1)), int(match.group(2)), match.group(3)


def test_cheats_on_the_ring_score_zero_and_a_hang_costs_only_its_task(tmp_path):
    # Each fixture is a whole lessons/04_ring/exercise.py that scored full marks on tasks 3
    # and 4 before the ring was judged in the grading process (see tests/cheats/). The last
    # one's task 4 hangs: task 4 scores 0 and says where, tasks 1 and 3 are graded as usual.
    runs = {}
    for name, extra in [("paused_all_reduce_and_small_worlds", []), ("divisible_sizes_and_fixed_seed", []),
                        ("replaced_verdict_and_a_hang", ["--task", "1", "--timeout", "10"])]:
        student = tmp_path / name
        shutil.copytree(ROOT / "lessons", student)
        shutil.copy(CHEATS / f"{name}.py", student / "04_ring" / "exercise.py")
        cmd = [sys.executable, "-m", "collectives", "grade", "--exercises", str(student), "--lesson", "04",
               "--task", "3", "--task", "4", *extra]
        runs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs = {name: proc.communicate(timeout=400)[0] for name, proc in runs.items()}
    for name, out in outs.items():
        assert "SCORE" in out, out[-3000:]
        for task in (3, 4):
            earned, points, row = _row(out, 4, task)
            assert earned == 0 < points, f"{name}: task {task} scored {earned}/{points}:\n{out[-3000:]}"
    hang = outs["replaced_verdict_and_a_hang"]
    assert _row(hang, 4, 1)[0] == 3, hang[-3000:]
    flat = {name: re.sub(r"[\s│]+", " ", out) for name, out in outs.items()}   # the table's wrapped cells
    assert "not run: the world hung in pipelined_ring_all_reduce (case" in flat["replaced_verdict_and_a_hang"], hang
    assert "called allreduce on the process group" in flat["paused_all_reduce_and_small_worlds"]
