"""Lesson 7's buckets in flight on GPUs, taken apart: which part makes a bucket come back wrong.

    python3 tools/gpu_inflight_probe.py --world 2 --json inflight.json

Sixteen buckets of 4 MiB of small integers (exact in fp32 whatever the order of the sums)
are handed to :class:`~collectives.hierarchical.HierarchicalAllReducer` on each layout of
the machine's GPUs, then compared with ``dist.all_reduce`` of the same buckets. Each variant
changes one thing:

* ``default`` -- the reducer as the course ships it;
* ``sync each`` -- the host waits for the device after every bucket (nothing overlaps);
* ``sync before wait`` -- all sixteen issued, the device synchronised, then the handles;
* ``no prepared`` -- every slice built afresh (:class:`~collectives.hierarchical.slice.Slice`);
* ``one comm`` -- stages 1 and 5 (or 2 and 4) on one process group, one NCCL communicator;
* ``messages`` -- stages 1 and 5 as point-to-point messages instead of NCCL's collectives;
* ``raw`` -- no reducer: NCCL's in-place reduce-scatter on one group and in-place all-gather
  on another, each on a stream of its own, chained by the works' ``wait()`` -- what the
  reducer issues for layout (D, 1), and ``raw, out of place`` the same with separate outputs.

Each world runs again under environment variants (``--env``): a variant that is exact where
the default is not names the mechanism. A wrong bucket is described: how many elements differ,
in which eighths of the bucket, and what they equal instead (this rank's input, the peer's,
zero, twice the sum).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

os.environ.update({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"})
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from collectives import launch, ops  # noqa: E402
from collectives.course.site import claims  # noqa: E402
from collectives.hierarchical import HierarchicalAllReducer  # noqa: E402

BUCKETS, NUMEL = 16, 1 << 20
ENVS = {"default": {},
        "no split share": {"NCCL_COMM_SPLIT_SHARE_RESOURCES": "0"},
        "launch blocking": {"CUDA_LAUNCH_BLOCKING": "1"},
        "record streams": {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}}


def _describe(got, want, mine, peers) -> dict | None:
    bad = got != want
    n = int(bad.sum())
    if n == 0:
        return None
    eighths = bad.view(8, -1).sum(1).tolist()
    g = got[bad]
    equal = {"this rank's input": mine[bad], "zero": torch.zeros_like(g), "twice the sum": 2 * want[bad]}
    for r, x in enumerate(peers):
        equal[f"rank {r}'s input"] = x[bad]
    return {"wrong": n, "by eighth": eighths,
            "equal to": {k: int((g == v).sum()) for k, v in equal.items() if int((g == v).sum())}}


def _raw(buckets, groups, out_of_place: bool) -> list:
    device = buckets[0].device
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    rs_group, ag_group = groups
    d, D = dist.get_rank(rs_group), dist.get_world_size(rs_group)
    cur = torch.cuda.current_stream(device)
    done = []
    for b in buckets:
        part = b.view(D, -1)
        s1.wait_stream(cur)
        with torch.cuda.stream(s1):
            out = torch.empty_like(part[d]) if out_of_place else part[d]
            w = dist.reduce_scatter_tensor(out, b, group=rs_group, async_op=True)
        with torch.cuda.stream(s2):
            w.wait()
            w2 = dist.all_gather_into_tensor(b, out, group=ag_group, async_op=True)
            w2.wait()
            e = torch.cuda.Event()
            e.record(s2)
        done.append(e)
    for e in done:
        cur.wait_event(e)
    return buckets


def _rank(layouts):
    device = ops.rank_device()
    p, me = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(1234 + me)
    src = [torch.randint(-8, 9, (NUMEL,), generator=gen).float().to(device) for _ in range(BUCKETS)]
    want = [b.clone() for b in src]
    for w in want:
        dist.all_reduce(w)
    peers = []
    for b in src:
        every = [torch.empty_like(b) for _ in range(p)]
        dist.all_gather(every, b)
        peers.append(every)
    torch.cuda.synchronize(device)
    raw_groups = (dist.new_group(list(range(p))), dist.new_group(list(range(p))))
    out = {}

    def check(name, fn):
        got = [b.clone() for b in src]
        try:
            fn(got)
            torch.cuda.synchronize(device)
            out[name] = [_describe(g, w, s, pr) for g, w, s, pr in zip(got, want, src, peers)]
        except Exception as exc:  # noqa: BLE001 - reported, the next variant still runs
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"

    for layout in layouts:
        def reducer(**kw):
            return HierarchicalAllReducer(layout=layout, **kw)

        def issue(r, got, sync_each=False, sync_before=False):
            handles = []
            for g in got:
                handles.append(r.all_reduce(g))
                if sync_each:
                    torch.cuda.synchronize(device)
            if sync_before:
                torch.cuda.synchronize(device)
            for h in handles:
                h.wait()

        r = reducer()
        L = f"{tuple(layout)}"
        check(f"{L} default", lambda got: issue(r, got))
        check(f"{L} default, again", lambda got: issue(r, got))
        check(f"{L} sync each", lambda got: issue(r, got, sync_each=True))
        check(f"{L} sync before wait", lambda got: issue(r, got, sync_before=True))
        r.close()
        r = reducer()
        r._prepared = lambda *a: None
        check(f"{L} no prepared", lambda got: issue(r, got))
        r.close()
        r = reducer()
        g = r.groups
        if layout[1] == 1:
            g.all_gather = g.reduce_scatter
        else:
            g.diffuse = g.collect
        check(f"{L} one comm", lambda got: issue(r, got))
        r.close()
        r = reducer(inside="messages")
        check(f"{L} messages", lambda got: issue(r, got))
        r.close()
    check("raw", lambda got: _raw(got, raw_groups, False))
    check("raw, out of place", lambda got: _raw(got, raw_groups, True))
    return out


def _summary(res) -> dict:
    """variant -> 'exact' or 'k of 16 wrong' (rank 0)."""
    rows = {}
    for name, per in res.items():
        if isinstance(per, str):
            rows[name] = per
        else:
            wrong = [i for i, x in enumerate(per) if x is not None]
            rows[name] = "exact" if not wrong else f"{len(wrong)} of {len(per)} buckets wrong: {wrong}"
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--env", default=",".join(ENVS), help="environment variants, comma-separated")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    p = args.world
    layouts = [(p, 1), (1, p)] + ([(2, p // 2)] if p >= 4 and p % 2 == 0 else [])
    runs = {}
    for name in args.env.split(","):
        try:
            res = launch.run(_rank, p, args=(layouts,), backend="nccl", timeout=150, env=ENVS[name])
            runs[name] = {"summary": _summary(res[0]), "ranks": res}
        except Exception as exc:  # noqa: BLE001 - a world that fails is reported, the next runs
            runs[name] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        print(f"== {name}: " + json.dumps(runs[name].get("summary", runs[name].get("error")), indent=1), flush=True)
    record = dict(claims.environment(backend="nccl", commit=claims.commit(), gpus=p),
                  device=f"{p}× {torch.cuda.get_device_name(0)}, NVLink",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python3 tools/gpu_inflight_probe.py " + " ".join(sys.argv[1:]), runs=runs)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
