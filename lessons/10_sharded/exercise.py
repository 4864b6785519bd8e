"""Lesson 10 exercise: sharded data parallel, the four moves ZeRO and FSDP are made of.

Four tasks. The first cuts a tensor into padded dim-0 shards and glues them back (FSDP2's
layout); the second is ZeRO-1's step (reduce-scatter the gradients, step on your rows,
all-gather the weights); the third gathers one layer's weights just before it is used
and frees them after; the fourth runs a forward that gathers the next layer while this
one computes, never holding more than ``max_alive`` layers whole.

Check your work:

    make check LESSON=10                                         # one PASS/FAIL line per task
    .venv/bin/python lessons/10_sharded/exercise.py --task 2 --verbose     # one task, every problem
    .venv/bin/torchrun --nproc-per-node 4 lessons/10_sharded/exercise.py   # the same, under torchrun
    make grade LESSON=10                                         # the same verdicts, as points

The checks are the grader's own judges, run outside your ranks: the weights and batches
are drawn at random on every run, and every message you send is recorded where your code
cannot reach it.

Course functions you may call (the sheet is checked against the code):

    collectives.ring.ring_reduce_scatter(output, input, op=ReduceOp.SUM, group=None) -> None
        ``output`` ← chunk ``rank`` of the reduction of every rank's ``input`` (input
        unchanged).
    collectives.ring.ring_all_gather(output, input, group=None) -> None
        ``output`` ← every rank's ``input``, concatenated in rank order.

The reference is ``collectives/sharded/`` (``steps.py`` for these four); the lesson page is
docs/lessons/10-sharded.md.
"""

from __future__ import annotations

import concurrent.futures  # noqa: F401  (task 4's side thread)

import torch
import torch.distributed as dist  # noqa: F401

from collectives import ops  # noqa: F401
from collectives.core.ops import ReduceOp  # noqa: F401
from collectives.course.grading.runner import run_tasks
from collectives.ring import ring_all_gather, ring_reduce_scatter  # noqa: F401

LESSON = 10


def shard_rows(full: torch.Tensor, rank: int, p: int) -> torch.Tensor:
    """Lesson 10, task 1: rank ``rank``'s rows of ``full``, flat and padded to equal size.

    TODO:     cut ``full`` on dim 0 into p shards of c = ceil(rows / p) rows; return rank
              ``rank``'s rows [rank·c, min((rank+1)·c, rows)) as a new flat tensor of
              c · row_numel elements, the missing rows zeros. A 0-d tensor has one row.
              Raise ValueError unless 0 <= rank < p.
    APPROACH: view ``full`` as (rows, row_numel); allocate zeros; copy the owned rows in.
    EXAMPLE:  full = [[1, 2], [3, 4], [5, 6]], p = 2 -> c = 2; rank 0: [1, 2, 3, 4],
              rank 1: [5, 6, 0, 0].
    HINT:     a rank past the end owns no row at all (7 rows over 6 ranks: c = 2, rank 4
              owns row... none, rank 3 owns row 6): clamp both ends to ``rows``.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 10, task 1: shard_rows")


def unshard_rows(gathered: torch.Tensor, shape, p: int) -> torch.Tensor:
    """Lesson 10, task 1: the tensor of ``shape`` from its p padded shards laid end to end.

    TODO:     ``gathered`` holds p · c · row_numel elements: shard 0, shard 1, ... as
              :func:`shard_rows` makes them. Return a new tensor of ``shape``, padding dropped.
    APPROACH: the shards end to end are the rows 0 .. p·c − 1 of a padded tensor: keep the
              first ``rows``.
    EXAMPLE:  [1, 2, 3, 4, 5, 6, 0, 0], shape (3, 2), p = 2 -> [[1, 2], [3, 4], [5, 6]].
    HINT:     return a copy (``.clone()``), not a view of ``gathered``.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 10, task 1: unshard_rows")


