"""Lesson 1 — point-to-point: ``send``, ``recv``, ``isend``, ``irecv``.

Every collective in this course is built from one primitive: rank ``a`` sends a tensor,
rank ``b`` receives it into a tensor of the same size. This module shows the primitive
in its two forms and what each costs:

* **blocking** ``dist.send``/``dist.recv`` return when the message has gone (or come).
  Easy to reason about, easy to deadlock: on gloo a ``send`` waits until the peer
  has posted the matching ``recv``, at *every* message size (see :func:`pass_token`).
* **immediate** ``dist.isend``/``dist.irecv`` return a ``Work`` handle at once; the
  transfer proceeds in the background until ``work.wait()``. Until then, the sent
  tensor must not be written and the received tensor must not be read -- the PyTorch
  tutorial calls both undefined behaviour, and :func:`modify_after_isend` and
  :func:`read_before_wait` show it happening.

:func:`exchange` (post the receive, post the send, wait for both) is the building block
later lessons use for every ring step, and :func:`measure_alpha_beta` measures the
latency α and inverse bandwidth β of one message on your machine, the two numbers the
course's cost model (:mod:`collectives.core.cost`) runs on.

Ranks: like ``dist.send``'s ``dst``, every peer argument here is a *global* rank, also
when a ``group`` is given; :func:`collectives.core.ops.global_rank` converts a group rank.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .core import cost, nccl_memory, ops

__all__ = ["pass_token", "exchange", "ping_pong", "measure_alpha_beta", "DEFAULT_SIZES",
           "modify_after_isend", "read_before_wait", "recv_first_deadlock", "send_first_ring"]


# ---------------------------------------------------------------------------------
# 1. Blocking send/recv around a ring
#
#        rank 0 ──► rank 1 ──► rank 2 ──► rank 3
#          ▲                                 │
#          └─────────────────────────────────┘
#
# Every rank sends to its right neighbour and receives from its left one. If every
# rank called send first, each would wait for its right neighbour to call recv --
# which it never does, because it is itself waiting in send: a deadlock, on gloo at
# every message size. (MPI libraries send small messages eagerly into a buffer on the
# receiver, so there the same code "works" until the message grows. NCCL does not: with
# its communicator created eagerly, a process group's point-to-point operations run one
# after the other on one stream, and a blocking send-then-recv between two NCCL ranks
# hangs at 4 KiB too.) Ordering by parity breaks the cycle: even ranks
# send then receive, odd ranks receive then send, so rank 1's recv lets rank 0's send
# finish, and the chain unwinds from there. With an odd ring the last rank is even
# too; it waits one step longer, but the chain still unwinds.
#
# Cost: two steps of α + n·β (each rank's recv and send happen one after the other).


def pass_token(token: torch.Tensor, group=None) -> torch.Tensor:
    """Send ``token`` to the right neighbour, return what arrived from the left one.

    Blocking ``send``/``recv`` only, ordered by parity so that the ring cannot deadlock.
    On a group of one rank the token comes straight back (nothing is sent: gloo cannot
    send to itself). ``token`` may be non-contiguous; the result is a new contiguous
    tensor of the same shape and dtype.
    """
    rank, p = ops.group_rank_and_size(group)
    received = torch.empty(token.shape, dtype=token.dtype, device=token.device)
    if p == 1:
        return received.copy_(token)
    right = ops.global_rank(group, (rank + 1) % p)
    left = ops.global_rank(group, (rank - 1) % p)
    outgoing = token.contiguous()      # gloo refuses to send a non-contiguous tensor
    if rank % 2 == 0:
        dist.send(outgoing, right, group=group)
        dist.recv(received, left, group=group)
    else:
        dist.recv(received, left, group=group)
        dist.send(outgoing, right, group=group)
    return received


# ---------------------------------------------------------------------------------
# 2. exchange: post the receive, post the send, wait for both
#
#     rank r:   irecv(recv_tensor ◄── recv_from)     posted first: a buffer is waiting
#               isend(send_tensor ──► send_to)       before anybody's data arrives
#               wait(irecv); wait(isend)
#
# Because neither call blocks, the order of the calls cannot deadlock: every rank
# has both halves of its exchange in flight before it waits on either. Posting the
# receive first is the habit of MPI codes (the incoming data lands in the user's
# buffer instead of a temporary one); on gloo it changes nothing measurable, but it
# costs nothing either.
#
# Cost: α + n·β for the pair of messages, sent and received at the same time when
# the link is full-duplex.


def exchange(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, send_to: int, recv_from: int,
             group=None) -> None:
    """Send ``send_tensor`` to ``send_to`` while receiving ``recv_tensor`` from ``recv_from``.

    Args:
        send_tensor: what to send; any layout (a non-contiguous view is sent through a
            contiguous copy, since gloo's ``isend`` refuses it).
        recv_tensor: where the incoming message lands, in place; any layout whose elements
            do not share memory (a non-contiguous view is received into a contiguous
            buffer, then copied in).
        send_to, recv_from: global ranks, as ``dist.isend``'s ``dst``. Both may be this
            rank (a ring of one): the data is copied, nothing is sent.
        group: the process group, ``None`` for the world.

    Raises:
        ValueError: ``recv_tensor`` is expanded (elements share memory), or only one of
            ``send_to``/``recv_from`` is this rank.
    """
    if recv_tensor.numel() > 1 and torch._debug_has_internal_overlap(recv_tensor) == 1:
        raise ValueError("exchange: recv_tensor has elements that share memory (an expanded "
                         "tensor); receive into a tensor with distinct elements")
    me = dist.get_rank()
    if send_to == me or recv_from == me:
        if send_to != recv_from:
            raise ValueError(f"exchange: rank {me} can exchange with itself only by sending to "
                             f"and receiving from itself (got send_to={send_to}, recv_from={recv_from})")
        recv_tensor.copy_(send_tensor)  # a ring of one: gloo cannot send to its own rank
        return
    # Copies for views come from nccl_memory.temporary: registered memory once
    # nccl_memory.register() has run (a transfer between registered and ordinary memory
    # never completes on NCCL).
    landing = recv_tensor if recv_tensor.is_contiguous() else nccl_memory.temporary(
        recv_tensor.numel(), recv_tensor.dtype, recv_tensor.device).view(recv_tensor.shape)
    outgoing = send_tensor if send_tensor.is_contiguous() else nccl_memory.contiguous_copy(send_tensor)
    if landing.is_cuda:
        # NCCL runs a process group's operations posted one by one in order, on one
        # stream, whatever the peer: two ranks each posting "receive, then send" would
        # deadlock. One group posts both at once.
        recv_work, send_work = ops.sendrecv(outgoing, send_to, landing, recv_from, group)
    else:
        recv_work = dist.irecv(landing, recv_from, group=group)
        send_work = dist.isend(outgoing, send_to, group=group)
    recv_work.wait()
    send_work.wait()
    if landing is not recv_tensor:
        recv_tensor.copy_(landing)


# ---------------------------------------------------------------------------------
# 3. The two rules of immediates, broken on purpose
#
# Both functions run on a world of two or more ranks (ranks above 1 idle) and return
# what rank 1 -- the receiver -- actually saw. The result is *undefined*: it depends
# on the message size, the backend, the scheduler, and it changes from run to run.
# Nothing here is "always wrong"; the point is that nothing is guaranteed.


def modify_after_isend(numel: int = 1 << 20) -> dict | None:
    """Rank 0 isends zeros, then writes ones into the tensor *before* ``wait()``.

    Returns, on rank 1, ``{"numel", "modified", "fraction"}``: how many elements arrived
    as the ones written after ``isend`` (0: the send had copied the data before the write;
    all: the write happened before the data left; in between: both, in one message).
    Other ranks return None.
    """
    rank = dist.get_rank()
    if rank == 0:
        tensor = torch.zeros(numel)
        work = dist.isend(tensor, 1)
        tensor.fill_(1.0)              # breaks the rule: written while in flight
        work.wait()
        return None
    if rank == 1:
        received = torch.empty(numel)
        dist.recv(received, 0)
        modified = int((received == 1.0).sum())
        return {"numel": numel, "modified": modified, "fraction": modified / max(numel, 1)}
    return None


def read_before_wait(numel: int = 1 << 20, delay: float = 0.0) -> dict | None:
    """Rank 1 irecvs into zeros and reads the buffer ``delay`` seconds later, before ``wait()``.

    Rank 0 sends ones. Returns, on rank 1, ``{"numel", "delay", "seen_before_wait",
    "after_wait"}``: the fraction of elements that already held the message when read
    early, and after ``wait()`` (always 1.0). Other ranks return None.
    """
    rank = dist.get_rank()
    if rank == 0:
        dist.send(torch.ones(numel), 1)
        return None
    if rank == 1:
        received = torch.zeros(numel)
        work = dist.irecv(received, 0)
        if delay:
            time.sleep(delay)
        early = received.clone()       # breaks the rule: read while in flight
        work.wait()
        return {"numel": numel, "delay": delay,
                "seen_before_wait": float((early == 1.0).float().mean()) if numel else 1.0,
                "after_wait": float((received == 1.0).float().mean()) if numel else 1.0}
    return None


# ---------------------------------------------------------------------------------
# 4. Deadlocks, to be run under the launcher's watchdog:
#
#     launch.run(p2p.recv_first_deadlock, 2, timeout=3)
#     -> WorldTimeout: rank 0 waiting in recv from rank 1 / rank 1 waiting in recv from rank 0


def recv_first_deadlock() -> None:
    """Ranks 0 and 1 each wait to receive from the other before sending: neither sends."""
    rank = dist.get_rank()
    if rank > 1:
        return
    peer = 1 - rank
    buffer = torch.zeros(4)
    dist.recv(buffer, peer)            # both ranks wait here forever
    dist.send(buffer, peer)


def send_first_ring(numel: int = 1) -> None:
    """Every rank sends to its right neighbour before receiving: on gloo this deadlocks
    at every size, because a blocking send waits for the matching recv."""
    rank, p = dist.get_rank(), dist.get_world_size()
    dist.send(torch.zeros(numel), (rank + 1) % p)
    dist.recv(torch.empty(numel), (rank - 1) % p)


# ---------------------------------------------------------------------------------
# 5. Ping-pong: what one message costs
#
#     rank 0 ──── n bytes ───► rank 1
#     rank 0 ◄─── n bytes ──── rank 1        round trip = 2·(α + n·β)
#
# Small messages measure α (latency: the software stack, the scheduler, the wire's
# start-up); large ones β (seconds per byte). A least-squares line through the one-way
# times of a sweep of sizes gives both (cost.fit_alpha_beta).

DEFAULT_SIZES = [8, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ping_pong(nbytes: int, iters: int = 10, group=None) -> list[float]:
    """Bounce ``nbytes`` between ranks 0 and 1 of ``group`` ``iters`` times.

    Rank 0 sends, rank 1 sends the message back; each direction is one blocking
    message of exactly ``nbytes`` bytes (a ``uint8`` tensor). Returns, on group rank 0,
    the ``iters`` round-trip times in seconds; on every other rank, ``[]`` (ranks above 1
    take no part). Needs a group of at least two ranks.
    """
    rank, p = ops.group_rank_and_size(group)
    if p < 2:
        raise ValueError("ping_pong needs at least two ranks")
    device = ops.rank_device()
    message = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    first, second = ops.global_rank(group, 0), ops.global_rank(group, 1)
    round_trips: list[float] = []
    if rank == 0:
        for _ in range(iters):
            _sync(device)
            start = time.perf_counter()
            dist.send(message, second, group=group)
            dist.recv(message, second, group=group)
            _sync(device)
            round_trips.append(time.perf_counter() - start)
    elif rank == 1:
        for _ in range(iters):
            dist.recv(message, first, group=group)
            dist.send(message, first, group=group)
    return round_trips


def measure_alpha_beta(sizes: list[int] | None = None, iters: int = 10,
                       group=None) -> tuple[cost.AlphaBeta, list[dict]]:
    """Ping-pong each size, fit ``one_way = α + β·nbytes``; the same answer on every rank.

    The one-way time of a size is half the median round trip (the median shrugs off
    the odd run the scheduler spoils). One short untimed ping-pong first pays for the
    connection set-up that the first message on a pair includes.

    Returns ``(link, table)``: ``link`` is :func:`collectives.core.cost.fit_alpha_beta` of the
    table; ``table`` has one row per size: ``{"nbytes", "round_trip", "one_way"}`` (seconds).
    """
    sizes = list(DEFAULT_SIZES if sizes is None else sizes)
    ping_pong(sizes[0], iters=2, group=group)            # warm-up, not timed
    one_way = []
    for nbytes in sizes:
        round_trips = ping_pong(nbytes, iters, group)
        one_way.append(statistics.median(round_trips) / 2 if round_trips else 0.0)
    # Only rank 0 timed anything; every rank gets its numbers.
    shared = torch.tensor(one_way, dtype=torch.float64, device=ops.rank_device())
    dist.broadcast(shared, ops.global_rank(group, 0), group=group)
    one_way = shared.cpu().tolist()
    table = [{"nbytes": n, "round_trip": 2 * t, "one_way": t} for n, t in zip(sizes, one_way)]
    return cost.fit_alpha_beta(sizes, one_way), table
