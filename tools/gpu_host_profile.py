"""Where the host's time goes when it issues the course's collectives on NCCL.

    python3 tools/gpu_host_profile.py [--world 2] [--size 256M] [--json FILE]

Per rank, in a world of the course's launcher (the trace installed, as in the tour and the
benchmarks): the host time to issue one ``ring_all_reduce`` (synchronised before, not
after: the launches alone), beside a minimal ring of ``batch_isend_irecv`` steps with no
course code; then cProfile of the ring's issuing, and of lesson 7's pipelined all-reduce and
16 buckets in flight, top functions by own time (rank 0). The numbers say which layer costs
what; nothing here is a benchmark of the GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpu_hierarchical import _in_flight  # noqa: E402  (tools/, beside this script)

from collectives import launch, ops, timing  # noqa: E402


def _host(fn, device, reps=30) -> float:
    return timing.measure_issue(fn, iters=reps, device=device)


def _profile(fn, device, reps=30, top=22) -> str:
    fn()
    torch.cuda.synchronize(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    torch.cuda.synchronize(device)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def minimal_ring(x):
    """The ring with nothing but torch: reduce-scatter then all-gather, one batch per step."""
    p, r = dist.get_world_size(), dist.get_rank()
    chunks = x.chunk(p)
    land = torch.empty_like(chunks[0])
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send, recv = chunks[(r - 1 - s) % p], (r - 2 - s) % p
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, land[: chunks[recv].numel()], left),
                                         dist.P2POp(dist.isend, send, right)]):
            w.wait()
        chunks[recv].add_(land[: chunks[recv].numel()])
    for s in range(p - 1):
        send, recv = chunks[(r - s) % p], chunks[(r - 1 - s) % p]
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, left), dist.P2POp(dist.isend, send, right)]):
            w.wait()


def rank_fn(numel: int) -> dict:
    from collectives.hierarchical import HierarchicalAllReducer, hierarchical_all_reduce, one_slice_all_reduce
    from collectives.ring import ring_all_reduce

    device = ops.rank_device()
    p = dist.get_world_size()
    x = torch.randn(numel, device=device)
    small = torch.randn(1 << 18, device=device)
    for fn in (lambda: ring_all_reduce(x), lambda: minimal_ring(x), lambda: dist.all_reduce(x)):
        fn()
    out = dict(p=p, numel=numel)
    out["host_ring_s"] = _host(lambda: ring_all_reduce(x), device)
    out["host_ring_1M_s"] = _host(lambda: ring_all_reduce(small), device)
    out["host_minimal_ring_s"] = _host(lambda: minimal_ring(x), device)
    out["host_nccl_s"] = _host(lambda: dist.all_reduce(x), device)
    out["gpu_ring_s"] = timing.median(timing.measure(lambda: ring_all_reduce(x), device=device))
    out["gpu_minimal_s"] = timing.median(timing.measure(lambda: minimal_ring(x), device=device))
    out["gpu_nccl_s"] = timing.median(timing.measure(lambda: dist.all_reduce(x), device=device))
    out["profile_ring"] = _profile(lambda: ring_all_reduce(x), device)
    layout = (1, p) if p == 2 else (p // 2, 2)
    out["layout"] = layout
    out["host_one_slice_s"] = _host(lambda: one_slice_all_reduce(x, layout=layout), device, reps=10)
    out["host_pipelined_s"] = _host(lambda: hierarchical_all_reduce(x, layout=layout), device, reps=10)
    out["gpu_one_slice_s"] = timing.median(timing.measure(lambda: one_slice_all_reduce(x, layout=layout),
                                                          device=device))
    out["gpu_pipelined_s"] = timing.median(timing.measure(lambda: hierarchical_all_reduce(x, layout=layout),
                                                          device=device))
    out["profile_pipelined"] = _profile(lambda: hierarchical_all_reduce(x, layout=layout), device, reps=5)
    buckets = [torch.randn(1 << 20, device=device) for _ in range(16)]
    reducer = HierarchicalAllReducer(layout=layout)

    def inflight(k):
        _in_flight(reducer, buckets, k)

    def flat():
        for w in [dist.all_reduce(b, async_op=True) for b in buckets]:
            w.wait()
    inflight(1)
    inflight(8)
    out["gpu_inflight1_s"] = timing.median(timing.measure(lambda: inflight(1), device=device))
    out["gpu_inflight8_s"] = timing.median(timing.measure(lambda: inflight(8), device=device))
    out["gpu_flat16_s"] = timing.median(timing.measure(flat, device=device))
    out["host_inflight8_s"] = _host(lambda: inflight(8), device, reps=5)
    out["profile_inflight8"] = _profile(lambda: inflight(8), device, reps=3)
    reducer.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", default="256M")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    res = launch.run(rank_fn, args.world, args=(timing.parse_size(args.size) // 4,), backend="nccl", timeout=400)
    r0 = res[0]
    for k, v in r0.items():
        if not k.startswith("profile"):
            print(f"{k:22} {v * 1e3:.3f} ms" if isinstance(v, float) else f"{k:22} {v}")
    for k, v in r0.items():
        if k.startswith("profile"):
            print(f"==== {k}\n{v}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
