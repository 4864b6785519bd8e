"""A clock the exercise patches, and answers no judge can read (lesson 1, tasks 3 and 4).

At import ``time.perf_counter`` is replaced by a clock that runs at a tenth of the speed:
``ping_pong`` is the reference, timing real round trips with it, so every time it reports
is a tenth of the truth while the code that timed it looks honest. ``measure_alpha_beta``
returns ``unittest.mock.ANY``, an object equal to everything, where the judge expects a
fit and a table. Tasks 1 and 2 are the reference.
"""

import time
import unittest.mock

from collectives.course.grading.runner import run_tasks
from collectives.p2p import exchange, pass_token  # noqa: F401
from collectives.p2p import ping_pong as _ping_pong

LESSON = 1

_real = time.perf_counter
_start = _real()
time.perf_counter = lambda: _start + (_real() - _start) / 10


def ping_pong(nbytes, iters=10, group=None):
    return _ping_pong(nbytes, iters, group)


def measure_alpha_beta(sizes=None, iters=10, group=None):
    return unittest.mock.ANY


if __name__ == "__main__":
    run_tasks(LESSON)
