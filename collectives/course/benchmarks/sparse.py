"""``.venv/bin/python -m collectives bench-sparse``: lesson 8's sparse all-reduce against ``dist.all_reduce``.

Three measurements, each printed as a table:

* **selection** (one process): the time of each way to find the k largest of n (topk,
  sort, kthvalue, reuse, sample) and of a threshold, at the benchmark's size -- the part of a
  sparse all-reduce that does not shrink with the bytes;
* **loopback** (``--world`` local ranks): each transport at ``--density`` against the dense
  all-reduce, with its selection time beside its total, so what remains is wire time; on
  NCCL under the rule for fair GPU comparisons (:mod:`.sparse_gpu`: NCCL called directly,
  every contender eager and untraced, interleaved rounds; the record's ``rule`` names it);
* **cluster** (``--cluster``: 2 simulated machines × 2 ranks joined by a 1 Gbit/s link,
  :mod:`collectives.core.cluster`; needs root): the same, and a density sweep from 0.1 %
  to 50 % with the crossover measured against the one :mod:`collectives.sparse.cost`
  predicts from α and β (β from the link rate, α from a small all-reduce).

``--gradients``: what is reduced. ``noise`` is i.i.d. Gaussian, every rank's own: the
selected indices are spread evenly and hardly overlap across ranks. ``recorded`` is real
gradients, each rank's own before averaging, recorded from data-parallel training of the
lab's wide MLP on the digits (:func:`recorded_gradients`): their large entries crowd into
some layers and are largely the same entries on every rank. On both, the split transport is
timed with equal index ranges and with Ok-Topk's balanced partition
(:func:`collectives.sparse.split.balanced_bounds`), with how unevenly the pairs land.

``--impl exercise`` times the functions of ``lessons/08_sparse/exercise.py`` instead of the
reference's (``collectives.course.impl.resolve("lessons/08_sparse/exercise.py:name")``).

Bytes each rank sends are counted from the trace (an all-gather's contribution leaves a
rank p−1 times in a ring, an all-reduce's 2(p−1)/p times).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ...core import cost as core_cost
from ...core import launch, ops, timing, trace
from ...sparse import cost, keep_count, sparse_all_reduce, time_selection, topk_indices
from ...sparse.profile import measure_compute
from ...sparse.split import balanced_bounds, split_sum_
from ..impl import resolve
from ..site.claims import commit, host

# The model and the tables live in .sparse_report; importable from here too.
from .sparse_report import _print, _select_seconds, measured_crossover, model_crossover, model_link, model_seconds  # noqa: F401

VARIANTS = ("allgather", "split", "dense")
IMPLS = {"reference": "collectives.sparse", "exercise": "lessons/08_sparse/exercise.py"}


def event_bytes(kind: str, nbytes: int, p: int) -> float:
    """Bytes one rank puts on the wire in one traced call, with ring all-gathers and a ring
    all-reduce: a message its size, an all-gather's contribution p − 1 times, an all-reduce
    2(p − 1)/p of it, an all-to-all what it was handed (its own slot is empty here)."""
    if kind in ("all_gather", "all_gather_into_tensor"):
        return (p - 1) * nbytes
    if kind == "all_reduce":
        return 2 * (p - 1) / p * nbytes
    return float(nbytes)


def wire_bytes(t: trace.Trace, p: int) -> float:
    """Bytes this rank puts on the wire in ``t``: its collectives and its messages (the split
    variant sends its pairs, and gathers dense pieces, as messages)."""
    return sum(event_bytes(e.kind, e.nbytes, p) for e in t.events if e.is_send or e.kind in trace.COLLECTIVES)


def _inputs(n: int, seed: int = 0) -> torch.Tensor:
    """This rank's input, on its device (its GPU under NCCL)."""
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    return torch.randn(n, generator=g).to(ops.rank_device())


def recorded_gradients(n: int, rank: int, p: int, warmup: int = 30, seed: int = 0) -> torch.Tensor:
    """``n`` elements of this rank's own gradients (before averaging) from data-parallel
    training of the lab's :class:`~collectives.sparse.lab.WideMLP` on the digits, 32 examples
    per rank per step, SGD with momentum.

    Every replica follows the weights data-parallel training gives them -- the average of the
    p ranks' gradients, computed here from all p shards, so no message is needed -- and after
    ``warmup`` steps this rank's local gradient of each further step is appended, step after
    step, until there are ``n`` (a model of 0.83 M parameters: 16 Mi elements are 20 steps)."""
    import torch.nn.functional as F

    from ...sparse import lab
    x_train, y_train, _, _ = lab.load_digits_split(seed)
    torch.manual_seed(seed)
    net = lab.WideMLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    shards = [(x_train[r::p], y_train[r::p]) for r in range(p)]
    rows_per_epoch = min(len(y) for _, y in shards)
    order = torch.randperm(rows_per_epoch, generator=torch.Generator().manual_seed(seed + 1))
    pieces, have, step = [], 0, 0
    while have < n:
        rows = order[(step * 32) % (rows_per_epoch - 32):][:32]
        if step >= warmup:
            opt.zero_grad()
            F.cross_entropy(net(shards[rank][0][rows]), shards[rank][1][rows]).backward()
            mine = torch.cat([q.grad.reshape(-1) for q in net.parameters()])
            pieces.append(mine[: n - have])
            have += pieces[-1].numel()
        opt.zero_grad()
        loss = sum(F.cross_entropy(net(x[rows]), y[rows]) for x, y in shards) / p
        loss.backward()
        opt.step()
        step += 1
    return torch.cat(pieces)


