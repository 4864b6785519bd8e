"""Lesson 10: the process groups sharding runs in besides the world -- a machine's ranks and
the ranks holding the same rows on other machines (hybrid sharding), and the groups of k
consecutive ranks ``reshard_after_forward=k`` gathers in (FSDP2's post-forward mesh, the
world's ranks viewed as rows of k)."""

from __future__ import annotations

import torch.distributed as dist


def hybrid_groups(ranks_per_machine: int):
    """``(shard_group, replicate_group)`` of this rank when ranks are placed machine-major,
    ``ranks_per_machine`` to a machine (every rank must call it: it creates every group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_machine < 1 or world % ranks_per_machine:
        raise ValueError(f"hybrid_groups: {world} ranks do not split into machines of {ranks_per_machine}")
    machines = world // ranks_per_machine
    shard = replicate = None
    for m in range(machines):
        g = dist.new_group(list(range(m * ranks_per_machine, (m + 1) * ranks_per_machine)))
        shard = g if rank // ranks_per_machine == m else shard
    for local in range(ranks_per_machine):
        g = dist.new_group([m * ranks_per_machine + local for m in range(machines)])
        replicate = g if rank % ranks_per_machine == local else replicate
    return shard, replicate


def consecutive_groups(ranks: list[int], k: int, index: int):
    """The group of ``ranks[index]``'s block when ``ranks`` are cut into blocks of ``k``
    (every rank must call it: it creates every block's group, in one order)."""
    mine = None
    for b in range(len(ranks) // k):
        g = dist.new_group(ranks[b * k:(b + 1) * k])
        mine = g if index // k == b else mine
    return mine


def reshard_groups(reshard, p: int, rank: int, group=None):
    """FSDP's ``reshard_after_forward`` as ``(switch, k, group of k, rank in it)``: as an int k
    (FSDP2's), after its forward a unit keeps a k-way sharding within groups of k consecutive
    ranks and its backward gathers within the group -- Ψ/k held between the two, the gather's
    ring k ranks long; 1 means False (kept whole) and p True (the whole group), as FSDP2's."""
    if isinstance(reshard, bool):
        return reshard, None, None, None
    if not isinstance(reshard, int) or reshard < 1 or p % reshard:
        raise ValueError(f"FSDP: reshard_after_forward must be True, False or an int dividing the "
                         f"{p} ranks, got {reshard!r}")
    if reshard in (1, p):
        return reshard == p, None, None, None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(p))
    return True, reshard, consecutive_groups(ranks, reshard, rank), rank % reshard
