"""Lesson 2 — the collectives, and building them from send/recv.

A collective is a communication pattern every rank of a group joins at once:
``broadcast``, ``reduce``, ``all_reduce``, ``scatter``, ``gather``, ``all_gather``,
``reduce_scatter``, ``all_to_all``, ``barrier``. :func:`tour_of_collectives` runs each
one on a world and records what every rank held before and after.

Then we build five of them from lesson 1's point-to-point messages, with the same
signature and meaning as their ``torch.distributed`` twins for the arguments we keep
(``tensor``, ``src``/``dst`` as *global* ranks, ``op``, ``group``; no ``async_op``, no
``group_src``/``group_dst``), and check them against the twins in the tests:

=========================  ========================  ================================
ours                       messages                  time, α–β model (one port per rank)
=========================  ========================  ================================
:func:`broadcast`          root sends p−1            (p−1)·(α + n·β)
:func:`tree_broadcast`     root sends ⌈log2 p⌉       ⌈log2 p⌉·(α + n·β)
:func:`reduce`             root receives p−1         (p−1)·(α + n·β)  (+ (p−1)·n·γ to combine)
:func:`scatter`            root sends p−1 of n/p     (p−1)·(α + n/p·β)
:func:`gather`             root receives p−1 of n/p  (p−1)·(α + n/p·β)
:func:`all_gather`         each sends p−1 of n/p     (p−1)·(α + n/p·β) if links run in parallel
=========================  ========================  ================================

(n is the size of the full result; for scatter/gather/all_gather each piece is n/p.)
The linear versions put all the work on one rank -- the root's link carries p−1 copies.
A binomial tree spreads it: every rank that already has the data forwards it, so the
number of holders doubles each round. Same total messages (p−1), but ⌈log2 p⌉ rounds
instead of p−1: the tree wins as soon as p > 2 -- unless one message of n bytes is so
large that pipelining pieces of it along a chain (or a ring, lesson 4) beats both.

Finally :func:`all_reduce_via_reduce_broadcast` -- reduce to rank 0, broadcast back -- is
the first all-reduce of the course: correct, simple, and 2(p−1) messages of the whole
tensor through one rank. Lessons 3 and 4 do better.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .core import cost, nccl_memory, ops
from .core.ops import ReduceOp
from .p2p import exchange

__all__ = ["tour_of_collectives", "broadcast", "tree_broadcast", "reduce", "scatter", "gather",
           "all_gather", "all_reduce_via_reduce_broadcast"]


# ---------------------------------------------------------------------------------
# The tour: every collective once, with what each rank held before and after.

def tour_of_collectives(numel: int = 2) -> list[dict]:
    """Run each collective on the world; return this rank's ``[{"collective", "call",
    "before", "after", "note"}, ...]`` (values as plain lists, ready for a table).

    Integer tensors, so that every value prints exactly; on the rank's device (its GPU
    under NCCL). Needs at least 2 ranks.
    """
    r, p = dist.get_rank(), dist.get_world_size()
    dev = ops.rank_device()
    rows = []

    def row(name, call, before, after, note=""):
        rows.append({"collective": name, "call": call, "before": before, "after": after, "note": note})

    def full(value):
        return torch.full((numel,), value, dtype=torch.int64, device=dev)

    def mine(base=0):
        return full(base + r)

    t = mine(); before = t.tolist()
    dist.broadcast(t, src=0)
    row("broadcast", "dist.broadcast(t, src=0)", before, t.tolist(), "rank 0's tensor everywhere")

    t = mine(1); before = t.tolist()
    dist.reduce(t, dst=0, op=ReduceOp.SUM)
    row("reduce", "dist.reduce(t, dst=0, op=SUM)", before, t.tolist(),
        "only rank 0's result is defined; gloo leaves partial sums elsewhere")

    t = mine(1); before = t.tolist()
    dist.all_reduce(t, op=ReduceOp.SUM)
    row("all_reduce", "dist.all_reduce(t, op=SUM)", before, t.tolist(), "the sum on every rank")

    pieces = [full(10 * i) for i in range(p)] if r == 0 else None
    t = full(0)
    dist.scatter(t, pieces, src=0)
    row("scatter", "dist.scatter(t, pieces if rank == 0 else None, src=0)",
        [x.tolist() for x in pieces] if pieces else "-", t.tolist(),
        "piece i of rank 0's list lands on rank i")

    t = mine()
    out = [full(0) for _ in range(p)] if r == 0 else None
    dist.gather(t, out, dst=0)
    row("gather", "dist.gather(t, out if rank == 0 else None, dst=0)", t.tolist(),
        [x.tolist() for x in out] if out else "-", "every rank's tensor, in rank order, on rank 0")

    t = mine()
    out = [full(0) for _ in range(p)]
    dist.all_gather(out, t)
    row("all_gather", "dist.all_gather(out, t)", t.tolist(), [x.tolist() for x in out],
        "every rank's tensor, in rank order, on every rank")

    chunks = [full(10 * r + j) for j in range(p)]
    t = full(0)
    dist.reduce_scatter(t, chunks, op=ReduceOp.SUM)
    row("reduce_scatter", "dist.reduce_scatter(t, chunks, op=SUM)", [c.tolist() for c in chunks],
        t.tolist(), "rank j gets the sum of everybody's chunk j")

    chunks = [full(10 * r + j) for j in range(p)]
    out = [full(0) for _ in range(p)]
    dist.all_to_all(out, chunks)
    row("all_to_all", "dist.all_to_all(out, chunks)", [c.tolist() for c in chunks],
        [x.tolist() for x in out], "chunk j of rank i becomes chunk i of rank j: a transpose")

    dist.barrier()
    start = time.perf_counter()
    time.sleep(0.03 * r)
    entered = time.perf_counter() - start
    dist.barrier()
    left = time.perf_counter() - start
    row("barrier", "time.sleep(0.03 * rank); dist.barrier()", f"entered at {entered * 1e3:.0f} ms",
        f"left at {left * 1e3:.0f} ms", "nobody leaves before the last rank arrives")

    evens, odds = dist.new_group(list(range(0, p, 2))), dist.new_group(list(range(1, p, 2)))
    t = mine(1); before = t.tolist()
    dist.all_reduce(t, group=evens if r % 2 == 0 else odds)
    row("subgroups", "dist.all_reduce(t, group=evens or odds)", before, t.tolist(),
        "dist.new_group(ranks): each group reduces on its own")

    t = mine(1); before = t.tolist()
    work = dist.all_reduce(t, async_op=True)
    overlap = float(torch.arange(1000.0).sum())          # work done while the sum is in flight
    work.wait()
    row("async_op", "work = dist.all_reduce(t, async_op=True); ...; work.wait()", before,
        t.tolist(), f"computed {overlap:.0f} meanwhile; read t only after wait()")
    return rows


# ---------------------------------------------------------------------------------
# Helpers shared by the hand-built collectives.

def _group_rank_of(global_rank: int, group, what: str) -> int:
    """The index in ``group`` of a global rank, with a clear error if it is not a member."""
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    if global_rank not in ranks:
        raise ValueError(f"{what}: rank {global_rank} is not in the group {ranks}")
    return ranks.index(global_rank)


def _check(tensor, group, what: str) -> bool:
    """Type, expanded tensor, group; False on a rank outside ``group`` (it returns at once)."""
    return ops.check_all_reduce_args(tensor, ReduceOp.SUM, group, what=what)


def _check_list(tensors, p: int, like: torch.Tensor, name: str, what: str) -> None:
    if tensors is None or len(tensors) != p:
        raise ValueError(f"{what}: {name} must hold one tensor per rank of the group ({p}), "
                         f"got {None if tensors is None else len(tensors)}")
    for i, t in enumerate(tensors):
        if t.numel() != like.numel() or t.dtype != like.dtype:
            raise ValueError(f"{what}: {name}[{i}] is {t.dtype} with {t.numel()} elements; "
                             f"expected {like.dtype} with {like.numel()}, like the tensor")


# ---------------------------------------------------------------------------------
# broadcast, linear:            root ──► 1
#                               root ──► 2          p−1 messages of n, one after the
#                               root ──► 3          other on the root's link:
#                                                   (p−1)·(α + n·β)

def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> None:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``, in place.

    Linear: the root sends the whole tensor to each other rank. Works on views.
    """
    if not _check(tensor, group, "broadcast"):
        return
    root = _group_rank_of(src, group, "broadcast")
    me, p = ops.group_rank_and_size(group)
    if me == root:
        payload = ops.work_buffer(tensor)     # a copy only for a view (from the pool once registered)
        sends = [dist.isend(payload, ops.global_rank(group, r), group=group)
                 for r in range(p) if r != root]
        for work in sends:
            work.wait()
    else:
        landing = ops.work_buffer(tensor)
        dist.recv(landing, src, group=group)
        ops.write_back(tensor, landing)


