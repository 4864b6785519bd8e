"""Shared test set-up: the ``--impl`` option (reference or exercise) and the GPU marker.

Each lesson's test file sets ``LESSON = N`` and asks for the ``impl`` fixture: the module
spec of the implementation under test -- ``collectives.<topic>`` by default, the
student's ``lessons/NN_topic/exercise.py`` under ``--impl exercise`` (what the grader runs).
Specs are strings so they cross into the ranks of a world, where
``collectives.course.impl.resolve(spec + ":function")`` loads them.
"""

import importlib.util

import pytest
import torch

from collectives.course.impl import spec_for

# The site's checks need the docs extras (mkdocs, its plugins, a browser). A machine with only
# the runtime and pytest -- the GPU lane's (tools/gpu_suite.sh) -- collects everything else.
collect_ignore = [] if importlib.util.find_spec("mkdocs") else ["test_site.py"]


def pytest_addoption(parser):
    parser.addoption("--impl", choices=("reference", "exercise"), default="reference",
                     help="implementation under test: the reference (default) or lessons/*/exercise.py")


def pytest_report_header(config):
    return f"implementation under test: {config.getoption('--impl')}"


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip = pytest.mark.skip(reason=f"needs at least 2 CUDA GPUs for NCCL (found {gpus})")
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None and gpus < (marker.args[0] if marker.args else 2):    # gpu(1): one GPU is enough
            item.add_marker(skip if not marker.args else pytest.mark.skip(reason=f"needs {marker.args[0]} CUDA "
                                                                          f"GPU(s) (found {gpus})"))
    _mark_groups(items)


@pytest.fixture(scope="session")
def impl_kind(request) -> str:
    return request.config.getoption("--impl")


@pytest.fixture(scope="module")
def impl(request, impl_kind) -> str:
    """Module spec of the implementation under test for this test file's ``LESSON``."""
    number = getattr(request.module, "LESSON", None)
    if number is None:
        raise RuntimeError(f"{request.module.__name__} must set LESSON = <lesson number>")
    return spec_for(number, impl_kind)


# Under ``pytest -n`` (pytest-xdist, ``--dist loadgroup``; ``make test`` runs two workers) a
# group runs on one worker, in file order: the notebooks before the site that shows their
# executed copies, and every test that builds a simulated cluster one after another. Both
# groups are collected first (sort is stable: the rest keep their order).
_GROUPS = {"test_notebooks.py": "site", "test_site.py": "site",
           "test_cluster.py": "cluster", "test_09_debugging.py": "cluster"}
_CLUSTER_TESTS = {"test_on_the_simulated_cluster_with_the_layout_from_the_environment",
                  "test_the_dedup_benchmark_on_the_simulated_cluster_writes_its_record",
                  "test_bench_pp_cluster_sends_less_across_the_link_than_data_parallel_and_as_the_model_says"}


def _group(item) -> str | None:
    if item.path.name in _GROUPS:
        return _GROUPS[item.path.name]
    return "cluster" if item.originalname in _CLUSTER_TESTS else None


_FIRST = ("site", "cluster")   # the longest chains start first, so no worker waits on them at the end


def _mark_groups(items) -> None:
    for item in items:
        group = _group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: _FIRST.index(_group(item)) if _group(item) in _FIRST else len(_FIRST))
