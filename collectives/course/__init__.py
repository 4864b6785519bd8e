"""The course's tooling: what walks the lessons.

The lesson map (:mod:`~collectives.course.catalog`), loading the implementation under
test (:mod:`~collectives.course.impl`), the equivalence harness
(:mod:`~collectives.course.verify`), the exercise runner (:mod:`~collectives.course.runner`),
the grader, the tour, the benchmarks, the plots and the command line. Tooling imports the
lessons and the infrastructure; neither imports it back.
"""
