"""``.venv/bin/python -m collectives bench-ddp``: one training step with the bucketed reducer, with
torch DDP, and with one all-reduce per gradient after backward.

::

    .venv/bin/python -m collectives bench-ddp                       # 2 gloo ranks, the transformer
    .venv/bin/python -m collectives bench-ddp --model mlp --bucket-cap-mb 4
    .venv/bin/python -m collectives bench-ddp --backend nccl        # one GPU per rank

All three train the same model from the same weights on the same per-rank batches (SGD),
so their parameters must agree; the table says how closely. ``--impl exercise`` adds a
fourth, the ``BucketedReducer`` of your ``lessons/06_bucketing/exercise.py``, held to the
same agreement (a class whose tasks are still stubs is listed as not written yet). A step is ``zero_grad``,
forward, backward (with the reduction), ``optimizer.step()``; its time is the slowest
rank's (barrier-aligned, CUDA events on GPU), sampled round-robin across the three
variants so that drift in the machine's speed hits all of them alike.

Bucket layouts: torch DDP given an explicit ``bucket_cap_mb`` uses that cap for its first
bucket too, so the reducer is given ``first_bucket_cap_mb = bucket_cap_mb`` here
(``--first-bucket-cap-mb`` to change it): both reduce the same buckets.

On GPUs (``--backend nccl``) the steps follow the course's rule for fair GPU comparisons
(:mod:`.steps_gpu`): every variant eager, the rank untraced so that the reducer's calls are
NCCL's own, one step of each per round in turn, each timed between CUDA events (the slowest
rank's), the median and spread of the rounds; the record names its ``rule``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import math
import os
import platform
import sys

import torch
import torch.distributed as dist

from ...bucketing import BucketedReducer, make_model
from ...core import launch, timing, trace
from .. import verify
from ..site.claims import host
from . import steps_gpu

VARIANTS = ("bucketed reducer", "torch DDP", "per-gradient after backward")
EXERCISE = "bucketed reducer (exercise)"     # --impl exercise: the student's BucketedReducer

# Sizes per --model. The transformer: 6 encoder layers, 78 tensors, 34 MiB of gradients --
# two buckets at the default 25 MiB cap -- and enough compute per step that a CPU spends
# most of the step in backward. The MLP: 32 layers of 512 x 512, 64 tensors, 32 MiB of
# gradients, and little compute per byte: the communication-heavy case, where one call per
# gradient pays its latency 64 times and nothing hides the transfers.
MODELS = {
    "transformer": dict(sizes=dict(vocab=8192, d_model=256, nhead=4, ff=1024, layers=6, seq=32), batch=4),
    "mlp": dict(sizes=dict(width=512, depth=32), batch=8),
}


def _wrap(variant: str, model, cfg: dict, device):
    if variant in ("bucketed reducer", EXERCISE):
        cls = BucketedReducer
        if variant == EXERCISE:
            from ..impl import resolve
            from .allreduce import exercise_target
            cls = resolve(exercise_target("collectives.bucketing:BucketedReducer"))
        return cls(model, bucket_cap_mb=cfg["bucket_cap_mb"], first_bucket_cap_mb=cfg["first_bucket_cap_mb"])
    if variant == "torch DDP":
        from torch.nn.parallel import DistributedDataParallel
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=cfg["bucket_cap_mb"])
    with torch.no_grad():   # the baseline starts from rank 0's weights too
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, src=0)
    return model


def _make_step(variant: str, wrapped, model, batch):
    """One training step of ``variant`` as a closure."""
    opt = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    params = [p for p in model.parameters() if p.requires_grad]
    world = dist.get_world_size()
    x, y = batch

    def step():
        opt.zero_grad(set_to_none=True)
        model.loss(wrapped(x), y).backward()
        if variant == "per-gradient after backward":
            for p in params:                 # no overlap, one call per gradient
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()
    return step


def _max_param_diff(a, b) -> float:
    """Largest |a − b| over all parameters, relative to the largest |b|, max over ranks."""
    worst = max(((pa - pb).abs().max() / pb.abs().max().clamp_min(1e-30)).item()
                for pa, pb in zip(a.parameters(), b.parameters()))
    return timing.max_over_ranks(worst)


def run_rank(cfg: dict) -> dict:
    """On every rank: build the three variants, check they agree, time their steps."""
    steps_gpu.untrace()  # measure a plain program: the reducer's calls are the backend's own, untraced
    device = verify.rank_device()
    torch.manual_seed(0)
    base = make_model(cfg["model"], **cfg["sizes"]).to(device)
    batch = base.batch(cfg["batch"], seed=1000 + dist.get_rank(), device=device)
    models, steps, missing = {}, {}, {}
    variants = VARIANTS + ((EXERCISE,) if cfg.get("impl") == "exercise" else ())
    for variant in variants:
        model = copy.deepcopy(base)
        try:
            wrapped = _wrap(variant, model, cfg, device)
            models[variant], steps[variant] = model, _make_step(variant, wrapped, model, batch)
            if variant == EXERCISE:
                steps[variant]()             # a stub raises here, on every rank alike
        except (NotImplementedError, AttributeError) as exc:
            if variant != EXERCISE:
                raise
            missing[variant] = f"not written yet ({exc})" if isinstance(exc, NotImplementedError) else str(exc)
            models.pop(variant, None)
            steps.pop(variant, None)
        if variant == "bucketed reducer":
            reducer = wrapped
    variants = tuple(v for v in variants if v not in missing)
    for _ in range(cfg["warmup"]):   # the first steps rebuild the buckets (both reducers)
        for variant in variants:
            steps[variant]()
    diff = {v: _max_param_diff(models[v], models["torch DDP"]) for v in variants}
    times, under_rule = {v: [] for v in variants}, {}
    if cfg.get("launch"):                  # on GPUs: the rule's interleaved rounds (steps_gpu)
        timed = steps_gpu.in_rounds({v: steps[v] for v in variants}, cfg["steps"], device)
        times = {v: timed[v]["times"] for v in variants}
        under_rule = dict(spread={v: timed[v]["spread"] for v in variants}, traced=trace.installed())
    else:
        n = len(variants)
        for r in range(cfg["steps"]):      # one step of each per round, starting variant rotated
            for variant in variants[r % n:] + variants[:r % n]:
                times[variant] += timing.measure(steps[variant], warmup=0, iters=1, device=device)
    grads = sum(p.numel() * p.element_size() for p in base.parameters())
    return dict(times=times, diff=diff, buckets=len(reducer.buckets), grad_bytes=grads,
                tensors=len(list(base.parameters())), device=str(device), missing=missing, **under_rule)


def _render(result: dict, cfg: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    med = {v: timing.median(result["times"][v]) for v in VARIANTS}
    paired = paired_ratios(result["times"])
    table = Table(title=f"one training step — {cfg['model']}, {result['tensors']} tensors, "
                        f"{timing.human_bytes(result['grad_bytes'])} of gradients, "
                        f"{cfg['world']} ranks, {cfg['backend']}, bucket cap {cfg['bucket_cap_mb']:g} MiB")
    for col in ("variant", "median step", "min", "max", "time / reducer's", "params vs torch DDP"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v in result["times"]:
        xs = result["times"][v]
        table.add_row(v, timing.human_seconds(timing.median(xs)), timing.human_seconds(min(xs)),
                      timing.human_seconds(max(xs)), f"{timing.median(xs) / med[VARIANTS[0]]:.3f}×",
                      f"{result['diff'][v]:.1e}")
    for v, why in result.get("missing", {}).items():
        table.add_row(v, why, "", "", "", "")
    console = Console()
    console.print(table)
    console.print(f"reducer / torch DDP: {med[VARIANTS[0]] / med[VARIANTS[1]]:.3f}× by medians, "
                  f"{paired['reducer / torch DDP']:.3f}× by the median of per-round ratios (target ≤ 1.05)")
    console.print(f"per-gradient / reducer: {med[VARIANTS[2]] / med[VARIANTS[0]]:.2f}× by medians, "
                  f"{paired['per-gradient / reducer']:.2f}× per round (the reducer's speed-up; "
                  f"target ≥ 1.15 where communication matters)")
    console.print(f"reducer buckets: {result['buckets']}; {cfg['steps']} rounds, one step of each variant per round")
    if cfg.get("launch"):
        console.print("the rule for fair GPU comparisons: every variant eager and untraced, in turn each round, "
                      "CUDA events, the slowest rank's")


def paired_ratios(times: dict) -> dict:
    """Median over rounds of the time ratios within a round: robust to a machine whose speed
    drifts (other jobs), since the variants of one round ran back to back."""
    ours, ddp, naive = (times[v] for v in VARIANTS)
    return {"reducer / torch DDP": timing.median([a / b for a, b in zip(ours, ddp)]),
            "per-gradient / reducer": timing.median([c / a for a, c in zip(ours, naive)])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives bench-ddp",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--first-bucket-cap-mb", type=float, default=None,
                        help="the reducer's first bucket (default: the bucket cap, as torch DDP)")
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each variant per round)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model", choices=sorted(MODELS), default="transformer")
    parser.add_argument("--batch", type=int, default=None, help="per-rank batch (default per model)")
    parser.add_argument("--out", default="bench-results", help="directory for the JSON")
    parser.add_argument("--impl", choices=("reference", "exercise"), default="reference",
                        help="exercise: also time the BucketedReducer of your lessons/06_bucketing/exercise.py")
    parser.add_argument("--launch", choices=steps_gpu.rule.LAUNCHES, default=None,
                        help="on GPUs, how every variant is launched: eager (the default there; graph is refused)")
    args = parser.parse_args(argv)
    if args.launch is not None and args.backend != "nccl":
        parser.error("--launch is for --backend nccl (GPUs)")
    if args.launch == "graph":
        parser.error(steps_gpu.NO_GRAPH)
    cfg = dict(world=args.world, backend=args.backend, bucket_cap_mb=args.bucket_cap_mb, impl=args.impl,
               first_bucket_cap_mb=args.first_bucket_cap_mb or args.bucket_cap_mb,
               steps=args.steps, warmup=args.warmup, model=args.model,
               sizes=MODELS[args.model]["sizes"], batch=args.batch or MODELS[args.model]["batch"])
    if args.backend == "nccl":
        cfg["launch"] = steps_gpu.LAUNCH
    if args.backend == "gloo":
        importlib.import_module("torch._dynamo")  # DDP imports it on first use (3 s): once, before forking
    env = {"env": steps_gpu.rule.rank_env(steps_gpu.LAUNCH)} if args.backend == "nccl" else {}
    result = launch.run(run_rank, args.world, args=(cfg,), backend=args.backend, timeout=600, **env)[0]
    _render(result, cfg)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench-ddp-{args.model}-{args.backend}-p{args.world}.json")
    with open(path, "w") as f:
        json.dump(record(result, cfg, argv if argv is not None else sys.argv[1:]), f, indent=1)
    print(f"wrote {path}")
    return 0


def record(result: dict, cfg: dict, argv: list[str]) -> dict:
    """The JSON record of a run; on GPUs with the rule's fields (``rule``: launch, inputs, ...)."""
    said = {"rule": steps_gpu.fields()} if cfg.get("launch") else {}
    return dict(config=cfg, result=result, paired=paired_ratios(result["times"]),
                median={v: timing.median(xs) for v, xs in result["times"].items()}, **said,
                python=platform.python_version(), **host(),
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                command=".venv/bin/python -m collectives bench-ddp " + " ".join(argv))


