"""Lesson 8 exercise: sparse all-reduce with error feedback, after SINGA.

Five tasks, in order; each builds on the ones before it:

| task | what                                              | stubs                                   |
|------|---------------------------------------------------|-----------------------------------------|
| 1    | choose what to send: a threshold, top-k four ways | threshold_indices, topk_indices         |
| 2    | SINGA's transport: all-gather (index, value)      | pack_pairs, allgather_sum_              |
| 3    | the contract: residual, modes, dense when all kept | sparse_all_reduce                      |
| 4    | SparCML's split: sparse reduce-scatter, densify    | split_sum_                             |
| 5    | a DDP communication hook with per-bucket residuals | sparse_hook                            |

Check your work:

    torchrun --nproc-per-node 4 lessons/08_sparse/exercise.py   # PASS/FAIL per task, per rank
    python lessons/08_sparse/exercise.py --world 3              # the same, on a local world of 3
    make grade LESSON=08                                        # the graded tests

Given: ``keep_count``, ``unpack_pairs``, ``exchange_counts``, ``SparseHookState``. Functions
you may use: ``ops.check_all_reduce_args``, ``ops.work_buffer`` / ``ops.write_back``,
``ops.finish_``, ``ops.chunk_bounds``, ``ops.group_rank_and_size``,
``cost.choose_sparse_variant``. The reference is ``collectives/sparse/``; the lesson page
is docs/lessons/08-sparse.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from collectives import cost, ops, trace, verify
from collectives.core.ops import ReduceOp
from collectives.course.runner import Task, run_tasks

LESSON = 8
INDEX_DTYPE = torch.int32         # indices travel as int32: 4 bytes each
MAX_NUMEL = 2**31 - 1
METHODS = ("topk", "sort", "kthvalue", "reuse")
VARIANTS = ("auto", "allgather", "split", "dense")


# ---- task 1: selection ------------------------------------------------------------------------

def keep_count(numel: int, density: float) -> int:
    """Given: k = ⌈density·n⌉, at least 1 for a non-empty tensor."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return 0 if numel == 0 else min(numel, max(1, math.ceil(density * numel)))


