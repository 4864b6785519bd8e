"""Lesson 7 on GPUs: hierarchical all-reduce against NCCL's all_reduce, and buckets in flight.

    .venv/bin/python tools/gpu_hierarchical.py            # 2 GPUs: layouts (1, 2) and (2, 1)
    .venv/bin/python tools/gpu_hierarchical.py --world 4  # 4 GPUs: (2, 2), (1, 4), (4, 1)
    .venv/bin/python tools/gpu_hierarchical.py --launch graph --json out.json   # every side replayed

Under the rule for fair GPU comparisons (``docs/benchmarks.md``,
:mod:`collectives.course.benchmarks.gpu_timing`). Each layout's contenders -- one slice,
pipelined (the plan, computed once per size: how many slices it chose is printed), NCCL's
inside stages against messages, 16 buckets of --bucket bytes one slice each, and handed to the
in-flight reducer with 1 and 8 in flight -- are set beside NCCL's flat all_reduce of the same
bytes (for the buckets: NCCL's sixteen calls, one per bucket, as DDP's default hook), NCCL
called directly. Every contender, NCCL's included, is launched the same way: ``--launch
eager`` issues each from Python, ``--launch graph`` captures each once in a CUDA graph and
replays it (NCCL's registration of captured buffers off: ``timing.graph_env``); a contender
that cannot be captured is listed under ``skipped``. Each is checked as launched against NCCL
(integer-valued data: bit for bit), then timed in interleaved rounds (``--rounds`` ×
``--iters`` runs issued back to back between CUDA events, the slowest rank's; median and
spread). Every contender all-reduces the caller's ordinary tensors in place (``inputs``:
``copied``). On one machine every link is NVLink: the layout only pretends, so this measures
what the stages, streams and lanes cost, not a gain.

Beside each GPU time, the host's: ``host_seconds`` is the time the host takes to *issue* the
call as launched (after a synchronisation, until the call returns; the GPUs run on),
``host_per_slice`` and ``host_per_bucket`` divide it; ``issue_per_bucket`` is the in-flight
reducer's own host work per bucket with torch.distributed's calls stubbed out (``bench-hier
host-cost``'s measure, here with CUDA streams and events). The course's call tracing is off,
for NCCL's calls as for ours. Multicast stays off (NVLS, symmetric memory).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
from pathlib import Path

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)      # no multicast: the ranks inherit it

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from collectives import launch, ops, timing  # noqa: E402
from collectives.course.benchmarks import gpu_timing as rule  # noqa: E402
from collectives.course.benchmarks.hierarchical_hostcost import _issue_cost  # noqa: E402
from collectives.course.site.claims import commit  # noqa: E402
from collectives.hierarchical import (  # noqa: E402
    HierarchicalAllReducer,
    default_slice_numel,
    hierarchical_all_reduce,
    one_slice_all_reduce,
    resolve,
)
from collectives.hierarchical.pipeline import default_tiers  # noqa: E402


def _in_flight(reducer, buckets, k):
    window = []
    for b in buckets:
        if len(window) == k:
            window.pop(0).wait()
        window.append(reducer.all_reduce(b))
    for h in window:
        h.wait()


def _host(call, device, iters):
    """Median seconds the host takes to issue ``call()``, the ranks starting together."""
    return timing.measure_issue(call, iters=iters, device=device, barrier=True)


def _nccl_buckets(buckets):
    """NCCL's flat all_reduce of each bucket, one call per bucket (DDP's default hook), called
    directly: not through the course's trace."""
    for b in buckets:
        rule.nccl_all_reduce(b)


