"""The labs' switch (``collectives.course.impl.Lab``): with IMPL = "exercise" a cell that needs
a task still a stub says which task, in one line, instead of a traceback or the reference."""

from __future__ import annotations

import re

import pytest
import torch

from collectives.course import impl
from collectives.course.impl import Lab, TaskNotWritten

EXERCISE = "lessons/04_ring/exercise.py"   # the stubs as a student gets them


def _reduce_scatter_in_a_rank():
    """Runs in a rank: the exercise's (unwritten) reduce-scatter, as lab 4's first cell does."""
    import torch.distributed as dist

    fn = impl.resolve(f"{EXERCISE}:ring_reduce_scatter")
    out = torch.empty(2)
    fn(out, torch.ones(2 * dist.get_world_size()))


def test_a_stub_is_told_from_written_code():
    assert impl.is_stub(impl.resolve(f"{EXERCISE}:tree_all_reduce"))
    assert not impl.is_stub(impl.resolve("collectives.topologies:tree_all_reduce"))

    def half_written(x):
        x.add_(1)
        raise NotImplementedError("Lesson 4, task 7: tree_all_reduce")
    assert not impl.is_stub(half_written), "code before the raise: the student has started"


def test_unwritten_task_names_itself_before_a_world_starts():
    lab = Lab(4, "exercise")
    with pytest.raises(TaskNotWritten) as caught:
        lab.target("tree_all_reduce")
    assert str(caught.value) == ("tree_all_reduce is not written yet (Lesson 4, task 7): "
                                 "write it or set IMPL = 'reference'")
    # a notebook shows the one line, not a traceback
    assert caught.value._render_traceback_() == [f"TaskNotWritten: {caught.value}"]
    # names the exercise does not define come from the reference, and the reference has no stubs
    reference = Lab(4, "reference").target("tree_all_reduce")
    assert impl.resolve(reference) is impl.resolve("collectives.topologies:tree_all_reduce")


def test_calling_an_unwritten_task_says_which_task():
    lab = Lab(4, "exercise")
    with pytest.raises(TaskNotWritten, match=r"^ring_all_reduce is not written yet \(Lesson 4, task 3\)"):
        lab.ring_all_reduce(torch.ones(4))


def test_a_rank_running_into_a_stub_stops_the_cell_with_the_task():
    lab = Lab(4, "exercise")
    with pytest.raises(TaskNotWritten, match=r"^ring_reduce_scatter is not written yet \(Lesson 4, task 1\)"):
        lab.run(_reduce_scatter_in_a_rank, 2, timeout=60)


def test_written_tasks_run_the_students_code(monkeypatch, tmp_path):
    # a student's copy of lessons/ where task 3 is written: it is what the lab runs, unwrapped errors and all
    folder = tmp_path / "04_ring"
    folder.mkdir()
    source = (impl.ROOT / EXERCISE).read_text()
    marker = 'raise NotImplementedError("Lesson 4, task 3: ring_all_reduce")'
    assert marker in source
    folder.joinpath("exercise.py").write_text(source.replace(marker, "tensor.mul_(2)"))
    monkeypatch.setenv("COLLECTIVES_EXERCISE_DIR", str(tmp_path))
    lab = Lab(4, "exercise")
    assert lab.target("ring_all_reduce") == f"{lab.spec}:ring_all_reduce"
    x = torch.ones(3)
    lab.ring_all_reduce(x)
    assert x.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(TaskNotWritten, match=r"\(Lesson 4, task 7\)"):
        lab.target("tree_all_reduce")


# --------------------------------------------------------------------------- the labs use the switch

SWITCHED_LABS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)


@pytest.mark.parametrize("number", SWITCHED_LABS)
def test_every_world_a_lab_starts_goes_through_its_switch(number):
    import inspect
    import json

    from collectives.course.catalog import lesson

    item = lesson(number)
    cells = ["".join(c["source"]) for c in json.loads(item.notebook.read_text())["cells"] if c["cell_type"] == "code"]
    setup = re.search(r"^(\w+) = Lab\(" + str(number) + r", IMPL\)", cells[0], re.M)
    assert setup and re.search(r'^IMPL = "reference"', cells[0], re.M), f"lab {number}: no switch in its first cell"
    name = setup.group(1)
    exercise = impl.load_module(str(item.exercise.relative_to(impl.ROOT)))
    written = [k for k, v in vars(exercise).items() if not k.startswith("_")
               and (inspect.isfunction(v) or inspect.isclass(v)) and v.__module__ == exercise.__name__]
    for i, code in enumerate(cells):
        assert "launch.run(" not in code, f"lab {number}, code cell {i}: start worlds with {name}.run"
        for fn in written:
            # the lesson's own functions only through the switch: never imported, never named by module
            assert not re.search(rf"import[^\n]*\b{fn}\b|{re.escape(item.module)}[.:]{fn}\b", code), \
                f"lab {number}, code cell {i} takes {fn} from the reference, not from {name}"


