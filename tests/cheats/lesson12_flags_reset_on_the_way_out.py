"""Lesson 12, cheat: the naive barrier -- a flag set to 1 on arrival and reset to 0 on the way out.

It passes many barriers: each rank usually looks at the flags before the fastest rank has
reset its own. But a rank that is descheduled between raising its flag and looking waits
for ever once a faster peer has reset -- in the judge's worlds, whose ranks enter after
random delays, that happens within a few barriers, and the rank gives up after the
probe's timeout, naming itself. Where it does not, the judge reads flags that went back
to 0 after a barrier; the lesson's epoch flags never go down. The all-reduces are the
reference's, on this barrier.
"""

import os
import time

from collectives.symmetric import one_shot_all_reduce, two_shot_all_reduce  # noqa: F401 - tasks 2, 3

LESSON = 12


def flag_barrier(ws):
    ws.epoch += 1
    ws.flags[ws.rank] = 1
    ws.pause_at("posted")
    started = time.monotonic()
    while min(ws.flags.tolist()) < 1:
        if time.monotonic() - started > ws.timeout:
            raise ws.timed_out(time.monotonic() - started, 1)
        os.sched_yield()
    ws.flags[ws.rank] = 0


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
