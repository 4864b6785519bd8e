"""The command line: ``.venv/bin/python -m collectives <command>`` (:mod:`~collectives.course.cli.main`).

Commands of their own live beside it: ``cluster`` (:mod:`~collectives.course.cli.cluster`),
``diagnose`` (:mod:`~collectives.course.cli.diagnose`) and ``trace``
(:mod:`~collectives.course.cli.trace`); every other command is a function of the module that
does the work, named in :data:`~collectives.course.cli.main.COMMANDS`.
"""
