"""Shared test set-up: the ``--impl`` option (reference or exercise) and the GPU marker.

Each lesson's test file sets ``LESSON = N`` and asks for the ``impl`` fixture: the module
spec of the implementation under test -- ``collectives.<topic>`` by default, the
student's ``lessons/NN_topic/exercise.py`` under ``--impl exercise`` (what the grader runs).
Specs are strings so they cross into the ranks of a world, where
``collectives.course.impl.resolve(spec + ":function")`` loads them.
"""

import pytest
import torch

from collectives.course.impl import spec_for


def pytest_addoption(parser):
    parser.addoption("--impl", choices=("reference", "exercise"), default="reference",
                     help="implementation under test: the reference (default) or lessons/*/exercise.py")


def pytest_report_header(config):
    return f"implementation under test: {config.getoption('--impl')}"


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip = pytest.mark.skip(reason=f"needs at least 2 CUDA GPUs for NCCL (found {gpus})")
    for item in items:
        if "gpu" in item.keywords and gpus < 2:
            item.add_marker(skip)


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
