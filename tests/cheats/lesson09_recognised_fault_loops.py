"""Lesson 9, cheat (d): which fault made the dumps, recognised from the function names in
``frames`` -- the course's own fault loops -- and the answer given only where that fault is
the one the task looks for, by the reference (14/14 under the old grader, whose dumps all
came from those loops). The judge now hands over hand-made dumps too, with other function
and file names: this file recognises nothing there and answers that nothing is wrong, and
every task scores nothing.
"""

from collectives.debugging import analyze

LESSON = 9
LOOPS = {"skipped_collective": "skip", "swapped_order": "order", "send_first_deadlock": "deadlock",
         "wrong_size": "size", "wrong_dtype": "dtype", "straggler": "straggler", "killed_rank": "killed",
         "link_down": "link"}


def _fault(dumps):
    for dump in dumps:
        for entry in dump["entries"]:
            for frame in entry["frames"]:
                if frame["name"] in LOOPS:
                    return LOOPS[frame["name"]]
    return None


def find_missing(dumps):
    return analyze.find_missing(dumps) if _fault(dumps) == "skip" else []


def find_mismatch(dumps):
    return analyze.find_mismatch(dumps) if _fault(dumps) in ("order", "size", "dtype") else []


def wait_for_graph(dumps):
    return analyze.wait_for_graph(dumps)


def find_wait_cycle(dumps):
    return analyze.find_wait_cycle(dumps) if _fault(dumps) == "deadlock" else None


def find_stragglers(dumps, min_lag=0.02):
    return analyze.find_stragglers(dumps, min_lag) if _fault(dumps) == "straggler" else []


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
