"""``.venv/bin/python -m collectives <command>``: see :mod:`collectives.course.cli`."""

import sys

from collectives.course.cli import main

if __name__ == "__main__":
    sys.exit(main())
