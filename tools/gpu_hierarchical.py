"""Lesson 7 on GPUs: hierarchical all-reduce against NCCL's all_reduce, 256 MiB float32.

    .venv/bin/python tools/gpu_hierarchical.py            # 2 GPUs: layouts (1, 2) and (2, 1)
    .venv/bin/python tools/gpu_hierarchical.py --world 4  # 4 GPUs: (2, 2), (1, 4), (4, 1)

Each layout is checked against ``dist.all_reduce`` (integer-valued data: bit for bit) and
timed with CUDA events (median of --iters after warm-up), one slice and pipelined, beside
NCCL's flat all_reduce on the same bytes. On one machine every link is NVLink: the layout
only pretends, so this measures the overhead of the stages and streams, not a gain.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from collectives import launch, ops, timing  # noqa: E402
from collectives.hierarchical import hierarchical_all_reduce, one_slice_all_reduce  # noqa: E402


def _rank(layouts, numel, iters):
    device = ops.rank_device()
    rows = []
    x = torch.randint(-8, 9, (numel,), device=device).float()
    timed = x.clone()
    nccl = timing.median(timing.measure(lambda: dist.all_reduce(timed), iters=iters, device=device))
    for layout in layouts:
        for name, fn in (("one slice", one_slice_all_reduce), ("pipelined", hierarchical_all_reduce)):
            y = x.clone()
            want = y.clone()
            dist.all_reduce(want)
            call = functools.partial(fn, layout=layout)
            call(y)
            exact = bool(torch.equal(y, want))
            t = timing.median(timing.measure(lambda: call(y), iters=iters, device=device))
            rows.append((layout, name, exact, t, nccl))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--size", default="256M")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    p = args.world
    layouts = [(1, p), (p, 1)] + ([(2, p // 2)] if p >= 4 and p % 2 == 0 else [])
    numel = timing.parse_size(args.size) // 4
    rows = launch.run(_rank, p, args=(layouts, numel, args.iters), backend="nccl", timeout=600)[0]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)} × {p}, {args.size} float32")
    for layout, name, exact, t, nccl in rows:
        print(f"layout {layout}  {name:10s} exact={exact}  {t * 1e3:8.2f} ms   NCCL {nccl * 1e3:8.2f} ms   "
              f"ratio to NCCL {nccl / t:.2f}")
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