def _rank(layouts, numel, bucket_numel, launch_mode, rounds, iters):
    """Every rank: per layout, every contender -- NCCL's flat all_reduce and its sixteen calls
    included -- launched alike (``launch_mode``), checked as launched against NCCL, then timed
    in interleaved rounds. Returns the rows and what was skipped."""
    rule.check_launch(launch_mode)
    rule.untrace_rank()                 # the rule: nothing traced, NCCL called directly
    device = ops.rank_device()
    rows, skipped = [], []
    x = torch.randint(-8, 9, (numel,), device=device).float()
    want = x.clone()
    rule.nccl_all_reduce(want)
    timed = x.clone()
    # The timed calls reduce in place, over and over: the sums overflow to +-inf and the
    # stubbed issue-cost rounds add stale staging (NaN). Exactness is judged on inputs reset
    # from pristine copies just before, never on what the timing left.
    pristine = [torch.randint(-8, 9, (bucket_numel,), device=device).float() for _ in range(16)]
    buckets = [b.clone() for b in pristine]
    want_buckets = [b.clone() for b in pristine]
    _nccl_buckets(want_buckets)

    def reset(name):
        if "bucket" in name:
            for b, fresh in zip(buckets, pristine):
                b.copy_(fresh)
        else:
            timed.copy_(x)

    def exact(name):
        if "bucket" in name:
            return all(torch.equal(a, b) for a, b in zip(buckets, want_buckets))
        return bool(torch.equal(timed, want))
    for layout in layouts:
        plan = default_slice_numel(numel, 4, resolve(layout), default_tiers(device))
        reducer = HierarchicalAllReducer(layout=layout)
        runs = {"nccl": lambda: rule.nccl_all_reduce(timed), "nccl, 16 buckets": lambda: _nccl_buckets(buckets)}
        for name, call in {"one slice": functools.partial(one_slice_all_reduce, layout=layout),
                           "pipelined": functools.partial(hierarchical_all_reduce, layout=layout),
                           "pipelined, inside as messages": functools.partial(
                               hierarchical_all_reduce, layout=layout, inside="messages")}.items():
            runs[name] = lambda call=call: call(timed)
        runs["16 buckets, one slice each"] = lambda layout=layout: [one_slice_all_reduce(b, layout=layout)
                                                                    for b in buckets]
        for k in (1, 8):
            runs[f"16 buckets, {k} in flight"] = lambda k=k, reducer=reducer: _in_flight(reducer, buckets, k)
        runs = rule.launched(runs, launch_mode)
        checked = {}
        for name, run in list(runs.items()):    # as launched: a replay's graph is captured here first
            try:
                run()
                reset(name)
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                checked[name] = exact(name)
            except Exception as exc:  # noqa: BLE001 - the contender is skipped, saying why; the others stand
                skipped.append(f"{name} {layout}: {rule.said(exc)}")
                del runs[name]
        samples = rule.rounds(runs, iters=iters, skipped=skipped, where=f" {layout}", count=rounds, device=device)
        timed_at = {name: rule.summary(times) for name, times in samples.items()}
        host = {name: _host(run, device, iters) for name, run in runs.items() if name in timed_at}
        issue, calls = _issue_cost(lambda: _in_flight(reducer, buckets, 16), 16, 5)
        issue = timing.median(issue)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for name, (seconds, spread) in timed_at.items():
            base = "nccl, 16 buckets" if "bucket" in name else "nccl"
            if name.startswith("nccl") or base not in timed_at:
                continue
            row = dict(layout=layout, name=name, exact=checked[name], seconds=seconds, spread=spread,
                       nccl=timed_at[base][0], nccl_spread=timed_at[base][1], launch=launch_mode,
                       nbytes=(16 * bucket_numel if "bucket" in name else numel) * 4,
                       host_seconds=host[name], nccl_host=host[base])
            if "bucket" in name:
                row.update(host_per_bucket=host[name] / 16)
                if "in flight" in name:
                    row.update(issue_per_bucket=issue, python_calls_per_bucket=calls)
            else:
                row["slices"] = 1 if name == "one slice" else -(-numel // plan)
                row["host_per_slice"] = host[name] / row["slices"]
            rows.append(row)
        reducer.close()
    return rows, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/gpu_hierarchical.py")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--size", default="256M")
    parser.add_argument("--bucket", default="4M", help="bytes per bucket of the bucket rows")
    parser.add_argument("--launch", default="eager", choices=rule.LAUNCHES,
                        help="eager: every contender issued from Python; graph: every one replayed, NCCL's included")
    parser.add_argument("--rounds", type=int, default=rule.ROUNDS, help="interleaved rounds of every contender")
    parser.add_argument("--iters", type=int, default=10, help="runs issued back to back per contender and round")
    parser.add_argument("--json", default="", help="also write the rows, with device, versions, date, command")
    args = parser.parse_args(argv)
    if args.world < 1 or args.rounds < 1 or args.iters < 1:
        parser.error("--world, --rounds and --iters must be at least 1")
    p = args.world
    layouts = [(1, p), (p, 1)] + ([(2, p // 2)] if p >= 4 and p % 2 == 0 else [])
    numel = timing.parse_size(args.size) // 4
    rows, skipped = launch.run(_rank, p, args=(layouts, numel, timing.parse_size(args.bucket) // 4, args.launch,
                                                args.rounds, args.iters),
                               backend="nccl", timeout=600, env=rule.rank_env(args.launch))[0]
    device = f"{torch.cuda.get_device_name(0)} x {p}"
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {device}, "
          f"{args.size} float32, every contender launched {args.launch}")
    for r in rows:
        extra = f"  ({r['slices']} slices)" if "slices" in r else ""
        extra += f"  host {r['host_seconds'] * 1e3:.3f} ms (NCCL's {r['nccl_host'] * 1e3:.3f} ms)"
        if "issue_per_bucket" in r:
            extra += f"  course's own host work {r['issue_per_bucket'] * 1e6:.0f} us per bucket"
        print(f"layout {r['layout']}  {r['name']:32s} exact={r['exact']}  {r['seconds'] * 1e3:8.2f} ms   "
              f"NCCL {r['nccl'] * 1e3:8.2f} ms   speed over NCCL's {r['nccl'] / r['seconds']:.2f}{extra}")
    for line in skipped:
        print(f"skipped: {line}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(
            command=".venv/bin/python tools/gpu_hierarchical.py " + " ".join(sys.argv[1:] if argv is None else argv),
            device=device, backend="nccl", torch=torch.__version__,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit(),
            gpus=p, rounds=args.rounds, iters_per_round=args.iters,
            rule=rule.fields(args.launch, "copied", skipped), rows=rows), indent=1))
    return 0 if rows and all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