def _gradients(kind: str, n: int) -> torch.Tensor:
    if kind == "noise":
        return _inputs(n)
    if kind == "recorded":
        return recorded_gradients(n, dist.get_rank(), dist.get_world_size()).to(ops.rank_device())
    raise ValueError(f"gradients are 'noise' or 'recorded', got {kind!r}")


def _timed(fn, warmup: int = 1, iters: int = 3, device=None) -> float:
    """Median seconds of ``fn``, max over ranks (CUDA events on a GPU)."""
    return timing.median(timing.measure(fn, warmup=warmup, iters=iters, device=device))


def _one(x: torch.Tensor, mode: dict, transport: str, iters: int, selection: str = "auto",
         impl: str = IMPLS["reference"]) -> dict:
    """Time ``transport`` on ``x``: total, and the selection alone, median over ``iters``.

    ``selection="reuse"`` keeps its threshold between calls (its steady state: the same
    tensor every call, so the filter always passes a few times k candidates)."""
    p = dist.get_world_size()
    reduce_ = resolve(impl + ":sparse_all_reduce")
    state: dict = {}
    with trace.recording() as t:
        info = reduce_(x.clone(), transport=transport, selection=selection, state=state, **mode)
    sent = wire_bytes(t, p)
    buf = torch.empty_like(x)                       # a fresh input each run: one copy, timed too

    def call():
        buf.copy_(x)
        reduce_(buf, transport=transport, selection=selection, state=state, **mode)

    total = _timed(call, iters=iters, device=x.device)
    k = keep_count(x.numel(), mode["density"]) if "density" in mode else info.kept
    select = statistics.median(s.seconds for s in time_selection(x, k, methods=(selection,), repeats=iters)) \
        if "density" in mode else statistics.median(
            s.seconds for s in time_selection(x, k, methods=(), repeats=iters, threshold=mode["threshold"]))
    return dict(seconds=total, select=select, sent=sent, used=info.transport)


def time_select(x: torch.Tensor, density: float, selection: str = "auto", iters: int = 3) -> float:
    """Seconds to choose what to send at ``density`` and copy the values out, alone, on
    every rank at once."""
    k = keep_count(x.numel(), density)
    return _timed(lambda: x.index_select(0, topk_indices(x, k, selection)), iters=iters, device=x.device)


def split_partitions(x: torch.Tensor, density: float, iters: int = 3) -> dict:
    """The split transport on ``x`` at ``density`` with equal index ranges and with Ok-Topk's
    balanced partition (computed once, reused: Ok-Topk recomputes it every few steps): time,
    how unevenly the pairs land (the most any owner receives ÷ the mean), and how many of rank
    0's indices every other rank selected too."""
    p, n = dist.get_world_size(), x.numel()
    k = keep_count(n, density)
    idx = topk_indices(x, k, "auto")
    idx = idx.sort().values
    vals = x.index_select(0, idx)
    with trace.paused():
        every = [torch.empty_like(idx) for _ in range(p)]
        dist.all_gather(every, idx)
        balance_start = time.perf_counter()
        balanced = balanced_bounds(idx, n)
        balance_seconds = time.perf_counter() - balance_start
    mine = set(every[0].tolist())
    shared = statistics.fmean(len(mine & set(e.tolist())) / k for e in every[1:]) if p > 1 else 1.0
    out = dict(overlap_with_rank0=shared, balance_seconds=balance_seconds)
    for name, bounds in (("equal", None), ("balanced", balanced)):
        landing = [sum(int(((e >= a) & (e < b)).sum()) for e in every)
                   for a, b in (bounds or ops.chunk_bounds(n, p))]
        buf = torch.empty_like(x)

        def call():
            split_sum_(buf, idx, vals, bounds=bounds)

        out[name] = dict(seconds=_timed(call, iters=iters, device=x.device),
                         imbalance=max(landing) / statistics.fmean(landing) if sum(landing) else 1.0)
    return out


