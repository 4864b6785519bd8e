"""Choosing what to send: a threshold, or the k largest magnitudes.

Selection is half of a sparse all-reduce's time on a fast link: the wire carries 1 % of
the bytes, but the selection still reads 100 % of the tensor, and top-k reads it more
than once. Five ways to find the k largest magnitudes, each returning *exactly* k
indices (ties broken arbitrarily, never by dropping a larger magnitude for a smaller):

=============  ==========================================================================
``topk``       ``torch.topk(|x|, k)``: one pass with a heap (CPU) or radix select (GPU).
``sort``       a full sort of ``|x|``, then the first k: O(n log n), the plainest.
``kthvalue``   the k-th largest magnitude ``t`` by ``kthvalue``, then every ``|x| > t``
               and as many ``|x| == t`` as fill k: two passes and a host-side count.
``reuse``      Ok-Topk's trick: last step's k-th magnitude as a filter. Gradients change
               slowly, so ``|x| ≥ t_prev`` keeps a few times k candidates; top-k of the
               candidates is the top-k of the whole. Too few candidates: a plain top-k.
``sample``     DGC's trick: the threshold estimated from up to 64 Ki elements at random places,
               set a little low, then the same filter and top-k of the candidates as
               ``reuse``. One comparison pass, no state; too few candidates: a plain top-k.
=============  ==========================================================================

Every method treats NaN as the largest magnitude (as ``torch.sort`` does) and infinities
as larger than any finite value, so a NaN or inf in the input is always sent and reaches
every rank, as it would through a dense all-reduce -- unless more than k of them crowd
out each other, when the residual keeps the rest.

Magnitudes are compared exactly, in every dtype. Two traps: ``|INT_MIN|`` does not fit its
own integer type (``torch.abs`` of int32 −2^31 is −2^31, the *smallest* value), so integers
are ranked by ``|x| − 1``, computed without overflow (:func:`magnitude`); and a threshold
given as a Python float is rounded to the tensor's dtype when torch compares them (200.3
becomes 200 in bfloat16, and 200 then passes), so the threshold is first moved *up* to the
dtype's next representable value (:func:`threshold_in`), after which the comparison is exact.

SINGA's top-k (``sparsabs`` with a magnitude comparator on integers) ranks ``|g|`` cast to
an integer, so every gradient below 1 in magnitude ties at 0 and the "top" k are simply
the first k indices: :func:`truncated_magnitude_topk` reproduces that, for the lesson to
show the difference.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

SELECTIONS = ("topk", "sort", "kthvalue", "reuse", "sample")   # the values of ``selection=`` besides "auto"
SAMPLE = 1 << 16                  # elements ``sample`` looks at to estimate the threshold (at most ...
MIN_SAMPLE = 1 << 10              # ... and at least: a tensor under 8 Ki elements takes a plain top-k)
INDEX_DTYPE = torch.int32         # what travels: 4 bytes per index
MAX_NUMEL = 2**31 - 1             # the largest tensor int32 indices can address
NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)   # dtypes NumPy compares natively


def magnitude(x: torch.Tensor) -> torch.Tensor:
    """A tensor that orders like ``|x|``: ``|x|`` for floating types (NaN kept: sorting and top-k
    rank it above +inf); for signed integers ``|x| − 1``, computed as ``~(−|x|)`` with
    ``−|x| = where(x > 0, −x, x)``, which never overflows (``|x|`` itself does at INT_MIN);
    unsigned integers are their own magnitude."""
    if x.is_floating_point():
        return x.abs()
    if not x.dtype.is_signed:
        return x
    return torch.bitwise_not(torch.where(x > 0, -x, x))


def threshold_in(threshold: float, dtype: torch.dtype) -> float | int:
    """What :func:`magnitude` of a ``dtype`` tensor is compared with so that ``|x| ≥ threshold``
    holds exactly: the smallest value of the dtype at or above ``threshold`` for floating types
    (a Python float is a double: torch would round it to the dtype, possibly down); for
    integers, ``⌈threshold⌉ − 1`` on the ``|x| − 1`` scale of :func:`magnitude` (``⌈threshold⌉``
    for unsigned ones). ``threshold`` is ≥ 0."""
    if dtype.is_floating_point:
        if dtype == torch.float64:
            return threshold
        c = torch.tensor(threshold, dtype=torch.float64).to(dtype)
        if float(c) < threshold:                          # rounded down: one step up
            c = torch.nextafter(c, torch.tensor(float("inf"), dtype=dtype))
        return float(c)
    if math.isinf(threshold):
        return math.inf                                   # no integer reaches it
    whole = math.ceil(threshold)
    return whole - 1 if dtype.is_signed else whole


def _below(magnitudes: torch.Tensor, bound: float | int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``magnitudes < bound`` (NaN: False), with a bound beyond the dtype's range handled here
    rather than by torch's scalar conversion."""
    if not magnitudes.is_floating_point() and bound > torch.iinfo(magnitudes.dtype).max:
        return torch.ones(magnitudes.shape, dtype=torch.bool, out=out) if out is None else out.fill_(True)
    return torch.lt(magnitudes, bound, out=out) if out is not None else torch.lt(magnitudes, bound)


