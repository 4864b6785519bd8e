"""Check and grade agree, and the grader can fail: proved lesson by lesson.

For every lesson, the exercise runner (``make check``: the exercise file run as a script)
and the grader (``make grade``) are run on

* the reference solution -- every task PASS in the runner, full points in the grader;
* the pristine stubs -- every task FAIL "not written yet" in both, 0 points;
* every partial solution, tasks 1..k solved and the rest stubs -- task k PASS and full,
  task k + 1 FAIL and zero, in both. With the two ends above this proves the whole
  matrix: a task that needed a later task's function would fail at its own boundary, and
  one that did not call its own function would pass on the stubs.

Both read one task table (:mod:`collectives.course.grading.tasks`); the runner's worlds run in
check mode and the grader's do not, so this also shows check mode changes no verdict of
working code. Cheating exercises (``tests/cheats/``) score 0 on the tasks they target.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from collectives.course.catalog import LESSONS, ROOT, lesson
from collectives.course.grading import grade as grading
from collectives.course.grading import runner
from collectives.course.grading.tasks import tasks_of

from .grading_fixtures import finished_worlds_side_channels_removed, grader, with_exercise

ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
NUMBERS = [item.number for item in LESSONS]
PARTIAL_WORLD = 4
LINE = re.compile(r"^task (\d+) .*?: (PASS|FAIL)(?:: (.*))?$")


def _runner_here(number: int, exercises: Path, *args: str) -> dict[int, tuple[bool, str]]:
    """The runner's own ``run_tasks`` on a copy of ``lessons/`` (the in-process route)."""
    out = io.StringIO()
    before = os.environ.get("COLLECTIVES_EXERCISE_DIR")
    os.environ["COLLECTIVES_EXERCISE_DIR"] = str(exercises)
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            runner.run_tasks(number, argv=list(args))
    finally:
        if before is None:
            os.environ.pop("COLLECTIVES_EXERCISE_DIR")
        else:
            os.environ["COLLECTIVES_EXERCISE_DIR"] = before
    return _parse(out.getvalue(), "")


def _parse(stdout: str, stderr: str) -> dict[int, tuple[bool, str]]:
    found = {}
    for line in stdout.splitlines():
        match = LINE.match(line)
        if match:
            found[int(match.group(1))] = (match.group(2) == "PASS", match.group(3) or "")
    assert found, f"no task lines in the runner's output:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return found


def partial_solution(number: int, solved: int, into: Path) -> Path:
    """A copy of ``lessons/`` whose lesson ``number`` has tasks 1..``solved`` taken from the
    reference and the rest left as stubs; returns the copy's folder."""
    shutil.copytree(ROOT / "lessons", into)
    item = lesson(number)
    exercise = into / item.exercise.parent.name / "exercise.py"
    names = [name for task in tasks_of(number)[:solved] for name in task.functions]
    lines = [f"import {item.module} as _reference  # noqa: E402"]
    for name in names:
        if "." in name:                      # a method of one of the exercise's classes
            owner, method = name.split(".", 1)
            lines.append(f"{owner}.{method} = _reference.{owner}.{method}")
        else:
            lines.append(f"{name} = _reference.{name}")
    source = exercise.read_text()
    head, main = source.split('if __name__ == "__main__":')
    exercise.write_text(head + "\n".join(lines) + "\n\n\nif __name__ == \"__main__\":" + main)
    return into


@pytest.mark.parametrize("number", NUMBERS)
def test_check_and_grade_agree_on_the_reference_the_stubs_and_every_partial_solution(number, tmp_path):
    tasks = tasks_of(number)
    assert tasks and all(t.functions for t in tasks), f"lesson {number}: every task names its functions"

    # the runner in this process (the script route, a subprocess per run, is tests/test_runner.py's)
    reference = (_runner_here(number, ROOT / "lessons", "--impl", "reference"), grader(number, "reference"))
    for task in tasks:
        for route, verdicts in zip(("make check", "make grade"), reference):
            passed, detail = verdicts[task.number]
            assert passed, f"lesson {number} task {task.number}, reference, {route}: {detail}"

    stubs = (_runner_here(number, ROOT / "lessons"), grader(number))
    for task in tasks:
        for route, verdicts in zip(("make check", "make grade"), stubs):
            passed, detail = verdicts[task.number]
            assert not passed and "not written yet" in detail, \
                f"lesson {number} task {task.number}, stubs, {route}: {detail}"

    for k in range(1, len(tasks)):
        if set(tasks[k].functions) <= {name for t in tasks[:k] for name in t.functions}:
            continue                         # task k + 1 asks more of a function already solved
        copy = partial_solution(number, k, tmp_path / f"solved{k}")
        # the reference's full judging is above; a partial is judged on worlds of 4 by both routes
        chosen = [str(a) for t in (k, k + 1) for a in ("--task", t)] + ["--world", str(PARTIAL_WORLD)]
        check = _runner_here(number, copy, *chosen)
        grade = grader(number, exercises=copy, tasks=[k, k + 1], world=PARTIAL_WORLD)
        for route, verdicts in (("make check", check), ("make grade", grade)):
            assert verdicts[k][0], f"lesson {number}, tasks 1..{k} solved, {route}: task {k} failed: {verdicts[k][1]}"
            assert not verdicts[k + 1][0], f"lesson {number}, tasks 1..{k} solved, {route}: task {k + 1} passed"


