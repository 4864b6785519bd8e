"""The exercise runner (``make check``): one line per task, from the grader's own judges.

A stub says it is not written yet, a hang costs only its task's line and says where, and
check mode -- on in the runner -- never fails correct code: its comparison travels through
the store, and the judges do not count the course's own traffic as the student's.
"""

import subprocess
import sys

from collectives.course.catalog import ROOT, lesson

ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_one_line_per_task_a_stub_says_so_and_a_hang_costs_only_its_line(tmp_path):
    # lesson 4's exercise with task 1 solved (the reference) and task 4 hanging; task 2 a stub
    source = lesson(4).exercise.read_text()
    head, main = source.split('if __name__ == "__main__":')
    exercise = tmp_path / "exercise.py"
    hang = ("def pipelined_ring_all_reduce(tensor, op=ReduceOp.SUM, group=None, pieces=4):\n"
            "    if dist.get_world_size() > 1:   # every rank waits for its left neighbour first\n"
            "        dist.recv(tensor.clone(), (dist.get_rank() - 1) % dist.get_world_size())\n\n\n")
    exercise.write_text(head + "from collectives.ring import ring_reduce_scatter  # noqa\n\n\n" + hang
                        + 'if __name__ == "__main__":' + main)
    proc = _run(exercise, "--task", "1", "--task", "2", "--task", "4", "--timeout", "6")
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4, proc.stdout + proc.stderr[-2000:]
    assert lines[0] == "task 1 ring reduce-scatter: PASS"
    assert lines[1] == "task 2 ring all-gather: FAIL: not written yet (Lesson 4, task 2: ring_all_gather)"
    assert lines[2].startswith("task 4 pipelined ring: FAIL: the world hung in pipelined_ring_all_reduce (")
    assert "and was stopped after 6 s" in lines[2] and "waiting in recv from rank" in lines[2], lines[2]
    assert lines[3].startswith("lesson 4: 1 of 3 tasks pass")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr


def test_check_mode_passes_the_reference_ring_and_a_ring_written_another_way():
    # check mode compares every call's arguments across ranks; before its comparison moved
    # to the store, the graded ring saw it as a collective and failed the reference
    # (the reference's own run in check mode is the agreement test's, tests/test_grader.py)
    for exercise in ("tests/solutions/lesson04_ring.py",):
        proc = _run(exercise, "--task", "3", "--task", "4")
        assert proc.stdout.splitlines()[:2] == ["task 3 ring all-reduce: PASS", "task 4 pipelined ring: PASS"], \
            exercise + "\n" + proc.stdout + proc.stderr[-2000:]
        assert proc.returncode == 0


def test_under_torchrun_on_one_machine_each_task_is_judged_in_the_world_and_says_so():
    # torchrun's own world of 4: the judges run in it (records exchanged through its store),
    # rank 0 prints one line per task with the time per rank its probes took
    torchrun = ROOT / ".venv" / "bin" / "torchrun"
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "4", "tests/solutions/lesson04_ring.py",
                           "--task", "3", "--task", "4"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**ENV, "OMP_NUM_THREADS": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("task ")]
    verdicts = [line.split(" (")[0].strip() for line in lines]
    assert verdicts == ["task 3 ring all-reduce: PASS", "task 4 pipelined ring: PASS"], proc.stdout + proc.stderr[-999:]
    assert all(" s per rank" in line for line in lines), lines
    assert "a check, not a grade" in proc.stdout           # the grade is make grade's, sealed from the student
    assert proc.returncode == 0
