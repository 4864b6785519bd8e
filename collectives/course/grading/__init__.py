"""Grading: the tasks, the runner that checks an exercise, and the grader that scores it.

:mod:`~collectives.course.grading.tasks` holds every lesson's graded tasks (one module per
lesson, with its helpers beside it) and the world that judges them outside the student's code;
:mod:`~collectives.course.grading.runner` is the exercise files' PASS/FAIL runner
(``make check``), :mod:`~collectives.course.grading.grade` the score table (``make grade``),
and :mod:`~collectives.course.grading.helpers` writes each exercise's helper sheet.
"""
