"""Lesson 8 exercise: sparse all-reduce with error feedback, after SINGA.

Six tasks, in order; each needs only itself and the tasks before it:

| task | what                                                    | stubs                                   |
|------|---------------------------------------------------------|-----------------------------------------|
| 1    | choose what to send: a threshold, top-k five ways       | threshold_indices, topk_indices         |
| 2    | SINGA's transport: all-gather (index, value)            | pack_pairs, allgather_sum_              |
| 3    | the contract: refusals, residual, modes, all-gather/dense | sparse_all_reduce                     |
| 4    | SparCML's split: sparse reduce-scatter, densify; "auto" | split_sum_                              |
| 5    | an asynchronous DDP hook: the all-gather left in flight | sparse_all_reduce_async, sparse_hook_async |
| 6    | DGC's corrections: per-layer top-k, momentum correction | topk_per_segment, DGCState.start_       |

Check your work:

    .venv/bin/python lessons/08_sparse/exercise.py                          # PASS/FAIL per task
    .venv/bin/torchrun --nproc-per-node 4 lessons/08_sparse/exercise.py     # the same, under torchrun
    make check LESSON=08                                                    # the same, from make
    make grade LESSON=08                                                    # the points

Each task is judged outside your process, on inputs you cannot know in advance, and on every
message your ranks make: the all-gather moves packed pairs in one all-gather (never a dense
all-reduce of the masked tensor), split sends each owner its pairs, and the training of the
hook (task 5) and of DGC (task 6) is held to DDP simulated step by step.

Given: ``keep_count``, ``magnitude``, ``threshold_in``, ``sample_threshold``, ``unpack_pairs``,
``exchange_counts``, ``SparseInfo``, ``SparseWork``, ``SparseHookState`` (residuals kept per
parameter), ``sparse_hook``, ``register_sparse_hook``, ``DGCState`` (but its ``start_``),
``dgc_hook``. Course functions you may call (the sheet is checked against the code):

    ops.check_all_reduce_args(tensor, op=ReduceOp.SUM, group=None, *, what='all_reduce',
                              compare=True, agree=None) -> bool
        Raise a clear error for input an in-place all-reduce cannot honour; return whether
        this rank takes part.
    ops.work_buffer(tensor) -> torch.Tensor
        A flat, contiguous buffer holding ``tensor``'s elements: the tensor's own memory
        when it is contiguous, else a copy (to be written back with :func:`write_back`).
    ops.write_back(tensor, flat) -> None
        Copy ``flat`` into ``tensor`` (its data, detached) unless it already is ``tensor``'s
        memory.
    ops.finish_(tensor, op, group_size) -> torch.Tensor
        Apply what remains after the combining: for AVG, one division by the group size.
    ops.chunk_bounds(numel, parts) -> list[tuple[int, int]]
        Split ``numel`` elements into ``parts`` contiguous chunks whose sizes differ by at
        most one.
    ops.group_rank_and_size(group=None) -> tuple[int, int]
        This rank's index in ``group`` and the group's size (the world when ``group`` is
        None).
    ops.global_rank(group, group_rank) -> int
        The global rank of ``group_rank`` in ``group``: what ``send``/``recv`` take.
    ops.post_exchange(recvs, sends, group=None) -> list
        Post every receive ``(buffer, src)``, then every send ``(buffer, dst)`` (global
        ranks); return the handles, each with ``wait()``. Empty buffers are not posted.
    trace.label(text)
        Tag the events made inside the block (e.g. "reduce-scatter step 2"); under a running
        ``torch.profiler``, the block is also a range of that name in its trace.
    collectives.ring.ring_all_gather(output, input, group=None) -> None
        ``output`` ← every rank's ``input``, concatenated in rank order.
    collectives.sparse.cost.choose_transport(n, k, p, link, value_bytes=4, counts=False,
                                             transports=('allgather', 'split', 'dense'),
                                             compute=None) -> str
        The transport the model predicts fastest (ties go to the earlier name in
        ``transports``).
    collectives.sparse.profile.profile_for(group=None, device=None) -> SparseProfile
        ``group``'s profile: the one given by :func:`set_profile`, or measured on first use.

The reference is ``collectives/sparse/``; the lesson page is docs/lessons/08-sparse.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from collectives import ops, trace  # noqa: F401 - the tasks use ops and trace
from collectives.core.ops import ReduceOp
from collectives.course.grading.runner import run_tasks
from collectives.ring import ring_all_gather  # noqa: F401 - task 4 may use it
from collectives.sparse.cost import SparseProfile, choose_transport  # noqa: F401 - task 4 uses them
from collectives.sparse.hooks import ParameterMemory
from collectives.sparse.profile import profile_for  # noqa: F401 - task 4 uses it
from collectives.sparse.select import sample_threshold  # noqa: F401 - given: task 1's "sample" threshold

LESSON = 8
INDEX_DTYPE = torch.int32         # indices travel as int32: 4 bytes each
MAX_NUMEL = 2**31 - 1
SELECTIONS = ("topk", "sort", "kthvalue", "reuse", "sample")      # selection= also takes "auto"
TRANSPORTS = ("allgather", "split", "dense")                      # transport= also takes "auto"


# ---- task 1: selection ------------------------------------------------------------------------

def keep_count(numel: int, density: float) -> int:
    """Given: k = ⌈density·n⌉, at least 1 for a non-empty tensor."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return 0 if numel == 0 else min(numel, max(1, math.ceil(density * numel)))


