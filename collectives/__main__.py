"""``.venv/bin/python -m collectives <command>``: see :mod:`collectives.course.cli.main`."""

import sys

from collectives.course.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
