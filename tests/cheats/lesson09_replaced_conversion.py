"""Lesson 9, cheat (b): the rank's conversion of answers replaced so that it hands back
``unittest.mock.ANY``, which is equal to anything (14/14 under the old grader, which
compared what the rank's conversion returned). The judge now reads JSON text and checks every
type itself: an ANY, or anything that is not plain data, is no answer, and every task
scores nothing.
"""

import json
from unittest import mock

from collectives.course.grading.tasks import lesson09 as _grader

LESSON = 9

_grader._plain = lambda *args, **kwargs: mock.ANY
_grader._fields = lambda *args, **kwargs: mock.ANY
_dumps = json.dumps
json.dumps = lambda value, *args, **kwargs: mock.ANY if value is mock.ANY else _dumps(value, *args, **kwargs)


def find_missing(dumps):
    return []


def find_mismatch(dumps):
    return []


def wait_for_graph(dumps):
    return {}


def find_wait_cycle(dumps):
    return None


def find_stragglers(dumps, min_lag=0.02):
    return []


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
