"""What every lesson 11 fixture builds on, written once: the exercise's given ``blocks``, and a
correct pairwise all-to-all and split exchange for the tasks built on task 1 (so that each
fixture's mistake in a later task is judged alone)."""

from __future__ import annotations

import torch

from collectives import ops
from tests.mistakes.given import given

blocks = given(11, "blocks")


def _wait(handles) -> None:
    for handle in handles:
        handle.wait()


def _schedule(rank: int, p: int, k: int) -> tuple[int, int]:
    if p & (p - 1) == 0:
        return rank ^ k, rank ^ k
    return (rank + k) % p, (rank - k) % p


def _pairwise(output, input, output_split_sizes=None, input_split_sizes=None, group=None) -> None:
    """A correct pairwise all-to-all, for the tasks built on task 1."""
    rank, p = ops.group_rank_and_size(group)
    src = input.contiguous()
    dst = output if output.is_contiguous() else torch.empty(output.shape, dtype=output.dtype)
    ins, outs = blocks(src, input_split_sizes, p), blocks(dst, output_split_sizes, p)
    outs[rank].copy_(ins[rank])
    for k in range(1, p):
        to, frm = _schedule(rank, p, k)
        _wait(ops.sendrecv(ins[to], ops.global_rank(group, to), outs[frm], ops.global_rank(group, frm), group))
    if dst is not output:
        output.copy_(dst)


def _exchange(counts: list[int], group=None) -> list[int]:
    rank, p = ops.group_rank_and_size(group)
    send = torch.tensor(counts, dtype=torch.int64, device=ops.rank_device())
    recv = torch.empty(p, dtype=torch.int64, device=ops.rank_device())
    _pairwise(recv, send, group=group)
    return recv.tolist()


def _uneven(input, input_split_sizes, group=None):
    sizes = _exchange(list(input_split_sizes), group)
    output = torch.empty((sum(sizes), *input.shape[1:]), dtype=input.dtype, device=input.device)
    _pairwise(output, input, sizes, list(input_split_sizes), group)
    return output, sizes
