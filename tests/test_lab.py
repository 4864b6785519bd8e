"""The labs' switch (``collectives.course.impl.Lab``): with IMPL = "exercise" a cell that needs
a task still a stub says which task, in one line, instead of a traceback or the reference."""

from __future__ import annotations

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
    assert str(caught.value) == ("task 7 of lesson 4 is not written yet (tree_all_reduce): "
                                 "write it or set IMPL = 'reference'")
    # a notebook shows the one line, not a traceback
    assert caught.value._render_traceback_() == [f"TaskNotWritten: {caught.value}"]
    # names the exercise does not define come from the reference, and the reference has no stubs
    reference = Lab(4, "reference").target("tree_all_reduce")
    assert impl.resolve(reference) is impl.resolve("collectives.topologies:tree_all_reduce")


def test_calling_an_unwritten_task_says_which_task():
    lab = Lab(4, "exercise")
    with pytest.raises(TaskNotWritten, match=r"^task 3 of lesson 4 is not written yet \(ring_all_reduce\)"):
        lab.ring_all_reduce(torch.ones(4))


def test_a_rank_running_into_a_stub_stops_the_cell_with_the_task():
    lab = Lab(4, "exercise")
    with pytest.raises(TaskNotWritten, match=r"^task 1 of lesson 4 is not written yet \(ring_reduce_scatter\)"):
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
    with pytest.raises(TaskNotWritten, match="task 7 of lesson 4"):
        lab.target("tree_all_reduce")
