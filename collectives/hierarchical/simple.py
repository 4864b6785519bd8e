"""The two simpler hierarchies the lesson compares Fairring's with, on the same groups.

Root-based (Horovod's first hierarchical mode)::

    inside: reduce to local rank 0  ->  across: all-reduce between the M roots
            ->  inside: broadcast from local rank 0

Only one rank per machine talks across, with the whole tensor: 2(M − 1)/M·n on one
link, while the other ranks' links (rails) idle; the inside stages move the whole
tensor D − 1 times through the root.

Reduce-scatter, all-reduce on the rails, all-gather::

    inside: reduce-scatter (local rank d keeps part d)  ->  across: all-reduce of part d
            on rail d  ->  inside: all-gather

The bytes of Fairring's design (2(M − 1)/M·n/D per rank across), with every rail busy;
what it lacks is the pipelining, and its rail all-reduce (lesson 4's ring) takes 2(M − 1)
rounds where the collect and the diffuse take one each. Its inside stages are the
hierarchy's own, so that the two differ in nothing else.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core import ops, streams, trace
from ..core.ops import ReduceOp
from ..ring import ring_all_reduce
from .layout import checked_layout, stage_groups
from .pipeline import slice_resources
from .slice import Slice


def _prepare(tensor, op, group, layout, what):
    shape = checked_layout(tensor, op, group, layout, what)
    if shape is None:
        return None                    # not in the group: nothing to do, as dist.all_reduce
    if tensor.numel() == 0 or dist.get_world_size(group) == 1:
        return None
    return shape, stage_groups(shape, group)


def root_based_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, layout=None) -> None:
    """Reduce to each machine's local rank 0, all-reduce between those roots, broadcast back.

    Cost, n bytes: inside 2(D − 1)·n through the root; across 2(M − 1)/M·n, all of it on
    the root's link.
    """
    prepared = _prepare(tensor, op, group, layout, "root_based_all_reduce")
    if prepared is None:
        return
    shape, groups = prepared
    p = dist.get_world_size(group)
    flat = ops.work_buffer(tensor.detach())
    base = ReduceOp.SUM if op == ReduceOp.AVG else op
    root = groups.inside_ranks()[0]
    if shape.D > 1:
        with trace.label("reduce to the root"):
            dist.reduce(flat, root, op=base, group=groups.reduce_scatter)
    if shape.M > 1 and groups.d == 0:
        with trace.label("all-reduce between the roots"):
            dist.all_reduce(flat, op=base, group=groups.collect)
    if groups.d == 0:
        ops.finish_(flat, op, p)
    if shape.D > 1:
        with trace.label("broadcast from the root"):
            dist.broadcast(flat, root, group=groups.all_gather)
    ops.write_back(tensor.detach(), flat)


def rail_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, layout=None) -> None:
    """Reduce-scatter inside the machine, all-reduce part d on rail d, all-gather inside.

    The inside stages are the hierarchy's own (one :class:`~.slice.Slice`, its padding slot
    included); only the middle differs: lesson 4's ring all-reduce of [d, :, :] on the rail,
    2(M − 1) rounds, where the hierarchy collects and diffuses in one round each. Cost, n
    bytes: inside 2(D − 1)/D·n, across 2(M − 1)/M·n/D per rank -- the hierarchy's bytes.
    """
    prepared = _prepare(tensor, op, group, layout, "rail_all_reduce")
    if prepared is None:
        return
    shape, groups = prepared
    p = dist.get_world_size(group)
    flat = ops.work_buffer(tensor.detach())
    caller = streams.current_stream(flat.device)      # every stage on the caller's stream, in turn
    one = Slice(flat, groups, op, p, slice_resources(groups, flat.device)["pools"], [caller] * 5)
    _wait(one.reduce_scatter())
    one.sum_partials()                             # [d, :, :]: machine m's sum
    base = ReduceOp.SUM if op == ReduceOp.AVG else op
    for blocks, _ in one.parts():
        if shape.M > 1:
            with trace.label("all-reduce on the rail"):
                ring_all_reduce(blocks[groups.d], op=base, group=groups.collect)
        ops.finish_(blocks[groups.d], op, p)
    _wait(one.all_gather())
    one.finish()
    ops.write_back(tensor.detach(), flat)


def _wait(works) -> None:
    for work in works:
        work.wait()