def magnitude(x: torch.Tensor) -> torch.Tensor:
    """Given: a tensor that orders like ``|x|``. Floats: ``|x|`` (NaN stays NaN; torch.sort and
    torch.topk rank it above +inf). Signed integers: ``|x| - 1`` computed as ``~(-|x|)`` --
    ``torch.abs`` of int32 -2^31 overflows to -2^31, the *smallest* value."""
    if x.is_floating_point():
        return x.abs()
    if not x.dtype.is_signed:
        return x
    return torch.bitwise_not(torch.where(x > 0, -x, x))


def threshold_in(threshold: float, dtype: torch.dtype):
    """Given: what ``magnitude(x)`` is compared with so that ``|x| >= threshold`` holds exactly:
    for floats the dtype's smallest value >= threshold (torch would round 200.3 to 200 in
    bfloat16), for signed integers ``ceil(threshold) - 1`` (their magnitude is |x| - 1)."""
    if dtype.is_floating_point:
        if dtype == torch.float64:
            return threshold
        c = torch.tensor(threshold, dtype=torch.float64).to(dtype)
        if float(c) < threshold:
            c = torch.nextafter(c, torch.tensor(float("inf"), dtype=dtype))
        return float(c)
    if math.isinf(threshold):
        return math.inf
    return math.ceil(threshold) - (1 if dtype.is_signed else 0)


