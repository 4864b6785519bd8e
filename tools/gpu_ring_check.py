"""The library's ring against NCCL's all_reduce, under the rule for fair GPU comparisons.

    torchrun --nproc-per-node 2 tools/gpu_ring_check.py --size 256M                 # registered, eager
    torchrun --nproc-per-node 2 tools/gpu_ring_check.py --size 256M --launch graph  # every side replayed
    torchrun --nproc-per-node 2 tools/gpu_ring_check.py --size 256M --plain --launch graph

Prints one JSON line (rank 0). One size per process: NCCL registration is once per process
(see nccl_memory.register). Both tensors come from collectives.core.nccl_memory (``--plain``:
ordinary memory); the rings warm up once (allocating their landing buffers in the pool), then
the pool is registered.

The rule (``docs/benchmarks.md``, :mod:`collectives.course.benchmarks.gpu_timing`): every
contender -- NCCL called directly (not through the course's trace), the ring as the library
runs it (each step through ``batch_isend_irecv``), the pipelined ring (``--pieces``) -- is
launched the same way: ``--launch eager`` issues each from Python, ``--launch graph`` captures
each once in a CUDA graph and replays it, NCCL's all_reduce included (NCCL's registration of
captured buffers off: :func:`collectives.core.timing.graph_env`; on registered memory the
capture comes after registration, so the captured ring moves only registered buffers). Every
contender, as launched, is checked bit for bit against NCCL on integer data, then timed in
interleaved rounds (``--rounds`` × ``--iters`` runs issued back to back between CUDA events,
the slowest rank's; median and spread). Every contender reduces the same tensor in place:
``inputs`` is ``resident`` on registered memory (every side reads the registered pool) and
``copied`` on plain memory (the caller's ordinary tensor). Last, the host time to issue one
call of the ring and of NCCL, as launched (perf_counter; if it approached the GPU time, the
host would be the limit).

``--replay-pieces 2,4`` (with ``--launch graph``): the pipelined ring replayed with each of
those piece counts too. ``--profile`` (with ``--launch graph``): the GPU's kernels of NCCL's
replayed call and of the replayed ring, by name, from torch's profiler.
"""
import argparse
import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from collectives import nccl_memory, timing  # noqa: E402
from collectives.course.benchmarks import gpu_timing as rule  # noqa: E402
from collectives.ring import pipelined_ring_all_reduce, ring_all_reduce  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, combinations the rule forbids refused (exit 2, naming why)."""
    ap = argparse.ArgumentParser(prog="tools/gpu_ring_check.py")
    ap.add_argument("--size", default="256M")
    ap.add_argument("--plain", action="store_true", help="ordinary memory, no registration")
    ap.add_argument("--pieces", type=int, default=2, help="pieces per chunk of the pipelined ring")
    ap.add_argument("--launch", default="eager", choices=rule.LAUNCHES,
                    help="eager: every contender issued from Python; graph: every one replayed, NCCL's included")
    ap.add_argument("--rounds", type=int, default=rule.ROUNDS, help="interleaved rounds of every contender")
    ap.add_argument("--iters", type=int, default=10, help="runs issued back to back per contender and round")
    ap.add_argument("--json", default="", help="also write the result here (rank 0)")
    ap.add_argument("--replay", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replay-pieces", default="", help="with --launch graph: the pipelined ring replayed, e.g. 2,4")
    ap.add_argument("--profile", action="store_true", help="with --launch graph: the kernels of NCCL and the ring")
    args = ap.parse_args(argv)
    if args.replay:
        ap.error("--replay replayed the ring alone against an eager NCCL; use --launch graph "
                 "(every contender replayed, NCCL's all_reduce included)")
    if args.launch == "eager" and (args.replay_pieces or args.profile):
        ap.error("--replay-pieces and --profile are for --launch graph")
    if args.rounds < 1 or args.iters < 1 or args.pieces < 1:
        ap.error("--rounds, --iters and --pieces must be at least 1")
    args.replay_pieces = [int(v) for v in args.replay_pieces.split(",") if v]
    return args


def in_rank(nbytes: int, plain: bool, pieces: int, launch: str, replay_pieces: list[int], rounds: int,
            iters: int, profile: bool, device: torch.device) -> dict:
    """Every rank: the contenders checked as launched, timed in interleaved rounds; the result
    (rank 0's counts). Runs under gloo on CPU too (``plain``, ``launch="eager"``)."""
    rule.check_launch(launch)
    rank = dist.get_rank()
    n = nbytes // 4
    make = (lambda: torch.empty(n, device=device)) if plain else \
        (lambda: nccl_memory.empty(n, dtype=torch.float32, device=device))
    x, y = make(), make()
    x.normal_()
    ring_all_reduce(y.normal_())               # warm-up: the landing buffers now exist
    pipelined_ring_all_reduce(y, pieces=pieces)
    if not plain:
        nccl_memory.register()
    rule.untrace_rank()                        # the rule: nothing traced, NCCL called directly
    values = torch.randint(-8, 9, (n,), device=device).float() * (rank + 1)
    expected = values.clone()
    rule.nccl_all_reduce(expected)
    runs = {"nccl": lambda: rule.nccl_all_reduce(x), "ring": lambda: ring_all_reduce(x),
            "pipelined": lambda: pipelined_ring_all_reduce(x, pieces=pieces)}
    for k in replay_pieces:
        runs[f"pipelined {k}"] = lambda k=k: pipelined_ring_all_reduce(x, pieces=k)
    runs = rule.launched(runs, launch)
    skipped, exact = [], {}
    for name, run in list(runs.items()):       # as launched: a replay's graph is captured on x here
        try:
            run()
            x.copy_(values)
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            exact[name] = bool(torch.equal(x, expected))
        except RuntimeError as exc:
            skipped.append(f"{name}: {rule.first_line(exc)}")
            del runs[name]
    samples = rule.rounds(runs, iters=iters, skipped=skipped, count=rounds, device=device)
    seconds, spread = {}, {}
    for name, times in samples.items():
        seconds[name], spread[name] = rule.summary(times)
    host = {name: timing.measure_issue(runs[name], device=device) for name in ("nccl", "ring") if name in samples}
    out = dict(launch=launch, exact=exact, seconds=seconds, spread=spread, host_s=host, skipped=skipped,
               speed_vs_nccl={name: seconds["nccl"] / t for name, t in seconds.items()
                              if name != "nccl" and "nccl" in seconds})
    if profile and device.type == "cuda":
        out["kernels_us"] = {name: timing.kernel_times(runs[name], device=device)
                             for name in ("nccl", "ring") if name in runs}
    return out


def record(result: dict, args: argparse.Namespace, nbytes: int, p: int, device: torch.device) -> dict:
    """Rank 0's record: the times, the checks, and the rule's fields under ``rule``."""
    t = result["seconds"]
    inputs = "copied" if args.plain else "resident"
    return dict(p=p, bytes=nbytes, memory="plain" if args.plain else "registered", launch=args.launch,
                exact=result["exact"].get("ring", False), checked=result["exact"],
                nccl_s=t.get("nccl"), ring_s=t.get("ring"), seconds=t, spread=result["spread"],
                nccl_busbw=timing.busbw(nbytes, t["nccl"], p) / 1e9 if "nccl" in t else None,
                ring_busbw=timing.busbw(nbytes, t["ring"], p) / 1e9 if "ring" in t else None,
                ratio=result["speed_vs_nccl"].get("ring"), speed_vs_nccl=result["speed_vs_nccl"],
                ring_host_s=result["host_s"].get("ring"), nccl_host_s=result["host_s"].get("nccl"),
                rounds=args.rounds, iters_per_round=args.iters,
                pipelined_pieces=args.pieces, pipelined_exact=result["exact"].get("pipelined", False),
                pipelined_ratio=result["speed_vs_nccl"].get("pipelined"),
                **({"kernels_us": result["kernels_us"]} if "kernels_us" in result else {}),
                rule=rule.fields(args.launch, inputs, result["skipped"]),
                env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                backend="nccl" if device.type == "cuda" else "gloo", torch=torch.__version__,
                nccl=".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="torchrun --nproc-per-node %d tools/gpu_ring_check.py %s" % (p, " ".join(sys.argv[1:])),
                commit=os.environ.get("COLLECTIVES_COMMIT", "unknown"))


def main():
    args = parse()
    os.environ.update(rule.rank_env(args.launch))      # before NCCL starts
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=60))
    rank, p = dist.get_rank(), dist.get_world_size()
    nbytes = timing.parse_size(args.size)
    result = in_rank(nbytes, args.plain, args.pieces, args.launch, args.replay_pieces, args.rounds, args.iters,
                     args.profile, device)
    if rank == 0:
        said = record(result, args, nbytes, p, device)
        print(json.dumps(said), flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(said, f, indent=1)
    # No destroy_process_group() and no interpreter teardown: with registered memory alive,
    # either aborts (the pool is freed after its communicator). The launcher does the same.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
