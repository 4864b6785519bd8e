"""Lesson 10 exercise: sharded data parallel, from the moves ZeRO and FSDP are made of to a
trained model.

Six tasks. The first cuts a tensor into padded dim-0 shards and glues them back (FSDP2's
layout); the second is ZeRO-1's step (reduce-scatter the gradients, step on your rows,
all-gather the weights); the third gathers one layer's weights just before it is used
and frees them after, for real; the fourth runs a forward that gathers the next layer
while this one computes, never holding more than ``max_alive`` layers whole. The fifth is
ZeRO-3's backward for a layer: gathered again, its gradients reduce-scattered from a
gradient hook and freed; the sixth trains a model with it, in fp32 and in bf16 over fp32
masters, equal to ``fully_shard``.

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

The reference is ``collectives/sharded/`` (``steps.py`` for tasks 1-4, ``zero3_steps.py`` for 5-6); the lesson page is
docs/lessons/10-sharded.md.
"""

from __future__ import annotations

import concurrent.futures  # noqa: F401  (task 4's side thread)

import torch
import torch.distributed as dist  # noqa: F401
from torch import nn  # noqa: F401

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
              ``shapes``, one after the other. All-gather every rank's piece; then for each
              parameter grow its storage back to its full size
              (``q.untyped_storage().resize_(q.numel() * q.element_size())``) and copy the
              full tensor i into it, through ``q.data`` -- in place, the same Parameter and
              the same storage, so the tensors autograd saved of it see the weights again.
    APPROACH: ``ring_all_gather`` into p · len(piece) elements; block r is rank r's piece;
              cut each block at the same offsets as your piece and glue each parameter's
              shards with ``unshard_rows``.
    EXAMPLE:  shapes [(3, 2), (3,)], p = 2: piece = 4 + 2 elements; the gathered 12 give
              the weight from elements 0-3 and 6-9, the bias from 4-5 and 10-11.
    HINT:     ``q.data.copy_(full)`` writes without autograd counting it as a change of
              what it saved; ``q.data = full`` would leave the saved tensor empty.
    CALLS:    collectives.ring.ring_all_gather
    """
    raise NotImplementedError("Lesson 10, task 3: gather_layer")


def free_layer(params) -> None:
    """Lesson 10, task 3: drop a layer's full parameters after use, for real.

    TODO:     shrink each parameter's storage to nothing: ``q.untyped_storage().resize_(0)``.
              The Parameter keeps its shape, and every tensor that shares its storage --
              the weight a forward saved for its backward -- holds no memory either.
    EXAMPLE:  after free_layer, ``params[0].untyped_storage().nbytes() == 0``.
    HINT:     ``q.data = torch.empty(0)`` frees nothing: autograd still holds the old tensor
              (the lesson page's trap).
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
              ValueError for max_alive < 1. A layer counts as alive from the moment its
              gather is submitted until it is freed.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 10, task 4: forward_prefetch")


def reduce_scatter_grads(params, shapes, grad_piece: torch.Tensor, group=None, reduce_dtype=None) -> None:
    """Lesson 10, task 5: a layer's gradients to this rank's rows of their mean.

    TODO:     ``params[i].grad`` is this rank's full gradient of the parameter of
              ``shapes[i]``. Pack them (block r = rank r's padded rows of every parameter,
              as in task 2) in ``reduce_dtype`` (None: the gradients' own dtype), ring
              reduce-scatter with ``ReduceOp.AVG``, and ADD the result to ``grad_piece``
              (this rank's padded piece, in its own dtype). Then drop the full gradients
              (``q.grad = None``).
    EXAMPLE:  two ranks, one bias of 3 rows: rank 0's grad_piece gains the mean of rows 0-1,
              rank 1's the mean of row 2 and a zero.
    HINT:     add, do not assign: a second backward before a step accumulates.
    CALLS:    collectives.ring.ring_reduce_scatter
    """
    raise NotImplementedError("Lesson 10, task 5: reduce_scatter_grads")


def zero3_layer(layer, shapes, piece: torch.Tensor, grad_piece: torch.Tensor, group=None,
                reduce_dtype=None) -> list:
    """Lesson 10, task 5: ZeRO-3 for one layer -- forward and backward -- from hooks.

    TODO:     ``layer``'s parameters are freed (task 3); ``piece`` is this rank's fp32 rows
              of them (the masters) and ``grad_piece`` where this rank's rows of the mean
              gradient go. Register hooks so that, whenever the layer runs:
              before its forward it is gathered (``piece`` cast to the parameters' dtype
              BEFORE the all-gather); after its forward it is freed; before its backward
              it is gathered again; once every parameter's gradient has accumulated, the
              gradients are reduce-scattered into ``grad_piece`` (above) and the layer freed.
              Return the hooks' handles.
    APPROACH: ``register_forward_pre_hook`` (gather), ``register_forward_hook`` (free, and
              ``output.register_hook``: it runs when the output's gradient is ready, just
              before the layer's backward -- gather there), and on each parameter
              ``register_post_accumulate_grad_hook`` (count them; at the last one reduce
              and free).
    EXAMPLE:  3 layers: forward gathers and frees 0, 1, 2; backward gathers 2, reduces 2,
              frees 2, then gathers 1 ... -- at most one layer whole at any time.
    HINT:     reset the count for the next backward. Gather only a freed layer
              (``untyped_storage().nbytes() == 0``).
    CALLS:    none
    """
    raise NotImplementedError("Lesson 10, task 5: zero3_layer")


def zero3_train(model, batches, lr: float = 1e-2, group=None, param_dtype=None, reduce_dtype=None):
    """Lesson 10, task 6: train a model under ZeRO-3, in fp32 or in bf16 over fp32 masters.

    TODO:     the units are ``model``'s children that hold parameters, in order. For each:
              this rank's fp32 piece of its parameters (task 1's rows, padded, one after the
              other -- the masters), a zero ``grad_piece`` beside it; if ``param_dtype`` is
              given cast the unit to it (``unit.to(param_dtype)``); free it (task 3) and hook
              it (task 5, with ``reduce_dtype``). One Adam (``lr``, ``foreach=False``) over
              Parameters that are views of this rank's real rows of the masters (no padding).
              Then for each batch ``x`` of ``batches``: ``loss = model(x in param_dtype)
              .float().square().mean()``, backward, give each row view its gradient from
              ``grad_piece``, zero ``grad_piece``, step, zero the optimizer's gradients.
              Remove the hooks at the end. Return (the losses as floats, a copy of every
              unit's fp32 piece after training).
    APPROACH: ``ShardGroup``-like offsets: cut each piece into its parameters' padded shards
              and keep the first (rows owned) · row_numel elements of each, shaped as rows.
    EXAMPLE:  p = 2, a unit Linear(8, 12): piece = 6·8 + 6 elements, rows 0-5 on rank 0.
    HINT:     ``nn.Parameter(view)`` shares the view's memory: Adam's step updates the piece.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 10, task 6: zero3_train")


if __name__ == "__main__":
    run_tasks(LESSON)
