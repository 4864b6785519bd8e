"""Lesson 2 exercise: build the collectives from send and recv.

Each function has the signature and meaning of its ``torch.distributed`` twin for the
arguments kept (``src``/``dst`` are *global* ranks, as in ``dist.broadcast``), and is
checked on the twin's results: every root, six dtypes, sizes 0, 1 and odd, subgroups,
non-contiguous views, bad input. Call only point-to-point functions (``dist.send``,
``dist.recv``, ``dist.isend``, ``dist.irecv``, lesson 1's ``exchange``) -- never the twin.

Check your work:

    .venv/bin/python lessons/02_collectives/exercise.py                        # PASS/FAIL per task
    .venv/bin/torchrun --nproc-per-node 4 lessons/02_collectives/exercise.py   # the same, under torchrun
    make check LESSON=02                                                        # the same, from make
    make grade LESSON=02                                                        # the points

Every message your functions make is recorded where your code cannot reach, and each
task is held to its pattern: who sends to whom, how many messages, how large, and that
each carried the data it should (the root's tensor, piece i for rank i, ...).

| task | what                                             | stub                              | points |
|------|--------------------------------------------------|-----------------------------------|--------|
| 1    | broadcast, linear: the root sends p−1 messages   | broadcast                         | 2      |
| 2    | reduce, linear, five ops                         | reduce                            | 3      |
| 3    | scatter                                          | scatter                           | 2      |
| 4    | gather                                           | gather                            | 2      |
| 5    | all_gather from p−1 exchanges                    | all_gather                        | 2      |
| 6    | all-reduce = reduce + broadcast                  | all_reduce_via_reduce_broadcast   | 2      |
| 7    | broadcast along a binomial tree                  | tree_broadcast                    | 2      |

Course functions you may call (the sheet is checked against the code):

    ops.check_all_reduce_args(tensor, op=ReduceOp.SUM, group=None, *, what='all_reduce',
                              compare=True, agree=None) -> bool
        Raise a clear error for input an in-place all-reduce cannot honour; return whether
        this rank takes part.
    ops.work_buffer(tensor) -> torch.Tensor
        A flat, contiguous buffer holding ``tensor``'s elements: the tensor's own memory
        when it is contiguous, else a copy (to be written back with :func:`write_back`).
    ops.write_back(tensor, flat) -> None
        Copy ``flat`` into ``tensor`` (its data, detached) unless it already is ``tensor``'s
        memory.
    ops.combine_(acc, incoming, op) -> torch.Tensor
        ``acc <- acc (op) incoming``, in place. AVG accumulates as SUM (see
        :func:`finish_`).
    ops.finish_(tensor, op, group_size) -> torch.Tensor
        Apply what remains after the combining: for AVG, one division by the group size.
    ops.group_rank_and_size(group=None) -> tuple[int, int]
        This rank's index in ``group`` and the group's size (the world when ``group`` is
        None).
    ops.global_rank(group, group_rank) -> int
        The global rank of ``group_rank`` in ``group``: what ``send``/``recv`` take.
    p2p.exchange(send_tensor, recv_tensor, send_to, recv_from, group=None) -> None
        Send ``send_tensor`` to ``send_to`` while receiving ``recv_tensor`` from
        ``recv_from``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from collectives import ops
from collectives.core.ops import ReduceOp
from collectives.course.grading.runner import run_tasks
from collectives.p2p import exchange  # noqa: F401  (lesson 1's reference: use it in task 5)

LESSON = 2


# Given: small helpers that are not the point of the lesson.

def group_rank_of(global_rank: int, group, what: str) -> int:
    """The index in ``group`` of a global rank; ValueError if it is not a member."""
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    if global_rank not in ranks:
        raise ValueError(f"{what}: rank {global_rank} is not in the group {ranks}")
    return ranks.index(global_rank)


def check_list(tensors, p: int, like: torch.Tensor, name: str, what: str) -> None:
    """ValueError unless ``tensors`` holds ``p`` tensors with ``like``'s dtype and numel."""
    if tensors is None or len(tensors) != p:
        raise ValueError(f"{what}: {name} must hold {p} tensors, got "
                         f"{None if tensors is None else len(tensors)}")
    for i, t in enumerate(tensors):
        if t.numel() != like.numel() or t.dtype != like.dtype:
            raise ValueError(f"{what}: {name}[{i}] does not match the tensor's dtype and size")


def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> None:
    """Lesson 2, task 1: copy ``tensor`` from global rank ``src`` to every rank of ``group``.

    TODO:     the root sends its whole tensor to every other rank of the group (p−1
              messages); every other rank receives it into ``tensor``, in place.
    APPROACH: ``me, p = ops.group_rank_and_size(group)``; ``root = group_rank_of(src,
              group, "broadcast")``; the peer of group rank r is ``ops.global_rank(group, r)``.
              Reject an expanded tensor: ``ops.check_all_reduce_args(tensor, ReduceOp.SUM,
              group, what="broadcast")`` does it.
    EXAMPLE:  4 ranks, tensor = [r, r] on rank r, broadcast(tensor, src=2) -> [2, 2] everywhere.
    HINT:     gloo sends and receives contiguous memory only: receive into
              ``ops.work_buffer(tensor)`` and ``ops.write_back(tensor, buffer)`` after; send
              ``tensor.contiguous()``. isend to everyone, then wait on all, lets the
              messages overlap.
    CALLS:    ops.check_all_reduce_args, ops.work_buffer, ops.write_back, ops.group_rank_and_size,
              ops.global_rank
    """
    raise NotImplementedError("Lesson 2, task 1: broadcast")


