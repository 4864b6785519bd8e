"""The library's ring against NCCL's all_reduce on registered memory: exactness, then speed.

    torchrun --nproc-per-node 4 tools/gpu_ring_check.py --sizes 64M,256M

Prints one JSON line per measurement as it goes (rank 0). Both tensors come from
collectives.nccl_memory, allocated for the largest size; the ring warms up once there
(allocating its landing buffer in the pool), the pool is registered -- once: see
nccl_memory.register -- and every size works on views. Results are checked bit for bit on
integer data, then both are timed with CUDA events (median of 20 after 5, max over
ranks), then the host time to issue one ring is taken (perf_counter, no synchronization
inside: if it approached the ring's GPU time, the host would be the limit).
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
    ap.add_argument("--sizes", default="64M,256M")
    ap.add_argument("--plain", action="store_true", help="ordinary memory, no registration")
    args = ap.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=60))
    rank, p = dist.get_rank(), dist.get_world_size()
    sizes = timing.parse_sizes(args.sizes)
    largest = max(sizes) // 4
    make = (lambda: torch.empty(largest, device=device)) if args.plain else \
        (lambda: nccl_memory.empty(largest, dtype=torch.float32, device=device))
    whole_x, whole_y = make(), make()          # views of these for every size: register once
    whole_x.normal_()
    ring_all_reduce(whole_y.normal_())         # warm-up: the landing buffer now has its final size
    if not args.plain:
        nccl_memory.register()
    for nbytes in sizes:
        n = nbytes // 4
        x, y = whole_x[:n], whole_y[:n]
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
                                  env={k: v for k, v in os.environ.items() if k.startswith("NCCL_P2P")
                                       or k.startswith("NCCL_MIN_P2P") or k.startswith("NCCL_MAX_P2P")})),
                  flush=True)
    # No destroy_process_group() and no interpreter teardown: with registered memory alive,
    # either aborts (the pool is freed after its communicator). The launcher does the same.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
