"""Lesson 1 exercise: point-to-point -- send, recv, isend, irecv.

Fill in the four stubs in order; each task uses the ones before it.

    python lessons/01_p2p/exercise.py                          # a local world of 4 ranks
    torchrun --nproc-per-node 4 lessons/01_p2p/exercise.py     # the same, started by torchrun
    make grade LESSON=01                                       # the graded tests

| task | what                                          | stub                 | points |
|------|-----------------------------------------------|----------------------|--------|
| 1    | pass a token around a ring, blocking calls    | pass_token           | 2      |
| 2    | exchange with two neighbours, immediates      | exchange             | 3      |
| 3    | ping-pong: round-trip times                   | ping_pong            | 2      |
| 4    | fit latency α and inverse bandwidth β         | measure_alpha_beta   | 3      |

Peer ranks are *global* ranks, as in ``dist.send(tensor, dst, group=group)``; turn a
rank inside a group into a global one with ``ops.global_rank(group, group_rank)``.
"""

from __future__ import annotations

# for your solutions: statistics.median, time.perf_counter, ops.group_rank_and_size, ops.global_rank
import statistics  # noqa: F401
import time  # noqa: F401

import torch
import torch.distributed as dist

from collectives import cost, ops, trace, verify  # noqa: F401
from collectives.course.runner import Task, run_tasks
from collectives.course.verify import CaseResult, Report

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
    """
    raise NotImplementedError("Lesson 1, task 4: measure_alpha_beta")


# ---------------------------------------------------------------------------------
# Checks run by `python lessons/01_p2p/exercise.py` on every rank (the graded tests in
# tests/test_01_p2p.py check more).

def _result(name: str, problem: str | None) -> CaseResult:
    return CaseResult(name, dist.get_rank(), problem is None, problem or "")


def _check_pass_token() -> Report:
    rank, p = dist.get_rank(), dist.get_world_size()
    token = torch.tensor([10 * rank, 10 * rank + 1])
    with trace.recording() as t:
        got = pass_token(token)
    expected = torch.tensor([10 * ((rank - 1) % p), 10 * ((rank - 1) % p) + 1])
    problems = [verify.compare(expected, got)]
    if p > 1 and {(e.kind, e.peer) for e in t.sends() + t.recvs()} != {("send", (rank + 1) % p),
                                                                        ("recv", (rank - 1) % p)}:
        problems.append("expected one blocking send to the right and one blocking recv from the left, "
                        f"saw {[(e.kind, e.peer) for e in t]}")
    return Report([_result("pass_token around the world", next((x for x in problems if x), None))])


def _check_exchange() -> Report:
    rank, p = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % p, (rank - 1) % p
    report = Report()
    out = torch.full((5,), -1, dtype=torch.int64)
    with trace.recording() as t:
        exchange(torch.full((5,), rank, dtype=torch.int64), out, right, left)
    problem = verify.compare(torch.full((5,), left, dtype=torch.int64), out)
    kinds = [(e.kind, e.peer) for e in t]
    if problem is None and p > 1 and kinds != [("irecv", left), ("isend", right)]:
        problem = f"expected an irecv from {left}, then an isend to {right}; saw {kinds}"
    report.results.append(_result("ring exchange", problem))
    # non-contiguous on both sides: a transposed send, a strided receive
    send = (torch.arange(6, dtype=torch.float32).view(2, 3) + 100 * rank).t()
    base = torch.full((12,), 77.0)
    exchange(send, base[::2].view(3, 2), right, left)
    expected = (torch.arange(6, dtype=torch.float32).view(2, 3) + 100 * left).t()
    problem = verify.compare(expected, base[::2].view(3, 2))
    if problem is None and bool((base[1::2] != 77.0).any()):
        problem = "wrote between the elements of the strided recv_tensor"
    report.results.append(_result("non-contiguous send and recv", problem))
    return report


def _check_ping_pong() -> Report:
    rank, p = dist.get_rank(), dist.get_world_size()
    if p < 2:
        return Report([_result("ping_pong", "needs at least 2 ranks")])
    with trace.recording() as t:
        times = ping_pong(1000, iters=4)
    problem = None
    if rank == 0 and (len(times) != 4 or not all(x > 0 for x in times)):
        problem = f"rank 0 should return 4 positive round-trip times, got {times}"
    elif rank != 0 and times != []:
        problem = f"rank {rank} should return [], got {times}"
    sizes = sorted({e.nbytes for e in t.sends()})
    expected_sends = 4 if rank in (0, 1) else 0
    if problem is None and (len(t.sends()) != expected_sends or sizes not in ([], [1000])):
        problem = f"expected {expected_sends} messages of 1000 bytes, sent {[e.nbytes for e in t.sends()]}"
    return Report([_result("ping_pong 1000 bytes x 4", problem)])


def _check_measure_alpha_beta() -> Report:
    if dist.get_world_size() < 2:
        return Report([_result("measure_alpha_beta", "needs at least 2 ranks")])
    sizes = [8, 1 << 20, 4 << 20]
    link, table = measure_alpha_beta(sizes, iters=5)
    problem = None
    if [row["nbytes"] for row in table] != sizes:
        problem = f"table sizes {[row['nbytes'] for row in table]}, expected {sizes}"
    elif not all(row["one_way"] > 0 and row["round_trip"] == 2 * row["one_way"] for row in table):
        problem = f"one_way must be > 0 and round_trip twice it: {table}"
    else:
        fit = cost.fit_alpha_beta(sizes, [row["one_way"] for row in table])
        if (fit.alpha, fit.beta) != (link.alpha, link.beta):
            problem = f"link {link} is not cost.fit_alpha_beta of the table ({fit})"
    if problem is None and dist.get_rank() == 0:
        print(f"[rank 0] one way: 8 B {table[0]['one_way'] * 1e6:.0f} µs, 4 MiB "
              f"{table[-1]['one_way'] * 1e3:.2f} ms; fit: α = {link.alpha * 1e6:.0f} µs, "
              f"1/β = {link.bandwidth / 1e9:.2f} GB/s", flush=True)
    return Report([_result("measure_alpha_beta", problem)])


if __name__ == "__main__":
    run_tasks(LESSON, [
        Task(1, "pass_token", _check_pass_token),
        Task(2, "exchange", _check_exchange),
        Task(3, "ping_pong", _check_ping_pong),
        Task(4, "measure_alpha_beta", _check_measure_alpha_beta),
    ])
