"""The all-reduce cases and their inputs: what :mod:`collectives.course.verify` runs.

A :class:`Case` is one input configuration (size, dtype, op, layout, values, subgroup);
:func:`default_cases` is the covering set for a world of p ranks; :func:`make_values` and
:func:`make_input` build a rank's input for a case -- integer-valued so that any order of
combining is exact, or random floats held to :data:`TOLERANCES` (:func:`tolerance`) -- laid
out contiguous, strided (the gaps hold :data:`SENTINEL`) or transposed. The harness that
feeds them to an implementation and to ``dist.all_reduce`` is :mod:`collectives.course.verify`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from ..core.ops import ReduceOp, op_name

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int32, torch.int64)
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES
ALL_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)
LARGE = (1 << 20) + 3  # over 1 Mi elements, and odd

# Random floats: |got - expected| <= atol + rtol * |expected|, with the world size p
# folded in (a sum of p terms in another order rounds up to p times differently).
# Values are drawn from [-1, 1], so partial sums stay below p in magnitude.
TOLERANCES = {  # dtype: (rtol per rank, atol per rank), both multiplied by p
    torch.float64: (1e-15, 1e-15),
    torch.float32: (2e-7, 5e-7),
    torch.float16: (1e-3, 4e-3),
    torch.bfloat16: (8e-3, 3e-2),
}
SENTINEL = 77  # what the gaps between a strided view's elements hold; must survive


@dataclass(frozen=True)
class Case:
    """One input configuration. ``group`` lists the global ranks of a subgroup, or None."""

    numel: int
    dtype: torch.dtype = torch.float32
    op: object = ReduceOp.SUM
    layout: str = "contiguous"      # "contiguous" | "strided" (every 2nd element) | "transposed"
    values: str = "int"             # "int": integer-valued, exact | "random": floats, tolerance
    group: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        parts = [f"n={self.numel}", str(self.dtype).replace("torch.", ""), op_name(self.op)]
        if self.layout != "contiguous":
            parts.append(self.layout)
        if self.values != "int":
            parts.append(self.values)
        if self.group is not None:
            parts.append("group=" + ",".join(map(str, self.group)))
        return " ".join(parts)


def default_cases(world_size: int, *, quick: bool = False, large: bool = True) -> list[Case]:
    """The covering set of cases for a world of ``world_size`` ranks (see the module doc)."""
    p = world_size
    cases: list[Case] = []
    odd = 1001 if p > 1 else 7  # not divisible by 2, 3 or 4
    # every dtype meets every op (AVG only for floats), integer-valued -> exact
    for dtype in ALL_DTYPES:
        for op in ALL_OPS:
            if op == ReduceOp.AVG and dtype in INT_DTYPES:
                continue
            if quick and op not in (ReduceOp.SUM, ReduceOp.MAX) and dtype != torch.float32:
                continue
            cases.append(Case(odd, dtype, op))
    # sizes that break naive chunking: empty, one element, fewer elements than ranks -- each
    # once: at p = 2 "fewer than ranks" is one element, and two cases of one name would be
    # judged as one (their messages counted together)
    sizes = list(dict.fromkeys([0, 1, max(p - 1, 1), 7 * p + 3]))
    for n in sizes:
        cases.append(Case(n, torch.float32, ReduceOp.SUM))
        if not quick:
            cases.append(Case(n, torch.int64, ReduceOp.MAX))
            cases.append(Case(n, torch.float64, ReduceOp.AVG))
    if large:
        cases.append(Case(LARGE, torch.float32, ReduceOp.SUM))
    # random floats, within tolerance
    for dtype in FLOAT_DTYPES if not quick else (torch.float32,):
        cases.append(Case(4099, dtype, ReduceOp.SUM, values="random"))
    if not quick:
        cases.append(Case(4099, torch.float32, ReduceOp.AVG, values="random"))
        cases.append(Case(4099, torch.float32, ReduceOp.PRODUCT, values="random"))
    # views: the implementation must write through them, and only to their elements
    for layout in ("strided", "transposed"):
        cases.append(Case(odd, torch.float32, ReduceOp.SUM, layout=layout))
        if not quick:
            cases.append(Case(odd, torch.int32, ReduceOp.MIN, layout=layout))
            cases.append(Case(odd, torch.float16, ReduceOp.PRODUCT, layout=layout))
    # subgroups: a prefix of the ranks and (where there are 3 or more) the even ranks
    groups = [tuple(range(max(p - 1, 1)))]
    if p >= 3:
        groups.append(tuple(range(0, p, 2)))
    if p == 2:
        groups.append((1,))
    for g in groups:
        cases.append(Case(odd, torch.float32, ReduceOp.SUM, group=g))
        if not quick:
            cases.append(Case(odd, torch.int64, ReduceOp.PRODUCT, group=g))
    return cases


def _generator(case: Case, rank: int, seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(zlib.crc32(f"{seed}|{case.name}|{rank}".encode()))
    return g


def make_values(case: Case, rank: int, seed: int = 0) -> torch.Tensor:
    """This rank's input values for ``case``, contiguous, 1-D, on the CPU."""
    g = _generator(case, rank, seed)
    n, dtype, op = case.numel, case.dtype, case.op
    if case.values == "random":
        if op == ReduceOp.PRODUCT:
            x = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
        else:
            x = torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1
        return x.to(dtype)
    # Integer-valued, chosen so that any order of combining is exact in every dtype:
    # sums of up to 8 terms in [-8, 8] (|sum| <= 64), products of {-2,-1,1,2} (|prod| <= 256),
    # min/max of integers in [-100, 100].
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        x = torch.randint(-8, 9, (n,), generator=g)
    elif op == ReduceOp.PRODUCT:
        choices = torch.tensor([-2, -1, 1, 2])
        x = choices[torch.randint(0, 4, (n,), generator=g)]
    else:
        x = torch.randint(-100, 101, (n,), generator=g)
    return x.to(dtype)


def make_input(case: Case, rank: int, seed: int = 0, device=None):
    """``(tensor, base)``: the tensor handed to the implementation, laid out as the case says,
    and the buffer it lives in (``base`` is None when the tensor owns its memory)."""
    values = make_values(case, rank, seed)
    device = device or torch.device("cpu")
    n = case.numel
    if case.layout == "contiguous":
        return values.to(device), None
    if case.layout == "strided":  # every other element of a buffer twice as long
        base = torch.full((2 * n,), SENTINEL, dtype=case.dtype, device=device)
        view = base[::2]
        view.copy_(values.to(device))
        return view, base
    if case.layout == "transposed":  # a (cols, rows) transpose of a contiguous (rows, cols)
        rows = 7 if n % 7 == 0 and n else 1
        for r in (13, 11, 7, 3):
            if n % r == 0:
                rows = r
                break
        cols = n // rows if rows else 0
        base = torch.empty((rows, cols), dtype=case.dtype, device=device)
        view = base.t()
        view.copy_(values.view(cols, rows).to(device))
        return view, base
    raise ValueError(f"unknown layout {case.layout!r}")


def tolerance(dtype: torch.dtype, world_size: int) -> tuple[float, float]:
    rtol, atol = TOLERANCES.get(dtype, (0.0, 0.0))
    return rtol * world_size, atol * world_size