def threshold_indices(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Lesson 8, task 1: indices (int64, ascending) of the elements with ``|x| >= threshold``.

    TODO:     keep every element whose magnitude reaches the threshold -- NaN included --
              compared exactly in x's dtype.
    APPROACH: test ``not (magnitude(x) < threshold_in(threshold, x.dtype))``: every comparison
              with NaN is false, so NaN is kept and reaches every rank as in a dense all-reduce;
              threshold_in moves the threshold onto the dtype's grid without rounding it down.
              If the bound is an int larger than the dtype's largest value, nothing passes.
    EXAMPLE:  x = [0.5, -2, 2, 1.999, nan, -inf, 0], threshold 2  ->  [1, 2, 4, 5].
              x = bfloat16 [200.], threshold 200.3  ->  [] (200 < 200.3).
    HINT:     torch.nonzero(mask).view(-1).
    CALLS:    none
    """
    raise NotImplementedError("Lesson 8, task 1: threshold_indices")


def topk_indices(x: torch.Tensor, k: int, selection: str = "auto", state: dict | None = None) -> torch.Tensor:
    """Lesson 8, task 1: indices (int64) of the k largest magnitudes of the 1-D ``x``, exactly k.

    TODO:     refuse an unknown ``selection`` and ``"reuse"`` without a ``state`` dict (ValueError),
              then five selections, each returning exactly k indices of largest |x| (ties: any):
              "topk"     torch.topk of magnitude(x);
              "sort"     a descending sort of magnitude(x), the first k;
              "kthvalue" t = the k-th largest (kthvalue finds the (n-k+1)-th smallest), every
                         magnitude > t, then as many == t as fill k;
              "reuse"    Ok-Topk: filter with last call's threshold ``state["threshold"]``: if at
                         least k candidates pass (threshold_indices), the top-k of the candidates
                         is the top-k of all; else a plain top-k. Store a threshold a little below
                         this call's k-th magnitude for next time;
              "sample"   DGC: the same filter, with sample_threshold(x, k) as the threshold;
              "auto"     "topk" on a GPU, "sample" on a CPU.
    APPROACH: NaN counts as the largest magnitude (torch.sort and torch.topk already rank it
              above +inf); kthvalue does not: replace NaN by inf for it. Integers: magnitude()
              ranks int32 -2^31 above 2^31 - 1, as it must.
    EXAMPLE:  |x| = [3, 1, 2, 2, 2, 0.5], k = 3  ->  {0} and two of {2, 3, 4}.
              x = [0.1, nan, -5, inf, 0.3], k = 2  ->  {1, 3}.
    HINT:     k = 0 -> an empty int64 tensor; k = n -> arange(n). SINGA ranks int(|g|): every
              gradient below 1 ties at 0 -- compare magnitudes as floats.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 8, task 1: topk_indices")


# ---- task 2: all-gather of (index, value) pairs ------------------------------------------------

def pack_pairs(indices: torch.Tensor, values: torch.Tensor, width: int) -> torch.Tensor:
    """Lesson 8, task 2: one uint8 buffer ``[width int32 indices | width values]``, zero-padded.

    TODO:     the first ``indices.numel()`` slots of each half hold the pairs; the rest zeros.
    APPROACH: SINGA copies its int32 indices bit for bit into the float send buffer; do the
              same for any dtype through byte views: ``t.view(torch.uint8)``, then torch.cat.
    EXAMPLE:  indices [3, 9], float32 values [1.5, -2], width 3  ->  24 bytes:
              int32 [3, 9, 0] as 12 bytes, then float32 [1.5, -2, 0] as 12 bytes.
    HINT:     the result must be what ``unpack_pairs(buffer, width, values.dtype)`` reads back.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 8, task 2: pack_pairs")


def unpack_pairs(buffer: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Given: the inverse of :func:`pack_pairs` for one rank's bytes: ``(indices int64, values)``."""
    split = width * 4

    def as_(raw, dt):
        size = torch.empty((), dtype=dt).element_size()
        return (raw.clone() if raw.storage_offset() % size else raw).view(dt)
    return as_(buffer[:split], INDEX_DTYPE).long(), as_(buffer[split:], dtype)


def exchange_counts(count: int, group=None, device=None) -> list[int]:
    """Given: every rank's count on every rank (one all-gather of one int64, read by the host)."""
    p = dist.get_world_size(group)
    every = torch.empty(p, dtype=torch.int64, device=device)
    dist.all_gather(list(every.chunk(p)), torch.tensor([count], dtype=torch.int64, device=device), group=group)
    return every.tolist()


def allgather_sum_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *,
                   counts: list[int] | None = None, group=None) -> torch.Tensor:
    """Lesson 8, task 2: ``out`` <- the sum over ranks of each rank's pairs, scattered into zeros.

    TODO:     pad this rank's pairs to the widest rank's count, all-gather everyone's packed
              buffer in ONE all-gather, and add each rank's pairs (only its real ones) into
              ``out`` after zeroing it, rank 0's first.
    APPROACH: ``counts`` is every rank's count (threshold mode); ``None`` means top-k mode,
              where every rank has ``indices.numel()`` pairs and nothing needs padding.
    EXAMPLE:  p = 2, rank 0 sends (3, a), rank 1 sends (3, c), (1, d)  ->  out[3] = a + c,
              out[1] = d, zeros elsewhere.
    HINT:     dist.all_gather(list(gathered.chunk(p)), send, group=group); out.index_add_.
              All counts zero: no all-gather at all, out is zeros. Keep the adding loop in a
              helper of its own: task 5 calls it from a future's callback.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 8, task 2: allgather_sum_")


# ---- task 3: the contract ----------------------------------------------------------------------

@dataclass
class SparseInfo:
    """Given: what one call did on this rank."""

    transport: str                     # "allgather", "split", "dense", "local" (one rank), "none" (not a member)
    kept: int                          # elements this rank sent
    counts: list[int] | None = None    # every rank's count (threshold mode)
    split: object = None               # split_sum_'s SplitInfo
    indices: torch.Tensor | None = None    # the indices sent (int64); None: all of them


def sparse_all_reduce(tensor: torch.Tensor, residual: torch.Tensor | None = None, *,
                      density: float | None = None, threshold: float | None = None,
                      transport: str = "allgather", selection: str = "auto", op=ReduceOp.SUM,
                      group=None, state: dict | None = None, segments=None,
                      profile: SparseProfile | None = None) -> SparseInfo:
    """Lesson 8, task 3: sum (or average) over ranks of what each rank sent; in place.

    TODO:     1. refuse bad input BEFORE touching anything (ValueError; TypeError for a wrong
                 type): 2^31 elements or more (int32 indices; check this first), bool or
                 complex dtype, op other than SUM/AVG, not exactly one of density/threshold,
                 density outside (0, 1], threshold < 0 or NaN, an unknown transport or
                 selection, "reuse" without a state dict, a residual of another shape/dtype/
                 device, not contiguous, or sharing the tensor's memory. Then
                 ops.check_all_reduce_args(tensor, op, group, what="sparse_all_reduce",
                 agree={"transport": ..., "density": ..., "threshold": ..., "selection": ...,
                 "segments": ...}); if it returns False this rank is not in the group: return
                 SparseInfo("none", 0) having touched nothing.
              2. x = tensor + residual, in the residual's memory (flat: ops.work_buffer).
              3. everything kept (threshold == 0 or density == 1): dist.all_reduce of x itself,
                 residual zeroed -- bit for bit the dense all-reduce.
              4. else select (task 1; with ``segments``: topk_per_segment, task 6), copy the
                 values out, zero the sent places of the residual, exchange counts in threshold
                 mode, and move the pairs: "allgather" (task 2) or "dense" (sent values in
                 zeros, dist.all_reduce); "split" and "auto" are task 4's. One rank: no messages.
              5. ops.finish_ for AVG, ops.write_back; return SparseInfo(transport, kept, counts,
                 indices=...).
    APPROACH: the identity tensor_in + residual_in == sent + residual_out holds exactly when
              every element goes to exactly one side.
    EXAMPLE:  p = 2, density 0.5, rank 0 x = [4, 1], rank 1 x = [1, -3] with zero residuals
              ->  tensor = [4, -3] on both; residuals [0, 1] and [1, 0].
    HINT:     every rank must pick the same transport: decide from values all ranks share.
    CALLS:    ops.check_all_reduce_args, ops.work_buffer, ops.finish_, ops.write_back
    """
    raise NotImplementedError("Lesson 8, task 3: sparse_all_reduce")


# ---- task 4: split, and the transport chosen by the cost model ----------------------------------

@dataclass
class SplitInfo:
    sent: list[int]          # pairs sent to each rank (own piece: 0)
    received: list[int]      # pairs received from each rank
    union: list[int]         # distinct indices in each rank's reduced piece
    densified: bool          # the gather moved dense pieces


def split_sum_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, group=None,
               densify: bool = True) -> SplitInfo:
    """Lesson 8, task 4: the sum over ranks of the pairs, by sparse reduce-scatter + all-gather.

    TODO:     rank j owns indices ops.chunk_bounds(n, p)[j].
              1. sort the pairs by index; count those for each rank (torch.searchsorted);
                 exchange (count, n) with every rank: dist.all_to_all_single of a (p, 2) int64
                 tensor, own count 0. If the n's differ, raise ValueError naming every rank's
                 size, on every rank, before any pair moves;
              2. send each rank its pairs (packed as in task 2), one message each
                 (ops.post_exchange); your own piece's pairs stay here;
              3. add every rank's pairs for your piece into a zeroed piece, in rank order;
                 note which places were touched;
              4. exchange the number of touched places (exchange_counts); if the fullest
                 piece's pairs take at least as many bytes as the longest dense piece, gather
                 dense pieces (lesson 4's ring_all_gather(out, piece, group) does it in place),
                 else all-gather the pairs (padded to the widest) and copy them into a zeroed out.
              Then in sparse_all_reduce: transport "split" calls this; "auto" asks
              choose_transport(n, widest count, p, prof.link, element size, counts=threshold
              mode, compute=prof.compute) with prof = profile or profile_for(group, device).
    APPROACH: bytes per rank (p-1)/p·k·(4+e) + (p-1)·min(u·(4+e), n/p·e): beats the
              all-gather once pieces fill (density above about 1/p).
    EXAMPLE:  n = 8, p = 2: rank 0 owns 0..3, rank 1 owns 4..7. Rank 0's pair (6, a) goes to
              rank 1, which adds it to its own (6, c) and sends back (6, a + c).
    HINT:     return SplitInfo(sent, received, union, densified) -- the tests read it.
    CALLS:    ops.chunk_bounds, ops.group_rank_and_size, ops.global_rank, ops.post_exchange, trace.label,
              collectives.ring.ring_all_gather, collectives.sparse.cost.choose_transport,
              collectives.sparse.profile.profile_for
    """
    raise NotImplementedError("Lesson 8, task 4: split_sum_")


# ---- task 5: an asynchronous DDP communication hook ---------------------------------------------

class SparseWork:
    """Given: a sparse all-reduce in flight: ``info`` at once, the sum when the future completes."""

    def __init__(self, info: SparseInfo, future: torch.futures.Future):
        self.info, self._future = info, future

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self) -> SparseInfo:
        self._future.wait()
        return self.info


def sparse_all_reduce_async(tensor: torch.Tensor, residual: torch.Tensor | None = None, *,
                            density: float | None = None, threshold: float | None = None,
                            transport: str = "allgather", selection: str = "auto", op=ReduceOp.SUM,
                            group=None, state: dict | None = None, segments=None,
                            profile: SparseProfile | None = None) -> SparseWork:
    """Lesson 8, task 5: :func:`sparse_all_reduce`, returning while the pairs travel.

    TODO:     do task 3's steps 1-4 up to the transport (refusals, residual, selection, counts);
              then start the collective with async_op=True and chain the rest with ``.then``:
              "allgather": dist.all_gather(..., async_op=True).get_future().then(add the pairs,
              finish, return the tensor); "dense" and everything kept: the same with
              dist.all_reduce. "split" needs the host between its rounds: run it here and
              return a completed future. Not in the group: a completed future, nothing touched.
    APPROACH: the callback runs when the data has arrived (on gloo's thread); whatever it
              returns is the future's value -- return ``tensor``: DDP reads the bucket from it.
    EXAMPLE:  work = sparse_all_reduce_async(t, r, density=0.01); ...; work.wait()  -> t summed,
              bit for bit what sparse_all_reduce(t, r, density=0.01) gives.
    HINT:     factor task 3 into "select" and "move" helpers and call them from both.
    CALLS:    ops.check_all_reduce_args, ops.work_buffer, ops.finish_, ops.write_back
    """
    raise NotImplementedError("Lesson 8, task 5: sparse_all_reduce_async")


@dataclass
class SparseHookState:
    """Given: settings and per-parameter memory of the hooks (DDP does not pass the hook its
    process group: ``group`` must be DDP's own; :func:`register_sparse_hook` sets it)."""

    density: float | None = None
    threshold: float | None = None
    error_feedback: bool = True
    transport: str = "allgather"
    selection: str = "auto"
    group: object = None
    per_parameter: bool = False
    residuals: ParameterMemory = field(default_factory=ParameterMemory)
    selection_state: dict = field(default_factory=dict)
    sent: int = 0
    elements: int = 0

    def residual_for(self, params, flat: torch.Tensor) -> torch.Tensor | None:
        """A bucket's residual: every parameter's own slice, in its place (survives DDP's rebuild)."""
        return self.residuals.flat(params, flat) if self.error_feedback else None

    def density_now(self) -> float | None:
        return self.density

    def _arguments(self, params, flat: torch.Tensor) -> dict:
        segments = [p.numel() for p in params] if self.per_parameter and self.threshold is None else None
        return dict(density=self.density_now() if self.threshold is None else None, threshold=self.threshold,
                    transport=self.transport, selection=self.selection, group=self.group,
                    state=self.selection_state.setdefault(tuple(id(p) for p in params), {}), segments=segments)

    def reduce_(self, params, flat: torch.Tensor) -> torch.Tensor:
        info = sparse_all_reduce(flat, self.residual_for(params, flat), **self._arguments(params, flat))
        self.sent, self.elements = self.sent + info.kept, self.elements + flat.numel()
        return flat

    def start_(self, params, flat: torch.Tensor) -> SparseWork:
        work = sparse_all_reduce_async(flat, self.residual_for(params, flat), **self._arguments(params, flat))
        self.sent, self.elements = self.sent + work.info.kept, self.elements + flat.numel()
        return work


def sparse_hook(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Given: the plain hook -- the whole sparse all-reduce, then a completed future."""
    flat = bucket.buffer()
    flat.div_(dist.get_world_size(state.group))
    state.reduce_(bucket.parameters(), flat)
    fut = torch.futures.Future()
    fut.set_result(flat)
    return fut


def sparse_hook_async(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Lesson 8, task 5: a DDP communication hook that returns while the pairs travel.

    TODO:     divide the bucket's buffer (bucket.buffer()) by the group's size, as DDP's own
              hook does, start its sparse all-reduce (SUM) with state.start_(bucket.parameters(),
              flat) and return the future of the collective in flight.
    APPROACH: DDP waits for the futures at the end of backward, so the next buckets' gradients
              are computed while this one's pairs travel. Dividing first makes density 1 bit
              for bit DDP's default all-reduce.
    EXAMPLE:  register_sparse_hook(ddp, SparseHookState(density=0.01), sparse_hook_async)
    HINT:     the group's size: dist.get_world_size(state.group).
    CALLS:    none
    """
    raise NotImplementedError("Lesson 8, task 5: sparse_hook_async")


def register_sparse_hook(ddp, state: SparseHookState, hook=sparse_hook_async) -> SparseHookState:
    """Given: ``ddp.register_comm_hook(state, hook)`` with ``state.group`` set to DDP's group."""
    if state.group is not None and state.group is not ddp.process_group:
        raise ValueError("register_sparse_hook: state.group is not the DDP model's process group")
    state.group = ddp.process_group
    ddp.register_comm_hook(state, hook)
    return state


# ---- task 6: DGC's corrections ---------------------------------------------------------------------

def topk_per_segment(x: torch.Tensor, segments, density: float, selection: str = "auto",
                     state: dict | None = None) -> torch.Tensor:
    """Lesson 8, task 6: the top ⌈density·size⌉ of each consecutive segment of ``x`` (indices into x).

    TODO:     segments are sizes adding up to x.numel() (a bucket's parameters, in order); select
              in each segment on its own (task 1) and shift its indices by where it starts.
    APPROACH: k = Σ ⌈density·size⌉ depends on the sizes only: the same on every rank, so the
              all-gather still needs no count exchange. A layer whose gradients are small still
              sends its share instead of being starved by the loudest layer of the bucket.
    EXAMPLE:  x = [9, 1, 2, | 3, -8], segments [3, 2], density 0.5  ->  {0, 2} and {4}: [0, 2, 4].
    HINT:     give each segment its own dict in ``state`` (state.setdefault(("segment", i), {}))
              so that "reuse" keeps one threshold per segment.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 8, task 6: topk_per_segment")


@dataclass
class DGCState(SparseHookState):
    """Given, but for ``start_``: SparseHookState with DGC's corrections, each optional."""

    momentum: float = 0.0               # momentum correction; the optimizer then has none
    factor_masking: bool = True
    warmup_steps: int = 0
    warmup_density: float = 0.25
    velocities: ParameterMemory = field(default_factory=ParameterMemory)
    step: int = 0

    def density_now(self) -> float | None:
        if self.density is None or self.step >= self.warmup_steps or self.warmup_density <= self.density:
            return self.density
        return max(self.density, self.warmup_density * (self.density / self.warmup_density)
                   ** (self.step / self.warmup_steps))

    def start_(self, params, flat: torch.Tensor) -> SparseWork:
        """Lesson 8, task 6: momentum correction and factor masking around one bucket's all-reduce.

        TODO:     with momentum m: u = self.velocities.flat(params, flat) (each parameter's
                  velocity, kept like the residual); u <- m·u + flat; flat <- u. Then start the
                  all-reduce as SparseHookState.start_ does (super().start_: the residual
                  accumulates the velocity, top-k of it is sent). With factor_masking, zero u
                  where this rank sent (work.info.indices; None means everything was sent).
        APPROACH: the optimizer is plain SGD: the momentum lives here, so an entry sent late
                  arrives with the momentum its delayed pieces would have had.
        EXAMPLE:  density 1, no masking: trains as DDP with SGD(momentum=m), to rounding.
        HINT:     without momentum (Adam), start_ is just super().start_.
        CALLS:    none
        """
        raise NotImplementedError("Lesson 8, task 6: DGCState.start_")

    def reduce_(self, params, flat: torch.Tensor) -> torch.Tensor:
        self.start_(params, flat).wait()
        return flat


def dgc_hook(state: DGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Given: the DGC hook (counts optimizer steps for the warm-up)."""
    flat = bucket.buffer()
    flat.div_(dist.get_world_size(state.group))
    work = state.start_(bucket.parameters(), flat)
    if bucket.is_last():
        state.step += 1
    return work.get_future()


# DDP checks a hook's annotations as objects, not strings (this file has postponed annotations).
for _hook, _state in ((sparse_hook, SparseHookState), (sparse_hook_async, SparseHookState), (dgc_hook, DGCState)):
    _hook.__annotations__ = {"state": _state, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


if __name__ == "__main__":
    run_tasks(LESSON)
