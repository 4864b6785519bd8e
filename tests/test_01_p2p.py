"""Lesson 1, point-to-point: the demos of what goes wrong, and the helpers on GPUs.

The graded tasks (pass_token, exchange, ping_pong, measure_alpha_beta) are judged by
collectives/course/grading/tasks/lesson01.py (and lesson01_timing.py), outside the ranks, on the reference as on a
student's exercise; what is left here is what the lesson shows rather than grades.
"""

import time

import pytest
import torch
import torch.distributed as dist

from collectives import launch, p2p
from collectives.course.catalog import world_timeout

LESSON = 1
WORLD_TIMEOUT = world_timeout(20)  # seconds; the demos finish in well under one


# --------------------------------------------------------------------------- the demos (reference)

def test_recv_first_deadlock_is_stopped_by_the_watchdog_naming_both_ranks():
    start = time.monotonic()
    with pytest.raises(launch.WorldTimeout) as info:
        launch.run(p2p.recv_first_deadlock, 2, timeout=3)
    assert time.monotonic() - start < 6
    assert "rank 0 waiting in recv from rank 1" in str(info.value)
    assert "rank 1 waiting in recv from rank 0" in str(info.value)


def test_send_first_ring_deadlocks_on_gloo_even_for_one_element():
    # gloo's blocking send waits for the matching recv: no size is small enough to slip through
    with pytest.raises(launch.WorldTimeout) as info:
        launch.run(p2p.send_first_ring, 3, args=(1,), timeout=2)
    for rank in range(3):
        assert f"rank {rank} waiting in send to rank {(rank + 1) % 3}" in str(info.value)


def _demos():
    out = {"modify": p2p.modify_after_isend(1 << 16), "read": p2p.read_before_wait(1 << 16)}
    try:  # why exchange copies views: gloo will not send one
        if dist.get_rank() == 0:
            dist.send(torch.zeros(2, 3).t(), 1)
        out["gloo_view"] = "sent"
    except RuntimeError as exc:
        out["gloo_view"] = str(exc)
    return out


@pytest.fixture(scope="module")
def demos():
    return launch.run(_demos, 2, timeout=WORLD_TIMEOUT)


def test_modify_after_isend_reports_what_the_receiver_saw(demos):
    sender, receiver = demos[0]["modify"], demos[1]["modify"]
    assert sender is None
    assert receiver["numel"] == 1 << 16 and 0 <= receiver["modified"] <= 1 << 16
    assert receiver["fraction"] == receiver["modified"] / (1 << 16)


def test_read_before_wait_is_complete_after_wait(demos):
    seen = demos[1]["read"]
    assert 0.0 <= seen["seen_before_wait"] <= 1.0 and seen["after_wait"] == 1.0


def test_gloo_send_refuses_a_non_contiguous_tensor(demos):
    assert "contiguous" in demos[0]["gloo_view"]


# --------------------------------------------------------------------------- the timed tasks' judge

def _round_trip_run(echo_host):
    from collectives.course.grading.tasks.tap import Call
    from collectives.course.grading.tasks.world import Outcome, Run

    def message(kind, peer, t):
        return Call(kind, peer, 8, "uint8", 0.0, 0.0, (0, 1), "", t)

    pinger = [message("send", 1, 10.0), message("recv", 1, 10.1), message("send", 1, 10.5), message("recv", 1, 10.6)]
    echoer = [message("recv", 0, 9.0), message("send", 0, 10.3), message("recv", 0, 10.4), message("send", 0, 10.55)]
    results = [{"case": (Outcome([0.4, 0.2]), 9.9, 10.9, "here")}, {"case": (Outcome([]), 9.8, 11.0, echo_host)}]
    return Run(2, [1, 2], results, [{"case": pinger}, {"case": echoer}], [[], []])


def test_a_round_trip_lies_between_its_messages_and_the_calls_around_them():
    from collectives.course.grading.tasks.lesson01_timing import round_trips

    # trip 1: sent at 10.0, echoed at 10.3, so at least 0.3 s; after the probe's 9.9 and
    # before the next send at 10.5, so at most 0.6 s. Trip 2: from 10.5 to its receive at
    # 10.6 (the echo at 10.55 came earlier); between the receive at 10.1 and the probe's 10.9.
    bounds = round_trips(_round_trip_run("here"), "case", 0, 1, 8)
    assert bounds == [pytest.approx((0.3, 0.6)), pytest.approx((0.1, 0.8))]
    # an echo on another host runs on another clock: only the pinger's own times count
    bounds = round_trips(_round_trip_run("elsewhere"), "case", 0, 1, 8)
    assert bounds[0] == pytest.approx((0.1, 0.6))
    assert round_trips(_round_trip_run("here"), "case", 0, 1, 16) == []


# --------------------------------------------------------------------------- on GPUs (NCCL)

def _nccl_world():
    rank, p = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    token = p2p.pass_token(torch.tensor([rank], device=device))
    landing = torch.full((4, 2), -1.0, device=device)
    grid = (torch.arange(8.0, device=device).view(2, 4) + 10 * rank).t()   # a transposed view
    p2p.exchange(grid, landing, (rank + 1) % p, (rank - 1) % p)
    round_trips = p2p.ping_pong(1 << 20, 3)
    link, table = p2p.measure_alpha_beta([8, 1 << 20], iters=3)
    return token.item(), landing.cpu(), round_trips, [row["one_way"] for row in table], link


@pytest.mark.gpu
def test_p2p_helpers_run_on_nccl_with_gpu_tensors():
    results = launch.run(_nccl_world, 2, backend="nccl", timeout=150)
    for rank, (token, landing, round_trips, one_way, link) in enumerate(results):
        left = (rank - 1) % 2
        assert token == left
        assert torch.equal(landing, torch.arange(8.0).view(2, 4).t() + 10 * left)
        assert (len(round_trips) == 3) == (rank == 0)
        assert all(t > 0 for t in one_way) and link.alpha > 0