# ---- the lab's experiments (run on every rank; plain data back) -------------------------

# The lab's transformer: 4 encoder layers, 54 tensors from 1 KiB (a LayerNorm bias) to
# 1 MiB, 14 MiB of gradients, and a small vocabulary, so that the embedding -- the last
# gradient of backward, whose all-reduce no layout can hide -- is small. Sixteen tokens
# per rank keep backward short enough on a CPU that communication is a large part of the step.
LAB_SIZES = dict(vocab=1024, d_model=256, nhead=4, ff=1024, layers=4, seq=16)


def _reducer_class(reducer: str | None):
    """The reducer a lab times: ``None`` for the course's, or a target such as
    ``Lab(6, "exercise").target("BucketedReducer")`` (a string, so it crosses into the ranks)."""
    if reducer is None:
        return BucketedReducer
    from ..impl import resolve
    return resolve(reducer)


def timeline_rank(sizes: dict = LAB_SIZES, batch: int = 1, bucket_cap_mb: float = 4.0,
                  first_bucket_cap_mb: float = 1.0, steps: int = 7, reducer: str | None = None) -> dict:
    """Train ``steps`` steps; return the names, the layout before and after the rebuild, and
    for a typical step -- the median by time to gradients written, among the steps after the
    rebuild -- its ``stats.relative()`` and traced collectives. ``reducer``: whose
    ``BucketedReducer`` (:func:`_reducer_class`)."""
    torch.manual_seed(0)
    model = make_model("transformer", **sizes)
    reducer = _reducer_class(reducer)(model, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
    opt = torch.optim.SGD(reducer.parameters(), lr=1e-2)
    x, y = model.batch(batch, seed=dist.get_rank())
    layouts, losses, seen = [reducer.bucket_indices], [], []
    for step in range(steps):
        opt.zero_grad()
        with trace.recording() as t:
            loss = model.loss(reducer(x), y)
            loss.backward()
        opt.step()
        layouts.append(reducer.bucket_indices)
        losses.append(loss.item())
        start = reducer.stats.start
        events = [dict(label=e.label, nbytes=e.nbytes, t0=e.t0 - start, t1=(e.t1 or math.nan) - start)
                  for e in t.collectives()]
        if step >= 1 or steps == 1:
            seen.append((reducer.stats.relative(), events))
    seen.sort(key=lambda item: item[0]["finished"])
    stats, events = seen[len(seen) // 2]
    return dict(names=reducer.names, sizes=[p.numel() * p.element_size() for p in reducer.params],
                layouts=layouts, stats=stats, events=events, losses=losses)


def sweep_rank(caps: list[float], sizes: dict = LAB_SIZES, batch: int = 1, steps: int = 6,
               reducer: str | None = None) -> dict:
    """Step time for each bucket cap (first bucket = cap), sampled round-robin; plus the time
    of backward alone and of one all-reduce of every gradient, for scale. ``reducer``: whose
    ``BucketedReducer`` (:func:`_reducer_class`)."""
    reducer_class = _reducer_class(reducer)
    trace.uninstall()
    torch.manual_seed(0)
    base = make_model("transformer", **sizes)
    x, y = base.batch(batch, seed=dist.get_rank())
    runs = {}
    for cap in caps:
        model = copy.deepcopy(base)
        reducer = reducer_class(model, bucket_cap_mb=cap, first_bucket_cap_mb=cap)
        step = _make_step("bucketed reducer", reducer, model, (x, y))
        for _ in range(2):   # the second step rebuilds the buckets
            step()
        runs[cap] = (step, len(reducer.buckets))
    times = {cap: [] for cap in caps}
    for _ in range(steps):
        for cap in caps:
            times[cap] += timing.measure(runs[cap][0], warmup=0, iters=1)
    plain = copy.deepcopy(base)

    def compute_only():
        plain.zero_grad()
        plain.loss(plain(x), y).backward()
    flat = torch.zeros(sum(p.numel() for p in base.parameters()))
    return dict(caps=list(caps), buckets=[runs[c][1] for c in caps], times=[times[c] for c in caps],
                compute=timing.measure(compute_only, iters=steps),
                all_reduce=timing.measure(lambda: dist.all_reduce(flat), iters=steps),
                grad_bytes=flat.numel() * 4)


# ---- the tour's row -------------------------------------------------------------------

def tour_fields(nbytes: int) -> dict:
    """On every rank of a tour world: an MLP with about ``nbytes`` of parameters, 1 MiB
    buckets; three steps against torch DDP, then one step of each timed."""
    device = verify.rank_device()
    width = max(8, int((nbytes / 4 / 4) ** 0.5))        # 4 layers of width² floats
    cfg = dict(bucket_cap_mb=1.0, first_bucket_cap_mb=1.0)
    torch.manual_seed(0)
    base = make_model("mlp", width=width, depth=4).to(device)
    batch = base.batch(16, seed=1000 + dist.get_rank(), device=device)
    ours_model, ddp_model = copy.deepcopy(base), copy.deepcopy(base)
    with trace.paused():
        ddp_step = _make_step("torch DDP", _wrap("torch DDP", ddp_model, cfg, device), ddp_model, batch)
        ours_step = _make_step("bucketed reducer", _wrap("bucketed reducer", ours_model, cfg, device),
                               ours_model, batch)
        for _ in range(3):
            ours_step()
            ddp_step()
        diff = _max_param_diff(ours_model, ddp_model)
    with trace.recording() as t:
        ours_step()
    p = dist.get_world_size()
    ring = 2 * (p - 1) / p          # bytes each rank sends per byte all-reduced (a ring)
    sent = timing.max_over_ranks(sum(e.nbytes for e in t.of_kind("all_reduce")) * ring)
    with trace.paused():
        ours = timing.measure(ours_step, device=device)
        ref = timing.measure(ddp_step, device=device)
    grads = sum(q.numel() * q.element_size() for q in base.parameters())
    ok = diff <= 1e-5
    return dict(verified=ok, detail="" if ok else f"parameters differ from torch DDP by {diff:.1e} (relative)",
                seconds=timing.median(ours), ref_seconds=timing.median(ref), nbytes=grads,
                bytes_sent=sent, bytes_theory=ring * grads, baseline="torch DDP")