# broadcast, binomial tree (second step): relative rank v = (rank − root) mod p.
#
#     round 0:  0 ──► 1
#     round 1:  0 ──► 2     1 ──► 3
#     round 2:  0 ──► 4     1 ──► 5     2 ──► 6     3 ──► 7
#
# Rank v receives once, from v minus its highest set bit, then forwards to v + 2^k for
# every 2^k above its highest bit. The root sends ⌈log2 p⌉ messages, every other rank
# receives exactly one: still p−1 messages in all, but ⌈log2 p⌉·(α + n·β).

def tree_broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> None:
    """:func:`broadcast` along a binomial tree rooted at ``src``: ⌈log2 p⌉ rounds."""
    if not _check(tensor, group, "tree_broadcast"):
        return
    root = _group_rank_of(src, group, "tree_broadcast")
    me, p = ops.group_rank_and_size(group)
    v = (me - root) % p

    def peer(rel: int) -> int:
        return ops.global_rank(group, (rel + root) % p)

    buffer = ops.work_buffer(tensor)
    if v != 0:
        parent = v - (1 << (v.bit_length() - 1))       # v without its highest bit
        dist.recv(buffer, peer(parent), group=group)
        ops.write_back(tensor, buffer)
    mask = 1 << v.bit_length() if v else 1
    while mask < p:
        if v + mask < p:
            dist.send(buffer, peer(v + mask), group=group)
        mask <<= 1


