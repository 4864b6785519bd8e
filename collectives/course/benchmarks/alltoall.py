"""bench-alltoall: lesson 11's all-to-alls against ``dist.all_to_all_single``, and the MoE layer.

Three suites, each writing ``bench-alltoall-<suite>.json`` (machine, versions, date,
command, commit, every row) under ``--out``:

* ``local`` -- linear, pairwise, Bruck and the library on local ranks, 4 KiB to 256 MiB of
  input per rank; an α–β fit of the pairwise times, Bruck's predicted crossover beside
  the measured one;
* ``cluster`` (or ``--cluster``) -- the simulated 2 × 2 and 4 × 2 clusters (root, network namespaces, links
  shaped to ``--link``): the hierarchical all-to-all against the flat ones and the library,
  the two-tier cost model beside;
* ``host`` -- the host's work per call of each algorithm on tiny tensors, beside the
  floor its messages alone cost (:mod:`.alltoall_host`);
* ``moe`` -- the MoE layer's dispatch + combine time against its expert compute, and an
  imbalance sweep (routing from uniform to skewed): the tokens the busiest rank receives
  and the step time the slowest rank sets;
* ``dedup`` -- on the simulated cluster, the flat MoE dispatch + combine against the
  node-deduplicating one, top-k, the model beside (:mod:`.alltoall_dedup`).

``--backend nccl`` runs ``local`` and ``moe`` on the GPUs (one rank per GPU); ``local`` then
follows the course's rule for GPU comparisons (:mod:`.alltoall_gpu`): ``--launch eager|graph``
launches every all-to-all, NCCL's included, the same way, ``--inputs copied|resident`` says
whether NCCL's window contender copies the caller's tensor in and out; nothing is traced,
and the record names both (a graph run writes ``bench-alltoall-local-nccl-graph.json``).
``tools/lesson11_figures.py`` turns the records into the site's claims and figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ...core import cost as core_cost
from ...core import launch, ops, timing, trace
from ..catalog import ROOT
from .alltoall_dedup import add_arguments, site_record, two_tier
from .alltoall_dedup import print_rows as print_dedup
from .alltoall_host import FLAT, _algorithms, library_all_to_all, print_rows, suite_host  # noqa: F401

DEFAULT_OUT = ROOT / "build" / "bench"
QUEUE = "50ms"


def _time_in_rank(sizes: list[int], iters: int, names: list[str], layout=None) -> dict:
    """Every algorithm at every size: verified against the library once, then timed (max
    over ranks). On CPUs; GPUs run :func:`.alltoall_gpu.in_rank`, under the rule."""
    p = dist.get_world_size()
    device = ops.rank_device()
    fns = _algorithms(names, layout)
    rows = []
    for nbytes in sizes:
        numel = max(p, nbytes // 4 // p * p)
        x = torch.randn(numel, device=device)
        expected = torch.empty_like(x)
        dist.all_to_all_single(expected, x)
        out = torch.empty_like(x)
        for name, fn in fns.items():
            out.zero_()
            fn(out, x)
            verified = bool(torch.equal(out, expected))
            with trace.recording() as t:
                fn(out, x)
            messages = len([e for e in t if e.kind in ("isend", "send")])
            times = timing.measure(lambda: fn(out, x), warmup=1, iters=iters, device=device)
            rows.append(dict(name=name, nbytes=numel * 4, verified=verified, seconds=timing.median(times),
                             times=times, messages=messages))
    return {"rows": rows, "world_size": p}


def meta(argv: list[str], backend: str) -> dict:
    from ..site.claims import commit, environment
    command = " ".join([".venv/bin/python -m collectives bench-alltoall", *argv])
    out = environment(backend=backend, command=command)
    out["commit"] = commit()
    return out


def fit_link(rows: list[dict], p: int) -> core_cost.AlphaBeta:
    """α and β from the pairwise times: t = (p − 1)·α + (p − 1)/p·n·β, least squares."""
    pts = [(r["nbytes"] * (p - 1) / p, r["seconds"] / (p - 1)) for r in rows if r["name"] == "pairwise"]
    return core_cost.fit_alpha_beta([b for b, _ in pts], [t for _, t in pts])


def suite_local(args, argv) -> dict:
    from collectives.alltoall import cost
    sizes = timing.parse_sizes(args.sizes)
    names = ["dist.all_to_all_single", "linear", "pairwise", "bruck"]
    if args.backend == "nccl":
        from . import alltoall_gpu, gpu_timing
        mode = args.launch or "eager"
        result = launch.run(alltoall_gpu.in_rank, args.ranks, args=(sizes, args.iters, mode, args.inputs or "copied"),
                            backend="nccl", timeout=600, env=gpu_timing.rank_env(mode))[0]
    else:
        result = launch.run(_time_in_rank, args.ranks, args=(sizes, args.iters, names), timeout=600)[0]
    p = result["world_size"]
    if p < 2:       # one rank (a smoke run on one GPU): nothing crosses a link, so no model to fit
        result.update(sizes=sorted({r["nbytes"] for r in result["rows"]}), alpha=None, beta=None,
                      predicted_crossover=None, measured_crossover=None)
        return result
    link = fit_link(result["rows"], p)
    for row in result["rows"]:
        if row["name"] in cost.MODELS:
            row["model_seconds"] = cost.predict(row["name"], row["nbytes"], p, link)
    measured = {n: [r["seconds"] for r in result["rows"] if r["name"] == n] for n in ("pairwise", "bruck")}
    from ..site.claims import crossover
    result.update(sizes=[r["nbytes"] for r in result["rows"] if r["name"] == "pairwise"],
                  alpha=link.alpha, beta=link.beta, predicted_crossover=cost.bruck_crossover(p, link),
                  measured_crossover=crossover([r["nbytes"] for r in result["rows"] if r["name"] == "pairwise"],
                                               measured["bruck"], measured["pairwise"]))
    return result


def suite_cluster(args, argv) -> dict:
    from collectives.alltoall import cost

    from ...core.cluster import Cluster
    sizes = timing.parse_sizes(args.sizes)
    names = ["dist.all_to_all_single", "linear", "pairwise", "hierarchical"]
    runs = []
    for D, M in ((2, 2), (2, 4)):
        with Cluster(M, D, link=args.link, latency=QUEUE) as made:
            result = launch.run(_time_in_rank, D * M, args=(sizes, args.iters, names, (D, M)), cluster=made,
                                timeout=900)[0]
        machine = two_tier(args.link, D, M)
        for row in result["rows"]:
            model = cost.hierarchical_seconds if row["name"] == "hierarchical" else cost.flat_seconds
            row["model_seconds"] = model(row["nbytes"], machine)
        runs.append(dict(layout=[D, M], **result))
    return {"runs": runs, "link": args.link, "latency": QUEUE}


def _moe_in_rank(tokens: int, hidden: int, ffn: int, k: int, skews: list[float], factors: list[float],
                 iters: int) -> list[dict]:
    from collectives.alltoall import MoELayer
    r, p = dist.get_rank(), dist.get_world_size()
    device = ops.rank_device()
    E = 2 * p
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(r)).to(device)
    rows = []
    with torch.no_grad():                       # the first calls pay for allocations and connections
        warm = MoELayer(hidden, ffn, E, k=k, seed=1).to(device)
        for _ in range(2):
            warm(x)
    for factor in factors:
        layer = MoELayer(hidden, ffn, E, k=k, capacity_factor=factor, seed=1).to(device)
        for skew in skews:
            layer.logit_bias.copy_(torch.linspace(skew, 0, E))
            phases = []
            for i in range(iters + 1):
                dist.barrier()
                with torch.no_grad():
                    layer(x)
                if i:
                    phases.append(layer.timings)
            mine = {key: sorted(ph[key] for ph in phases)[len(phases) // 2]
                    for key in ("dispatch", "experts", "combine")}
            stats = [None] * p
            dist.all_gather_object(stats, dict(mine, received=layer.stats["received"], dropped=layer.stats["dropped"]))
            if r == 0:
                step = [s["dispatch"] + s["experts"] + s["combine"] for s in stats]
                rows.append(dict(factor=factor, skew=skew, per_rank=stats, slowest=max(step),
                                 mean=sum(step) / p, received=[s["received"] for s in stats],
                                 dropped=sum(s["dropped"] for s in stats),
                                 communication=max(s["dispatch"] + s["combine"] for s in stats),
                                 experts=max(s["experts"] for s in stats)))
    return rows


def suite_moe(args, argv) -> dict:
    skews = [float(s) for s in args.skews.split(",")]
    factors = [float(f) for f in args.factors.split(",")]
    rows = launch.run(_moe_in_rank, args.ranks, args=(args.tokens, args.hidden, args.ffn, 2, skews, factors,
                                                      args.iters), backend=args.backend, timeout=600)[0]
    return {"rows": rows, "world_size": args.ranks, "tokens": args.tokens, "hidden": args.hidden,
            "ffn": args.ffn, "k": 2, "experts": 2 * args.ranks}


def suite_dedup(args, argv) -> dict:
    from .alltoall_dedup import suite_dedup as run
    return run(args, argv)


SUITES = {"local": suite_local, "cluster": suite_cluster, "moe": suite_moe, "host": suite_host, "dedup": suite_dedup}


def write(suite: str, argv: list[str], backend: str, result: dict, out: str | None) -> Path:
    folder = Path(out) if out else DEFAULT_OUT
    folder.mkdir(parents=True, exist_ok=True)
    graph = "-graph" if result.get("launch") == "graph" else ""      # a GPU run replayed from CUDA graphs
    path = folder / f"bench-alltoall-{suite}{'-nccl' if backend == 'nccl' else ''}{graph}.json"
    record = {"bench": f"bench-alltoall {suite}", "meta": meta(argv, backend), **result}
    record["date"] = record["meta"]["date"] or datetime.datetime.now(datetime.timezone.utc).isoformat()
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--cluster" in argv:                    # bench-alltoall --cluster: the cluster suite
        argv = ["cluster"] + [a for a in argv if a not in ("--cluster", "cluster")]
    suite = argv[0] if argv and not argv[0].startswith("-") else "local"
    rest = argv[1:] if argv and argv[0] == suite else argv
    if suite not in SUITES:
        print(f"unknown suite {suite!r}; one of: {', '.join(SUITES)}")
        return 2
    parser = argparse.ArgumentParser(prog=f".venv/bin/python -m collectives bench-alltoall {suite}",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K..256M" if suite == "local" else "64K,1M,4M",
                        help="bytes of input per rank, e.g. 4K..16M or 64K,1M")
    parser.add_argument("--ranks", type=int, default=4, help="local and moe: ranks")
    parser.add_argument("--iters", type=int, default=5, help="timed runs (median)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="local and moe")
    parser.add_argument("--link", default="1gbit", help="cluster: rate of each machine's link (tc syntax)")
    parser.add_argument("--tokens", type=int, default=2048, help="moe: tokens per rank")
    parser.add_argument("--hidden", type=int, default=256, help="moe")
    parser.add_argument("--ffn", type=int, default=1024, help="moe")
    parser.add_argument("--skews", default="0,1,2,4,8", help="moe: router bias towards expert 0, uniform at 0")
    parser.add_argument("--factors", default="1.25,100", help="moe: capacity factors (100: nothing dropped)")
    parser.add_argument("--calls", type=int, default=200, help="host: calls per timed batch")
    parser.add_argument("--repeats", type=int, default=9, help="host: timed batches (median)")
    parser.add_argument("--before", default="", help="host: an earlier host record to compare with")
    parser.add_argument("--out", default="", help="folder for the JSON (default build/bench)")
    parser.add_argument("--launch", choices=("eager", "graph"), default=None,
                        help="local on GPUs (default eager): every all-to-all issued from Python, or every one, "
                             "NCCL's included, replayed from a CUDA graph (the rule for fair GPU comparisons)")
    parser.add_argument("--inputs", choices=("copied", "resident"), default=None,
                        help="local on GPUs (default copied): NCCL's window contender copies the caller's tensor "
                             "in and out inside the timed call, or finds its input in the window")
    add_arguments(parser)
    args = parser.parse_args(rest)
    if (args.launch or args.inputs) and (suite != "local" or args.backend != "nccl"):
        parser.error("--launch and --inputs are for the local suite on GPUs (--backend nccl)")
    if args.backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    result = SUITES[suite](args, rest)
    path = write(suite, [suite, *rest], args.backend, result, args.out or None)
    rows = result.get("rows", []) + [r for run in result.get("runs", []) for r in run["rows"]]
    if suite == "host":
        print_rows(result)
        rows = []
    if suite == "dedup":
        print_dedup(result)
        print(f"wrote {site_record(json.loads(path.read_text()), path.parent)}")
        rows = []
    for row in rows:
        if "nbytes" in row:
            print(f"{row.get('layout', '')}{timing.human_bytes(row['nbytes']):>10}  {row['name']:<24} "
                  f"{timing.human_seconds(row['seconds']):>10}  verified={row['verified']}")
        else:
            print(f"factor {row['factor']:<6} skew {row['skew']:<4} slowest {timing.human_seconds(row['slowest'])} "
                  f"mean {timing.human_seconds(row['mean'])} received {row['received']} dropped {row['dropped']}")
    print(f"wrote {path}")
    return 0 if all(r.get("verified", True) for r in result.get("rows", []) + rows) else 1


def tour_runner(nbytes: int) -> dict:
    """The tour's row for lesson 11: the pairwise all-to-all verified against and timed
    beside ``dist.all_to_all_single``; bytes sent from the trace against (p − 1)/p·n."""
    from collectives.alltoall import cost, pairwise_all_to_all
    p = dist.get_world_size()
    device = ops.rank_device()
    numel = max(p, nbytes // 4 // p * p)
    x = torch.randn(numel, device=device)
    ints = torch.arange(numel, device=device) + 1000 * dist.get_rank()
    expected, got = torch.empty_like(ints), torch.empty_like(ints)
    dist.all_to_all_single(expected, ints)
    pairwise_all_to_all(got, ints)
    ok = bool(torch.equal(got, expected))
    out = torch.empty_like(x)
    with trace.recording() as t:
        pairwise_all_to_all(out, x)
    sent = timing.max_over_ranks(t.bytes_sent())
    ours = timing.measure(lambda: pairwise_all_to_all(out, x), device=device)
    ref = timing.measure(lambda: dist.all_to_all_single(out, x), device=device)
    return dict(verified=ok, detail="" if ok else "differs from dist.all_to_all_single",
                seconds=timing.median(ours), ref_seconds=timing.median(ref), nbytes=numel * 4,
                bytes_sent=sent, bytes_theory=cost.pairwise(numel * 4, p).bytes_per_rank,
                baseline="dist.all_to_all_single")
