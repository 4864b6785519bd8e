"""The library's ring against NCCL's all_reduce on registered memory: exactness, then speed.

    torchrun --nproc-per-node 4 tools/gpu_ring_check.py --size 256M

Prints one JSON line (rank 0). One size per process: NCCL registration is once per
process (see nccl_memory.register). Both tensors come from collectives.nccl_memory; the
ring warms up once (allocating its landing buffer in the pool), then the pool is
registered, then results are checked bit for bit on integer data, then both are timed
with CUDA events (median of 20 after 5, max over ranks), then the host time to issue one
ring is taken (perf_counter, no synchronization inside: if it approached the ring's GPU
time, the host would be the limit).
"""
import argparse
import datetime
import json
import os
import sys
import statistics
import time

import torch
import torch.distributed as dist

from collectives import nccl_memory, timing
from collectives.ring import ring_all_reduce


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="256M")
    ap.add_argument("--plain", action="store_true", help="ordinary memory, no registration")
    args = ap.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=60))
    rank, p = dist.get_rank(), dist.get_world_size()
    nbytes = timing.parse_size(args.size)
    n = nbytes // 4
    make = (lambda: torch.empty(n, device=device)) if args.plain else \
        (lambda: nccl_memory.empty(n, dtype=torch.float32, device=device))
    x, y = make(), make()
    x.normal_()
    ring_all_reduce(y.normal_())               # warm-up: the landing buffer now exists
    if not args.plain:
        nccl_memory.register()
    values = torch.randint(-8, 9, (n,), device=device).float() * (rank + 1)
    expected = values.clone()
    dist.all_reduce(expected)
    y.copy_(values)
    ring_all_reduce(y)
    exact = bool(torch.equal(y, expected))
    t_nccl = timing.median(timing.measure(lambda: dist.all_reduce(x), warmup=5, iters=20, device=device))
    t_ring = timing.median(timing.measure(lambda: ring_all_reduce(x), warmup=5, iters=20, device=device))
    host = []                              # how long the host takes to issue one ring
    for _ in range(20):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        ring_all_reduce(x)
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize(device)
    if rank == 0:
        print(json.dumps(dict(p=p, bytes=nbytes, memory="plain" if args.plain else "registered",
                              exact=exact, nccl_s=t_nccl, ring_s=t_ring,
                              nccl_busbw=timing.busbw(nbytes, t_nccl, p) / 1e9,
                              ring_busbw=timing.busbw(nbytes, t_ring, p) / 1e9,
                              ratio=t_nccl / t_ring, ring_host_s=statistics.median(host),
                              env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")})),
              flush=True)
    # No destroy_process_group() and no interpreter teardown: with registered memory alive,
    # either aborts (the pool is freed after its communicator). The launcher does the same.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
