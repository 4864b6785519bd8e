"""``.venv/bin/python -m collectives bench-tp``: lesson 13's sequence-parallel MLP, sequential
against async TP against torch's.

The workload is the forward of one sequence-parallel MLP without its activation, the two
places where tensor parallelism's collectives sit on the critical path::

    x (s/p, h) ──all-gather──> (s, h) ──· W1 (h, f/p)──> (s, f/p) ──· W2 (f/p, h)──> partial (s, h)
                                                                       ──reduce-scatter──> (s/p, h)

side by side in one world, in interleaved rounds (one batch of runs of every variant per
round, so a change of the machine's load falls on all of them alike):

* ``sequential`` -- lesson 4's ring all-gather, the two matmuls, the ring reduce-scatter;
* ``async`` -- :func:`~collectives.tensor_parallel.all_gather_matmul` and
  :func:`~collectives.tensor_parallel.matmul_reduce_scatter`, p pieces each, every transfer
  under the matmul of the piece before it;
* ``dtensor`` -- torch's own: ``ColwiseParallel(input_layouts=Shard(0))`` then
  ``RowwiseParallel(output_layouts=Shard(0))`` on the two linear layers (DTensor);
* on GPUs (``--backend nccl``), ``fused`` -- ``torch.ops.symm_mem.fused_all_gather_matmul``
  and ``fused_matmul_reduce_scatter`` (symmetric memory; NVLink multicast kept off).

Every variant is first checked against the sequential one (to 1e-4 relative: the matmuls
cut in pieces may round differently). Each time is the median of ``--rounds`` batches of
``--iters`` runs (the slowest rank's), with the spread (the lowest and highest batch).
``--json PATH`` writes every time with device, versions, date, command, commit, host cores
and load (:func:`collectives.course.site.claims.environment`); ``--record NAME`` draws the
chart and writes the record a page reads (``docs/img/NAME.svg`` and ``.json``). ``--counts``
measures no time: it counts what one block sends and keeps per rank, TP against sequence
parallelism, at 1 to 8 ranks, checks every count against its formula and writes the record
``13-tp-vs-sp`` (:mod:`collectives.course.benchmarks.tp_record`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ...core import launch, ops, timing
from ...ring import ring_all_gather, ring_reduce_scatter
from ...symmetric.gpu import no_multicast
from ...tensor_parallel import TPGroup, all_gather_matmul, matmul_reduce_scatter

CPU_SHAPES = "256x512x2048,1024x1024x4096"          # tokens s x hidden h x MLP width f
GPU_SHAPES = "4096x4096x16384,8192x8192x28672"
CPU_VARIANTS = ("sequential", "async", "dtensor")
GPU_VARIANTS = ("sequential", "async", "dtensor", "fused")


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"bench-tp: a shape is s x h x f, like 1024x1024x4096; got {item!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def _variants(s, h, f, dtype, device, names):
    """The variants' forward functions on this rank's data, and the data."""
    tp = TPGroup()
    p, r = tp.size, tp.rank
    for what, n in (("tokens", s), ("MLP width", f)):
        if n % p:
            raise ValueError(f"bench-tp: {what} {n} does not split over {p} ranks")
    g = torch.Generator().manual_seed(1234)
    w1 = (torch.randn(h, f, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(f, h, generator=g) / f ** 0.5).to(dtype)
    w1_mine, w2_mine = w1[:, r * f // p:(r + 1) * f // p].contiguous().to(device), \
        w2[r * f // p:(r + 1) * f // p].contiguous().to(device)
    x = torch.randn(s // p, h, generator=torch.Generator().manual_seed(r)).to(dtype).to(device)

    def sequential():
        full = x.new_empty(s, h)
        ring_all_gather(full, x)
        out = x.new_empty(s // p, h)
        ring_reduce_scatter(out, (full @ w1_mine) @ w2_mine)
        return out

    def asynchronous(timeline=None):
        return matmul_reduce_scatter(all_gather_matmul(x, w1_mine, tp, timeline=timeline), w2_mine, tp,
                                     timeline=timeline)

    fns = {"sequential": sequential, "async": asynchronous}
    if "dtensor" in names:
        fns["dtensor"] = _dtensor(w1, w2, x, device)
    if "fused" in names:
        fns["fused"] = _fused(x, w1_mine, w2_mine)
    return fns


def _dtensor(w1, w2, x, device):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mlp = nn.Sequential(nn.Linear(*w1.shape, bias=False), nn.Linear(*w2.shape, bias=False)).to(w1.dtype)
    with torch.no_grad():
        mlp[0].weight.copy_(w1.t())
        mlp[1].weight.copy_(w2.t())
    mlp = mlp.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(input_layouts=Shard(0)),
                                   "1": RowwiseParallel(output_layouts=Shard(0))})

    def run():
        with torch.no_grad():
            out = mlp(x)
        return out.wait() if hasattr(out, "wait") else out
    return run


def _fused(x, w1_mine, w2_mine):
    import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem

    from ...symmetric.gpu import _enable

    name = dist.group.WORLD.group_name
    _enable(symm_mem, name)                      # older torch must be told the group uses it

    def run():
        _, (h1,) = torch.ops.symm_mem.fused_all_gather_matmul(x, [w1_mine], 0, name, return_A=False)
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(h1, w2_mine, "sum", 0, name)
    return run


def bench_rank(shapes, names, dtype_name: str, iters: int, rounds: int) -> dict:
    """In each rank: check every variant against the sequential one, then time them all."""
    device = ops.rank_device()
    dtype = getattr(torch, dtype_name)
    out = {"times": {n: [] for n in names}, "spread": {n: [] for n in names}, "checked": {}}
    for s, h, f in shapes:
        fns = _variants(s, h, f, dtype, device, names)
        want = fns["sequential"]().float()
        for name, fn in fns.items():
            got = fn().float()
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            ok = bool(torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())))
            out["checked"][f"{name} {s}x{h}x{f}"] = ok
        batches = {n: [] for n in names}
        for _ in range(rounds):
            for name in names:
                batches[name].append(timing.measure_back_to_back(fns[name], iters=iters, device=device))
        for name in names:
            out["times"][name].append(statistics.median(batches[name]))
            out["spread"][name].append([min(batches[name]), max(batches[name])])
    if device.type == "cpu":                     # one async forward of the last shape, its pieces timed
        out["timeline"] = _timeline(fns["async"])
    return out


def _timeline(asynchronous) -> list[dict]:
    """When each transfer and each matmul of one async forward ran, from its start (seconds)."""
    import time

    timeline: list = []
    dist.barrier()
    begin = time.perf_counter()
    asynchronous(timeline)
    return [dict(e, start=e["start"] - begin, end=e["end"] - begin) for e in timeline]


def print_table(result: dict) -> None:
    names = list(result["times"])
    head = f"{'s x h x f':>18}" + "".join(f"{n + ' [spread]':>30}" for n in names) + "   async × sequential"
    print(f"bench-tp, {result['backend']}, {result['world']} ranks, {result['dtype']}")
    print(head)
    for i, shape in enumerate(result["shapes"]):
        row = f"{'x'.join(map(str, shape)):>18}"
        for n in names:
            lo, hi = result["spread"][n][i]
            show = timing.human_seconds
            cell = f"{show(result['times'][n][i])} [{show(lo)}-{show(hi)}]"
            row += f"{cell:>30}"
        row += f"   {result['times']['async'][i] / result['times']['sequential'][i]:.2f}"
        print(row)
    bad = [k for k, ok in result["checked"].items() if not ok]
    print("every variant equals the sequential one" if not bad else f"NOT EQUAL: {bad}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives bench-tp",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: 4 on CPU, every GPU under NCCL)")
    parser.add_argument("--shapes", default=None, help=f"s x h x f, comma-separated (default {CPU_SHAPES}; "
                                                       f"GPUs {GPU_SHAPES})")
    parser.add_argument("--dtype", default=None, help="float32 on CPU (default), bfloat16 on GPUs (default)")
    parser.add_argument("--iters", type=int, default=10, help="runs per batch")
    parser.add_argument("--rounds", type=int, default=7, help="batches of every variant, interleaved")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", type=Path, default=None, help="write the times, with their meta, here")
    parser.add_argument("--record", default=None, help="draw docs/img/NAME.svg and write its record NAME.json")
    parser.add_argument("--img", type=Path, default=None, help="where --record writes (default docs/img)")
    parser.add_argument("--counts", action="store_true", help="count bytes and activations (no timing)")
    args = parser.parse_args(argv)
    from ..site import claims
    from . import tp_record

    if args.counts:
        counted = tp_record.counts()
        print("every count equals its formula:", counted)
        print(f"wrote {tp_record.save_counts_record(counted, args.record or '13-tp-vs-sp', args.img)}")
        return 0

    if args.backend == "nccl":
        no_multicast()
        world = args.world or torch.cuda.device_count()
        names, shapes = GPU_VARIANTS, parse_shapes(args.shapes or GPU_SHAPES)
        dtype = args.dtype or "bfloat16"
        backend = "nccl"
    else:
        world = args.world or 4
        names, shapes = CPU_VARIANTS, parse_shapes(args.shapes or CPU_SHAPES)
        dtype = args.dtype or "float32"
        backend = "gloo"
    got = launch.run(bench_rank, world, args=(shapes, names, dtype, args.iters, args.rounds),
                     backend=backend, timeout=args.timeout)[0]
    command = " ".join([".venv/bin/python -m collectives bench-tp"] + argv)
    result = {"backend": backend, "world": world, "dtype": dtype, "shapes": [list(s) for s in shapes],
              "iters": args.iters, "rounds": args.rounds, **got,
              "meta": claims.environment(backend=backend, command=command)}
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.record:
        print(f"wrote {tp_record.save_bench_record(result, args.record, args.img)}")
    return 0 if all(result["checked"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