def zero1_step(params, shards, optimizer, group=None) -> None:
    """Lesson 10, task 2: ZeRO-1's step -- reduce-scatter, step on my rows, all-gather.

    TODO:     ``params[i].grad`` is this rank's full gradient of ``params[i]``; ``shards[i]``
              is this rank's rows of ``params[i]`` (a view of them, rows as in task 1, no
              padding), and ``optimizer`` steps ``shards`` only. Give each shard the mean
              over the ranks of its rows' gradient (``shards[i].grad``), call
              ``optimizer.step()``, then bring every rank's updated rows into ``params``.
    APPROACH: pack every gradient into one buffer of p blocks, block r = rank r's padded
              shards of every parameter one after the other; ``ring_reduce_scatter`` with
              ``ReduceOp.AVG`` hands you your block. After the step, your block of the
              weights (``shard_rows`` of each parameter, concatenated) goes through
              ``ring_all_gather``; unpack each parameter with ``unshard_rows``.
    EXAMPLE:  p = 2, one parameter of 3 rows: rank 0 steps rows 0-1, rank 1 row 2; each
              sends half the gradient and half the weights: the bytes of one all-reduce.
    HINT:     no all-reduce anywhere (that is DDP), and no second optimizer: the grader
              reads the state of the one you are given. Write into ``params`` under
              ``torch.no_grad()``.
    CALLS:    collectives.ring.ring_reduce_scatter, collectives.ring.ring_all_gather
    """
    raise NotImplementedError("Lesson 10, task 2: zero1_step")


def gather_layer(params, shapes, piece: torch.Tensor, group=None) -> None:
    """Lesson 10, task 3: make a layer's freed parameters whole again, just before use.

    TODO:     ``piece`` is this rank's padded shards (task 1) of the parameters of
              ``shapes``, one after the other. All-gather every rank's piece and set
              ``params[i].data`` to the full tensor i (the same Parameter objects: the
              layer and the optimizer keep pointing at them).
    APPROACH: ``ring_all_gather`` into p · len(piece) elements; block r is rank r's piece;
              cut each block at the same offsets as your piece and glue each parameter's
              shards with ``unshard_rows``.
    EXAMPLE:  shapes [(3, 2), (3,)], p = 2: piece = 4 + 2 elements; the gathered 12 give
              the weight from elements 0-3 and 6-9, the bias from 4-5 and 10-11.
    HINT:     assigning ``.data`` swaps the tensor under the Parameter without autograd noticing.
    CALLS:    collectives.ring.ring_all_gather
    """
    raise NotImplementedError("Lesson 10, task 3: gather_layer")


def free_layer(params) -> None:
    """Lesson 10, task 3: drop a layer's full parameters after use.

    TODO:     set each ``params[i].data`` to an empty tensor of its dtype and device, so
              the full weights' memory is freed (the shards elsewhere are kept).
    EXAMPLE:  after free_layer, ``params[0].numel() == 0``.
    HINT:     ``torch.empty(0, dtype=..., device=...)``.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 10, task 3: free_layer")


def forward_prefetch(layers, shapes, pieces, x: torch.Tensor, max_alive: int = 2, group=None) -> torch.Tensor:
    """Lesson 10, task 4: a forward that gathers layer i+1 while layer i computes.

    TODO:     run ``x`` through ``layers`` in order. Each layer's parameters are freed
              (task 3) on entry; ``shapes[i]`` and ``pieces[i]`` are what
              :func:`gather_layer` needs for layer i. Before layer i computes it must be
              gathered; start layer i+1's gather *before* layer i computes, on a thread of
              its own, so it travels meanwhile -- but never have more than ``max_alive``
              layers gathered or being gathered. Free each layer after its forward. Return
              the output; every layer is freed when you return.
    APPROACH: one ``concurrent.futures.ThreadPoolExecutor(1)``: every gather goes through
              it, so every rank issues them in the same order. Count the layers alive.
    EXAMPLE:  4 layers, max_alive 2: gather 0 (wait) + start 1; compute 0; free 0; wait 1
              + start 2; compute 1; ...
    HINT:     with max_alive = 1 there is no room to prefetch: it must still work.
              ValueError for max_alive < 1.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 10, task 4: forward_prefetch")


if __name__ == "__main__":
    run_tasks(LESSON)
