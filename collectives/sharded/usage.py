"""Lesson 10: a parameter used on some ranks and not on others in a step -- a branch only some
ranks' batches take -- as DDP's ``find_unused_parameters`` and FSDP2's
``set_reduce_scatter_unused_params`` handle it.

A rank that did not use a parameter has no gradient for it. If it simply left the parameter
out, its reduce-scatter would pack fewer elements than the other ranks' (gloo refuses the
message) or come at another moment. Torch's answer, followed here: a rank contributes zeros
for what it did not use, at the moment the others reduce it, so the collectives match and
the mean is the users' gradients summed over all p ranks. Before anything is reduced, the
ranks learn what each used with one all-gather of a few flags (what DDP learns by walking
autograd's graph from the forward's outputs, :func:`reached`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from .shard import all_gather


def reached(outputs, params) -> list[bool]:
    """For each of ``params``: does autograd's graph from ``outputs`` (any nesting of tensors)
    reach it -- will a backward from them give it a gradient?"""
    stack = [t.grad_fn for t in tree_leaves(outputs) if torch.is_tensor(t) and t.grad_fn is not None]
    seen, found = set(), set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)         # an AccumulateGrad: the leaf it feeds
        if variable is not None:
            found.add(id(variable))
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return [id(q) in found for q in params]


def across(flags, group=None, use_torch: bool = False, device=None) -> list[list[bool]]:
    """Every rank's ``flags`` (the same number on each), rank by rank: one all-gather."""
    p = dist.get_world_size(group)
    mine = torch.tensor([float(f) for f in flags], dtype=torch.float32, device=device)
    every = mine.new_empty(p * mine.numel())
    all_gather(every, mine, use_torch=use_torch, group=group)
    return [[bool(x) for x in row] for row in every.view(p, -1).tolist()]


def first_partial(names, every, did: str = "was used") -> str | None:
    """The first of ``names`` some ranks flagged and others did not, said with both lists of
    ranks ("NAME ``did`` on rank(s) [...] and not on rank(s) [...]"); None when every rank
    flagged the same ones."""
    p = len(every)
    for j, name in enumerate(names):
        used = [r for r in range(p) if every[r][j]]
        if used and len(used) < p:
            return f"{name} {did} on rank(s) {used} and not on rank(s) {[r for r in range(p) if r not in used]}"
    return None
