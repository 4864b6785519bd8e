"""The course's tooling: what walks the lessons, in folders by concern.

At the top, what every concern uses: the lesson map (:mod:`~collectives.course.catalog`),
loading the implementation under test (:mod:`~collectives.course.impl`), the equivalence
harness (:mod:`~collectives.course.verify` with its :mod:`~collectives.course.cases`) and the
tour (:mod:`~collectives.course.tour`). Below them, one folder per concern:

=============  ===========================================================================
``site/``      what the course site shows: claims read from records, figures, the trace
               player, the labs' glue
``benchmarks/`` every ``bench-*`` command, one module per lesson or topic, its record beside it
``grading/``   the graded tasks, the exercise runner, the grader, the helper sheets
``cli/``       the command line: ``.venv/bin/python -m collectives <command>``
=============  ===========================================================================

Imports go one way: ``cli`` -> ``grading`` and ``benchmarks`` -> ``site`` -> the top
modules -> the lessons -> ``core``. A benchmark draws its figures and states its sentences
with the site's helpers; the site reads the benchmarks' records as JSON files, never their
code; grading and the benchmarks do not import each other. ``tests/test_architecture.py``
checks this order.
"""
