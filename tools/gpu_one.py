"""What one GPU can check: the GPU tests' workers in a world of one NCCL rank.

    .venv/bin/python tools/gpu_one.py [--out DIR]

The `gpu` tests need two GPUs (NCCL between them). On a machine with one, this runs the
same worker functions in a world of one rank: every code path that touches CUDA streams,
events, CUDA graphs and NCCL calls on device tensors runs for real, with p = 1 (an
all-reduce of one rank is its input, so a copy to the wrong place still shows). Prints one
line per worker and writes the results as JSON.
"""

import argparse
import datetime
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from collectives import launch  # noqa: E402

WORKERS = [  # (label, "tests.module:function", args)
    ("lesson 5: reducers wait for the producer (graphs)", "tests.test_05_fused:_gpu_producer_is_waited_for",
     ("collectives.fused",)),
    ("lesson 5: training loop, default zero_grad", "tests.test_05_fused:_gpu_training_loop", ()),
    ("lesson 7: hierarchical, layout (1, 1), 64 MiB", "tests.test_07_hierarchical:_gpu_checks", ((1, 1), 16 << 20)),
    ("lesson 8: every variant and mode on NCCL", "tests.test_08_sparse:_gpu_rank", ("collectives.sparse",)),
]


def _verdict(result) -> tuple[bool, str]:
    """Workers return a list of problems, or a dict of reports / None per check."""
    if isinstance(result, list) and result and all(isinstance(x, bool) for x in result):
        return all(result), "" if all(result) else f"checks per step: {result}"   # one flag per step
    if isinstance(result, list):
        return (not result), "; ".join(map(str, result))[:400]
    if isinstance(result, dict):
        bad = {}
        for key, value in result.items():
            ok = value is None or getattr(value, "ok", True) is True
            if not ok:
                bad[key] = value.summary() if hasattr(value, "summary") else str(value)
        return (not bad), "; ".join(f"{k}: {v}" for k, v in bad.items())[:400]
    return bool(result), repr(result)[:400]


def _run(target, args):
    import importlib
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)(*args)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                torch=torch.__version__, gpu=torch.cuda.get_device_name(0),
                nccl=".".join(map(str, torch.cuda.nccl.version())))
    print(meta, flush=True)
    rows = []
    for label, target, wargs in WORKERS:
        t0 = time.perf_counter()
        try:
            result = launch.run(_run, 1, args=(target, wargs), backend="nccl", timeout=240)[0]
            ok, detail = _verdict(result)
        except Exception:  # noqa: BLE001 - one worker's failure must not hide the next
            ok, detail = False, traceback.format_exc()[-1500:]
        rows.append(dict(worker=label, ok=ok, detail=detail, seconds=round(time.perf_counter() - t0, 1)))
        print(f"{'PASS' if ok else 'FAIL'}  {label}  ({rows[-1]['seconds']} s)" + (f"\n    {detail}" if detail else ""),
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu-one.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