def test_the_grade_command_prints_the_table_and_fails_below_full_marks(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "collectives", "grade", "--lesson", "04", "--task", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert "SCORE 0/3" in proc.stdout and proc.returncode != 0, proc.stdout + proc.stderr[-2000:]
    assert "lessons/04_ring/exercise.py --verbose" in proc.stdout, "it says how to see the problems in full"


CHEATS = ROOT / "tests" / "cheats"
# fixture -> (lesson, tasks it must score 0 on)
CHEAT_TARGETS = {
    # fixture: (lesson, tasks it must score 0 on, a task of the reference's it must still score,
    # or None where the fixture replaces every task's function)
    "lesson01_predicted_tokens_and_made_up_times": (1, (1, 2, 3, 4), None),
    "lesson02_paused_twins_and_decoys": (2, (1, 2, 5, 7), None),
    "lesson02_predicted_inputs": (2, (1, 2, 4, 5, 7), 3),
    "lesson03_paused_all_reduce_and_decoys": (3, (1, 2, 3), None),
    "lesson03_replaced_verdict_and_own_input_forwarded": (3, (1, 3), None),
    "paused_all_reduce_and_small_worlds": (4, (3, 4), 1),
    "divisible_sizes_and_fixed_seed": (4, (3, 4), 1),
    "replaced_verdict_and_a_hang": (4, (3, 4), 1),
    "lesson05_paused_per_tensor_with_decoys": (5, (4, 5), 1),
    "lesson05_replaced_verdict": (5, (4, 5), 2),
    "lesson05_known_inputs": (5, (1, 3), 2),
    "lesson05_silenced_stream_checker": (5, (5,), 1),
    "lesson06_paused_flat_with_decoys": (6, (2, 3), 1),
    "lesson06_replaced_test_helpers": (6, (3, 4), 1),
    "lesson06_lazy_launches_forged_times": (6, (2, 3), 1),
    "lesson07_paused_flat_with_decoys": (7, (2, 3, 4, 5), 1),
    "lesson07_replaced_verdict": (7, (1, 2, 3, 4), 6),
    "lesson07_rail_for_the_stages": (7, (3, 4), 2),
    "lesson07_flat_hook": (7, (6,), 5),
    "lesson08_dense_masked_all_reduce": (8, (2, 3, 4), 1),
    "lesson08_paused_flat_with_decoys": (8, (2, 3, 5), 1),
    "lesson08_replaced_verdict_and_test_helpers": (8, (2, 3), 1),
    "lesson08_dense_hook": (8, (5,), 1),
    "lesson09_walks_to_the_expected_answers": (9, (1, 2, 3, 4), None),
    "lesson09_replaced_conversion": (9, (1, 2, 3, 4), None),
    "lesson09_any_cycle": (9, (3,), 1),
    "lesson09_recognised_fault_loops": (9, (1, 2, 3, 4), None),
    "lesson10_all_reduce_and_gather_everything": (10, (2, 4), 1),
    "lesson11_library_all_to_all": (11, (1, 2, 3, 4, 5), None),
    "lesson12_all_reduce_in_disguise": (12, (2, 3), 1),
    "lesson12_flags_reset_on_the_way_out": (12, (1,), None),
    "lesson13_library_gathers_moved_case_and_decoys": (13, (3, 4, 5), 1),
    "lesson14_side_channel_barrier_and_moved_case": (14, (1, 2, 4), 3),
    # every class of cheat on the grader itself, judged on worlds of 4 (QUICK): a task that
    # fails there fails the full grade too
    "side_channel_and_decoys": (4, (1, 2, 3), None),
    "forged_records_and_moved_cases": (4, (1, 2), None),
    "functional_collectives_and_tap_originals": (4, (1, 2), None),
    "planted_module": (4, (1, 2), None),
    "lesson01_slowed_clock_and_foreign_answers": (1, (3, 4), None),
    "patched_judge_at_import": (4, (1,), None),
    "signed_forgeries_and_a_gloo_of_its_own": (4, (1, 2), None),
}
QUICK = {"side_channel_and_decoys", "forged_records_and_moved_cases", "signed_forgeries_and_a_gloo_of_its_own",
         "functional_collectives_and_tap_originals",
         "planted_module", "lesson01_slowed_clock_and_foreign_answers", "patched_judge_at_import"}


@pytest.mark.parametrize("name", CHEAT_TARGETS)
def test_every_cheat_scores_zero_on_its_tasks_and_a_hang_costs_only_its_task(name, tmp_path, monkeypatch):
    number, targets, control = CHEAT_TARGETS[name]
    student = tmp_path / name
    with_exercise(number, CHEATS / f"{name}.py", student)
    monkeypatch.setenv("COLLECTIVES_TIMEOUT", "10")
    if name in OWN_TREE:
        verdicts = _graded_in_a_copy_of_the_package(number, student, sorted(targets), tmp_path)
    else:
        verdicts = grader(number, exercises=student, tasks=sorted(targets),
                          world=PARTIAL_WORLD if name in QUICK else None)
    if control is not None:                  # the fixture leaves the reference's task whole (worlds of 4 show it)
        verdicts.update(grader(number, exercises=student, tasks=[control], world=PARTIAL_WORLD))
    finished_worlds_side_channels_removed()     # before the verdicts are held: a failing one leaves nothing
    for task in targets:
        assert not verdicts[task][0], f"{name}: task {task} scored: {verdicts[task][1]}"
    if control is not None:
        assert verdicts[control][0], f"{name}: task {control} (the reference's) scores: {verdicts[control][1]}"
    if name == "replaced_verdict_and_a_hang":
        assert "hung in pipelined_ring_all_reduce" in verdicts[4][1], verdicts[4][1]


# A cheat that writes into the course's package is graded by a grader of its own, in a copy of
# the package: the live tree is what every other test's worlds check, at the same time, on the
# other pytest worker, and a file planted there would fail their worlds too.
OWN_TREE = {"planted_module"}


def _graded_in_a_copy_of_the_package(number: int, student: Path, tasks: list[int], tmp_path: Path) -> dict:
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT / "collectives", copy / "collectives", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "grade.json"
    env = dict(os.environ, PYTHONPATH=str(copy))
    subprocess.run([sys.executable, "-m", "collectives", "grade", "--lesson", f"{number:02d}", "--exercises",
                    str(student), "--json", str(out), "--world", str(PARTIAL_WORLD)]
                   + [a for task in tasks for a in ("--task", str(task))],
                   cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert not (ROOT / "collectives" / "course" / "grading" / "tasks" / "planted_by_a_rank.py").exists()
    [record] = json.loads(out.read_text())
    return {t["task"]: (t["passed"], t["result"]) for t in record["tasks"]}


def test_every_cheat_fixture_is_listed():
    on_disk = {p.stem for p in CHEATS.glob("*.py")} - {"__init__", "zeros", "avg_divides_the_whole_tensor",
                                                        "side_channel"}
    assert on_disk == set(CHEAT_TARGETS), on_disk ^ set(CHEAT_TARGETS)


def test_lesson_7_stages_written_with_library_collectives_pass(tmp_path):
    # the stubs' plain way (a reduce-scatter, an all-to-all and all-gathers on the stage
    # groups; dist.all_reduce on the rail for task 2) is the design too, not only the
    # reference's messages
    student = tmp_path / "lessons"
    with_exercise(7, ROOT / "tests" / "solutions" / "lesson07_library.py", student)
    verdicts = grader(7, exercises=student, tasks=[2, 3])
    assert verdicts[2][0] and verdicts[3][0], verdicts


def test_a_judge_patched_at_import_fails_under_make_check_as_under_make_grade(tmp_path):
    # the exercise run as a script hands over to a fresh interpreter before judging: what it
    # patched in its own process at import judges nothing
    student = tmp_path / "lessons"
    shutil.copytree(ROOT / "lessons", student)
    exercise = student / "04_ring" / "exercise.py"
    shutil.copy(CHEATS / "patched_judge_at_import.py", exercise)
    proc = subprocess.run([sys.executable, str(exercise), "--task", "1", "--world", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    check = _parse(proc.stdout, proc.stderr)
    assert not check[1][0] and "not written yet" in check[1][1] and proc.returncode == 1, proc.stdout
    grade = grader(4, exercises=student, tasks=[1], world=2)
    assert not grade[1][0] and "not written yet" in grade[1][1], grade


def test_a_class_run_grades_every_folder_and_writes_its_json_whatever_a_judge_meets(tmp_path, monkeypatch):
    # a rank's record holding an object of the student's (unittest.mock.ANY) breaks a judge
    # that reads it: that task scores 0 with a verdict, and the next folder is graded
    import pickle
    import unittest.mock

    from collectives.core import channels
    from collectives.course.grading.tasks import GradedTask, Verdict

    def judge(grading):
        if os.environ["COLLECTIVES_EXERCISE_DIR"].endswith("anything"):
            channels.sealed_loads(pickle.dumps(unittest.mock.ANY)).reshape(-1)     # AttributeError
        return Verdict()

    monkeypatch.setattr(grading, "tasks_of", lambda number: [GradedTask(number, 1, "reads a record", 2, judge)])
    folders = [tmp_path / "answers_anything", tmp_path / "honest"]
    out = tmp_path / "class.json"
    code = grading.main([a for f in folders for a in ("--exercises", str(f))] + ["--lesson", "04", "--json", str(out)])
    records = json.loads(out.read_text())
    assert code == 1 and [r["earned"] for r in records] == [0, 2], records
    assert "could not read what the ranks returned (AttributeError" in records[0]["tasks"][0]["result"], records


def test_a_hang_names_every_rank_s_wait_and_the_cycle():
    from collectives.core.launch import WorldTimeout
    from collectives.course.grading.tasks import hang_line

    waits = {0: "waiting in recv from rank 2 (for 4.0 s), in ring_all_reduce (n=8)",
             1: "waiting in recv from rank 0 (for 4.0 s), in ring_all_reduce (n=8)",
             2: "waiting in send to rank 1 (for 4.0 s), in ring_all_reduce (n=8)", 3: "finished"}
    line = hang_line(WorldTimeout(5, waits, {r: "ring_all_reduce (n=8)" for r in range(3)}), "task")
    assert line.startswith("the world hung in ring_all_reduce (n=8) and was stopped after 5 s (")
    for r in range(3):
        assert f"rank {r} {waits[r].split(' (for')[0]}" in line, line
    assert "rank 3" not in line.split("(", 2)[2].split("):")[0] and "rank 0 -> rank 2 -> rank 1 -> rank 0" in line, line


def probe_every_route(probe):
    """Every route to a collective in a world of 2 whose task allows messages only."""
    import torch
    import torch.distributed as dist

    from collectives.course.grading.tasks import fence

    t = torch.ones(4)
    world = dist.group.WORLD
    tap_wrapper = dist.ProcessGroup.allreduce
    original = next(c.cell_contents for c in tap_wrapper.__closure__ if callable(c.cell_contents)
                    and getattr(c.cell_contents, "__name__", "") == "allreduce")
    attempts = {
        "dist.all_reduce": lambda: dist.all_reduce(t),
        "group.alltoall_base": lambda: world.alltoall_base(torch.empty(4), t, [], []).wait(),
        "functional": lambda: torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(t, "sum", world.group_name)),
        "c10d operator": lambda: torch.ops.c10d.allreduce_([t], world, dist.ReduceOp.SUM, None, False, -1),
        "the tap's original": lambda: original(world, [t]).wait(),
        "a new group": lambda: dist.all_reduce(t, group=dist.new_group([0, 1])),
    }
    errors = {name: probe.call(name, attempt).error for name, attempt in attempts.items()}
    sent = probe.call("messages", lambda: dist.send(t, 1) if probe.rank == 0 else dist.recv(t, 0))
    probe.call("behind the fence", lambda: fence._ORIGINAL["allreduce"](world._gloo, [t]).wait())
    probe.call("a gloo group", lambda: dist.broadcast(t, 0, group=dist.new_group([0, 1], backend="gloo")))
    return errors, sent.error


def test_a_task_of_messages_offers_no_other_route_and_sees_the_backend_used_behind_it():
    from collectives.course.grading.tasks import P2P, Grading

    grading = Grading("collectives.ring", timeout=60)
    grading.routes = P2P
    run = grading.world("tests.test_grader:probe_every_route", 2)
    for rank in range(2):
        errors, sent = run.results[rank]
        assert not sent, sent
        for route, error in errors.items():
            assert error.startswith("raised RuntimeError"), (rank, route, error)
    problems = run.problems()
    for rank in range(2):       # a group made with a backend of its own is seen by the recorder underneath
        assert f"rank {rank}: called allreduce, alltoall_base, broadcast: this task allows recv, recv_anysource, " \
               "send only" in problems, problems
        assert f"rank {rank}: called the process group's backend directly (operations behind the process " \
               "group)" in problems, problems


def test_the_sealed_reader_admits_the_listed_course_classes_only():
    import pickle

    from collectives.core import channels
    from collectives.course.grading.tasks.tap import Call
    from collectives.debugging.dumps import Missing

    call = Call("send", 1, 4, "float32", 1.0, 2.0, (0, 1))
    assert channels.sealed_loads(pickle.dumps(call)) == call
    assert isinstance(channels.sealed_loads(pickle.dumps(Missing.__new__(Missing))), channels.Foreign)


def test_stamps_are_taken_with_the_clock_the_course_held_before_any_exercise(monkeypatch):
    import time

    from collectives.core import trace
    from collectives.course.grading.tasks import fence, tap

    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)
    assert all(clock() > 0 for clock in (trace._clock, tap._clock, fence._clock))


def test_the_audit_table_names_only_fixtures_and_tests_that_grade_it():
    page = (ROOT / "docs" / "reference" / "grading.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ") and not line.startswith("| Class")]
    named = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[2])}
    tests = {name for name in globals() if name.startswith("test_")}
    assert named and named <= set(CHEAT_TARGETS) | tests, named - set(CHEAT_TARGETS) - tests
    assert QUICK <= named, QUICK - named


