"""What ``transport="auto"`` knows about a group: its link and its processor, measured once.

The choice between the all-gather, the split and the dense transport is a question of time,
not bytes: on NVLink the dense all-reduce wins at 1 % (selection and the pairs' handling
outlast the bytes saved), on 1 Gbit/s Ethernet the all-gather wins up to about 13 %
(``docs/benchmarks.md``). So the first ``transport="auto"`` call on a group measures, on
every rank of it at once:

* the **link**: α from a one-element all-reduce, β from a 1 MiB one
  (T = 2(p−1)·α + 2(p−1)/p·n·β, the ring's model);
* the **processor** (:class:`~collectives.sparse.cost.SparseCompute`): zeroing per element,
  selection at 1 % per kept element, packing, unpacking and adding per pair.

Every figure is the slowest rank's (:func:`collectives.core.timing.measure` takes the max
over the group), so every rank holds the same :class:`~collectives.sparse.cost.SparseProfile`
and makes the same choice -- a rank that chose another transport would wait forever. The
measurement costs about 0.1 s once per group (a few all-reduces, not traced: they are the
course's measuring, not the algorithm). :func:`set_profile` gives a group a profile instead
(the tests, or a link you have measured better).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..core import timing, trace
from ..core.cost import AlphaBeta
from .allgather import pack_pairs, unpack_pairs
from .cost import SparseCompute, SparseProfile
from .select import keep_count, topk_indices

_profiles: dict[tuple, SparseProfile] = {}
os.register_at_fork(after_in_child=_profiles.clear)     # a forked rank measures its own world


def _key(group, device: torch.device) -> tuple:
    ranks = (tuple(range(dist.get_world_size())) if group is None or group is dist.GroupMember.WORLD
             else tuple(dist.get_process_group_ranks(group)))
    return ranks, dist.get_backend(group), device.type


def measure_link(group=None, device=None, nbytes: int = 1 << 20, iters: int = 3) -> AlphaBeta:
    """α and β of ``group``'s all-reduce, fitted to the ring's model from two sizes."""
    device = torch.device(device or "cpu")
    p = dist.get_world_size(group)
    if p == 1:
        return AlphaBeta(0.0, 0.0)
    tiny, big = torch.zeros(1, device=device), torch.zeros(nbytes // 4, device=device)

    def seconds(t):
        return timing.median(timing.measure(lambda: dist.all_reduce(t, group=group), warmup=1, iters=iters,
                                            group=group, device=device))
    small, large = seconds(tiny), seconds(big)
    alpha = small / (2 * (p - 1))
    beta = max(large - small, 1e-12) / (2 * (p - 1) / p * nbytes)
    return AlphaBeta(alpha, beta)


def measure_compute(x: torch.Tensor, group=None, iters: int = 3, density: float = 0.01) -> SparseCompute:
    """The processor's rates on ``x`` (1-D), timed on every rank of ``group`` at once, as the
    ranks share the processor during an all-reduce:

    * ``scan``: zeroing the result, per element;
    * ``pick``: choosing the top ``density`` (``selection="auto"``) and copying the values
      out, per kept element;
    * ``pair``: packing 10 % of the elements as pairs, then unpacking and adding them p times
      (what the all-gather transport does with every rank's), per pair.
    """
    p, n = dist.get_world_size(group), x.numel()
    out = torch.empty_like(x)
    k, many = keep_count(n, density), keep_count(n, 0.1)
    idx = topk_indices(x, many, "auto")
    vals = x.index_select(0, idx)

    def timed(fn):
        return timing.median(timing.measure(fn, warmup=1, iters=iters, group=group, device=x.device))

    def pack_and_add():
        packed = pack_pairs(idx, vals, many)
        for _ in range(p):
            i, v = unpack_pairs(packed, many, x.dtype)
            out.index_add_(0, i, v)
    return SparseCompute(scan=timed(out.zero_) / n,
                         pick=timed(lambda: x.index_select(0, topk_indices(x, k, "auto"))) / k,
                         pair=timed(pack_and_add) / (many + p * many))


def measure_profile(group=None, device=None, numel: int = 1 << 19) -> SparseProfile:
    """Measure ``group``'s link and processor (a collective: every rank of the group calls it)."""
    device = torch.device(device or "cpu")
    with trace.paused():
        link = measure_link(group, device)
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
        compute = measure_compute(x, group)
    return SparseProfile(link, compute)


def profile_for(group=None, device=None) -> SparseProfile:
    """``group``'s profile: the one given by :func:`set_profile`, or measured on first use."""
    device = torch.device(device or "cpu")
    key = _key(group, device)
    if key not in _profiles:
        _profiles[key] = measure_profile(group, device)
    return _profiles[key]


def set_profile(profile: SparseProfile, group=None, device=None) -> None:
    """Give ``group`` a profile instead of measuring one (the same on every rank)."""
    _profiles[_key(group, torch.device(device or "cpu"))] = profile