def keep_count(numel: int, density: float) -> int:
    """k = ⌈density·n⌉ (at least 1 for a non-empty tensor): the same on every rank, so
    top-k mode needs no count exchange."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if numel == 0:
        return 0
    return min(numel, max(1, int(-(-density * numel // 1))))


def threshold_indices(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (int64, ascending) of the elements with ``|x| ≥ threshold``, NaN included.

    Written as ``not (|x| < threshold)`` so that NaN, for which every comparison is false,
    is kept. The count of a threshold is data-dependent: ``nonzero`` synchronises with the
    host on a GPU. It is the one synchronisation threshold mode needs anyway (every rank
    must learn every rank's count). The work is done by :func:`at_least`.

    Exact in every dtype: ``threshold_indices(tensor([200.], dtype=bfloat16), 200.3)`` is
    empty, and integers are compared as integers (:func:`threshold_in`)."""
    return at_least(x, threshold)


CHUNK = 1 << 20      # elements :func:`at_least` compares at a time on a CPU (4 MiB of float32)


def at_least(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (int64, ascending) of ``not (|x| < threshold)`` in the 1-D ``x``: one read of ``x``.

    The plain version is one line -- ``torch.nonzero(x.abs().lt(t).logical_not_())`` --
    and on a GPU that is what runs. On a CPU two things make it slow, and both are avoided:

    * **memory**: ``x.abs()`` of 16 Mi floats is a fresh 64 MiB tensor, and a fresh tensor
      that large costs more in page faults (the kernel zeroing every new page on first
      touch) than the arithmetic. The comparison runs a chunk at a time in two small
      buffers, reused for every chunk, which stay in the cache.
    * **one element at a time**: on one thread, torch's CPU ``nonzero`` and its comparisons
      that write ``bool`` look at each element on its own, where NumPy's ``abs``, ``less``
      and ``flatnonzero`` are vectorised -- and a CPU tensor *is* a NumPy array
      (``x.numpy()`` shares its memory). A rank computing on one intra-op thread (several
      ranks to a host, as in training) compares and finds in NumPy. With several threads
      torch shares its passes among them and NumPy does not: torch compares, and finds the
      flags eight at a time (:func:`true_indices`). ``bench-sparse`` times both cases.

    For the dtypes NumPy lacks (bfloat16) or ranks differently (integers, see
    :func:`magnitude`), torch compares.
    """
    n = x.numel()
    bound = threshold_in(threshold, x.dtype)
    if x.is_cuda:
        return torch.nonzero(_below(magnitude(x), bound).logical_not_()).view(-1)
    if x.dtype in NUMPY_FLOATS and _one_thread(x):
        return _at_least_numpy(x.detach().numpy(), bound)
    if n <= CHUNK or not x.is_floating_point():
        return true_indices(_below(magnitude(x), bound).logical_not_())
    mag = torch.empty(CHUNK, dtype=x.dtype)
    below = torch.empty(CHUNK, dtype=torch.bool)
    found = []
    for lo in range(0, n, CHUNK):
        part = x[lo:lo + CHUNK]
        m, b = mag[:part.numel()], below[:part.numel()]
        _below(torch.abs(part, out=m), bound, out=b)
        hits = true_indices(b.logical_not_())
        if hits.numel():
            found.append(hits.add_(lo))
    return torch.cat(found) if found else torch.empty(0, dtype=torch.int64)


def _at_least_numpy(a: np.ndarray, bound: float) -> torch.Tensor:
    """:func:`at_least` of the array ``a`` (float16/32/64, 1-D), a chunk at a time in NumPy."""
    n = a.size
    limit = a.dtype.type(bound)                  # exactly representable: threshold_in put it on the grid
    mag = np.empty(min(n, CHUNK), dtype=a.dtype)
    below = np.empty(min(n, CHUNK), dtype=bool)
    found = []
    for lo in range(0, n, CHUNK):
        part = a[lo:lo + CHUNK]
        m, b = mag[:part.size], below[:part.size]
        np.less(np.abs(part, out=m), limit, out=b)   # NaN < t is false: NaN is kept, as on a GPU
        hits = np.flatnonzero(np.logical_not(b, out=b))
        if hits.size:
            found.append(hits + lo if lo else hits)
    hits = np.concatenate(found) if len(found) > 1 else found[0] if found else np.empty(0, dtype=np.int64)
    return torch.from_numpy(hits.astype(np.int64, copy=False))


def _one_thread(t: torch.Tensor) -> bool:
    """A CPU tensor in a process computing on one intra-op thread: NumPy's vectorised loops
    beat torch's there (torch's CPU ``nonzero`` and ``bool`` comparisons go an element at a
    time); with several threads torch shares its passes among them and NumPy does not."""
    return not t.is_cuda and torch.get_num_threads() == 1


def true_indices(mask: torch.Tensor) -> torch.Tensor:
    """``torch.nonzero(mask).view(-1)`` for a 1-D bool tensor, faster on a CPU. Ascending,
    as ``nonzero``'s.

    A CPU ``nonzero`` looks at every byte on its own. On one thread NumPy's ``flatnonzero``
    (vectorised) does it. On several, eight flags are read as one int64 word: ``nonzero``
    of the words finds the few words with a flag set, and only their bytes are looked at
    one by one. Mostly true (more than one word in eight has a flag), the plain ``nonzero``
    is faster, and that is what runs."""
    n = mask.numel()
    if _one_thread(mask):
        return torch.from_numpy(np.flatnonzero(mask.numpy()).astype(np.int64, copy=False))
    whole = n - n % 8
    if mask.is_cuda or whole == 0 or not mask.is_contiguous() or mask.storage_offset() % 8:
        return torch.nonzero(mask).view(-1)
    words = torch.nonzero(mask[:whole].view(torch.int64)).view(-1)
    if words.numel() * 8 > whole // 8:
        return torch.nonzero(mask).view(-1)
    rows, cols = torch.nonzero(mask[:whole].view(-1, 8).index_select(0, words), as_tuple=True)
    found = words.index_select(0, rows).mul_(8).add_(cols)
    if whole < n:
        found = torch.cat([found, torch.nonzero(mask[whole:]).view(-1).add_(whole)])
    return found


def _sort_desc(mag: torch.Tensor) -> torch.Tensor:
    # torch.sort puts NaN last in ascending order, i.e. first in descending: the largest.
    return torch.sort(mag, descending=True, stable=True).indices


def validate_selection(selection: str, state: dict | None) -> None:
    """Refuse an unknown ``selection``, and ``"reuse"`` without the ``state`` it keeps its
    threshold in (it would silently be a plain top-k every call)."""
    if selection != "auto" and selection not in SELECTIONS:
        raise ValueError(f"unknown selection {selection!r}; use auto or one of {', '.join(SELECTIONS)}")
    if selection == "reuse" and not isinstance(state, dict):
        raise ValueError("selection='reuse' filters with last call's threshold, kept in state=: pass a "
                         "dict kept per tensor (state={}), or choose another selection")


def topk_indices(x: torch.Tensor, k: int, selection: str = "auto", state: dict | None = None) -> torch.Tensor:
    """Indices (int64) of the k largest magnitudes of the 1-D tensor ``x``.

    ``selection`` is one of :data:`SELECTIONS`, or ``"auto"``: the fastest measured on the
    tensor's device -- ``torch.topk`` on a GPU (a radix select, where the filters read a
    threshold back to the host), ``sample`` on a CPU (``bench-sparse`` times each method;
    its records are on ``docs/benchmarks.md``). ``state``
    carries ``reuse``'s threshold from one call to the next (a dict the caller keeps, one
    per tensor; ``reuse`` refuses to run without it); the other selections ignore it.
    """
    validate_selection(selection, state)
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be between 0 and {n}, got {k}")
    method = ("topk" if x.is_cuda else "sample") if selection == "auto" else selection
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if k == n:
        return torch.arange(n, device=x.device)
    mag = _Magnitudes(x)                    # |x|, computed whole only if a method needs it whole
    if method == "topk":
        return torch.topk(mag.whole(), k, sorted=False).indices
    if method == "sort":
        return _sort_desc(mag.whole())[:k]
    if method == "kthvalue":
        mag = mag.whole()
        # kthvalue finds the k-th *smallest*; the k-th largest is the (n-k+1)-th smallest.
        # NaN is never "greater": count NaN as above the threshold explicitly.
        ranked = torch.nan_to_num(mag, nan=float("inf")) if mag.is_floating_point() else mag
        t = torch.kthvalue(ranked, n - k + 1).values
        above = torch.nonzero((mag > t) | torch.isnan(mag)).view(-1)
        if above.numel() > k:               # more than k NaN/inf: rank them by sort instead
            return _sort_desc(mag)[:k]
        at = torch.nonzero(mag == t).view(-1)[: k - above.numel()]
        return torch.cat([above, at])
    if method == "sample":
        return _filtered_topk(x, mag, k, sample_threshold(x, k))
    # reuse
    picked = _filtered_topk(x, mag, k, state.get("threshold"))
    # The k-th largest kept magnitude, a little lowered: next step's filter keeps
    # somewhat more than k candidates when the gradient drifts.
    state["threshold"] = float(_float_magnitude(x.index_select(0, picked)).min()) * 0.9
    return picked


class _Magnitudes:
    """``|x|`` on demand: whole (``torch.topk`` of everything), or at given indices (the
    candidates of a filter) without ever making the whole. CPU top-k and sort of half
    types go through float32: slower in half, the same order."""

    def __init__(self, x: torch.Tensor):
        self.x, self._whole = x, None

    def _widen(self, t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype in (torch.float16, torch.bfloat16) and not t.is_cuda else t

    def whole(self) -> torch.Tensor:
        if self._whole is None:
            self._whole = self._widen(magnitude(self.x))
        return self._whole

    def index_select(self, dim: int, indices: torch.Tensor) -> torch.Tensor:
        return self._widen(magnitude(self.x.index_select(dim, indices)))


def _float_magnitude(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` as floating point (float64 for integers: exact to 2^53, and |INT_MIN| fits), for
    thresholds estimated from a few elements; :func:`at_least` then compares exactly."""
    return x.abs() if x.is_floating_point() else x.double().abs()


