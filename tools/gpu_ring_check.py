"""The library's ring against NCCL's all_reduce on registered memory: exactness, then speed.

    .venv/bin/torchrun --nproc-per-node 4 tools/gpu_ring_check.py --size 256M

Prints one JSON line (rank 0). One size per process: NCCL registration is once per
process (see nccl_memory.register). Both tensors come from collectives.core.nccl_memory; the
rings warm up once (allocating their landing buffers in the pool), then the pool is
registered, then results are checked bit for bit on integer data. Then NCCL, the ring as
the library runs it (each step through ``batch_isend_irecv``) and the pipelined ring
(``--pieces``, 2 by default) are timed with CUDA events in interleaved rounds (``--rounds`` × ``--iters``; each run the
slowest rank's; median over all). Last, the host time to issue one ring (perf_counter, no
synchronization inside: if it approached the ring's GPU time, the host would be the limit).

``--replay``: the ring also captured once in a CUDA graph and replayed -- the same messages
with the host's cost per call taken out -- checked bit for bit, timed in the same rounds, with
its host time per replay. NCCL's registration of captured buffers is turned off first
(:func:`collectives.core.timing.graph_env`). On registered memory the capture comes after
:func:`~collectives.core.nccl_memory.register`: the ring's landing buffers, made in the pool by
the warm-up, are reused, so the captured ring allocates nothing and every buffer it moves is
registered. ``--replay-pieces 2,4``: the
pipelined ring replayed the same way with each of those piece counts (where the host no
longer sets the pace, does overlapping a piece's add with the next piece's transfer pay?).
``--profile`` (with ``--replay``): the GPU's kernels of NCCL's call and of the replayed ring,
by name, from torch's profiler (CUPTI sees the kernels of a replayed graph): where the
replayed ring's time goes on the GPU, beside NCCL's one kernel.
"""
import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from collectives import nccl_memory, timing
from collectives.ring import pipelined_ring_all_reduce, ring_all_reduce


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="256M")
    ap.add_argument("--plain", action="store_true", help="ordinary memory, no registration")
    ap.add_argument("--pieces", type=int, default=2, help="pieces per chunk of the pipelined ring")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds of every variant")
    ap.add_argument("--iters", type=int, default=10, help="timed runs per variant and round")
    ap.add_argument("--json", default="", help="also write the result here (rank 0)")
    ap.add_argument("--replay", action="store_true", help="also the ring replayed from a CUDA graph")
    ap.add_argument("--replay-pieces", default="", help="with --replay: the pipelined ring replayed, e.g. 2,4,8")
    ap.add_argument("--profile", action="store_true", help="with --replay: the kernels of NCCL's call and the replay")
    args = ap.parse_args()
    if args.replay:
        os.environ.update(timing.graph_env())      # before NCCL starts
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
    ring_all_reduce(y.normal_())               # warm-up: the landing buffers now exist
    pipelined_ring_all_reduce(y, pieces=args.pieces)
    if not args.plain:
        nccl_memory.register()
    values = torch.randint(-8, 9, (n,), device=device).float() * (rank + 1)
    expected = values.clone()
    dist.all_reduce(expected)
    y.copy_(values)
    ring_all_reduce(y)
    exact = bool(torch.equal(y, expected))
    y.copy_(values)
    pipelined_ring_all_reduce(y, pieces=args.pieces)
    exact_pipelined = bool(torch.equal(y, expected))

    cases = {"nccl": lambda: dist.all_reduce(x), "ring": lambda: ring_all_reduce(x),
             "pipelined": lambda: pipelined_ring_all_reduce(x, pieces=args.pieces)}
    replayed = {}
    if args.replay:                            # one capture on x: checked on integer data, then timed
        cases["replayed"] = timing.capture_graph(lambda: ring_all_reduce(x), warm=2, device=device).replay
        x.copy_(values)
        cases["replayed"]()
        torch.cuda.synchronize(device)
        replayed["exact"] = bool(torch.equal(x, expected))
        for k in [int(v) for v in args.replay_pieces.split(",") if v]:
            name = f"replayed pipelined {k}"
            cases[name] = timing.capture_graph(lambda k=k: pipelined_ring_all_reduce(x, pieces=k), warm=2,
                                               device=device).replay
            x.copy_(values)
            cases[name]()
            torch.cuda.synchronize(device)
            replayed[f"pipelined_{k}_exact"] = bool(torch.equal(x, expected))
    times = {name: [] for name in cases}
    for _ in range(args.rounds):               # interleaved: a change of load falls on all alike
        for name, fn in cases.items():
            times[name] += timing.measure(fn, warmup=2, iters=args.iters, device=device)
    t = {name: statistics.median(v) for name, v in times.items()}


    host = timing.measure_issue(cases["ring"], device=device)   # the host's time to issue one ring
    if args.replay:
        replayed.update(ratio=t["nccl"] / t["replayed"], seconds=t["replayed"],
                        host_s=timing.measure_issue(cases["replayed"], device=device))
        if args.profile:
            replayed["kernels_us"] = {what: timing.kernel_times(cases[what], device=device)
                                     for what in ("nccl", "replayed")}
        for name in cases:
            if name.startswith("replayed pipelined "):
                replayed[f"pipelined_{name.split()[-1]}_ratio"] = t["nccl"] / t[name]
    t_nccl, t_ring = t["nccl"], t["ring"]
    if rank == 0:
        result = dict(p=p, bytes=nbytes, memory="plain" if args.plain else "registered",
                      exact=exact, nccl_s=t_nccl, ring_s=t_ring,
                      nccl_busbw=timing.busbw(nbytes, t_nccl, p) / 1e9,
                      ring_busbw=timing.busbw(nbytes, t_ring, p) / 1e9,
                      ratio=t_nccl / t_ring, ring_host_s=host,
                      rounds=args.rounds, iters_per_round=args.iters,
                      pipelined_pieces=args.pieces, pipelined_exact=exact_pipelined,
                      pipelined_ratio=t_nccl / t["pipelined"],
                      **({"replayed": replayed} if replayed else {}),
                      env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
                      device=torch.cuda.get_device_name(device), torch=torch.__version__,
                      nccl=".".join(map(str, torch.cuda.nccl.version())),
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      command="torchrun --nproc-per-node %d tools/gpu_ring_check.py %s" % (p, " ".join(sys.argv[1:])),
                      commit=os.environ.get("COLLECTIVES_COMMIT", "unknown"))
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    # No destroy_process_group() and no interpreter teardown: with registered memory alive,
    # either aborts (the pool is freed after its communicator). The launcher does the same.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
