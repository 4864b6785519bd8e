"""The plain pipeline, one stage per rank: what the exercise builds, step by step.

Rank r holds stage r of p. Micro-batches enter at rank 0, targets wait at rank p − 1;
every other rank is handed lists of ``None`` of the same length m::

    rank 0 ──act──► rank 1 ──act──► ... ──act──► rank p−1      forward:  F, the activation
    rank 0 ◄─grad── rank 1 ◄─grad── ... ◄─grad── rank p−1      backward: B, its gradient

* :func:`pipeline_forward` -- the forward pass alone: the first message on each link is
  the activation's shape (:func:`.runner.shape_message`), agreed once; then one
  activation per micro-batch;
* :func:`gpipe_step` -- GPipe: every F, then every B, micro-batches in order, gradients
  accumulated in the stage; the loss gradient (y − t)/m starts the backward;
* :func:`run_schedule` -- any order of F, B and W steps for this rank (1F1B's, ZB-H1's):
  :class:`.runner.Pipeline` with one chunk per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core import ops
from .runner import SHAPE_SLOTS, Pipeline, shape_from, shape_message
from .schedules import Step
from .stage import Stage

__all__ = ["pipeline_forward", "gpipe_step", "run_schedule"]


def _neighbours(group):
    rank, p = ops.group_rank_and_size(group)
    prev = ops.global_rank(group, rank - 1) if rank > 0 else None
    nxt = ops.global_rank(group, rank + 1) if rank < p - 1 else None
    return rank, p, prev, nxt


def pipeline_forward(stage: Stage, micro_batches: list, group=None) -> list[torch.Tensor]:
    """Run every micro-batch forward through the stages; return this rank's outputs.

    Rank 0 reads ``micro_batches``; every other rank first receives the shape of what will
    come (one small int64 message), then one activation per micro-batch from the rank
    before it, and sends its own outputs on -- their shape first -- to the rank after it.
    """
    rank, p, prev, nxt = _neighbours(group)
    dtype, device = stage.weights[0][0].dtype, stage.weights[0][0].device
    outputs, sends, shape = [], [], None
    for i, x in enumerate(micro_batches):
        if prev is not None:
            if shape is None:
                msg = torch.empty(SHAPE_SLOTS, dtype=torch.int64, device=device)
                dist.recv(msg, prev, group=group)
                shape = shape_from(msg)
            x = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(x, prev, group=group)
        y = stage.forward(x, i)
        if nxt is not None:
            if i == 0:
                sends.append(dist.isend(shape_message(y.shape, device), nxt, group=group))
            sends.append(dist.isend(y.contiguous(), nxt, group=group))
        outputs.append(y)
    for work in sends:
        work.wait()
    return outputs


def gpipe_step(stage: Stage, micro_batches: list, targets: list, group=None) -> list[float]:
    """One GPipe training step: every forward, then every backward, in micro-batch order.

    Gradients accumulate in ``stage.grads``, micro-batch 0 first (one process's order, so
    the bits agree). Returns the losses on the last rank, ``[]`` elsewhere.
    """
    m = len(micro_batches)
    order = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    return run_schedule(stage, order, micro_batches, targets, group)


def run_schedule(stage: Stage, order: list, micro_batches: list, targets: list, group=None) -> list[float]:
    """Run this rank's ``order`` of ``(kind, mb)`` steps -- F, B, and W where the backward is
    split -- with one stage per rank; returns the losses on the last rank."""
    rank, p = ops.group_rank_and_size(group)
    pipe = Pipeline({rank: stage}, p, group)
    return pipe.run([Step(str(kind), int(mb), rank) for kind, mb in order], micro_batches, targets)
