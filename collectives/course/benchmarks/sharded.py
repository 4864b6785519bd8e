"""``.venv/bin/python -m collectives bench-sharded``: lesson 10's step time and memory, side by side.

::

    .venv/bin/python -m collectives bench-sharded                  # 4 local gloo ranks
    sudo .venv/bin/python -m collectives bench-sharded --cluster   # 2 machines x 2 ranks, 1 Gbit/s
    .venv/bin/python -m collectives bench-sharded --backend nccl   # every GPU of this host

One model (an MLP of ``--layers`` square layers of ``--width``, Adam), the same batches,
trained a few steps by each contender in one run: torch's DDP, torch's FSDP2
(``fully_shard`` per layer), and lesson 10's ZeRO-1, ZeRO-2 and ZeRO-3 (on lesson 4's
ring; ZeRO-3 also on torch's collectives). Each row: the median step time over
``--iters`` steps (every rank waits for the slowest) and the bytes each rank holds of
parameters, gradients and optimizer state, counted tensor by tensor after a backward, and
the peak of live tensor bytes above the start of one more step
(:class:`~collectives.core.live_bytes.LiveBytes`, on CPU and GPU alike; on GPUs also
``torch.cuda.max_memory_allocated`` over the training steps after the first, above what was
allocated before the contender was built: not the full model made before it is sharded, nor
the first step, which builds the optimizer state). On GPUs the step times follow the rule for
fair GPU comparisons (:mod:`.steps_gpu`); the memory is measured with each contender alone.

``--cluster`` runs on a simulated cluster (:class:`~collectives.core.cluster.Cluster`,
needs root) and sets hybrid sharding (ZeRO-3 inside a machine, the gradient shards
averaged across) against full sharding over all four ranks and DDP, with the
communication time the cost model (:mod:`collectives.sharded.cost`) predicts beside each.

Writes ``docs/data/10-sharded-<suite>.json`` (device, versions, date, command, commit, rows)
and the page's figure and claims, ``docs/img/10-sharded-<suite>.{svg,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ...core import launch, live_bytes, netns, ops, trace
from ...core.cost import AlphaBeta, TwoTier
from ...hierarchical.cost import DEFAULT_TIERS
from ...sharded import FSDP, ZeRO, hybrid_groups, optimizer_state_bytes, tensor_bytes
from ...sharded import cost as scost
from ..catalog import ROOT
from ..site import claims, plots
from . import steps_gpu

DATA = ROOT / "docs" / "data"
NAMES = {"ddp": "torch DDP", "fsdp2": "torch FSDP2", "zero1": "ZeRO-1", "zero2": "ZeRO-2",
         "zero3": "ZeRO-3 (ring)", "zero3_torch": "ZeRO-3 (torch collectives)",
         "zero3_torch_so": "ZeRO-3 (torch collectives, freed in stream order)",
         "hybrid": "hybrid ZeRO-3", "full": "full ZeRO-3"}


def make_model(layers: int, width: int, device) -> nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1]).to(device)


def _device(backend: str):
    if backend == "nccl":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _contender(name: str, layers: int, width: int, device, hybrid_rpm: int):
    """(forward module, step function, memory function) of one contender."""
    model = make_model(layers, width, device)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)   # noqa: E731
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = adam(ddp.parameters())
        mem = lambda: dict(params=tensor_bytes(list(model.parameters())),   # noqa: E731
                           grads=tensor_bytes([q.grad for q in model.parameters()]),
                           optimizer=optimizer_state_bytes(opt))
        return ddp, lambda: (opt.step(), opt.zero_grad()), mem
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m)
        fully_shard(model)
        opt = adam(model.parameters())

        def mem():
            return dict(params=tensor_bytes([q.to_local() for q in model.parameters()]),
                        grads=tensor_bytes([q.grad.to_local() for q in model.parameters() if q.grad is not None]),
                        optimizer=sum((v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size()
                                      for st in opt.state.values() for v in st.values()))
        return model, lambda: (opt.step(), opt.zero_grad()), mem
    if name in ("zero1", "zero2"):
        z = ZeRO(model, stage=int(name[-1]), optimizer=adam)
        model.close = z.remove      # its gradient hooks keep it, and the model, alive until removed
        return model, lambda: (z.step(), z.zero_grad()), z.memory
    groups = {}
    if name == "hybrid":
        shard, replicate = hybrid_groups(hybrid_rpm)
        groups = dict(group=shard, replicate_group=replicate)
    release = "stream_order" if name.endswith("_so") else "record_stream"
    f = FSDP(model, use_torch=name.startswith("zero3_torch"), release=release, **groups)
    opt = adam(f.parameters())
    return f, lambda: (opt.step(), opt.zero_grad()), lambda: f.memory(opt)


def _bench_in_rank(names, layers, width, batch, iters, backend, hybrid_rpm=2) -> list[dict]:
    device = _device(backend)
    rows = []
    g = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(batch, width, generator=g).to(device) for _ in range(2)]
    base = _settled(device, None)               # the batches alone: every contender starts from here
    for name in names:
        before = _settled(device, base)
        fwd, step, mem = _contender(name, layers, width, device, hybrid_rpm)
        times, memory, steady = [], None, before
        for i in range(iters + 1):
            if i == 1 and device.type == "cuda":
                # the allocator's peak over training steps alone: not the full model built
                # before it was sharded, nor the first step that builds the optimizer state
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                steady = torch.cuda.memory_allocated(device)
            _sync(device)
            t0 = time.perf_counter()
            fwd(xs[i % 2]).square().mean().backward()
            if i == 1:
                memory = mem()
            step()
            _sync(device)
            if i > 0:                           # the first step builds the optimizer state
                times.append(time.perf_counter() - t0)
        row = dict(name=name, seconds=statistics.median(times), times=times, memory=memory,
                   peak_bytes=_metered_step(fwd, step, xs[0], device))
        if device.type == "cuda":      # the steps' peak above what was allocated before the contender was built
            row["max_memory_allocated"] = torch.cuda.max_memory_allocated(device) - before
            row["allocated_before"], row["allocated_steady"] = before, steady - before
            row["allocated_after"] = torch.cuda.memory_allocated(device) - before
        if hasattr(fwd, "close"):
            fwd.close()
        rows.append(row)
        del fwd, step, mem
    return rows


def _rule_in_rank(names, layers, width, batch, iters, backend) -> list[dict]:
    """On GPUs: each contender's memory measured alone (:func:`_bench_in_rank`), then all built
    again, side by side, and their steps timed in ``iters`` rounds (:func:`.steps_gpu.in_rounds`)."""
    steps_gpu.untrace()
    # one step after the first is all the memory needs; the times are the rounds' below
    rows = _bench_in_rank(names, layers, width, batch, 1, backend)
    device = _device(backend)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    built = {name: _contender(name, layers, width, device, 2)[:2] for name in names}
    timed = steps_gpu.time_steps(built, x, iters, device)
    for row in rows:
        row.update(timed[row["name"]], traced=trace.installed())
    return rows


def _settled(device, base: int | None, patience: float = 5.0) -> int:
    """Bytes allocated on ``device`` once the earlier contender's memory is released (0 on CPU).

    Deleting a contender does not free all its memory at once: the process group keeps the
    tensors of its last collectives until it next looks at its finished work, which a new
    collective makes it do. A baseline read before that counts them, they are freed during
    the next contender's steps, and that contender's peak reads too low. So: collect, issue
    a one-element all-reduce, synchronise, and look again, up to ``patience`` seconds, until
    the allocator is back at ``base``; what is still there after that is reported by the
    caller (``allocated_before`` above the first contender's)."""
    if device.type != "cuda":
        return 0
    import gc
    deadline = time.monotonic() + patience
    done = torch.zeros(1, dtype=torch.int32, device=device)
    dist.all_reduce(done)                   # the first look at the finished work
    while True:                             # every rank goes round as often as the slowest
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        now = torch.cuda.memory_allocated(device)
        done.fill_(int(base is None or now <= base or time.monotonic() > deadline))
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            return now
        time.sleep(0.05)


def _metered_step(fwd, step, x, device) -> int:
    """Peak live tensor bytes above the start of one more training step (forward, backward,
    optimizer step, zero_grad), counted by :class:`~collectives.core.live_bytes.LiveBytes`:
    the same meter on CPU and GPU, for every contender."""
    import gc
    gc.collect()
    _sync(device)
    with live_bytes.LiveBytes() as meter:
        fwd(x).square().mean().backward()
        step()
    _sync(device)
    return meter.peak


def predictions(psi_bytes: float, machines: int, rpm: int, link: str) -> dict:
    """The cost model's communication seconds per step (ring collectives, α-β links)."""
    across = AlphaBeta(100e-6, 1 / netns.rate_bytes_per_second(link))
    machine = TwoTier(DEFAULT_TIERS.inside, across, machines, rpm)
    return {"full": scost.full_shard_seconds(psi_bytes, machine),
            "hybrid": scost.hybrid_shard_seconds(psi_bytes, machine),
            "ddp": scost.flat_all_reduce_seconds(psi_bytes, machine)}


def run(args, argv) -> dict:
    p = args.world or 4
    if args.cluster:
        from ...core.cluster import Cluster
        names = ["ddp", "full", "hybrid"]
        rpm = args.ranks_per_machine
        with Cluster(args.machines, rpm, link=args.link) as made:
            rows = launch.run(_bench_in_rank, args.machines * rpm,
                              args=(names, args.layers, args.width, args.batch, args.iters, "gloo", rpm),
                              cluster=made, timeout=1800)
        p = args.machines * rpm
    else:
        names = args.only.split(",") if args.only else ["ddp", "fsdp2", "zero1", "zero2", "zero3", "zero3_torch"]
        if not args.only and args.backend == "nccl":   # on CPU there is no stream to order by: the same row
            names.append("zero3_torch_so")
        nccl = args.backend == "nccl"
        if nccl and not args.world:
            p = torch.cuda.device_count()
        rows = launch.run(_rule_in_rank if nccl else _bench_in_rank, p,
                          args=(names, args.layers, args.width, args.batch, args.iters, args.backend),
                          backend=args.backend, timeout=1800,
                          **({"env": steps_gpu.rule.rank_env(steps_gpu.LAUNCH)} if nccl else {}))
    # a step lasts as long as its slowest rank: each contender's time is the slowest rank's median
    # (under the rule every rank's rounds are already the slowest rank's, kept with their spread)
    out = []
    for k, name in enumerate(names):
        per_rank = [r[k] for r in rows]
        out.append(dict(name=name, label=NAMES[name], seconds=max(r["seconds"] for r in per_rank),
                        memory_per_rank=[r["memory"] for r in per_rank],
                        peak_bytes=[r["peak_bytes"] for r in per_rank],
                        max_memory_allocated=[r.get("max_memory_allocated") for r in per_rank],
                        allocated=[{k: r.get(f"allocated_{k}") for k in ("before", "steady", "after")}
                                   for r in per_rank]))
        if "spread" in per_rank[0]:
            out[-1].update(spread=per_rank[0]["spread"], times=per_rank[0]["times"])
    psi = sum(q.numel() for q in make_model(args.layers, args.width, "cpu").parameters())
    result = dict(world_size=p, layers=args.layers, width=args.width, batch=args.batch, iters=args.iters,
                  psi=psi, backend=args.backend, rows=out,
                  formula={s: scost.memory_bytes(psi, p, s, scost.FP32_ADAM) for s in (0, 1, 2, 3)})
    if args.backend == "nccl":
        result["rule"] = steps_gpu.fields()
    if args.cluster:
        result.update(cluster=dict(machines=args.machines, ranks_per_machine=args.ranks_per_machine, link=args.link),
                      predicted_comm_seconds=predictions(4 * psi, args.machines, args.ranks_per_machine, args.link))
    return result


def suite_name(args) -> str:
    return "cluster" if args.cluster else "nccl" if args.backend == "nccl" else "local"


def write(args, argv, result: dict, out: Path, img: Path | None) -> Path:
    meta = claims.environment(backend=args.backend,
                              command=" ".join([".venv/bin/python -m collectives bench-sharded", *argv]).strip(),
                              commit=claims.commit())
    suite = suite_name(args)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"10-sharded-{suite}.json"
    path.write_text(json.dumps({"bench": "bench-sharded", "suite": suite, "meta": meta, **result}, indent=1) + "\n")
    if img is not None:
        img.mkdir(parents=True, exist_ok=True)
        record, fig = figure(suite, result, meta)
        plots.save(fig, img / f"10-sharded-{suite}", record)
    return path


def figure(suite: str, result: dict, meta: dict):
    """The step-time bars and memory bars, and the record of what they show."""
    rows = result["rows"]
    names = {r["name"]: r["label"] for r in rows}
    if suite == "cluster":
        c = result["cluster"]
        where = f"{c['machines']} machines x {c['ranks_per_machine']} ranks, {c['link']}"
    else:
        where = f"{result['world_size']} ranks, {meta['backend']}"
    record = claims.Record(f"10-sharded-{suite}", names=names, meta=meta,
                           title=f"bench-sharded: step time and memory per rank, {where}",
                           alt=f"Bars of step time and of bytes per rank for {', '.join(names.values())}")
    times = {r["name"]: r["seconds"] for r in rows}
    base = "fsdp2" if "fsdp2" in times else "ddp"
    record.times("step", times, baseline=base,
                 where=f"one training step of a {result['layers']}-layer MLP of width {result['width']}, {where}")
    mem0 = {r["name"]: sum(r["memory_per_rank"][0].values()) for r in rows}
    record.fact("memory", "Bytes rank 0 holds after a backward (parameters + gradients + optimizer state): "
                + ", ".join(f"{names[k]} {v / 2**20:.2f} MiB" for k, v in mem0.items()) + ".", bytes=mem0)
    head = ["contender", "step", "params MiB", "grads MiB", "optimizer MiB"]
    table_rows = []
    for r in rows:
        m = r["memory_per_rank"][0]
        table_rows.append([r["label"], claims.human(r["seconds"])] + [f"{m[k] / 2**20:.2f}" for k in
                                                                       ("params", "grads", "optimizer")])
    if suite == "cluster":
        pred = result["predicted_comm_seconds"]
        head.append("model: comm s")
        for row, r in zip(table_rows, rows):
            row.append(claims.human(pred[r["name"]]) if r["name"] in pred else "")
        record.fact("model", "The cost model's communication per step: "
                    + ", ".join(f"{names[k]} {claims.human(v)}" for k, v in pred.items() if k in names) + ".",
                    predicted=pred)
    if all(r.get("peak_bytes") for r in rows):
        peak = {r["name"]: max(r["peak_bytes"]) for r in rows}
        head.append("peak MiB")
        for row, r in zip(table_rows, rows):
            row.append(f"{peak[r['name']] / 2**20:.2f}")
        vs = "fsdp2" if "fsdp2" in peak else None
        said = [f"{names[k]} {v / 2**20:.2f} MiB" + (f" ({v / peak[vs]:.2f}× {names[vs]}'s)" if vs and k != vs else "")
                for k, v in peak.items()]
        record.fact("peak", "Peak live tensor bytes above the start of one training step, the largest of any "
                    "rank's: " + ", ".join(said) + ".", bytes=peak)
    if any(r["max_memory_allocated"][0] for r in rows):
        head.append("max allocated MiB")
        for row, r in zip(table_rows, rows):
            row.append(f"{r['max_memory_allocated'][0] / 2**20:.1f}")
        top = {r["name"]: max(r["max_memory_allocated"]) for r in rows}
        vs = "fsdp2" if "fsdp2" in top else None
        said = [f"{names[k]} {v / 2**20:.1f} MiB" + (f" ({v / top[vs]:.2f}× {names[vs]}'s)" if vs and k != vs else "")
                for k, v in top.items()]
        record.fact("allocated", "The caching allocator's peak (max_memory_allocated) over the training steps "
                    "after the first, above what was allocated before the contender was built, the largest of "
                    "any rank's: " + ", ".join(said) + ".", bytes=top)
    record.table = {"head": head, "rows": table_rows}
    record.caption = record.text()
    fig = plots._figure(7.0, 3.0)
    ax1, ax2 = fig.subplots(1, 2)
    labels = [r["label"] for r in rows]
    ax1.barh(labels, [r["seconds"] * 1e3 for r in rows], color="#4c72b0")
    ax1.set_xlabel("step time (ms)", fontsize=9)
    ax1.invert_yaxis()
    left = [0.0] * len(rows)
    for key, colour in (("params", "#4c72b0"), ("grads", "#dd8452"), ("optimizer", "#55a868")):
        vals = [r["memory_per_rank"][0][key] / 2**20 for r in rows]
        ax2.barh(labels, vals, left=left, color=colour, label=key)
        left = [a + b for a, b in zip(left, vals)]
    ax2.set_xlabel("MiB on rank 0", fontsize=9)
    ax2.invert_yaxis()
    ax2.set_yticklabels([])
    ax2.legend(fontsize=9)
    for ax in (ax1, ax2):
        ax.tick_params(labelsize=9)
    fig.suptitle(record.title, fontsize=10)
    return record, fig


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives bench-sharded",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=None,
                        help="local ranks (default: 4 on gloo, every GPU of this host on nccl)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--cluster", action="store_true", help="the simulated cluster (needs root)")
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--ranks-per-machine", type=int, default=2)
    parser.add_argument("--link", default="1gbit", help="rate of each cross-machine link (tc syntax)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5,
                        help="timed steps (median); on GPUs, rounds of one step per contender")
    parser.add_argument("--only", default="", help="contenders, comma-separated: " + ",".join(NAMES))
    parser.add_argument("--out", default=str(DATA), help="folder of the JSON record (default docs/data)")
    parser.add_argument("--img", default="", help="folder of the page's figure and claims (e.g. docs/img)")
    args = parser.parse_args(argv)
    if args.cluster and args.backend != "gloo":
        parser.error("--cluster runs on gloo")
    result = run(args, argv)
    path = write(args, argv, result, Path(args.out), Path(args.img) if args.img else None)
    for r in result["rows"]:
        m = r["memory_per_rank"][0]
        peak = r["max_memory_allocated"][0]
        extra = f", max allocated {peak / 2**20:.1f} MiB" if peak else ""
        held = r.get("allocated", [{}])[0]
        if peak and held.get("steady") is not None:
            extra += (f" (allocated when the steps began {held['steady'] / 2**20:.1f}, after them "
                      f"{held['after'] / 2**20:.1f}, before the contender {held['before'] / 2**20:.1f} MiB)")
        extra = f", peak live {max(r['peak_bytes']) / 2**20:.2f} MiB" + extra
        print(f"{r['label']:28s} step {claims.human(r['seconds']):>9s}  rank 0 holds "
              f"{sum(m.values()) / 2**20:.2f} MiB{extra}")
    if args.cluster:
        pred = result["predicted_comm_seconds"]
        print("model, communication per step:", {k: claims.human(v) for k, v in pred.items()})
    print(f"wrote {path}")
    return 0


