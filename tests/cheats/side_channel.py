"""What the side-channel cheats share: every rank's tensor through files in /dev/shm.

:func:`share` writes this rank's tensor to a folder of this world's own and waits for the
others' (the folder is named after the file the launcher gave the rank for its stderr,
unique to the world). No message, no store: nothing the process group sees.
"""

import os
import time

import torch
import torch.distributed as dist

_count: dict[tuple, int] = {}


def _folder() -> str:
    world = os.path.basename(os.path.dirname(os.readlink("/proc/self/fd/2")))
    path = os.path.join("/dev/shm", f"side-{world}")
    os.makedirs(path, exist_ok=True)
    return path


def share(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every group rank's ``tensor`` (group order), passed through files."""
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    n = _count[ranks] = _count.get(ranks, 0) + 1
    tag = f"{'-'.join(map(str, ranks))}.{n}"
    mine = os.path.join(_folder(), f"{tag}.{dist.get_rank()}")
    torch.save(tensor.detach().clone(), mine + ".tmp")
    os.rename(mine + ".tmp", mine)
    out = []
    for r in ranks:
        path = os.path.join(_folder(), f"{tag}.{r}")
        while not os.path.exists(path):
            time.sleep(0.001)
        out.append(torch.load(path))
    return out


def decoys(sizes: list[tuple[int, int]], dst: int, dtype, group=None) -> None:
    """Messages of the expected sizes to ``dst`` (global rank) holding random values, and the
    matching receives from the left, one (send, receive) size pair a step: the pattern the
    judge counts, without the data."""
    p = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(p))
    left = ranks[(ranks.index(dist.get_rank()) - 1) % p]
    for send_n, recv_n in sizes:
        junk = (torch.rand(send_n) * 100).round().to(dtype)
        ops = [dist.P2POp(dist.isend, junk, dst, group),
               dist.P2POp(dist.irecv, torch.empty(recv_n, dtype=dtype), left, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def reduce_scatter_by_files(output, input, op, group=None) -> tuple[list[int], int, list[tuple]]:
    """The ring's reduce-scatter computed from every rank's input read through files: fills
    ``output``; returns the group's ranks, this rank's place, and what the ring would have sent
    at each step -- (the block, the size of the block received back)."""
    from collectives.core.ops import ReduceOp, chunk_bounds
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    p, me = len(ranks), ranks.index(dist.get_rank())
    every = share(input.reshape(-1).double(), group)
    bounds = chunk_bounds(input.numel(), p)
    reduced = {ReduceOp.PRODUCT: lambda s: s.prod(0), ReduceOp.MIN: lambda s: s.min(0).values,
               ReduceOp.MAX: lambda s: s.max(0).values}.get(op, lambda s: s.sum(0))
    lo, hi = bounds[me]
    result = reduced(torch.stack(every))[lo:hi].to(input.dtype)
    if op == ReduceOp.AVG:
        result.div_(p)
    output.copy_(result.view(output.shape))
    steps = []
    for s in range(p - 1):                  # step s: the chunk me − s − 1, reduced over me − s .. me
        a, b = bounds[(me - s - 1) % p]
        c, d = bounds[(me - s - 2) % p]
        steps.append((reduced(torch.stack([every[(me - k) % p][a:b] for k in range(s + 1)])).to(input.dtype), d - c))
    return ranks, me, steps