def reduce(tensor: torch.Tensor, dst: int = 0, op=ReduceOp.SUM, group=None) -> None:
    """Lesson 2, task 2: combine every rank's ``tensor`` with ``op`` into ``tensor`` on ``dst``.

    TODO:     every other rank sends its tensor to the root; the root receives them one by
              one and combines each into its own: SUM, PRODUCT, MIN, MAX, AVG.
              Only the root's result matters (the other ranks' tensors may stay as they are).
    APPROACH: ``ops.check_all_reduce_args(tensor, op, group, what="reduce")`` first (bad
              op, AVG on integers, expanded tensor). Accumulate in ``ops.work_buffer(tensor)``
              with ``ops.combine_(acc, incoming, op)``; at the end ``ops.finish_(acc, op, p)``
              (AVG: one division) and ``ops.write_back``.
    EXAMPLE:  4 ranks, tensor = [r + 1] on rank r, reduce(tensor, dst=0, op=MAX) -> [4] on rank 0.
    HINT:     receive in group-rank order with one scratch buffer: a blocking recv from
              rank 1, then rank 2, ... never deadlocks, whoever sends first.
    CALLS:    ops.check_all_reduce_args, ops.work_buffer, ops.write_back, ops.combine_, ops.finish_
    """
    raise NotImplementedError("Lesson 2, task 2: reduce")


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group=None) -> None:
    """Lesson 2, task 3: ``scatter_list[i]`` on global rank ``src`` lands in ``tensor`` on group rank i.

    TODO:     the root sends piece i to group rank i (p−1 messages) and copies its own
              piece into ``tensor``; every other rank receives its piece into ``tensor``.
    APPROACH: on the root only, ``check_list(scatter_list, p, tensor, "scatter_list",
              "scatter")``; other ranks may get ``None``.
    EXAMPLE:  4 ranks, on rank 0 scatter_list = [[0], [10], [20], [30]];
              scatter(t, scatter_list, src=0) -> t = [10 * r] on rank r.
    HINT:     the pieces may have another shape than ``tensor`` (same number of
              elements): ``tensor.copy_(piece.reshape(tensor.shape))``.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 2, task 3: scatter")


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group=None) -> None:
    """Lesson 2, task 4: every rank's ``tensor`` lands in ``gather_list[i]`` (i its group rank) on ``dst``.

    TODO:     every other rank sends its tensor to the root; the root receives group rank
              i's tensor into ``gather_list[i]`` and copies its own into its own slot.
    APPROACH: the mirror image of scatter; ``check_list`` on the root only.
    EXAMPLE:  4 ranks, tensor = [r] on rank r, gather(tensor, out, dst=3) -> out = [[0], [1],
              [2], [3]] on rank 3.
    HINT:     ``gather_list`` entries may be views: receive through ``ops.work_buffer`` and
              ``ops.write_back``.
    CALLS:    ops.work_buffer, ops.write_back
    """
    raise NotImplementedError("Lesson 2, task 4: gather")


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
    """Lesson 2, task 5: every rank's ``tensor`` lands in ``tensor_list[i]`` (i its group rank) everywhere.

    TODO:     in p−1 rounds, send your tensor to every other rank and receive theirs.
    APPROACH: in round k = 1 .. p−1, send to group rank (me + k) % p and receive from
              (me − k) % p with lesson 1's ``exchange`` (global ranks!); copy your own
              tensor into ``tensor_list[me]``.
    EXAMPLE:  4 ranks, tensor = [r] on rank r -> tensor_list = [[0], [1], [2], [3]] everywhere.
    HINT:     in each round every rank sends one message and receives one: a permutation,
              so no rank is flooded and nothing waits in a cycle.
    CALLS:    p2p.exchange
    """
    raise NotImplementedError("Lesson 2, task 5: all_gather")


def all_reduce_via_reduce_broadcast(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """Lesson 2, task 6: all-reduce ``tensor`` in place, as ``dist.all_reduce`` does.

    TODO:     your ``reduce`` to group rank 0, then your ``broadcast`` from it.
    APPROACH: ``ops.check_all_reduce_args(tensor, op, group)``; work in
              ``flat = ops.work_buffer(tensor)`` and ``ops.write_back(tensor, flat)`` at the end,
              so views work.
    EXAMPLE:  4 ranks, tensor = [r + 1] on rank r, op=SUM -> [10] everywhere; op=AVG -> [2.5].
    HINT:     group rank 0 is global rank ``ops.global_rank(group, 0)``; AVG needs no
              special case here -- reduce already divided.
    CALLS:    ops.check_all_reduce_args, ops.work_buffer, ops.write_back, ops.global_rank
    """
    raise NotImplementedError("Lesson 2, task 6: all_reduce_via_reduce_broadcast")


def tree_broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> None:
    """Lesson 2, task 7: :func:`broadcast` along a binomial tree: ⌈log2 p⌉ rounds, not p−1.

    TODO:     number the ranks relative to the root, v = (me − root) % p. Every rank but
              the root receives once, from v with its highest set bit cleared; then it
              sends to v + 2^k for every power of two 2^k above its highest bit with
              v + 2^k < p, smallest first.
    APPROACH: ``v.bit_length()`` is one more than the position of the highest bit; the
              root (v = 0) starts sending at 2^0. Turn relative ranks back into global
              ones with ``ops.global_rank(group, (rel + root) % p)``.
    EXAMPLE:  p = 8, root 0: round 0: 0→1; round 1: 0→2, 1→3; round 2: 0→4, 1→5, 2→6, 3→7.
              The root sends 3 messages instead of 7.
    HINT:     blocking send and recv are safe here: a parent sends only after it has
              received, and each child posts its only recv at once.
    CALLS:    ops.global_rank
    """
    raise NotImplementedError("Lesson 2, task 7: tree_broadcast")


if __name__ == "__main__":
    run_tasks(LESSON)