def tour_runner(nbytes: int) -> dict:
    """The tour's row for lesson 10: one ZeRO-3 step (ring) of a 4-layer MLP of about
    ``nbytes`` of weights, checked against DDP's parameters and timed against DDP's step;
    bytes sent per rank from the trace against 3·(p−1)/p of the weights'."""
    from torch.nn.parallel import DistributedDataParallel

    from ...core import timing, trace
    width = max(int((nbytes / 16) ** 0.5), 4)
    device = ops.rank_device()                 # its GPU under NCCL
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    ddp_model = make_model(4, width, device)
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    f = FSDP(make_model(4, width, device))
    opt = torch.optim.Adam(f.parameters(), lr=1e-3)

    def ours():
        f(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def theirs():
        ddp(x).square().mean().backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
    with trace.recording() as t:
        ours()
    theirs()
    diff = max((a - b).abs().max().item() for a, b in zip(f.full_parameters(), ddp_model.parameters()))
    sent = timing.max_over_ranks(t.bytes_sent())
    mine = timing.measure(ours, warmup=1, iters=3, device=device)
    ref = timing.measure(theirs, warmup=1, iters=3, device=device)
    f.close()
    p = dist.get_world_size()
    weights = 4 * sum(q.numel() for q in ddp_model.parameters())
    ok = diff <= 1e-5
    return dict(verified=ok, detail="" if ok else f"parameters differ from DDP's by {diff:.3g}",
                seconds=timing.median(mine), ref_seconds=timing.median(ref), nbytes=weights,
                bytes_sent=sent, bytes_theory=scost.comm_elements(weights, p, 3))
