"""Lesson 1, point-to-point: values, message patterns from the trace, and the demos.

Each graded task runs in one world of its own (a fork start costs ~0.1 s), so a task
that deadlocks or raises fails only its own tests. Inside a world every check records
its result; the tests below assert on those records.
"""

import time

import pytest
import torch
import torch.distributed as dist

from collectives import cost, launch, p2p, trace
from collectives.course.catalog import world_timeout
from collectives.course.impl import resolve

LESSON = 1
WORLD_TIMEOUT = world_timeout(20)  # seconds; a correct task finishes in well under one


def _run(fn, world_size, *args):
    """Run a world; return its per-rank results, or the exception that ended it."""
    try:
        return launch.run(fn, world_size, args=args, timeout=WORLD_TIMEOUT)
    except (launch.RankError, launch.WorldTimeout) as exc:
        return exc


def _results(world):
    if isinstance(world, Exception):
        pytest.fail(str(world).splitlines()[0] + "\n" + str(world)[-1500:], pytrace=False)
    return world


def _traced(fn, *args, **kwargs):
    with trace.recording() as t:
        value = fn(*args, **kwargs)
    return value, [(e.kind, e.peer, e.nbytes) for e in t]


# --------------------------------------------------------------------------- task 1

def _pass_token_world(spec):
    pass_token = resolve(spec + ":pass_token")
    rank, p = dist.get_rank(), dist.get_world_size()
    odd_ring = dist.new_group([0, 1, 2])   # three ranks: the last rank is even too
    alone = [dist.new_group([r]) for r in range(p)]
    out = {}
    token = torch.tensor([10 * rank, 10 * rank + 1])
    got, events = _traced(pass_token, token)
    out["world"] = (got, events)
    if rank < 3:
        got, events = _traced(pass_token, torch.tensor([float(rank)]), group=odd_ring)
        out["odd"] = (got, events)
    transposed = (torch.arange(6, dtype=torch.float64).view(2, 3) + 100 * rank).t()
    out["view"] = pass_token(transposed)
    out["alone"] = _traced(pass_token, torch.tensor([7, rank]), group=alone[rank])
    return out


@pytest.fixture(scope="module")
def token_world(impl):
    return _run(_pass_token_world, 4, impl)


@pytest.mark.task(lesson=1, task=1, points=2, title="pass_token with blocking send/recv")
def test_pass_token_delivers_the_left_neighbours_token(token_world):
    for rank, out in enumerate(_results(token_world)):
        left = (rank - 1) % 4
        assert out["world"][0].tolist() == [10 * left, 10 * left + 1], f"rank {rank}"


@pytest.mark.task(lesson=1, task=1, points=2, title="pass_token with blocking send/recv")
def test_pass_token_sends_one_blocking_message_right_and_receives_one_from_left(token_world):
    for rank, out in enumerate(_results(token_world)):
        events = out["world"][1]
        assert sorted(events) == sorted([("send", (rank + 1) % 4, 16), ("recv", (rank - 1) % 4, 16)]), \
            f"rank {rank}: {events}"


@pytest.mark.task(lesson=1, task=1, points=2, title="pass_token with blocking send/recv")
def test_pass_token_works_on_an_odd_subgroup_without_deadlock(token_world):
    # group [0, 1, 2]: group ranks are global ranks here, the ring closes 2 -> 0
    results = _results(token_world)
    for rank in range(3):
        got, events = results[rank]["odd"]
        assert got.tolist() == [float((rank - 1) % 3)], f"rank {rank}"
        assert {(k, peer) for k, peer, _ in events} == {("send", (rank + 1) % 3), ("recv", (rank - 1) % 3)}


@pytest.mark.task(lesson=1, task=1, points=2, title="pass_token with blocking send/recv")
def test_pass_token_keeps_shape_of_a_transposed_token_and_sends_nothing_alone(token_world):
    for rank, out in enumerate(_results(token_world)):
        left = (rank - 1) % 4
        expected = (torch.arange(6, dtype=torch.float64).view(2, 3) + 100 * left).t()
        assert torch.equal(out["view"], expected), f"rank {rank}"
        got, events = out["alone"]
        assert got.tolist() == [7, rank] and events == [], "a group of one gets its own token back"


# --------------------------------------------------------------------------- task 2