def test_the_whole_diagnosis_runs_the_students_checks():
    from collectives.debugging import diagnose, synth

    dumps = synth.scenario_dumps("skip", seed=3)
    assert diagnose(dumps, checks=Lab(9, "reference")) == diagnose(dumps)
    with pytest.raises(TaskNotWritten, match=r"^find_mismatch is not written yet \(Lesson 9, task 2\)"):
        diagnose(dumps, checks=Lab(9, "exercise"))


def test_a_lab_run_on_the_stubs_stops_at_the_first_task_with_its_name(monkeypatch):
    # lab 1's cells as a notebook runs them, in this process (a kernel costs seconds): the
    # setup and the first world run, the first cell that needs task 1 stops with its name
    import nbformat

    from collectives.course.site import labs

    monkeypatch.chdir(labs.NOTEBOOK_DIR)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(labs.NOTEBOOK_DIR / "01_p2p.ipynb", as_version=4)
    namespace = {"__name__": "__main__", "display": lambda *a, **k: None}
    stopped = None
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith("%"))
        source = source.replace('IMPL = "reference"', 'IMPL = "exercise"')
        try:
            exec(compile(source, f"<lab 1, code cell {i}>", "exec"), namespace)
        except TaskNotWritten as exc:
            stopped = i, exc
            break
    assert stopped is not None, "lab 1 ran to the end on the stubs"
    cell, exc = stopped
    assert "pass_token" in nb.cells[[k for k, c in enumerate(nb.cells) if c.cell_type == "code"][cell]].source
    assert str(exc) == "pass_token is not written yet (Lesson 1, task 1): write it or set IMPL = 'reference'"
    assert namespace["IMPL"] == "exercise" and namespace["p2p"].impl == "exercise"


def test_lab_6s_timelines_and_sweeps_run_the_switchs_reducer():
    from collectives.course.benchmarks import bucketing as bucketing_bench

    lab = Lab(6, "exercise")
    tiny = dict(vocab=16, d_model=8, nhead=2, ff=16, layers=1, seq=4)
    with pytest.raises(TaskNotWritten, match=r"is not written yet \(Lesson 6, task \d\)"):
        lab.run(bucketing_bench.sweep_rank, 2, args=([1.0],),
                kwargs=dict(sizes=tiny, steps=1, reducer=lab.target("BucketedReducer")), timeout=60)
    # with "reference" the same cells run the course's reducer (lab 6 runs so in the suite)
    assert bucketing_bench._reducer_class(Lab(6, "reference").target("BucketedReducer")) is \
        bucketing_bench.BucketedReducer


# Tasks a lab runs inside another task of the student's: gather_layer inside forward_prefetch,
# zero3_layer's hooks inside zero3_train, and reduce_scatter_grads inside those hooks.
INSIDE = {10: {"gather_layer": "forward_prefetch", "zero3_layer": "zero3_train",
               "reduce_scatter_grads": "zero3_layer"}}


@pytest.mark.parametrize("number", (10, 11))
def test_the_lab_runs_the_students_code_for_every_task(number):
    """Every task of lessons 10 and 11 is called through the lab's switch in some code cell
    (or inside another task that is), so "exercise" shows the student's code at work."""
    import inspect
    import json

    from collectives.course.catalog import lesson

    item = lesson(number)
    exercise = impl.load_module(str(item.exercise.relative_to(impl.ROOT)))
    tasks = [k for k, v in vars(exercise).items() if inspect.isfunction(v) and v.__module__ == exercise.__name__
             and re.match(rf"\s*Lesson {number}, task \d", v.__doc__ or "")]
    assert len(tasks) >= 5
    code = "\n".join("".join(c["source"]) for c in json.loads(item.notebook.read_text())["cells"]
                     if c["cell_type"] == "code")
    called = {t for t in tasks if re.search(rf"\blab\.{t}\b|\"{t}\"", code)}   # lab.name, or getattr(lab, "name")
    for _ in INSIDE.get(number, {}):                 # inside of inside: until nothing is added
        called |= {t for t, outer in INSIDE.get(number, {}).items() if outer in called}
    assert called == set(tasks), f"lab {number} never runs {sorted(set(tasks) - called)} through lab"
