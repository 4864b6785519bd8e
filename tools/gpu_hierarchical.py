"""Lesson 7 on GPUs: hierarchical all-reduce against NCCL's all_reduce, and buckets in flight.

    .venv/bin/python tools/gpu_hierarchical.py            # 2 GPUs: layouts (1, 2) and (2, 1)
    .venv/bin/python tools/gpu_hierarchical.py --world 4  # 4 GPUs: (2, 2), (1, 4), (4, 1)
    .venv/bin/python tools/gpu_hierarchical.py --json out.json

Each layout is checked against ``dist.all_reduce`` (integer-valued data: bit for bit) and
timed with CUDA events (median of --iters after warm-up): one slice, pipelined (the plan,
computed once per size: how many slices it chose is printed), NCCL's inside stages against
messages, and 16 buckets of --bucket bytes handed to the in-flight reducer with 1 and 8 in
flight, beside NCCL's flat all_reduce of the same bytes (one call per bucket, as DDP's
default hook); then the same 16 buckets, one slice each, captured once in a CUDA graph and
replayed (the world starts with NCCL's registration of captured buffers off:
``timing.graph_env``). On one machine every link is NVLink: the layout only pretends, so this
measures what the stages, streams and lanes cost, not a gain.

Beside each GPU time, the host's: ``host_seconds`` is the time the host takes to *issue* the
call (after a synchronisation, until the call returns; the GPUs run on), ``host_per_slice``
and ``host_per_bucket`` divide it; ``issue_per_bucket`` is the in-flight reducer's own host
work per bucket with torch.distributed's calls stubbed out (``bench-hier host-cost``'s
measure, here with CUDA streams and events). The course's call tracing is off, for NCCL's
calls as for ours: a plain program. Multicast stays off (NVLS, symmetric memory).
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
import torch.distributed as dist  # noqa: E402

from collectives import launch, ops, timing, trace  # noqa: E402
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


def _replayed(layout, pristine, buckets, flat_buckets, nccl_buckets, nccl_host, iters, device) -> dict:
    """Lesson 7's sixteen buckets, one slice each, captured once in a CUDA graph and replayed:
    every call of every bucket issued by one launch, so the host's cost per bucket is gone.
    Exact against NCCL on fresh copies first; beside NCCL's sixteen calls replayed the same way."""
    row = dict(layout=layout, name="16 buckets, replayed from a CUDA graph", nccl=nccl_buckets,
               nbytes=16 * pristine[0].numel() * 4, exact=False, seconds=float("nan"), host_seconds=float("nan"),
               nccl_host=nccl_host)

    def issue():
        for b in buckets:
            one_slice_all_reduce(b, layout=layout)
    try:
        graph = timing.capture_graph(issue, warm=2, device=device)
        want = [b.clone() for b in pristine]
        for w in want:
            dist.all_reduce(w)
        for b, fresh in zip(buckets, pristine):
            b.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize(device)
        row["exact"] = all(torch.equal(a, b) for a, b in zip(buckets, want))
        row["seconds"] = timing.median(timing.measure(graph.replay, iters=iters, device=device))
        row["host_seconds"] = _host(graph.replay, device, iters)
        theirs = timing.capture_graph(flat_buckets, warm=2, device=device)
        row["nccl_graph"] = timing.median(timing.measure(theirs.replay, iters=iters, device=device))
        # where the replay's time goes on the GPU, beside NCCL's sixteen calls
        row["kernels_us"] = {"replayed": timing.kernel_times(graph.replay, device=device),
                             "nccl": timing.kernel_times(flat_buckets, device=device)}
    except Exception as exc:  # noqa: BLE001 - the row says what failed; the others stand
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return row