def threshold_indices(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Lesson 8, task 1: indices (int64, ascending) of the elements with ``|x| >= threshold``.

    TODO:     keep every element whose magnitude reaches the threshold -- NaN included.
    APPROACH: write the test as ``not (|x| < threshold)``: every comparison with NaN is
              false, so NaN is kept, and NaN then reaches every rank as in a dense all-reduce.
    EXAMPLE:  x = [0.5, -2, 2, 1.999, nan, -inf, 0], threshold 2  ->  [1, 2, 4, 5].
    HINT:     torch.nonzero(mask).view(-1).
    """
    raise NotImplementedError("Lesson 8, task 1: threshold_indices")


def topk_indices(x: torch.Tensor, k: int, method: str = "topk", state: dict | None = None) -> torch.Tensor:
    """Lesson 8, task 1: indices (int64) of the k largest magnitudes of the 1-D ``x``, exactly k.

    TODO:     four methods, each returning exactly k indices of largest |x| (ties: any of them):
              "topk"     torch.topk of |x|;
              "sort"     a descending sort of |x|, the first k;
              "kthvalue" t = the k-th largest |x| (kthvalue finds the (n-k+1)-th smallest),
                         every |x| > t, then as many |x| == t as fill k;
              "reuse"    Ok-Topk: filter with last call's threshold kept in ``state``
                         (``state["threshold"]``): if at least k candidates pass, the top-k of
                         the candidates is the top-k of all; else a plain top-k. Store a
                         threshold a little below this call's k-th magnitude for next time.
    APPROACH: NaN counts as the largest magnitude (torch.sort and torch.topk already rank it
              above +inf); kthvalue does not: replace NaN by inf for it.
    EXAMPLE:  |x| = [3, 1, 2, 2, 2, 0.5], k = 3  ->  {0} and two of {2, 3, 4}.
              x = [0.1, nan, -5, inf, 0.3], k = 2  ->  {1, 3}.
    HINT:     k = 0 -> an empty int64 tensor; k = n -> arange(n). SINGA ranks int(|g|): every
              gradient below 1 ties at 0 -- compare magnitudes as floats.
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
              ``out`` after zeroing it.
    APPROACH: ``counts`` is every rank's count (threshold mode); ``None`` means top-k mode,
              where every rank has ``indices.numel()`` pairs and nothing needs padding.
    EXAMPLE:  p = 2, rank 0 sends (3, a), rank 1 sends (3, c), (1, d)  ->  out[3] = a + c,
              out[1] = d, zeros elsewhere.
    HINT:     dist.all_gather(list(gathered.chunk(p)), send, group=group); out.index_add_.
              All counts zero: no all-gather at all, out is zeros.
    """
    raise NotImplementedError("Lesson 8, task 2: allgather_sum_")


# ---- task 3: the contract ----------------------------------------------------------------------

def sparse_all_reduce(tensor: torch.Tensor, residual: torch.Tensor | None = None, *,
                      density: float | None = None, threshold: float | None = None,
                      method: str = "auto", selection: str = "topk", op=ReduceOp.SUM,
                      group=None, link=None, state: dict | None = None):
    """Lesson 8, task 3: sum (or average) over ranks of what each rank sent; in place.

    TODO:     1. refuse bad input with ValueError: 2^31 elements or more (int32 indices; check
                 this first), op other than SUM/AVG, not exactly one of density/threshold, a
                 residual of another shape/dtype/device; then ops.check_all_reduce_args.
              2. x = tensor + residual (in the flat work buffer, ops.work_buffer).
              3. everything kept (threshold == 0 or density == 1): dist.all_reduce of x itself,
                 residual zeroed -- bit for bit the dense all-reduce.
              4. else select (task 1), keep the rest in residual (residual = x, then zero the
                 sent places), exchange counts in threshold mode, pick the transport
                 ("auto": cost.choose_sparse_variant(n, widest count, p, link or cost.GIGABIT,
                 element size)), move the pairs: "allgather" (task 2), "split" (task 4), or
                 "dense" (sent values in zeros, dist.all_reduce). One rank: no communication.
              5. ops.finish_ for AVG, ops.write_back.
    APPROACH: the identity tensor_in + residual_in == sent + residual_out holds exactly when
              every element goes to exactly one side.
    EXAMPLE:  p = 2, density 0.5, rank 0 x = [4, 1], rank 1 x = [1, -3] with zero residuals
              ->  tensor = [4, -3] on both; residuals [0, 1] and [1, 0].
    HINT:     every rank must pick the same transport: decide from values all ranks share.
    """
    raise NotImplementedError("Lesson 8, task 3: sparse_all_reduce")


# ---- task 4: split ----------------------------------------------------------------------------

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
                 exchange the counts (dist.all_to_all_single of p int64, own slot 0);
              2. send each rank its pairs (packed as in task 2) in ONE all_to_all_single with
                 byte split sizes; your own piece's pairs stay here;
              3. add every rank's pairs for your piece into a zeroed piece, in rank order;
                 note which places were touched;
              4. exchange the number of touched places (exchange_counts); if the fullest
                 piece's pairs take at least as many bytes as the longest dense piece,
                 all-gather dense pieces (padded to the longest), else all-gather the pairs
                 (padded to the widest) and copy them into a zeroed ``out``.
    APPROACH: bytes per rank (p-1)/p·k·(4+e) + (p-1)·min(u·(4+e), n/p·e): beats the
              all-gather variant once pieces fill (density above about 1/p).
    EXAMPLE:  n = 8, p = 2: rank 0 owns 0..3, rank 1 owns 4..7. Rank 0's pair (6, a) goes to
              rank 1, which adds it to its own (6, c) and sends back (6, a + c).
    HINT:     return SplitInfo(sent, received, union, densified) -- the tests read it.
    """
    raise NotImplementedError("Lesson 8, task 4: split_sum_")


# ---- task 5: a DDP communication hook ----------------------------------------------------------

@dataclass
class SparseHookState:
    """Given: settings and per-bucket memory of :func:`sparse_hook`."""

    density: float | None = None
    threshold: float | None = None
    error_feedback: bool = True
    method: str = "auto"
    selection: str = "topk"
    group: object = None
    residuals: dict = field(default_factory=dict)     # bucket index -> residual
    selection_state: dict = field(default_factory=dict)

    def residual_for(self, key, flat: torch.Tensor) -> torch.Tensor | None:
        """Bucket ``key``'s residual; zeros when new or when DDP rebuilt the bucket's size."""
        if not self.error_feedback:
            return None
        res = self.residuals.get(key)
        if res is None or res.shape != flat.shape or res.dtype != flat.dtype:
            res = self.residuals[key] = torch.zeros_like(flat)
        return res


def sparse_hook(state: SparseHookState, bucket: dist.GradBucket) -> "torch.futures.Future[torch.Tensor]":
    """Lesson 8, task 5: a DDP communication hook averaging a bucket by sparse all-reduce.

    TODO:     divide the bucket's flat buffer (bucket.buffer()) by the world size, as DDP's
              own hook does, sparse-all-reduce it (SUM) with the residual of this bucket
              (state.residual_for(bucket.index(), flat)), return a completed future of it.
    APPROACH: dividing first makes density 1 bit for bit DDP's default all-reduce.
    EXAMPLE:  ddp.register_comm_hook(SparseHookState(density=0.01), sparse_hook)
    HINT:     fut = torch.futures.Future(); fut.set_result(flat); return fut.
    """
    raise NotImplementedError("Lesson 8, task 5: sparse_hook")


# DDP checks the hook's annotations as objects, not strings (this file has postponed annotations).
sparse_hook.__annotations__ = {"state": SparseHookState, "bucket": dist.GradBucket,
                               "return": torch.futures.Future[torch.Tensor]}


# ---- the checks torchrun runs ------------------------------------------------------------------

def _report(name: str, problems: list[str]) -> verify.Report:
    rank = dist.get_rank()
    return verify.Report([verify.CaseResult(name, rank, False, p) for p in problems]
                         or [verify.CaseResult(name, rank, True)])


def check_selection() -> verify.Report:
    x = torch.rand(1000, generator=torch.Generator().manual_seed(3)) * 2 - 1
    truth = sorted(torch.topk(x.abs(), 10).indices.tolist())
    problems = [f"{m}: not the 10 largest |x|" for m in METHODS
                if sorted(topk_indices(x, 10, m, {}).tolist()) != truth]
    y = torch.tensor([0.5, -2.0, 2.0, 1.999, float("nan"), -float("inf"), 0.0])
    if threshold_indices(y, 2.0).tolist() != [1, 2, 4, 5]:
        problems.append("threshold: |x| >= 2 keeps -2, 2, NaN and -inf")
    return _report("selection", problems)


def _contract(method: str) -> verify.Report:
    rank = dist.get_rank()
    problems = []
    for mode in ({"density": 0.1}, {"threshold": 1.5}):
        x = torch.randn(1001, generator=torch.Generator().manual_seed(rank))
        t, r = x.clone(), torch.zeros_like(x)
        sparse_all_reduce(t, r, method=method, **mode)
        sent = x - r
        expected = verify.reference_all_reduce(sent)
        if not torch.allclose(t, expected, atol=1e-6):
            problems.append(f"{method} {mode}: not dist.all_reduce of what each rank sent")
        if not torch.equal(sent + r, x):
            problems.append(f"{method} {mode}: residual identity broken")
    return _report(f"contract {method}", problems)


def check_allgather() -> verify.Report:
    rank, p = dist.get_rank(), dist.get_world_size()
    x = torch.arange(1, 101, dtype=torch.float32) * (rank + 1)
    idx = torch.arange(rank, 100, 7)
    out = torch.empty(100)
    allgather_sum_(out, idx, x[idx], counts=exchange_counts(idx.numel()))
    sent = torch.zeros(100)
    sent[idx] = x[idx]
    ok = torch.equal(out, verify.reference_all_reduce(sent))
    return _report("allgather_sum_", [] if ok else ["not the sum of every rank's pairs"])


def check_contract() -> verify.Report:
    report = _contract("allgather")
    return report.merge(verify.check_all_reduce(lambda t, op=ReduceOp.SUM, group=None:
                                                sparse_all_reduce(t, density=1.0, op=op, group=group),
                                                [c for c in verify.default_cases(dist.get_world_size(), quick=True)
                                                 if c.op in (ReduceOp.SUM, ReduceOp.AVG)]))


def check_split() -> verify.Report:
    return _contract("split")


def check_hook() -> verify.Report:
    import copy

    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    da, db = DistributedDataParallel(a), DistributedDataParallel(b)
    db.register_comm_hook(SparseHookState(density=1.0), sparse_hook)
    g = torch.Generator().manual_seed(dist.get_rank())
    for model in (da, db):
        g.manual_seed(dist.get_rank())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            x, y = torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    return _report("sparse_hook", [] if same else ["at density 1 the hook must train exactly like DDP"])


if __name__ == "__main__":
    run_tasks(LESSON, [
        Task(1, "selection", check_selection),
        Task(2, "all-gather of pairs", check_allgather),
        Task(3, "sparse_all_reduce contract", check_contract),
        Task(4, "split", check_split),
        Task(5, "DDP hook", check_hook),
    ])