def sample_threshold(x: torch.Tensor, k: int) -> float | None:
    """A magnitude that a few more than k elements reach, estimated from a sample of
    s = min(:data:`SAMPLE`, n/8) elements at random positions (None under :data:`MIN_SAMPLE`:
    a tensor that small takes a plain top-k).

    Of the sample, about e = s·k/n elements lie above the k-th largest magnitude, give or
    take √e (a binomial count); the threshold is the sample's (e + 4√e)-th largest, so that
    fewer than k candidates pass only on a 4σ bad draw, which the fallback to a full top-k
    covers. The count is binomial because the positions are random: evenly spaced ones are
    not, for a gradient laid out in rows. Every 8th element of a bucket whose first layer
    has 64 inputs is one column of 8×8 pixels, the digits' blank left edge: a sample of
    zeros, a threshold of 0, and every element a candidate.
    """
    n = x.numel()
    size = min(SAMPLE, n // 8)                    # an eighth of the tensor at most
    if size < MIN_SAMPLE:
        return None
    sample = _float_magnitude(x.index_select(0, _sample_positions(n, size, x.device))).float()
    expected = size * k / n                       # sample elements above the k-th largest
    rank = int(expected + 4 * expected ** 0.5) + 1
    if rank >= size:
        return None
    if not _one_thread(sample):
        return float(torch.topk(sample, rank, sorted=True).values[-1])
    # one thread: NumPy's partition, one pass (NaN sorts last, as the largest)
    return float(np.partition(sample.numpy(), size - rank)[size - rank])


_POSITIONS: dict[tuple, torch.Tensor] = {}


def _sample_positions(n: int, size: int, device: torch.device) -> torch.Tensor:
    """``size`` positions in ``range(n)``, drawn once per (n, size, device) with a seed of
    their own and kept (ascending: the gather reads memory in order). The same on every
    rank and every call: the sample's randomness is against the data's layout, not between
    calls."""
    key = (n, size, str(device))
    positions = _POSITIONS.get(key)
    if positions is None:
        if len(_POSITIONS) >= 256:                # bounded: a model has a few bucket sizes
            _POSITIONS.clear()
        drawn = torch.randint(n, (size,), generator=torch.Generator().manual_seed(n))
        positions = _POSITIONS[key] = torch.sort(drawn).values.to(device)
    return positions


def _filtered_topk(x: torch.Tensor, mag: "_Magnitudes", k: int, t: float | None) -> torch.Tensor:
    """Top-k of the elements with ``|x| ≥ t``, in ascending index order: exact whenever at
    least k pass (every top-k element then passes). Fewer, or no ``t``: a plain top-k of
    the whole (in no particular order).

    Of c candidates, the k largest stay: found as the c − k smallest to drop when those are
    fewer (the usual case: the filter lets through only a few more than k), else directly.
    Either way a mask over the candidates keeps them in index order."""
    if t is not None and t == t:                  # a NaN estimate would filter out nothing
        candidates = at_least(x, t)                # ascending
        c = candidates.numel()
        if c >= k:
            cand_mag = mag.index_select(0, candidates)
            if c - k < k:                          # NaN ranks largest: never dropped
                drop = torch.topk(cand_mag, c - k, largest=False, sorted=False).indices
                keep = torch.ones(c, dtype=torch.bool, device=x.device).index_fill_(0, drop, False)
            else:
                best = torch.topk(cand_mag, k, sorted=False).indices
                keep = torch.zeros(c, dtype=torch.bool, device=x.device).index_fill_(0, best, True)
            return candidates[keep]
    return torch.topk(mag.whole(), k, sorted=False).indices


def topk_per_segment(x: torch.Tensor, segments, density: float, selection: str = "auto",
                     state: dict | None = None) -> torch.Tensor:
    """Indices (int64, into ``x``) of the top ⌈density·size⌉ of each consecutive segment of
    ``x`` (``segments``: their sizes, adding up to ``x.numel()``): DGC's selection per layer.

    k = Σ ⌈density·size⌉ depends only on the sizes, so it is the same on every rank and
    top-k mode still needs no count exchange. ``state``: one dict for all the segments
    (``reuse`` keeps a threshold per segment in it)."""
    picked, start = [], 0
    for i, size in enumerate(segments):
        own = None if state is None else state.setdefault(("segment", i), {})
        picked.append(topk_indices(x[start:start + size], keep_count(size, density), selection, own).add_(start))
        start += size
    return torch.cat(picked) if picked else torch.empty(0, dtype=torch.int64, device=x.device)


def truncated_magnitude_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """SINGA's ranking, for comparison: magnitudes compared as integers (``int(|g|)``).

    Every ``|g| < 1`` becomes 0, all tie, and a stable ranking returns the first k
    indices whatever their size. Not used by the all-reduce; the lesson's test shows
    :func:`topk_indices` picks the true largest where this does not.
    """
    as_int = magnitude(x).to(torch.int64)
    return torch.sort(as_int, descending=True, stable=True).indices[:k]


@dataclass
class SelectionTime:
    method: str
    seconds: float       # median over repeats
    k: int
    n: int


def time_selection(x: torch.Tensor, k: int, methods=SELECTIONS, repeats: int = 5,
                   threshold: float | None = None) -> list[SelectionTime]:
    """Median time of each selection method on ``x`` (and of a fixed ``threshold``, if given).

    ``reuse`` is timed in its steady state: primed once on ``x`` itself, so each timed call
    filters with last step's threshold. On a GPU each call is synchronised before the clock
    stops (the figure includes the kernels, not only their launch).
    """
    import statistics

    def timed(fn):
        times = []
        for _ in range(repeats + 1):
            if x.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if x.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])          # the first call warms up

    rows = []
    for method in methods:
        state: dict = {}
        if method == "reuse":
            topk_indices(x, k, "reuse", state)
        rows.append(SelectionTime(method, timed(lambda: topk_indices(x, k, method, state)), k, x.numel()))
    if threshold is not None:
        rows.append(SelectionTime("threshold", timed(lambda: threshold_indices(x, threshold)), k, x.numel()))
    return rows