def _exchange_world(spec):
    exchange = resolve(spec + ":exchange")
    rank, p = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % p, (rank - 1) % p
    back_half = dist.new_group([1, 2, 3])
    out = {}
    # a ring to the right, then to the left, in several dtypes
    for dtype in (torch.int64, torch.float16, torch.bfloat16, torch.float32):
        recv = torch.full((5,), -1, dtype=dtype)
        _, events = _traced(exchange, torch.full((5,), rank, dtype=dtype), recv, right, left)
        out[("right", dtype)] = (recv, events)
    recv = torch.empty(3, dtype=torch.int32)
    exchange(torch.full((3,), rank, dtype=torch.int32), recv, left, right)
    out["left"] = recv
    # pairs (0, 1), (2, 3): send to and receive from the same peer
    recv = torch.empty(2)
    exchange(torch.tensor([rank, 2.0 * rank]), recv, rank ^ 1, rank ^ 1)
    out["pair"] = recv
    # non-contiguous both ways: a transposed send, a strided receive with sentinels between
    send = (torch.arange(6, dtype=torch.float32).view(2, 3) + 100 * rank).t()
    base = torch.full((12,), 77.0)
    exchange(send, base[::2].view(3, 2), right, left)
    out["views"] = base
    # empty messages still match up
    recv = torch.empty(0)
    out["empty"] = _traced(exchange, torch.empty(0), recv, right, left)[1]
    # a subgroup: peers are global ranks 1 -> 2 -> 3 -> 1
    if rank in (1, 2, 3):
        g_right, g_left = rank % 3 + 1, (rank - 2) % 3 + 1
        recv = torch.empty(1, dtype=torch.int64)
        exchange(torch.tensor([rank]), recv, g_right, g_left, group=back_half)
        out["group"] = recv.item()
    # with itself: a ring of one copies
    recv = torch.empty(2)
    out["self"] = (_traced(exchange, torch.tensor([1.0, 2.0]), recv, rank, rank)[1], recv)
    # an expanded recv tensor cannot hold a message
    try:
        exchange(torch.ones(4), torch.zeros(1).expand(4), right, left)
        out["expanded"] = "accepted"
    except ValueError:
        out["expanded"] = "ValueError"
    return out   # (last: an exchange that posted before refusing leaves no other check out of step)


@pytest.fixture(scope="module")
def exchange_world(impl):
    return _run(_exchange_world, 4, impl)


@pytest.mark.task(lesson=1, task=2, points=3, title="exchange with isend/irecv")
def test_exchange_receives_from_recv_from_in_every_dtype(exchange_world):
    for rank, out in enumerate(_results(exchange_world)):
        for dtype in (torch.int64, torch.float16, torch.bfloat16, torch.float32):
            recv, _ = out[("right", dtype)]
            assert recv.dtype == dtype and recv.tolist() == [(rank - 1) % 4] * 5, f"rank {rank} {dtype}"
        assert out["left"].tolist() == [(rank + 1) % 4] * 3
        assert out["pair"].tolist() == [rank ^ 1, 2.0 * (rank ^ 1)]


@pytest.mark.task(lesson=1, task=2, points=3, title="exchange with isend/irecv")
def test_exchange_posts_one_irecv_from_recv_from_then_one_isend_to_send_to(exchange_world):
    for rank, out in enumerate(_results(exchange_world)):
        _, events = out[("right", torch.int64)]
        assert events == [("irecv", (rank - 1) % 4, 40), ("isend", (rank + 1) % 4, 40)], f"rank {rank}"
        assert [k for k, _, _ in out["empty"]] == ["irecv", "isend"]


@pytest.mark.task(lesson=1, task=2, points=3, title="exchange with isend/irecv")
def test_exchange_handles_non_contiguous_tensors_through_a_contiguous_buffer(exchange_world):
    # gloo's own send raises on a non-contiguous tensor (see test_gloo_send_refuses_...)
    for rank, out in enumerate(_results(exchange_world)):
        left = (rank - 1) % 4
        base = out["views"]
        expected = (torch.arange(6, dtype=torch.float32).view(2, 3) + 100 * left).t()
        assert torch.equal(base[::2].view(3, 2), expected), f"rank {rank}"
        assert bool((base[1::2] == 77.0).all()), "wrote between the elements of a strided view"


@pytest.mark.task(lesson=1, task=2, points=3, title="exchange with isend/irecv")
def test_exchange_in_a_subgroup_uses_global_ranks_and_copies_with_itself(exchange_world):
    results = _results(exchange_world)
    assert [results[r]["group"] for r in (1, 2, 3)] == [3, 1, 2]
    for rank, out in enumerate(results):
        events, recv = out["self"]
        assert events == [] and recv.tolist() == [1.0, 2.0], "exchange with itself sends nothing"
        assert out["expanded"] == "ValueError", "an expanded recv_tensor must raise ValueError"


