"""Lesson 1 exercise: point-to-point -- send, recv, isend, irecv.

Fill in the four stubs in order; each task uses the ones before it.

Check your work:

    .venv/bin/python lessons/01_p2p/exercise.py                        # PASS/FAIL per task
    .venv/bin/torchrun --nproc-per-node 4 lessons/01_p2p/exercise.py   # the same, under torchrun
    make check LESSON=01                                                # the same, from make
    make grade LESSON=01                                                # the points

Your functions run in worlds of their own, on inputs only the checker knows, and every
message they make is recorded where your code cannot reach: a task passes on the values
it returns AND the messages it made (peers, sizes, the data they carried). The timed
tasks are judged on consistency, not speed: each round trip you return must lie between
the times your messages were recorded, in seconds.

| task | what                                          | stub                 | points |
|------|-----------------------------------------------|----------------------|--------|
| 1    | pass a token around a ring, blocking calls    | pass_token           | 2      |
| 2    | exchange with two neighbours, immediates      | exchange             | 3      |
| 3    | ping-pong: round-trip times                   | ping_pong            | 2      |
| 4    | fit latency α and inverse bandwidth β         | measure_alpha_beta   | 3      |

Peer ranks are *global* ranks, as in ``dist.send(tensor, dst, group=group)``; turn a
rank inside a group into a global one with ``ops.global_rank(group, group_rank)``.

Course functions you may call (the sheet is checked against the code):

    ops.group_rank_and_size(group=None) -> tuple[int, int]
        This rank's index in ``group`` and the group's size (the world when ``group`` is
        None).
    ops.global_rank(group, group_rank) -> int
        The global rank of ``group_rank`` in ``group``: what ``send``/``recv`` take.
    cost.fit_alpha_beta(sizes_bytes, seconds) -> AlphaBeta
        Least-squares fit of ``seconds = α + β·bytes`` (one-way message times).
    cost.AlphaBeta(alpha, beta, gamma=0.0)
        Latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte) of one link.
"""

from __future__ import annotations

# for your solutions: statistics.median, time.perf_counter, ops.group_rank_and_size, ops.global_rank
import statistics  # noqa: F401
import time  # noqa: F401

import torch
import torch.distributed as dist

from collectives import cost, ops  # noqa: F401
from collectives.course.grading.runner import run_tasks

LESSON = 1

# Message sizes (bytes) measure_alpha_beta sweeps when given none: 8 B to 16 MiB.
DEFAULT_SIZES = [8, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def pass_token(token: torch.Tensor, group=None) -> torch.Tensor:
    """Lesson 1, task 1: send ``token`` to the right neighbour, return what came from the left.

    TODO:     with blocking ``dist.send``/``dist.recv`` only, send ``token`` to the rank on
              your right in ``group`` and receive the left rank's token into a new tensor
              of the same shape and dtype; return it.
    APPROACH: group rank r of p: right = (r + 1) % p, left = (r - 1) % p, as global
              ranks. A group of one: return a copy of ``token``, send nothing (gloo
              cannot send to itself).
    EXAMPLE:  4 ranks, token = tensor([10 * r]) on rank r -> rank 0 gets [30], rank 1 [0],
              rank 2 [10], rank 3 [20].
    HINT:     if every rank sends first, every rank waits for a recv that is never
              posted: on gloo a blocking send waits for the matching recv at *every*
              size (MPI and NCCL hide this for small messages by buffering them, so
              the bug shows up only when the message grows). Order by parity: even
              ranks send then receive, odd ranks receive then send. Send
              ``token.contiguous()``: gloo refuses a non-contiguous tensor.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 1, task 1: pass_token")


def exchange(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, send_to: int, recv_from: int,
             group=None) -> None:
    """Lesson 1, task 2: send ``send_tensor`` to ``send_to`` while receiving ``recv_tensor``
    from ``recv_from`` (global ranks), without any chance of a deadlock.

    TODO:     post ``dist.irecv`` into ``recv_tensor`` from ``recv_from``, then
              ``dist.isend`` of ``send_tensor`` to ``send_to``, then wait on both.
              Accept any layout: send a non-contiguous ``send_tensor`` through
              ``.contiguous()``, and receive into a contiguous buffer that you copy into a
              non-contiguous ``recv_tensor`` after the wait. Raise ValueError for an
              expanded ``recv_tensor`` (its elements share memory).
    APPROACH: if ``send_to`` and ``recv_from`` are both this rank (a ring of one),
              copy and return; if only one of them is, raise ValueError.
    EXAMPLE:  4 ranks, exchange(tensor([r]), out, (r + 1) % 4, (r - 1) % 4) -> out holds
              the left neighbour's rank on every rank.
    HINT:     immediates do not block, so every rank has both halves in flight before
              it waits on either. Do not touch ``send_tensor`` or read ``recv_tensor``
              before the waits: that is undefined behaviour.
              ``torch._debug_has_internal_overlap(t) == 1`` detects an expanded tensor.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 1, task 2: exchange")


def ping_pong(nbytes: int, iters: int = 10, group=None) -> list[float]:
    """Lesson 1, task 3: bounce ``nbytes`` between ranks 0 and 1 of ``group``; time round trips.

    TODO:     group rank 0 sends a ``uint8`` tensor of ``nbytes`` elements to group rank 1
              and receives it back, ``iters`` times, timing each round trip with
              ``time.perf_counter()``; group rank 1 receives and sends back ``iters``
              times. Return the round-trip times (seconds) on group rank 0, ``[]`` on every
              other rank. Raise ValueError on a group of fewer than two ranks.
    APPROACH: blocking ``send``/``recv``; exactly ``iters`` messages each way, each of
              exactly ``nbytes`` bytes (the tests count them). Ranks 2 and up do nothing.
    EXAMPLE:  ping_pong(1024, iters=3) -> [3.1e-05, 2.9e-05, 3.0e-05] on rank 0, [] on the others.
    HINT:     ``ops.group_rank_and_size(group)``; ``ops.global_rank(group, 1)`` is whom
              group rank 0 talks to.
    CALLS:    ops.group_rank_and_size, ops.global_rank
    """
    raise NotImplementedError("Lesson 1, task 3: ping_pong")


def measure_alpha_beta(sizes: list[int] | None = None, iters: int = 10,
                       group=None) -> tuple[cost.AlphaBeta, list[dict]]:
    """Lesson 1, task 4: measure one message's latency α and inverse bandwidth β.

    TODO:     for each size (``DEFAULT_SIZES`` when None) run your ``ping_pong`` and take
              one_way = median(round trips) / 2. Give every rank in ``group`` rank 0's
              numbers, then fit ``link = cost.fit_alpha_beta(sizes, one_way)``. Return
              ``(link, table)`` with one table row per size, in order:
              ``{"nbytes": n, "round_trip": 2 * one_way, "one_way": one_way}``.
    APPROACH: a short untimed ping-pong first: the first messages between a pair pay
              for setting up the connection.
    EXAMPLE:  measure_alpha_beta([8, 1 << 20]) -> (AlphaBeta(alpha=4e-05, beta=1e-09, ...),
              [{"nbytes": 8, ...}, {"nbytes": 1048576, ...}]) on every rank.
    HINT:     only group rank 0 measured anything: put its one-way times in a float64
              tensor and ``dist.broadcast`` it from group rank 0 (a global rank!).
    CALLS:    cost.fit_alpha_beta, cost.AlphaBeta
    """
    raise NotImplementedError("Lesson 1, task 4: measure_alpha_beta")


if __name__ == "__main__":
    run_tasks(LESSON)
