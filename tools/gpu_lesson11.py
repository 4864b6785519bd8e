"""Lesson 11 on GPUs: every all-to-all checked on NCCL, then timed against NCCL's all_to_all_single.

    .venv/bin/python tools/gpu_lesson11.py --out DIR                # every GPU count from 2 to all of them
    .venv/bin/python tools/gpu_lesson11.py --out DIR --worlds 2     # one count
    .venv/bin/python tools/gpu_lesson11.py --out DIR --quick        # small sizes, few runs

For each GPU count p (one rank per GPU, NCCL, spawned ranks):

* checks -- linear, pairwise, Bruck and the hierarchical all-to-all (every layout of p)
  equal ``dist.all_to_all_single`` bit for bit on GPU tensors (int32/int64, float32,
  bfloat16, uneven splits with empty blocks), the sizes' exchange and the uneven
  all-to-all, and the MoE layer equal to its single-process twin in output and gradients
  (fp32; the twin computed on the same GPU). Written to ``DIR/11-gpu-checks-p<p>.json``;
* the benchmark -- ``bench-alltoall local --backend nccl`` (4 KiB to 256 MiB per rank) twice,
  every all-to-all issued from Python (``--launch eager``) and every one, NCCL's included,
  replayed from a CUDA graph (``--launch graph``), as the rule for fair GPU comparisons asks
  (``docs/benchmarks.md``), and ``bench-alltoall moe --backend nccl``; each local run with a
  summary of the best hand-written all-to-all's speed as a fraction of NCCL's, launched
  the same way in the same rounds, at every size from 32 MiB up (the lesson's
  target: 0.85 or more); ``bench-alltoall host --backend nccl``: the host's time per call
  of each all-to-all on tiny tensors, beside the floor its messages alone cost (what a
  call costs before the GPU has anything to do). Written to
  ``DIR/bench-alltoall-*-nccl-p<p>.json`` (the replayed local run:
  ``DIR/bench-alltoall-local-nccl-graph-p<p>.json``).

Every JSON record carries the device, GPU count, torch and NCCL versions, the date, the
command and the git commit. NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1), set before any rank starts.
On a machine without two CUDA GPUs it says so and exits 0 without writing anything.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from collectives import launch, ops  # noqa: E402


def _meta(p: int, argv: list[str]) -> dict:
    from collectives.course.site import claims
    commit = claims.commit()
    return {"device": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}", "gpus_used": p,
            "gpu_count": torch.cuda.device_count(), "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([".venv/bin/python tools/gpu_lesson11.py", *argv]), "commit": commit,
            "env": {k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                               "NVSHMEM_DISABLE_NVLS")}}


def _checks_in_rank() -> dict:
    import collectives.alltoall as a2a
    r, p = dist.get_rank(), dist.get_world_size()
    dev = ops.rank_device()
    out = {}

    def record(name, ok):
        out[name] = bool(ok)

    for dtype in (torch.int32, torch.int64, torch.float32, torch.bfloat16):
        x = (torch.arange(p * 6 * 3, device=dev) + 1000 * r).to(dtype).view(p * 6, 3)
        want = torch.empty_like(x)
        dist.all_to_all_single(want, x)
        for name in ("linear_all_to_all", "pairwise_all_to_all", "bruck_all_to_all"):
            got = torch.zeros_like(x)
            getattr(a2a, name)(got, x)
            record(f"{name} {dtype}", torch.equal(got, want))
        for D in (d for d in range(1, p + 1) if p % d == 0):
            got = torch.zeros_like(x)
            a2a.hierarchical_all_to_all(got, x, layout=(D, p // D))
            record(f"hierarchical ({D}, {p // D}) {dtype}", torch.equal(got, want))
    ins = [(3 * r + 5 * d) % 4 for d in range(p)]
    outs = a2a.exchange_splits(ins)
    record("exchange_splits", outs == [(3 * s + 5 * r) % 4 for s in range(p)])
    x = (torch.arange(sum(ins) * 2, device=dev) + 100 * r).view(-1, 2)
    want = torch.empty(sum(outs), 2, dtype=x.dtype, device=dev)
    dist.all_to_all_single(want, x, outs, ins)
    for name in ("linear_all_to_all", "pairwise_all_to_all", "bruck_all_to_all"):
        got = torch.zeros_like(want)
        getattr(a2a, name)(got, x, outs, ins)
        record(f"{name} uneven", torch.equal(got, want))
    got, sizes = a2a.all_to_all_uneven(x, ins)
    record("all_to_all_uneven", torch.equal(got, want) and sizes == outs)
    # the MoE layer against its twin, on this rank's GPU
    H, F, E, T, k = 16, 32, 2 * p, 64, 2
    xs = [torch.randn(T, H, generator=torch.Generator().manual_seed(50 + s)).to(dev) for s in range(p)]
    tg = [torch.randn(T, H, generator=torch.Generator().manual_seed(90 + s)).to(dev) for s in range(p)]
    layer = a2a.MoELayer(H, F, E, k=k, capacity_factor=1.0, seed=3).to(dev)
    xr = xs[r].clone().requires_grad_()
    y = layer(xr)
    (y * tg[r]).sum().backward()
    twin_x = [t.clone().requires_grad_() for t in xs]
    routers = [a2a.make_router(3, H, E).to(dev).requires_grad_() for _ in range(p)]
    experts = [tuple(w.to(dev).requires_grad_() for w in a2a.make_expert(3, e, H, F)) for e in range(E)]
    outs_twin, dropped = a2a.moe_reference(twin_x, routers, experts, k, 1.0)
    sum((o * t).sum() for o, t in zip(outs_twin, tg)).backward()
    record("moe output", torch.equal(y, outs_twin[r]))
    record("moe input grad", torch.equal(xr.grad, twin_x[r].grad))
    record("moe router grad", torch.equal(layer.router.grad, routers[r].grad))
    record("moe expert grads", all(torch.equal(layer.w1[i].grad, experts[layer.first + i][0].grad)
                                   and torch.equal(layer.w2[i].grad, experts[layer.first + i][1].grad)
                                   for i in range(layer.local)))
    record("moe dropped", layer.stats["dropped"] == dropped[r])
    return out


def _bench(suite: str, p: int, out: Path, quick: bool, argv: list[str], launch: str = "eager") -> Path | None:
    graph = "-graph" if launch == "graph" else ""
    tmp = out / f"tmp-{suite}{graph}-p{p}"
    args = [sys.executable, "-m", "collectives", "bench-alltoall", suite, "--backend", "nccl", "--ranks", str(p),
            "--out", str(tmp)]
    if suite == "local":
        args += ["--sizes", "4K,64K,1M,32M,64M" if quick else "4K..256M", "--iters", "5" if quick else "20",
                 "--launch", launch]
    elif suite == "host":
        args += ["--calls", "50" if quick else "200", "--repeats", "3" if quick else "9"]
    else:
        args += ["--iters", "3" if quick else "10", "--tokens", "4096" if quick else "16384",
                 "--hidden", "1024", "--ffn", "4096"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    made = tmp / f"bench-alltoall-{suite}-nccl{graph}.json"
    if not made.exists():
        return None
    record = json.loads(made.read_text())
    record["gpu_meta"] = _meta(p, argv)
    if suite == "local":
        record["target"] = _target(record["rows"])
    path = out / f"bench-alltoall-{suite}-nccl{graph}-p{p}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return path


def _target(rows: list[dict]) -> list[dict]:
    """At each size from 32 MiB: the best hand-written all-to-all's speed as a fraction of
    NCCL's, from one run -- every contender launched the same way (both from Python, or both
    replayed from a CUDA graph), timed in the same interleaved rounds, as the rule for fair
    GPU comparisons asks (``docs/benchmarks.md``). NCCL on its registered window is not
    hand-written: it is NCCL's own, and it is not the baseline."""
    from collectives.course.benchmarks.alltoall_gpu import NCCL, OURS

    sizes = sorted({r["nbytes"] for r in rows if r["nbytes"] >= 32 << 20})
    out = []
    for n in sizes:
        at = {r["name"]: r["seconds"] for r in rows if r["nbytes"] == n}
        ours = {k: v for k, v in at.items() if k in OURS}
        if NCCL not in at or not ours:
            out.append({"nbytes": n, "best": None, "why_none": "NCCL's or every hand-written row is missing "
                        "at this size (see the record's skipped)"})
            continue
        best = min(ours, key=ours.get)
        out.append({"nbytes": n, "best": best, "fraction_of_nccl": at[NCCL] / ours[best],
                    "meets_0.85": at[NCCL] / ours[best] >= 0.85})
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON records")
    parser.add_argument("--worlds", default="", help="GPU counts, e.g. 2,4 (default: 2 .. every GPU)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-bench", action="store_true", help="the checks only")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(f"lesson 11 on GPUs needs at least 2 CUDA GPUs; this machine has {gpus}: nothing to do")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    worlds = [int(w) for w in args.worlds.split(",")] if args.worlds else list(range(2, gpus + 1))
    ok = True
    for p in worlds:
        checks = launch.run(_checks_in_rank, p, backend="nccl", timeout=600)
        failed = sorted({name for rank in checks for name, good in rank.items() if not good})
        ok &= not failed
        path = out / f"11-gpu-checks-p{p}.json"
        path.write_text(json.dumps({"meta": _meta(p, argv), "per_rank": checks, "failed": failed}, indent=1) + "\n")
        print(f"{p} GPUs: {len(checks[0])} checks per rank, failed: {failed or 'none'}  -> {path}")
        if not args.skip_bench:
            for suite, mode in (("local", "eager"), ("local", "graph"), ("host", "eager"), ("moe", "eager")):
                made = _bench(suite, p, out, args.quick, argv, mode)
                print(f"{p} GPUs, bench {suite}{' (graph)' if mode == 'graph' else ''}: {made or 'FAILED'}")
                ok &= made is not None
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
