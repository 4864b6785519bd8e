"""The judge patched when the exercise is imported (lesson 4: nothing written).

At import the exercise replaces what judges a task -- ``run_task`` where the runner and the
tasks' table hold it, and ``verify.compare`` -- with functions that find nothing wrong;
every function is left a stub. Run as a script (``make check``), the old runner judged in
this very process and every task passed. ``make grade`` never judged here.
"""

import collectives.course.grading.runner as _runner
import collectives.course.grading.tasks as _tasks
from collectives import verify
from collectives.course.grading.runner import run_tasks
from collectives.course.grading.tasks.world import Verdict

LESSON = 4


def _nothing_wrong(task, grading):
    return Verdict()


_runner.run_task = _tasks.run_task = _nothing_wrong
verify.compare = lambda *args, **kwargs: None


def _stub(name):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"Lesson 4: {name}")
    stub.__name__ = name
    return stub


ring_reduce_scatter = _stub("ring_reduce_scatter")
ring_all_gather = _stub("ring_all_gather")
ring_all_reduce = _stub("ring_all_reduce")
pipelined_ring_all_reduce = _stub("pipelined_ring_all_reduce")
recursive_doubling_all_reduce = _stub("recursive_doubling_all_reduce")
halving_doubling_all_reduce = _stub("halving_doubling_all_reduce")
tree_all_reduce = _stub("tree_all_reduce")


if __name__ == "__main__":
    run_tasks(LESSON)