def _rank(layouts, numel, bucket_numel, iters):
    trace.uninstall()
    device = ops.rank_device()
    rows = []
    x = torch.randint(-8, 9, (numel,), device=device).float()
    timed = x.clone()
    nccl = timing.median(timing.measure(lambda: dist.all_reduce(timed), iters=iters, device=device))
    # The timed calls reduce in place, over and over: after some hundred calls the sums
    # overflow to ±inf and the stubbed issue-cost rounds add stale staging (NaN). Exactness is
    # therefore judged on fresh copies of the pristine buckets, never on the timed ones.
    pristine = [torch.randint(-8, 9, (bucket_numel,), device=device).float() for _ in range(16)]
    buckets = [b.clone() for b in pristine]

    def flat_buckets():
        for w in [dist.all_reduce(b, async_op=True) for b in buckets]:
            w.wait()
    nccl_buckets = timing.median(timing.measure(flat_buckets, iters=iters, device=device))
    nccl_host = _host(lambda: dist.all_reduce(timed), device, iters)
    nccl_buckets_host = _host(flat_buckets, device, iters)
    for layout in layouts:
        plan = default_slice_numel(numel, 4, resolve(layout), default_tiers(device))
        variants = {"one slice": functools.partial(one_slice_all_reduce, layout=layout),
                    "pipelined": functools.partial(hierarchical_all_reduce, layout=layout),
                    "pipelined, inside as messages": functools.partial(hierarchical_all_reduce, layout=layout,
                                                                       inside="messages")}
        for name, call in variants.items():
            y = x.clone()
            want = y.clone()
            dist.all_reduce(want)
            call(y)
            exact = bool(torch.equal(y, want))
            t = timing.median(timing.measure(lambda: call(y), iters=iters, device=device))
            slices = 1 if name == "one slice" else -(-numel // plan)
            host = _host(lambda: call(y), device, iters)
            rows.append(dict(layout=layout, name=name, exact=exact, seconds=t, nccl=nccl, nbytes=numel * 4,
                             slices=slices, host_seconds=host, host_per_slice=host / slices, nccl_host=nccl_host))
        reducer = HierarchicalAllReducer(layout=layout)
        want = [b.clone() for b in pristine]
        for w in want:
            dist.all_reduce(w)
        got = [b.clone() for b in pristine]
        _in_flight(reducer, got, 16)
        exact = all(torch.equal(a, b) for a, b in zip(got, want))
        for k in (1, 8):
            t = timing.median(timing.measure(lambda: _in_flight(reducer, buckets, k), iters=iters, device=device))
            host = _host(lambda: _in_flight(reducer, buckets, k), device, iters)
            rows.append(dict(layout=layout, name=f"16 buckets, {k} in flight", exact=exact, seconds=t,
                             nccl=nccl_buckets, nbytes=16 * bucket_numel * 4, host_seconds=host,
                             host_per_bucket=host / 16, nccl_host=nccl_buckets_host))
        issue, calls = _issue_cost(lambda: _in_flight(reducer, buckets, 16), 16, 5)
        issue = timing.median(issue)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for row in rows[-2:]:
            row.update(issue_per_bucket=issue, python_calls_per_bucket=calls)
        reducer.close()
    for layout in layouts if device.type == "cuda" else ():    # last: a failed capture spoils no other row
        rows.append(_replayed(layout, pristine, buckets, flat_buckets, nccl_buckets, nccl_buckets_host, iters, device))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--size", default="256M")
    parser.add_argument("--bucket", default="4M", help="bytes per bucket of the in-flight rows")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default="", help="also write the rows, with device, versions, date, command")
    args = parser.parse_args()
    p = args.world
    layouts = [(1, p), (p, 1)] + ([(2, p // 2)] if p >= 4 and p % 2 == 0 else [])
    numel = timing.parse_size(args.size) // 4
    rows = launch.run(_rank, p, args=(layouts, numel, timing.parse_size(args.bucket) // 4, args.iters),
                      backend="nccl", timeout=600, env=timing.graph_env())[0]
    device = f"{torch.cuda.get_device_name(0)} x {p}"
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {device}, "
          f"{args.size} float32")
    for r in rows:
        extra = f"  ({r['slices']} slices)" if "slices" in r else ""
        extra += f"  host {r['host_seconds'] * 1e3:.3f} ms (NCCL's {r['nccl_host'] * 1e3:.3f} ms)"
        if "nccl_graph" in r:
            extra += f"  (NCCL's 16 calls replayed {r['nccl_graph'] * 1e3:.2f} ms)"
        if "error" in r:
            extra += f"  {r['error']}"
        if "issue_per_bucket" in r:
            extra += f"  course's own host work {r['issue_per_bucket'] * 1e6:.0f} us per bucket"
        print(f"layout {r['layout']}  {r['name']:32s} exact={r['exact']}  {r['seconds'] * 1e3:8.2f} ms   "
              f"NCCL {r['nccl'] * 1e3:8.2f} ms   ratio to NCCL {r['nccl'] / r['seconds']:.2f}{extra}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            command=".venv/bin/python tools/gpu_hierarchical.py " + " ".join(sys.argv[1:]), device=device,
            torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit(),
            gpus=p, rows=rows), indent=1))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
