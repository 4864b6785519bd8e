"""The code passes ``ruff check`` (pyflakes, pycodestyle, import order: ``[tool.ruff]`` in
pyproject.toml), so ``make test`` and CI hold every change to the same style."""

import subprocess
import sys

from collectives.course.catalog import ROOT

CHECKED = ("collectives", "lessons", "tests", "tools")


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *CHECKED],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ruff check {' '.join(CHECKED)}:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
