"""Exercise files that cheat on lesson 4's ring tasks (kept to prove the grader gives them 0).

Files named ``lessonNN_*.py`` are whole exercise files of lesson NN, each saying in its
docstring which tasks it earned under a grader that ran in the student's ranks; the
task table must give those tasks 0.

Each ``*.py`` here is a whole ``lessons/04_ring/exercise.py``: the reference for every task,
with the ring all-reduce (task 3) and the pipelined ring (task 4) replaced by a cheat that
scored full marks under the grader before it judged the ring in the grading process.
:mod:`tests.cheats.zeros` sends the messages the pattern tests expect, carrying zeros.
"""
