"""Lesson 9, cheat (a): the expected answers, read out of the grading process's memory.
The old judge built its list of expected answers before it forked the rank; this file walks
up the call stack (and through every object the garbage collector knows) for it, and
returns the one at the current scenario's place (14/14
under the old grader). The judge now computes them after the rank's world has ended, from
seeds the rank drew for itself: there is nothing to find, and every task scores nothing.
"""

import gc
import sys

from collectives.debugging.dumps import Mismatch, Missing, Straggler, WaitCycle

LESSON = 9
_calls = {"n": 0}


def _answer(key):
    """The judge's list of expected answers (a local named ``wanted`` up the stack), at this
    call's place; else nothing is wrong."""
    index = _calls["n"]
    _calls["n"] += 1
    frame = sys._getframe(1)
    while frame is not None:
        wanted = frame.f_locals.get("wanted")
        if isinstance(wanted, list) and index < len(wanted):
            return wanted[index]
        frame = frame.f_back
    if "heap" not in _calls:              # anywhere else in memory (looked through once)
        _calls["heap"] = [obj for obj in gc.get_objects() if isinstance(obj, dict)
                          and {"missing", "mismatch", "cycle", "stragglers"} <= set(obj)]
    for obj in _calls["heap"]:
        return obj[key]
    return [] if key != "cycle" else None


def find_missing(dumps):
    # the answers had four fields once, five now
    return [Missing(r[0], r[1], "all_reduce", r[2], r[3]) if len(r) == 4 else Missing(*r)
            for r in _answer("missing")]


def find_mismatch(dumps):
    return [Mismatch(r[0], r[1], r[2], r[3], ()) if len(r) == 4 else Mismatch(*r) for r in _answer("mismatch")]


def wait_for_graph(dumps):
    return {}


def find_wait_cycle(dumps):
    ranks = _answer("cycle")
    return WaitCycle(tuple(ranks), ()) if ranks else None


def find_stragglers(dumps, min_lag=0.02):
    return [Straggler(group, rank, 0, 0, 0.0, 0) for group, rank in _answer("stragglers")]


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
