"""The lab notebooks, executed once and kept: what the site shows on each lab page.

Notebooks are stored in git without outputs. The test suite executes every one of them
(``tests/test_notebooks.py``); the site shows each lab *with* its outputs. Both go
through :func:`execute`, which writes the executed copy to ``build/executed/`` with a
key made of the notebook's text and the source of the ``collectives`` package. The site
build (``tools/mkdocs_hooks.py``) asks :func:`executed` for a copy: it reuses the one
the tests just made when the key still matches, and executes the notebook itself only
when it does not (``make docs`` on a fresh checkout). So ``make test`` runs each notebook
once, and the site never shows outputs from code that has changed since.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..catalog import ROOT

NOTEBOOK_DIR = ROOT / "notebooks"
# build/executed/notebooks/: the folder is named like the original one, so the site
# plugin's pattern "notebooks/*.ipynb" matches an executed copy as it does the notebook.
CACHE_DIR = ROOT / "build" / "executed" / "notebooks"
# Seconds per cell; a whole notebook is meant to run in under 40 s. Longer than a world's own
# limit (``launch.run``'s 120 s): a world that hangs in a cell is stopped by the launcher's
# watchdog, which says where each rank waited, before the cell's limit ends the notebook
# with nothing but "timed out".
CELL_TIMEOUT = 180    # (and inside pytest-timeout's 300 s per test)
KEY = "collectives_executed_key"   # where the key is kept in the executed copy's metadata


def source_key(path: Path) -> str:
    """What an executed copy depends on: the notebook and the package it imports."""
    digest = hashlib.sha256(Path(path).read_bytes())
    package = ROOT / "collectives"
    for source in sorted(package.rglob("*.py")):
        digest.update(source.relative_to(ROOT).as_posix().encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()


def cached_path(path: Path) -> Path:
    return CACHE_DIR / Path(path).name


def _cached(path: Path, key: str):
    """The executed copy of ``path`` if it was made from this exact source, else None."""
    import nbformat

    copy = cached_path(path)
    if not copy.exists():
        return None
    try:
        nb = nbformat.read(copy, as_version=4)
    except (ValueError, json.JSONDecodeError):
        return None
    return nb if nb.metadata.get(KEY) == key else None


def execute(path: Path, timeout: int = CELL_TIMEOUT):
    """Execute ``path`` top to bottom from ``notebooks/`` and keep the executed copy.

    Raises nbclient's ``CellExecutionError`` (or ``CellTimeoutError``) when a cell fails;
    nothing is written then. The notebook file itself is never touched.
    """
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    key = source_key(path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()
    nb.metadata[KEY] = key
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = cached_path(path).with_suffix(".tmp")
    nbformat.write(nb, tmp)
    tmp.replace(cached_path(path))
    return nb


def executed(path: Path, timeout: int = CELL_TIMEOUT) -> Path:
    """The path of an executed copy of ``path``, executing it only when none is current."""
    path = Path(path)
    if _cached(path, source_key(path)) is None:
        execute(path, timeout)
    return cached_path(path)
