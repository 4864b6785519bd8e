"""The same algorithms on GPUs through NCCL (marked gpu: skipped without two CUDA GPUs)."""

import pytest
import torch

from collectives import launch
from collectives.course import tour

from . import workers

pytestmark = pytest.mark.gpu


def gpu_worlds():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [p for p in (2, 4) if p <= n] or [2]


@pytest.mark.parametrize("world_size", gpu_worlds())
def test_every_all_reduce_of_the_tour_matches_nccl(world_size):
    targets = [e.target for e in tour.entries() if e.runner is None]
    assert targets
    results = launch.run(workers.check_targets, world_size, args=(targets, True),
                         backend="nccl", timeout=150)
    for rank, per_target in enumerate(results):
        for target, (ok, summary) in per_target.items():
            assert ok, f"{target} on rank {rank}: {summary}"


def test_the_ring_is_exact_on_nccl_registered_memory():
    problems = launch.run(workers.ring_in_registered_memory, 2, args=(64 << 20,),
                          backend="nccl", timeout=150)
    assert problems == [None, None]


def test_the_flight_recorder_on_nccl_merges_ddps_calls_timed_by_cuda_events():
    # tools/gpu_lesson09.py's check: DDP's all-reduces from torch's Flight Recorder, durations from CUDA events
    # imported by name from tools/ (on sys.path, which spawned ranks inherit): they unpickle its _rank
    import importlib
    import sys
    from pathlib import Path

    tools = str(Path(__file__).resolve().parent.parent / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    result = importlib.import_module("gpu_lesson09").check(2)
    assert result["ok"], result["problems"]


# What the GPU lane runs, held by the tests too: a red tour or runner cannot hide behind green
# unit tests (each row of the tour calls the benchmarks' own tour runners, so they run here).

def test_every_row_of_the_tour_is_verified_on_nccl():
    # on 2 GPUs (on 4, every row costs a world of its own: minutes; the lane's tour step runs every count)
    rows = tour.run_tour(2, 1 << 20, "nccl", progress=False)
    assert len(rows) == len(tour.entries())
    failed = [f"lesson {r.lesson} {r.algorithm}: {r.detail}" for r in rows if not r.verified]
    assert not failed, "\n".join(failed)


def test_an_exercise_runner_passes_its_reference_on_nccl():
    """Lesson 4's runner on NCCL: the graded cases drawn on the rank's GPU go through NCCL."""
    import subprocess
    import sys

    from collectives.course.catalog import ROOT

    proc = subprocess.run([sys.executable, str(ROOT / "lessons/04_ring/exercise.py"), "--impl", "reference",
                           "--backend", "nccl", "--world", "2", "--task", "3"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 of 1 tasks pass" in proc.stdout
