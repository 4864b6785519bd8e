"""The lab notebooks: stored clean, and each runs top to bottom without an error.

Every ``notebooks/*.ipynb`` (and every lesson's notebook named in the lesson map) is
executed with nbclient on the ``python3`` kernel of this interpreter, from
``notebooks/`` as the working directory, the way a student runs it. The notebook is read
into memory and executed there: outputs are never written back to the file. The executed
copy is kept under ``build/executed/`` (``collectives.course.site.labs``), where the site
build finds it: the lab pages show these outputs without running the notebooks again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from collectives.course.catalog import LESSONS, ROOT

NOTEBOOK_DIR = ROOT / "notebooks"

NOTEBOOKS = sorted(set(NOTEBOOK_DIR.glob("*.ipynb")) | {item.notebook for item in LESSONS})


def _read(path: Path):
    import nbformat

    if not path.exists():
        pytest.fail(f"{path.relative_to(ROOT)} is missing (the lesson map names it)")
    return nbformat.read(path, as_version=4)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    # Outputs in git are stale the moment the code changes, and make every diff noisy.
    nb = _read(path)
    dirty = [i + 1 for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, (f"{path.name}: cells {dirty} carry outputs or execution counts; clear them "
                       "(Jupyter: Edit > Clear Outputs of All Cells) before committing")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path):
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    from collectives.course.site import labs

    _read(path)
    try:
        nb = labs.execute(path)    # always run here; the copy it keeps is what the site shows
    except (CellExecutionError, CellTimeoutError) as exc:
        pytest.fail(f"{path.name} failed:\n{exc}", pytrace=False)
    errors = [(i + 1, out.get("ename"), out.get("evalue"))
              for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, f"{path.name}: cells raised {errors}"
