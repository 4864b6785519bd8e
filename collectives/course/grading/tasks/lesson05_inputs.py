"""What lesson 5's graded tasks draw, and how their records are read.

Shared by :mod:`~collectives.course.grading.tasks.lesson05` (the plan and the copies) and
:mod:`~collectives.course.grading.tasks.lesson05_all_reduce` (the fused all-reduce and the
reducer): integer-valued inputs drawn from a seed (so any order of combining is exact),
tensors of every shape and view a copy must handle, one float64 tensor per list to send
back, and the rule every fused call is held to -- exactly the all-reduces of the plan.
"""

from __future__ import annotations

import math

import torch

from ... import verify
from ...verify import SENTINEL, Case

WORLD = 3                        # the tasks that communicate; a subgroup of two leaves a rank out
SUBGROUP = (0, 1)
THRESHOLD, BUFFER = 4096, 2048   # 4 KiB or more: on its own; buffers of 512 float32
MAX_PROBLEMS = 20


def _draw(g: torch.Generator, lo: int, hi: int) -> int:
    """An integer in [lo, hi], from ``g``."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def _short(value, limit: int = 160) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _piece(g: torch.Generator, dtype: torch.dtype, kind: int) -> torch.Tensor:
    """One input tensor of a copy: 1-D, 2-D, a transposed or strided view, a scalar or empty."""
    def values(*shape):
        return torch.randint(-50, 51, shape, generator=g).to(dtype)
    if kind == 0:
        return values(_draw(g, 1, 12))
    if kind == 1:
        return values(_draw(g, 1, 4), _draw(g, 1, 5))
    if kind == 2:
        return values(_draw(g, 2, 4), _draw(g, 2, 5)).t()
    if kind == 3:
        n = _draw(g, 1, 9)
        base = torch.full((2 * n,), SENTINEL, dtype=dtype)
        base[::2] = values(n)
        return base[::2]
    if kind == 4:
        return values()
    return torch.zeros((0,) if _draw(g, 0, 1) else (0, 3), dtype=dtype)


def _values(shape, dtype, op, seed: int) -> torch.Tensor:
    """Integer-valued input of ``shape``: any order of combining is exact."""
    return verify.make_values(Case(math.prod(shape), dtype, op), 0, seed).view(shape)


def _flat(tensors) -> torch.Tensor:
    """Every element of ``tensors`` in one float64 tensor (exact for the course's values): one
    tensor to send back, not one per element of the list."""
    return torch.cat([t.detach().reshape(-1).double() for t in tensors] + [torch.zeros(0, dtype=torch.float64)])


def _list_problem(expected: list[torch.Tensor], flat: torch.Tensor) -> str | None:
    """What differs between each expected tensor and its part of ``flat`` (from :func:`_flat`)."""
    offset = 0
    for i, e in enumerate(expected):
        problem = verify.compare(e.reshape(-1).double(), flat[offset:offset + e.numel()])
        if problem:
            return f"tensor {i} ({_dt(e.dtype)}, shape {tuple(e.shape)}): {problem}"
        offset += e.numel()
    return None


def _logical(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements in logical order, plus what lies between a strided view's."""
    base = t._base if t._base is not None else t
    return torch.cat([t.detach().reshape(-1).double(), base.detach().reshape(-1).double()])


def _one_call_problem(calls, expected: list[tuple[int, str]], ranks: list[int]) -> str | None:
    """Exactly the all-reduces ``expected`` ((numel, dtype) each, in order), over ``ranks``."""
    others = sorted({c.kind for c in calls if c.kind != "allreduce" and not c.kind.startswith(("store.", "backend."))})
    if others:
        return f"called {', '.join(others)}: a fused all-reduce makes all-reduces only"
    got = [(c.numel, c.dtype) for c in calls if c.kind == "allreduce"]
    if got != expected:
        what = "one all-reduce per flush and one per tensor on its own, in the layout's order"
        return f"all-reduced {_short(got)}, expected {what}: {_short(expected)}"
    group = tuple(ranks)
    if any(c.ranks and tuple(c.ranks) != group for c in calls if c.kind == "allreduce"):
        bad = next(c.ranks for c in calls if c.kind == "allreduce" and c.ranks and tuple(c.ranks) != group)
        return f"all-reduced over ranks {bad}, expected the group's {group}"
    return None