def test_verbose_adds_the_next_step_for_the_first_problem():
    from collectives.course.grading.tasks import Verdict

    task = tasks_of(4)[0]
    routes = Verdict(["rank 0: called allreduce: this task allows recv, recv_anysource, send only"])
    assert "next: build it from dist.send" in runner.task_line(task, routes, verbose=True)
    assert "next:" not in runner.task_line(task, routes)
    hang = Verdict(["the world hung in x (rank 0 waiting in recv from rank 1; rank 1 waiting in recv from rank 0): "
                    "the ranks wait on each other in a cycle, rank 0 -> rank 1 -> rank 0"])
    assert "post the receive before the send" in runner.task_line(task, hang, verbose=True)


def test_a_ring_message_must_carry_a_block_or_piece_of_the_ring_not_one_of_its_size():
    import torch

    from collectives.core.ops import chunk_bounds
    from collectives.course import verify
    from collectives.course.grading.tasks import lesson04
    from collectives.course.grading.tasks.tap import Call, fingerprint
    from collectives.course.grading.tasks.world import Run

    p, case = 3, verify.Case(lesson04.PIPELINE_N)
    run = Run(p, [11, 22, 33], [], [{}] * p, [[]] * p)
    inputs = [verify.make_values(case, r, run.secrets[r]) for r in range(p)]
    lo, hi = chunk_bounds(case.numel, p)[0]
    piece = (inputs[0][lo:hi] + inputs[2][lo:hi])[: (hi - lo) // 2]      # rank 0 forwards half of chunk 0's partial

    def send(values):
        return Call("send", 1, values.numel(), "float32", 0.0, fingerprint(values), (0, 1, 2))
    assert lesson04._pipelined_content(run, case, 0, [send(piece)]) is None
    decoy = send(torch.randint(-100, 100, (piece.numel(),)).float())
    problem = lesson04._pipelined_content(run, case, 0, [decoy])
    assert "did not carry a chunk reduced over the ranks before it" in problem, problem


def test_traffic_is_bounded_both_ways():
    from collectives.course.grading.tasks.evidence import traffic_within
    from collectives.course.grading.tasks.tap import Call

    def sends(*sizes):
        return [Call("send", 1, n, "float32", 0.0, 0.0, (0, 1)) for n in sizes]
    assert traffic_within(sends(3, 3), 6, 6) is None
    assert "at least 6 must leave this rank" in traffic_within(sends(3), 6, 6)
    assert "more than the 6 this algorithm sends" in traffic_within(sends(3, 3, 12), 6, 6)
