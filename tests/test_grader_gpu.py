"""Graded worlds on GPUs are fenced as on CPUs: messages cross through the grading process.

``--backend nccl`` puts the cases a probe draws on the rank's device on its GPU; the world's
groups are still the grader's fence (``fence.GPU_BACKEND``). These tests need one GPU: ranks
share it (messages do not need NCCL), and a collective on GPU tensors in a world that shares
GPUs fails saying so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from collectives.core import launch
from collectives.core.ops import rank_device
from collectives.course.catalog import ROOT, lesson
from collectives.course.grading.tasks import fence, tap

from .grading_fixtures import with_exercise

pytestmark = pytest.mark.gpu(1)
CHEATS = Path(__file__).parent / "cheats"
LINE = re.compile(r"^task (\d+) .*?: (PASS|FAIL)(?:: (.*))?$", re.M)


def _messages() -> dict:
    """Each rank sends its peer GPU tensors of four dtypes (one with ``batch_isend_irecv``)
    into buffers it had filled on its stream just before: what lands is the message."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    device = rank_device()
    out = {"device": device.type}
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        base = torch.arange(1000, device=device) * (rank + 1)
        message = (base % 2 == 0) if dtype is torch.bool else base.to(dtype)
        buffer = torch.empty_like(message)
        buffer.fill_(True if dtype is torch.bool else 7)        # queued before the receive is posted
        ops = [dist.P2POp(dist.isend, message, peer), dist.P2POp(dist.irecv, buffer, peer)]
        for work in (dist.batch_isend_irecv(ops) if dtype is torch.int64 else [op.op(op.tensor, peer) for op in ops]):
            work.wait()
        out[str(dtype)] = buffer.cpu().tolist()
    return out


def test_gpu_messages_cross_through_the_grader_in_stream_order():
    world = launch.run_world(_messages, 2, backend=fence.GPU_BACKEND, relay=tap.digest, timeout=120)
    for rank, got in enumerate(world.results):
        assert got["device"] == "cuda"
        sender = 2 - rank                                       # the peer's rank + 1
        base = torch.arange(1000) * sender
        assert got["torch.float32"] == base.float().tolist()
        assert got["torch.bfloat16"] == base.to(torch.bfloat16).tolist()
        assert got["torch.int64"] == base.tolist()
        assert got["torch.bool"] == (base % 2 == 0).tolist()
        carried = world.relayed[1 - rank]                      # what the launcher wrote down
        assert [(dst, dtype, n) for dst, dtype, n, _ in carried] == [
            (rank, d, 1000) for d in ("float32", "bfloat16", "int64", "bool")]
        assert carried[2][3][0] == pytest.approx(tap.fingerprint(base))


def _collectives() -> list:
    device = rank_device()
    t = torch.arange(4.0, device=device) + 1
    dist.all_reduce(t)
    gathered = torch.empty(4 * dist.get_world_size(), device=device)
    work = dist.all_gather_into_tensor(gathered, t[:4] * (dist.get_rank() + 1), async_op=True)
    work.wait()
    rank, size = dist.get_rank(), dist.get_world_size()
    whole = torch.arange(2.0 * size, device=device) + rank
    mine = whole[2 * rank:2 * rank + 2]                  # the output is a slice of the input
    dist.reduce_scatter_tensor(mine, whole)
    return [t.cpu().tolist(), gathered.cpu().tolist(), mine.cpu().tolist()]


def test_a_collective_on_gpu_tensors_runs_on_nccl_or_on_host_copies_when_ranks_share_gpus():
    size = torch.cuda.device_count()
    for ranks in (size, size + 1):               # NCCL; then more ranks than GPUs: gloo, through the host
        world = launch.run_world(_collectives, ranks, backend=fence.GPU_BACKEND, relay=tap.digest,
                                 timeout=120)
        total = [float(v * ranks) for v in (1, 2, 3, 4)]
        for got in world.results:
            assert got[0] == total
            assert got[1] == [v * (r + 1) for r in range(ranks) for v in total]
        for rank, got in enumerate(world.results):
            assert got[2] == [float(ranks * v + ranks * (ranks - 1) // 2) for v in (2 * rank, 2 * rank + 1)]


def _check(number: int, *args: str, exercises: Path | None = None) -> dict[int, tuple[bool, str]]:
    """The exercise runner (``make check``'s route) on GPUs, worlds of 2 sharing the GPU."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLLECTIVES_TIMEOUT": "60"}
    script = lesson(number).exercise
    if exercises is not None:
        script = exercises / script.parent.name / "exercise.py"
    done = subprocess.run([sys.executable, "-m", "collectives.course.grading.runner", "--check-lesson", str(number),
                           "--exercise", str(script), "--backend", "nccl", "--world", "2", *args],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = {int(m[1]): (m[2] == "PASS", m[3] or "") for m in LINE.finditer(done.stdout)}
    assert lines, done.stdout + done.stderr
    return lines


def test_the_runner_on_gpus_passes_the_reference_and_fails_cheats_as_on_cpus(tmp_path):
    reference = _check(4, "--impl", "reference")
    assert all(ok for ok, _ in reference.values()), reference
    for name in ("functional_collectives_and_tap_originals", "signed_forgeries_and_a_gloo_of_its_own"):
        student = with_exercise(4, CHEATS / f"{name}.py", tmp_path / name)
        verdicts = _check(4, "--task", "1", "--task", "2", exercises=student)
        assert not any(ok for ok, _ in verdicts.values()), (name, verdicts)
