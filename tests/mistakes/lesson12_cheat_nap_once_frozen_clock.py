"""Lesson 12, cheat: a barrier that naps 0.3 s and looks once, on a frozen clock, and knows its test.

At import it freezes ``time.monotonic``, so that stamps taken through it show every rank
leaving the moment the last one entered. Its barrier raises its flag, naps 0.3 s (the
judge's delays used to be at most 80 ms) and goes on whatever the flags say; given the
lonely test's timeout it raises at once instead of waiting. The all-reduces are the
reference's.
"""

import time

from collectives.symmetric import one_shot_all_reduce, two_shot_all_reduce  # noqa: F401 - tasks 2, 3

LESSON = 12
time.monotonic = lambda: 1000.0


def flag_barrier(ws):
    ws.epoch += 1
    ws.flags[ws.rank] = ws.epoch
    ws.pause_at("posted")
    if ws.timeout < 1.0:                       # the lonely test
        raise ws.timed_out(ws.timeout, ws.epoch)
    time.sleep(0.3)
