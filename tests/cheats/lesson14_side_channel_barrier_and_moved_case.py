"""Lesson 14, cheat: three classes on three tasks; the orders (tasks 3 and 5) are the reference's.

Task 1: every activation goes through a file in /dev/shm; the messages the judge counts --
the shape first, then one per micro-batch, to the next stage -- are sent, of the right
sizes, holding zeros. Task 2: the reference's step, the stages then kept in step with
``dist.barrier`` where the task allows send and recv alone. Task 4: the schedule run outside
its case -- the probe's own sender, found on the stack, closes the case and opens it again
afterwards -- and the step's messages written into the record on the course's record
channel.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from collectives import ops
from collectives.course.grading.tasks.tap import Call
from collectives.pipeline import basic, one_f_one_b_order, shape_from, zb_h1_order  # noqa: F401
from tests.cheats.forged_records_and_moved_cases import _write
from tests.cheats.side_channel import _folder

LESSON = 14
SHAPE_SLOTS = 4
_calls = [0]


def shape_message(shape) -> torch.Tensor:
    return torch.tensor([len(shape), *shape] + [0] * (SHAPE_SLOTS - 1 - len(shape)), dtype=torch.int64)


def _path(call: int, i: int, rank: int) -> str:
    return os.path.join(_folder(), f"pp.{call}.{i}.{rank}")


def pipeline_forward(stage, micro_batches, group=None):
    rank, p = ops.group_rank_and_size(group)
    prev = ops.global_rank(group, rank - 1) if rank > 0 else None
    nxt = ops.global_rank(group, rank + 1) if rank < p - 1 else None
    _calls[0] += 1
    outputs, sends = [], []
    for i, x in enumerate(micro_batches):
        if prev is not None:
            if i == 0:
                dist.recv(torch.empty(SHAPE_SLOTS, dtype=torch.int64), prev, group=group)
            path = _path(_calls[0], i, rank - 1)
            while not os.path.exists(path):
                time.sleep(0.001)
            x = torch.load(path)
            dist.recv(torch.empty_like(x), prev, group=group)       # the decoy
        y = stage.forward(x, i)
        if nxt is not None:
            torch.save(y.detach().clone(), _path(_calls[0], i, rank) + ".tmp")
            os.rename(_path(_calls[0], i, rank) + ".tmp", _path(_calls[0], i, rank))
            if i == 0:
                sends.append(dist.isend(shape_message(y.shape), nxt, group=group))
            sends.append(dist.isend(torch.zeros_like(y).contiguous(), nxt, group=group))
        outputs.append(y)
    for work in sends:
        work.wait()
    return outputs


def gpipe_step(stage, micro_batches, targets, group=None):
    losses = basic.gpipe_step(stage, micro_batches, targets, group)
    dist.barrier(group=group)
    return losses


def run_schedule(stage, order, micro_batches, targets, group=None):
    probe = next((f.f_locals["self"] for f in _frames() if type(f.f_locals.get("self")).__name__ == "Probe"), None)
    key = next((f.f_locals["key"] for f in _frames() if "key" in f.f_locals and "self" in f.f_locals), None)
    if probe is not None:
        probe._sink(("end", key))
    losses = basic.run_schedule(stage, order, micro_batches, targets, group)
    if probe is not None:
        probe._sink(("case", key))
    rank, p = ops.group_rank_and_size(group)
    for kind, _ in order:
        peer = rank + 1 if kind == "F" else rank - 1
        if 0 <= peer < p:
            _write(Call("send", ops.global_rank(group, peer), 1, "float32", 0.0, 0.0, (), "", time.perf_counter()))
    return losses


def _frames():
    f = sys._getframe(1)
    while f is not None:
        yield f
        f = f.f_back


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