# ---------------------------------------------------------------------------------
# reduce, linear:               1 ──► root
#                               2 ──► root          the root receives and combines p−1
#                               3 ──► root          tensors: (p−1)·(α + n·β + n·γ)

def reduce(tensor: torch.Tensor, dst: int = 0, op=ReduceOp.SUM, group=None) -> None:
    """Combine every rank's ``tensor`` with ``op`` into ``tensor`` on global rank ``dst``.

    SUM, PRODUCT, MIN, MAX, AVG (AVG: the sum, divided once by the group size at the
    end). Only the root's result is defined -- as for ``dist.reduce`` -- and here the
    other ranks' tensors are left untouched (gloo's ``dist.reduce`` leaves partial
    results in them).
    """
    if not ops.check_all_reduce_args(tensor, op, group, what="reduce"):
        return                         # not in the group: nothing to do, as dist.*
    root = _group_rank_of(dst, group, "reduce")
    me, p = ops.group_rank_and_size(group)
    if me != root:
        dist.send(ops.work_buffer(tensor), dst, group=group)
        return
    acc = ops.work_buffer(tensor)
    incoming = nccl_memory.temporary(acc.numel(), acc.dtype, acc.device)   # registered memory once registered
    for r in range(p):                       # in group-rank order: the same order every run
        if r != root:
            dist.recv(incoming, ops.global_rank(group, r), group=group)
            ops.combine_(acc, incoming, op)
    ops.finish_(acc, op, p)
    ops.write_back(tensor, acc)


# ---------------------------------------------------------------------------------
# scatter and gather, linear: the root sends piece i to rank i (or receives it from
# rank i): p−1 messages of one piece each, (p−1)·(α + n/p·β) for a result of n bytes.

