"""The exercise runner: one line per task, a hang costs only its task and names where it hung."""

import subprocess
import sys

from collectives.course.catalog import ROOT, lesson


def test_one_line_per_task_and_a_hanging_task_costs_only_its_line(tmp_path):
    # lesson 4's exercise with its checks, task 1 solved (the reference) and task 4 hanging
    source = lesson(4).exercise.read_text()
    head, main = source.split('if __name__ == "__main__":')
    exercise = tmp_path / "exercise.py"
    exercise.write_text(head + "from collectives.ring import ring_reduce_scatter  # noqa\n"
                        "from tests.cheats.replaced_verdict_and_a_hang import pipelined_ring_all_reduce  # noqa\n\n"
                        'if __name__ == "__main__":' + main)
    proc = subprocess.run([sys.executable, str(exercise), "--world", "3", "--task", "1", "--task", "2",
                           "--task", "4", "--timeout", "6"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4, proc.stdout + proc.stderr[-2000:]
    assert lines[0] == "task 1 ring reduce-scatter: PASS"
    assert lines[1].startswith("task 2 ring all-gather: FAIL on ranks 0-2: not implemented yet")
    assert lines[2].startswith("task 4 pipelined ring: FAIL: the world hung in pipelined_ring_all_reduce (case ")
    assert "waiting in recv from rank" in lines[2]
    assert lines[3].startswith("lesson 4: 1 of 3 tasks pass on a world of 3")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
