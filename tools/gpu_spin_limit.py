"""How long lesson 12's kernels spin before they give up on a peer that never comes, on one GPU.

    python3 tools/gpu_spin_limit.py --json docs/data/gpu/lesson12-spin-limit-1x-h200.json

A world of two whose second rank never launches (its signal pads are local buffers nobody
writes, as in ``tests/test_12_spin_limit.py``): rank 0's one-shot waits at its first barrier
until ``spin_limit`` tries have failed, writes its record and returns. Timed with CUDA events
from the launch to the kernel's end, for each barrier and several limits up to the default
(:data:`collectives.symmetric.triton_errors.SPIN_LIMIT`); the record keeps each time, and the
tries per second of the largest limit. NVLink multicast stays off; nothing leaves the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from collectives.course.site import claims  # noqa: E402
from collectives.symmetric import triton_allreduce as ta  # noqa: E402
from collectives.symmetric import triton_errors  # noqa: E402

N = 3 * 4096                       # three programs of 4096 float32
_ALIVE: list = []


def _world():
    pads = [torch.zeros(2048, dtype=torch.int32, device="cuda") for _ in range(2)]
    buffers = [torch.arange(N, dtype=torch.float32, device="cuda") * (q + 1) for q in range(2)]
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device="cuda") for ts in (buffers, pads)]
    handle = types.SimpleNamespace(buffer_ptrs_dev=ptrs[0].data_ptr(), signal_pad_ptrs_dev=ptrs[1].data_ptr(),
                                   rank=0, world_size=2)
    return handle, (pads, buffers, ptrs)


def measure(barrier: str, limit: int) -> dict:
    handle, kept = _world()
    out = torch.full((N,), -1.0, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    ta.one_shot(handle, N, torch.float32, out, spin_limit=limit, barrier=barrier)
    end.record()
    end.synchronize()
    records = ta.errors_of(handle).found()
    assert records and {r["peer"] for r in records} == {1}, "the kernel did not give up on peer 1"
    assert torch.equal(out, torch.full_like(out, -1.0)), "the kernel went on past the barrier"
    _ALIVE.append(kept)      # a later world at these addresses would find this one's record
    return dict(barrier=barrier, spin_limit=limit, seconds=start.elapsed_time(end) / 1e3,
                programs_that_gave_up=len(records))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--limits", default=f"65536,1048576,{triton_errors.SPIN_LIMIT}")
    args = parser.parse_args(argv)
    limits = [int(x) for x in args.limits.split(",")]
    rows = [measure(barrier, limit) for barrier in ta.BARRIERS for limit in limits]
    top = max(limits)
    record = claims.environment(backend="none", command="python3 " + " ".join(sys.argv),
                                commit=claims.commit())
    record.update(device=torch.cuda.get_device_name(), rows=rows, default_spin_limit=triton_errors.SPIN_LIMIT,
                  rule=dict(launch="eager", inputs="none: one kernel timed alone, compared with nothing"),
                  tries_per_second={b: top / next(r["seconds"] for r in rows if r["barrier"] == b
                                                  and r["spin_limit"] == top) for b in ta.BARRIERS})
    import triton
    record["triton"] = triton.__version__
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
    for r in rows:
        print(f"{r['barrier']:9s} {r['spin_limit']:>10d} tries: {r['seconds'] * 1e3:9.1f} ms")
    print("wrote", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