# --------------------------------------------------------------------------- task 3

def _ping_pong_world(spec):
    ping_pong = resolve(spec + ":ping_pong")
    rank = dist.get_rank()
    pair_12 = dist.new_group([1, 2])
    solo = dist.new_group([0])
    out = {"world": _traced(ping_pong, 1000, iters=5)}
    if rank in (1, 2):
        out["group"] = _traced(ping_pong, 24, 3, group=pair_12)
    if rank == 0:
        try:
            ping_pong(8, 1, group=solo)
            out["solo"] = "accepted"
        except ValueError:
            out["solo"] = "ValueError"
    return out


@pytest.fixture(scope="module")
def ping_pong_world(impl):
    return _run(_ping_pong_world, 3, impl)   # rank 2 watches: ping-pong is ranks 0 and 1


@pytest.mark.task(lesson=1, task=3, points=2, title="ping_pong round trips")
def test_ping_pong_returns_round_trip_times_on_rank_0_only(ping_pong_world):
    results = _results(ping_pong_world)
    times = results[0]["world"][0]
    assert len(times) == 5 and all(isinstance(t, float) and 0 < t < 5 for t in times), times
    assert results[1]["world"][0] == [] and results[2]["world"][0] == []


@pytest.mark.task(lesson=1, task=3, points=2, title="ping_pong round trips")
def test_ping_pong_sends_iters_messages_of_nbytes_each_way(ping_pong_world):
    results = _results(ping_pong_world)
    ev0, ev1, ev2 = (results[r]["world"][1] for r in range(3))
    sends = lambda events: [(peer, n) for kind, peer, n in events if kind in trace.SENDS]
    recvs = lambda events: [(peer, n) for kind, peer, n in events if kind in trace.RECVS]
    assert sends(ev0) == recvs(ev0) == [(1, 1000)] * 5, f"rank 0: {ev0}"
    assert sends(ev1) == recvs(ev1) == [(0, 1000)] * 5, f"rank 1: {ev1}"
    assert ev2 == [], "rank 2 takes no part"


@pytest.mark.task(lesson=1, task=3, points=2, title="ping_pong round trips")
def test_ping_pong_in_a_subgroup_pairs_its_first_two_ranks(ping_pong_world):
    results = _results(ping_pong_world)
    times, events = results[1]["group"]
    assert len(times) == 3 and {(e[1], e[2]) for e in events} == {(2, 24)}
    assert results[2]["group"][0] == []
    assert results[0]["solo"] == "ValueError", "a group of one cannot ping-pong"


# --------------------------------------------------------------------------- task 4

SIZES = [8, 64 << 10, 1 << 20]


def _alpha_beta_world(spec):
    measure_alpha_beta = resolve(spec + ":measure_alpha_beta")
    with trace.recording() as t:
        link, table = measure_alpha_beta(SIZES, iters=3)
    sends = [e.nbytes for e in t.sends() if e.peer == 1 - dist.get_rank()]
    return link, table, sends


@pytest.fixture(scope="module")
def alpha_beta_world(impl):
    return _run(_alpha_beta_world, 2, impl)


@pytest.mark.task(lesson=1, task=4, points=3, title="measure_alpha_beta")
def test_measure_alpha_beta_returns_one_row_per_size_the_same_on_every_rank(alpha_beta_world):
    (link0, table0, _), (link1, table1, _) = _results(alpha_beta_world)
    assert [row["nbytes"] for row in table0] == SIZES
    assert table0 == table1 and (link0.alpha, link0.beta) == (link1.alpha, link1.beta), \
        "every rank must get rank 0's measurements"
    for row in table0:
        assert row["one_way"] > 0 and row["round_trip"] == pytest.approx(2 * row["one_way"])


@pytest.mark.task(lesson=1, task=4, points=3, title="measure_alpha_beta")
def test_measure_alpha_beta_link_is_the_least_squares_fit_of_the_table(alpha_beta_world):
    link, table, _ = _results(alpha_beta_world)[0]
    fit = cost.fit_alpha_beta([row["nbytes"] for row in table], [row["one_way"] for row in table])
    assert (link.alpha, link.beta) == pytest.approx((fit.alpha, fit.beta))


@pytest.mark.task(lesson=1, task=4, points=3, title="measure_alpha_beta")
def test_measure_alpha_beta_ping_pongs_every_size_at_least_iters_times(alpha_beta_world):
    for rank, (_, _, sends) in enumerate(_results(alpha_beta_world)):
        for size in SIZES:
            assert sends.count(size) >= 3, f"rank {rank} sent {sends.count(size)} messages of {size} bytes"


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
