"""Lesson 9, cheat (c): task 3 answered with ``WaitCycle(mock.ANY, ())``, no patching at all
(the old judge compared the cycle's ranks with ``==``, and ANY equals everything). The
judge now takes only plain ints: task 3 scores nothing (task 1, the reference's, still
scores).
"""

from unittest import mock

from collectives.debugging.analyze import find_missing  # noqa: F401 - the reference's task 1
from collectives.debugging.dumps import WaitCycle

LESSON = 9


def find_mismatch(dumps):
    return []


def wait_for_graph(dumps):
    return {}


def find_wait_cycle(dumps):
    return WaitCycle(mock.ANY, ())


def find_stragglers(dumps, min_lag=0.02):
    return []


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
