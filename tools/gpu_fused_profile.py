"""Where the host time of one fused all-reduce goes, on one GPU (a world of one rank).

    .venv/bin/python tools/gpu_fused_profile.py [--count 1000 --numel 4096] [--json FILE]

Times, on the host (perf_counter; the GPU work of these calls is microseconds), each piece
of FusedAllReducer's hot path for ``count`` tensors, then the whole call; then the time
between CUDA events around whole calls issued back to back, under the rule for fair GPU
comparisons (``docs/benchmarks.md``): one flat NCCL all-reduce (called directly), the fused
call and the bound call, all issued from Python (``..., eager``: the reducers with
``graphs=False``), then all replayed from CUDA graphs (the flat call captured here, the
reducers replaying their own), each column in interleaved rounds with its median and spread,
beside a replay of the recorded graph alone; then a cProfile of 20 whole calls. Prints JSON and the
profile's top lines; ``--json`` also writes the three tables as a record (device, torch, date,
command, commit).
"""
import argparse
import cProfile
import datetime
import io
import json
import operator
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

from collectives import timing
from collectives.fused import FastFusedAllReducer as FusedAllReducer


def host(fn, n=30):
    fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return statistics.median(xs) * 1e6


def device(fn, n=30):
    """Median µs between CUDA events around one call (host issue and GPU time together), as
    the benchmark measures it (collectives.core.timing.measure, here in a world of one rank)."""
    return timing.median(timing.measure(fn, warmup=1, iters=n, device=torch.device("cuda", 0))) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--json", default="", help="write the measured tables here as a record")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0),
                            timeout=datetime.timedelta(seconds=60))
    ts = [torch.randn(args.numel, device="cuda") for _ in range(args.count)]
    flat = torch.empty(args.count * args.numel, device="cuda")
    slots = list(flat.split(args.numel))
    red = FusedAllReducer(threshold_bytes=1 << 40, buffer_bytes=flat.numel() * 4, device="cuda")
    bound = FusedAllReducer(threshold_bytes=1 << 40, buffer_bytes=flat.numel() * 4, device="cuda")
    bts = [t.clone() for t in ts]
    bound.bind(bts)
    eager = FusedAllReducer(threshold_bytes=1 << 40, buffer_bytes=flat.numel() * 4, device="cuda",
                            graphs=False)
    red.all_reduce(ts).wait()           # planned: the list is now the known one
    out = {
        "flat all_reduce": host(lambda: dist.all_reduce(flat)),
        "torch.cat(out=)": host(lambda: torch.cat(ts, out=flat)),
        "_foreach_copy_ back": host(lambda: torch._foreach_copy_(ts, slots)),
        "split_with_sizes_copy back": host(lambda: torch.split_with_sizes_copy(
            flat, [args.numel] * args.count, out=ts)),
        "id map": host(lambda: list(map(id, ts))),
        "data_ptr map": host(lambda: tuple(map(torch.Tensor.data_ptr, ts))),
        "size map": host(lambda: tuple(map(torch.Tensor.size, ts))),
        "device map": host(lambda: tuple(map(operator.attrgetter("device"), ts))),
        "KnownList.matches": host(lambda: red._recent.matches(ts)),
        "_prepare": host(lambda: red._prepare(ts)),
        "fused call": host(lambda: (red.all_reduce(ts), red.wait())),
        "fused call, graphs=False": host(lambda: (eager.all_reduce(ts), eager.wait())),
        "bound call": host(lambda: (bound.all_reduce(bts), bound.wait())),
    }
    print("host µs", json.dumps({k: round(v, 1) for k, v in out.items()}), flush=True)
    # The comparison with one flat all-reduce follows the rule for fair GPU comparisons: NCCL
    # called directly, every contender issued from Python or every one replayed from a CUDA
    # graph (each column in interleaved rounds of its own), never one set against the other.
    from collectives.course.benchmarks import gpu_timing as rule
    eager_bound = FusedAllReducer(threshold_bytes=1 << 40, buffer_bytes=flat.numel() * 4, device="cuda",
                                  graphs=False)
    ebts = [t.clone() for t in ts]
    eager_bound.bind(ebts)
    skipped: list[str] = []
    # the flat call and the bound reducer all-reduce bytes already in place; the fused call copies them
    inputs = {"flat all_reduce": "resident", "fused call": "copied", "bound call": "resident",
              "replay of the fused call's graph": "copied"}
    timed = rule.both_launches(
        {"flat all_reduce": lambda: rule.nccl_all_reduce(flat),
         "fused call": lambda: (eager.all_reduce(ts), eager.wait()),
         "bound call": lambda: (eager_bound.all_reduce(ebts), eager_bound.wait())},
        {"flat all_reduce": rule.Replayed(lambda: rule.nccl_all_reduce(flat)),
         "fused call": lambda: (red.all_reduce(ts), red.wait()),            # replays its own graph
         "bound call": lambda: (bound.all_reduce(bts), bound.wait()),
         "replay of the fused call's graph": red._recent.graph.replay},
        iters=30, skipped=skipped, device=torch.device("cuda", 0))
    events = {f"{name}{', eager' if column == 'b2b' else ''}": times[f"{column}_s"] * 1e6
              for name, times in timed.items() for column in ("b2b", "graph") if f"{column}_s" in times}
    spreads = {f"{name}{', eager' if column == 'b2b' else ''}": [v * 1e6 for v in times[f"{column}_spread"]]
               for name, times in timed.items() for column in ("b2b", "graph") if f"{column}_s" in times}
    print("CUDA events µs", json.dumps({k: round(v, 1) for k, v in events.items()}), flush=True)

    # The copies alone, each recorded as a graph: which way moves 1000 tensors fastest on the GPU?
    from collectives.fused.reuse import StepGraphs
    dev = torch.device("cuda", 0)
    sizes = [args.numel] * args.count

    def split_streams(copy, k):
        """copy(part_of_tensors, part_of_flat, part_of_slots) on k streams at once."""
        streams = [torch.cuda.Stream(dev) for _ in range(k - 1)]
        step = args.count // k

        def run():
            here = torch.cuda.current_stream(dev)
            for i in range(k):
                lo, hi = i * step, (args.count if i == k - 1 else (i + 1) * step)
                part = (ts[lo:hi], flat[lo * args.numel: hi * args.numel], slots[lo:hi])
                if i < k - 1:
                    streams[i].wait_stream(here)
                    with torch.cuda.stream(streams[i]):
                        copy(*part)
                else:
                    copy(*part)
            for st in streams:
                here.wait_stream(st)
        return run

    cat_in = lambda t, f, s: torch.cat(t, out=f)                           # noqa: E731
    split_back = lambda t, f, s: torch.split_with_sizes_copy(f, [x.numel() for x in t], out=t)  # noqa: E731
    copies = {
        "cat in": lambda: torch.cat(ts, out=flat),
        "_foreach_copy_ in": lambda: torch._foreach_copy_(slots, ts),
        "split_with_sizes_copy back": lambda: torch.split_with_sizes_copy(flat, sizes, out=ts),
        "_foreach_copy_ back": lambda: torch._foreach_copy_(ts, slots),
        "cat in, 2 streams": split_streams(cat_in, 2),
        "cat in, 4 streams": split_streams(cat_in, 4),
        "split back, 2 streams": split_streams(split_back, 2),
        "split back, 4 streams": split_streams(split_back, 4),
    }
    recorded = {name: StepGraphs(dev).record(fn) for name, fn in copies.items()}
    replays = {k: device(g.replay) for k, g in recorded.items()}
    print("graph replay µs", json.dumps({k: round(v, 1) for k, v in replays.items()}), flush=True)
    if args.json:
        record = {"host_us": out, "cuda_events_us": events, "cuda_events_spread_us": spreads,
                  "rule": rule.fields(rule.BOTH, inputs, skipped), "graph_replay_us": replays,
                  "count": args.count, "numel": args.numel, "device": torch.cuda.get_device_name(0),
                  "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": "python3 " + " ".join(sys.argv),
                  "commit": os.environ.get("COLLECTIVES_COMMIT", "unknown")}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        red.all_reduce(ts)
        red.wait()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
    print(s.getvalue(), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
