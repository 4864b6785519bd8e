"""A module written into the grader's own tree (lesson 4, tasks 1 and 2).

The ring's halves are the reference's; the first call in each rank also writes a module
into the course's package (``collectives/course/grading/tasks/``), where a later import --
the grader's own, or the sealed reader's of a class it names -- would run it.
"""

import os

import collectives
from collectives.ring import *  # noqa: F401,F403
from collectives.ring import ring_all_gather as _all_gather
from collectives.ring import ring_reduce_scatter as _reduce_scatter
from collectives.topologies import *  # noqa: F401,F403

PLANTED = os.path.join(os.path.dirname(collectives.__file__), "course", "grading", "tasks", "planted_by_a_rank.py")


def _plant():
    with open(PLANTED, "w") as f:
        f.write("class Verdict:\n    ok = True\n")


def ring_reduce_scatter(output, input, *args, **kwargs):
    _plant()
    return _reduce_scatter(output, input, *args, **kwargs)


def ring_all_gather(output, input, *args, **kwargs):
    _plant()
    return _all_gather(output, input, *args, **kwargs)