def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group=None) -> None:
    """``scatter_list[i]`` on global rank ``src`` lands in ``tensor`` on group rank i.

    ``scatter_list`` is read on the root only (one tensor per group rank, each with
    ``tensor``'s dtype and number of elements); other ranks may pass None.
    """
    if not _check(tensor, group, "scatter"):
        return
    root = _group_rank_of(src, group, "scatter")
    me, p = ops.group_rank_and_size(group)
    if me == root:
        _check_list(scatter_list, p, tensor, "scatter_list", "scatter")
        sends = [dist.isend(ops.work_buffer(scatter_list[r]), ops.global_rank(group, r), group=group)
                 for r in range(p) if r != root]
        tensor.copy_(scatter_list[root].reshape(tensor.shape))
        for work in sends:
            work.wait()
    else:
        landing = ops.work_buffer(tensor)
        dist.recv(landing, src, group=group)
        ops.write_back(tensor, landing)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group=None) -> None:
    """Every rank's ``tensor`` lands in ``gather_list[i]`` (i its group rank) on global rank ``dst``.

    ``gather_list`` is needed on the root only (one tensor per group rank, each with
    ``tensor``'s dtype and number of elements); other ranks may pass None.
    """
    if not _check(tensor, group, "gather"):
        return
    root = _group_rank_of(dst, group, "gather")
    me, p = ops.group_rank_and_size(group)
    if me != root:
        dist.send(ops.work_buffer(tensor), dst, group=group)
        return
    _check_list(gather_list, p, tensor, "gather_list", "gather")
    for r in range(p):
        target = gather_list[r]
        if r == root:
            target.copy_(tensor.reshape(target.shape))
            continue
        landing = ops.work_buffer(target)
        dist.recv(landing, ops.global_rank(group, r), group=group)
        ops.write_back(target, landing)


# ---------------------------------------------------------------------------------
# all_gather, direct: p−1 rounds of lesson 1's exchange. In round k rank i sends its
# tensor to i+k and receives from i−k, so each round is a permutation -- no rank is
# sent two messages at once. Each rank sends p−1 messages of n/p: (p−1)·(α + n/p·β)
# when the links run in parallel.
#
#     round 1:  0→1 1→2 2→3 3→0      round 2:  0→2 1→3 2→0 3→1      round 3:  0→3 1→0 2→1 3→2

def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
    """Every rank's ``tensor`` lands in ``tensor_list[i]`` (i its group rank) on every rank."""
    if not _check(tensor, group, "all_gather"):
        return
    me, p = ops.group_rank_and_size(group)
    _check_list(tensor_list, p, tensor, "tensor_list", "all_gather")
    payload = ops.work_buffer(tensor)
    for k in range(1, p):
        to, frm = (me + k) % p, (me - k) % p
        exchange(payload, tensor_list[frm], ops.global_rank(group, to), ops.global_rank(group, frm),
                 group=group)
    tensor_list[me].copy_(tensor.reshape(tensor_list[me].shape))


# ---------------------------------------------------------------------------------
# all-reduce = reduce to rank 0, then broadcast from it.
#
#     1 ─┐                ┌─► 1
#     2 ─┼─► 0 (combine) ─┼─► 2        2(p−1) messages of n through rank 0:
#     3 ─┘                └─► 3        2(p−1)·(α + n·β) + (p−1)·n·γ


def all_reduce_via_reduce_broadcast(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """All-reduce ``tensor`` in place: :func:`reduce` to group rank 0, then :func:`broadcast`."""
    if not ops.check_all_reduce_args(tensor, op, group, what="all_reduce_via_reduce_broadcast"):
        return                         # not in the group: nothing to do, as dist.*
    root = ops.global_rank(group, 0)
    flat = ops.work_buffer(tensor)
    reduce(flat, root, op, group)
    broadcast(flat, root, group)
    ops.write_back(tensor, flat)


@cost.model("reduce_broadcast")
def reduce_broadcast_cost(n: float, p: int) -> cost.Cost:
    """Linear reduce then linear broadcast: 2(p−1)·α + 2(p−1)·n·β + (p−1)·n·γ; rank 0 sends (p−1)·n."""
    if p == 1:
        return cost.Cost(0, 0.0, 0.0)
    return cost.Cost(2 * (p - 1), 2 * (p - 1) * n, (p - 1) * n, (p - 1) * n)


def broadcast_cost(n: float, p: int, tree: bool = False) -> cost.Cost:
    """Linear broadcast: (p−1)·(α + n·β); binomial tree: ⌈log2 p⌉·(α + n·β). Bytes per rank:
    the most any rank sends -- (p−1)·n at the linear root, ⌈log2 p⌉·n at the tree's."""
    steps = cost.log2_ceil(p) if tree else p - 1
    return cost.Cost(steps, steps * n, steps * n)