def compare_in_world(n: int, density: float, iters: int = 5, sweep=(), variants=VARIANTS,
                     sweep_selection: str = "auto", main: bool = True, gradients: str = "noise",
                     impl: str = IMPLS["reference"]) -> dict:
    """On every rank: the dense all-reduce, each transport at ``density`` (unless not ``main``),
    the split transport's two partitions, and a sweep of densities (top-k with
    ``sweep_selection``). Top-k selects the way ``sparse_all_reduce`` does by default
    (``auto``: the sampled filter on a CPU, ``torch.topk`` on a GPU); the all-gather transport
    is also timed with the other two. ``gradients``: ``noise`` or ``recorded``."""
    p = dist.get_world_size()
    x = _gradients(gradients, n)
    usual = "topk" if x.is_cuda else "sample"           # what selection="auto" picks here
    sweep_selection = usual if sweep_selection == "auto" else sweep_selection
    if x.is_cuda:                     # NCCL: every contender under the rule for fair GPU comparisons
        from .sparse_gpu import compare_on_gpu
        return dict(compare_on_gpu(x, density, sweep, iters, variants if main else (), usual, impl, wire_bytes),
                    gradients=gradients)
    y = x.clone()
    dense = _timed(lambda: dist.all_reduce(y), iters=iters, device=x.device)
    tiny = torch.zeros(1, device=x.device)
    alpha = _timed(lambda: dist.all_reduce(tiny), warmup=2, iters=10, device=x.device) / (2 * max(p - 1, 1))
    out = dict(p=p, n=n, density=density, dense=dense, dense_sent=2 * (p - 1) / p * n * 4, alpha=alpha,
               gradients=gradients, rows=[], sweep=[])
    for variant in variants if main else ():
        out["rows"].append(dict(variant=variant, mode=f"top-k ({usual})",
                                **_one(x, {"density": density}, variant, iters, usual, impl)))
    if main:
        for selection in [s for s in ("sample", "reuse", "topk") if s != usual]:
            out["rows"].append(dict(variant="allgather", mode=f"top-k ({selection})",
                                    **_one(x, {"density": density}, "allgather", iters, selection, impl)))
        thr = float(torch.quantile(x[: 1 << 20].abs(), 1 - density))
        out["rows"].append(dict(variant="allgather", mode="threshold",
                                **_one(x, {"threshold": thr}, "allgather", iters, "auto", impl)))
        if p > 1 and impl == IMPLS["reference"]:
            out["partitions"] = split_partitions(x, density, iters)
    if sweep:
        c = measure_compute(x, iters=max(2, iters // 2))
        out["compute"] = dict(scan=c.scan, pair=c.pair)
    for d in sweep:
        row = dict(density=d, select=time_select(x, d, sweep_selection, max(2, iters // 2)))
        for variant in ("allgather", "split"):
            row[variant] = _one(x, {"density": d}, variant, max(2, iters // 2), sweep_selection, impl)["seconds"]
        out["sweep"].append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives bench-sparse",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="64M", help="bytes of float32 per all-reduce (default 64M = 16 Mi floats)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--cluster", action="store_true",
                        help="2 simulated machines x world/2 ranks over a shaped link (needs root)")
    parser.add_argument("--link", default="1gbit", help="the cluster's link rate (default 1gbit)")
    parser.add_argument("--sweep", default="", help="densities to sweep, e.g. 0.001,0.003,0.01,0.03,0.1,0.2,0.3,0.5")
    parser.add_argument("--no-selection", action="store_true", help="skip the one-process selection table")
    parser.add_argument("--sweep-only", action="store_true", help="only the dense all-reduce and the sweep")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="default: nccl when there is a GPU per rank (not with --cluster), else gloo")
    parser.add_argument("--gradients", default="noise", help="noise, recorded, or both (noise,recorded)")
    parser.add_argument("--impl", choices=tuple(IMPLS), default="reference",
                        help="time the reference or YOUR lessons/08_sparse/exercise.py")
    parser.add_argument("--json", default="", help="also write the results to this file")
    args = parser.parse_args(argv)
    n = timing.parse_size(args.size) // 4
    sweep = [float(s) for s in args.sweep.split(",") if s]
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               "torch": torch.__version__, "command": ".venv/bin/python -m collectives bench-sparse " + " ".join(
                   argv if argv is not None else sys.argv[1:]), "impl": args.impl}
    if not args.no_selection:
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        k = keep_count(n, args.density)
        thr = float(torch.quantile(x[: 1 << 20].abs(), 1 - args.density))
        rows = time_selection(x, k, repeats=args.iters, threshold=thr)
        print(f"selection of k = {k} of n = {n} (one process, {torch.get_num_threads()} threads):")
        for r in rows:
            print(f"  {r.method:>9}: {timing.human_seconds(r.seconds)}")
        results["selection"] = [dict(method=r.method, seconds=r.seconds) for r in rows]
    backend = args.backend or ("gloo" if args.cluster else launch.auto_backend(args.world))
    where = (f"cluster 2 machines, {args.link}" if args.cluster
             else "NVLink (NCCL)" if backend == "nccl" else "loopback")
    results["device"] = _device(backend)
    command = ".venv/bin/python -m collectives bench-sparse " + " ".join(argv if argv is not None else sys.argv[1:])
    results.update(command=command, commit=commit(), **host(), python=sys.version.split()[0],
                   date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    t0 = time.time()
    for i, kind in enumerate(k for k in args.gradients.split(",") if k):
        kwargs = dict(args=(n, args.density, args.iters, sweep if i == 0 else (), VARIANTS, "auto",
                            not args.sweep_only, kind, IMPLS[args.impl]), timeout=1800, backend=backend)
        if args.cluster:
            kwargs.update(machines=2, link=args.link)
        try:
            result = launch.run(compare_in_world, args.world, **kwargs)[0]
        except launch.RankError as exc:
            stub = re.search(r"Lesson 8, task \d+: \w+", str(exc))
            if args.impl == "exercise" and stub:
                print(f"{IMPLS['exercise']}: {stub.group(0)} is not written yet", file=sys.stderr)
                return 1
            raise
        _print(result, f"{where}, {kind} gradients", args.link if args.cluster else None)
        results[where if i == 0 else f"{where}, {kind} gradients"] = result
    if backend == "nccl":             # the rule's fields at the top, where the GPU lane's record reads them
        from .sparse_gpu import record_rule
        results["rule"] = record_rule(results)
    result = results[where]
    if sweep:
        measured = measured_crossover(result["sweep"], result["dense"])
        line = f"crossover (best sparse = dense): measured {measured if measured is None else f'{measured:.1%}'}"
        if args.cluster:
            link = model_link(result, args.link)
            wire_only = model_crossover(result, link)
            with_cpu = model_crossover(result, link, with_compute=True)
            c = result["compute"]
            line += (f"; model, wire alone {wire_only:.1%}, wire + processor "
                     f"{'none in the sweep' if with_cpu is None else f'{with_cpu:.1%}'} "
                     f"(α = {timing.human_seconds(result['alpha'])}, {args.link}; zeroing "
                     f"{c['scan'] * 1e9:.2f} ns per element, {c['pair'] * 1e9:.1f} ns per pair)")
            results["model_crossover"] = wire_only
            results["model_crossover_with_compute"] = with_cpu
        results["measured_crossover"] = measured
        print(line)
    print(f"({time.time() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _device(backend: str) -> str:
    if backend == "nccl":
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    from .sparse_train import machine
    return machine()


def _tour(nbytes: int, mode_name: str, transport: str) -> dict:
    """A tour row: verify the contract on this input, count bytes, time against dist.all_reduce."""
    p = dist.get_world_size()
    n = max(nbytes // 4, 1)
    x = _inputs(n)
    mode = {"density": 0.01} if mode_name == "top-k" else \
        {"threshold": float(torch.quantile(x[: 1 << 20].abs(), 0.99))}
    t, r = x.clone(), torch.zeros_like(x)
    sparse_all_reduce(t, r, transport=transport, **mode)
    sent = x - r
    expected = sent.clone()
    with trace.paused():
        dist.all_reduce(expected)
    ok = bool(torch.equal(sent + r, x)) and bool(torch.allclose(t, expected, atol=1e-5))
    with trace.recording() as tr:
        info = sparse_all_reduce(x.clone(), transport=transport, **mode)
    counts = info.counts or [info.kept] * p
    y = x.clone()
    with trace.paused():
        ours = timing.measure(lambda: sparse_all_reduce(x.clone(), transport=transport, **mode))
        ref = timing.measure(lambda: dist.all_reduce(y))
    theory = cost.sparse_cost(transport, n, max(counts), p, 4, counts="threshold" in mode).bytes_per_rank
    ring = core_cost.ring(n * 4, p).bytes_per_rank
    return dict(verified=ok, detail="" if ok else "not dist.all_reduce of what was sent",
                seconds=timing.median(ours), ref_seconds=timing.median(ref), nbytes=n * 4,
                bytes_sent=wire_bytes(tr, p), bytes_theory=theory,
                baseline=f"all_reduce, ring {timing.human_bytes(ring)}")


def tour_topk_allgather(nbytes: int) -> dict:
    return _tour(nbytes, "top-k", "allgather")


def tour_topk_split(nbytes: int) -> dict:
    return _tour(nbytes, "top-k", "split")


def tour_threshold_allgather(nbytes: int) -> dict:
    return _tour(nbytes, "threshold", "allgather")
