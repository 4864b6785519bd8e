"""Lesson 12 on GPUs: check the all-reduces without messages against NCCL, then time them.

    .venv/bin/python tools/gpu_lesson12.py --out DIR             # every GPU of the machine
    .venv/bin/python tools/gpu_lesson12.py --out DIR --world 2   # 2 of them
    .venv/bin/python tools/gpu_lesson12.py --out DIR --quick     # the checks and 4 KiB .. 16 MiB
    .venv/bin/python tools/gpu_lesson12.py --out DIR --exercise  # and your Triton one-shot (task 4)

No torchrun: the script starts one process per GPU itself (:func:`collectives.core.launch.run`,
``backend="nccl"``). NVLink multicast stays off: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NCCL_NVLS_ENABLE=0`` and ``NVSHMEM_DISABLE_NVLS=1`` are set below before torch is imported,
and passed on to every rank; nothing calls a multicast (multimem) op.

Writes into DIR, every file with the device, GPU count, torch and NCCL versions, date,
command and git commit:

* ``12-gpu-checks.json``: the lesson's plain-torch and Triton one-shot and two-shot, and
  torch's ``symm_mem`` ops, each against ``dist.all_reduce`` (NCCL) bit for bit on
  integer-valued data, bf16 and fp32, sizes 1, 1001, 4099 and 1 Mi + 3;
* ``12-bench-gpu.json``: ``bench-symmetric --backend nccl``'s times, 4 KiB to 1 GiB, under the
  rule for fair GPU comparisons (``docs/benchmarks.md``): every contender launched the same way
  (``--launch eager``, the default, or ``graph``: then the record is ``12-bench-gpu-graph``),
  NCCL called untraced, the copies into and out of symmetric memory timed (``--inputs copied``,
  the default, or ``resident``);
* ``12-bench-gpu.svg`` and the record beside it (``12-bench-gpu.json`` in DIR/img): who
  wins where; copy it into docs/img for the lesson page.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.update({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"})
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from collectives import launch  # noqa: E402
from collectives.course.benchmarks import gpu_timing as rule  # noqa: E402
from collectives.course.benchmarks import symmetric as bench  # noqa: E402
from collectives.course.benchmarks.symmetric_gpu import check_rank  # noqa: E402
from collectives.course.site import claims  # noqa: E402
from collectives.symmetric.gpu import NO_MULTICAST, triton_available  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--world", type=int, default=None, help="GPUs to use (default: all)")
    parser.add_argument("--quick", action="store_true", help="sizes 4 KiB to 16 MiB only")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--launch", choices=("eager", "graph"), default="eager",
                        help="every contender issued from Python, or every one replayed from a CUDA graph")
    parser.add_argument("--inputs", choices=("copied", "resident"), default="copied",
                        help="time the copies into and out of symmetric memory, or start with inputs in place")
    parser.add_argument("--exercise", action="store_true",
                        help="also check lessons/12_symmetric/exercise.py's triton_one_shot (task 4)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("lesson 12 on GPUs needs at least 2 CUDA GPUs; nothing to do here")
        return 0
    world = args.world or torch.cuda.device_count()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = claims.environment(backend="nccl", commit=claims.commit(), gpus=world, triton=triton_available(),
                              multicast_off=dict(NO_MULTICAST))

    results = launch.run(check_rank, world, args=(args.dtypes.split(","), 1 << 22, args.exercise), backend="nccl",
                         timeout=600, env=dict(NO_MULTICAST))
    checks = {"meta": meta, **rule.compares_nothing(),      # checks only: the lane's record looks for no rule here
              "world": world, "checked": results[0]["checked"], "skipped": results[0]["skipped"],
              "every_rank_agrees": all(r["checked"] == results[0]["checked"] for r in results)}
    (args.out / "12-gpu-checks.json").write_text(json.dumps(checks, indent=1) + "\n")
    print(json.dumps(checks["checked"], indent=1))
    # the lesson's own kernels must pass every size; torch's ops may refuse some sizes (an error, not a wrong
    # value); the exercise's kernel is the student's to finish (a stub is reported, not failed)
    failed = [f"{d}: {name} ({ok})" for d, per in checks["checked"].items() for name, ok in per.items()
              if ok is not True and (not name.startswith(("symm_", "exercise_")) or ok is False)]

    sizes = "4K,16K,64K,256K,1M,4M,16M" if args.quick else "4K,16K,64K,256K,1M,4M,16M,64M,256M,1G"
    name = "12-bench-gpu" + ("-graph" if args.launch == "graph" else "") + ("-resident" if args.inputs == "resident"
                                                                             else "")
    bench.main(["--backend", "nccl", "--world", str(world), "--sizes", sizes, "--dtypes", args.dtypes,
                "--launch", args.launch, "--inputs", args.inputs,
                "--json", str(args.out / f"{name}.json"), "--record", name, "--img", str(args.out / "img")])
    if failed:
        print("FAILED against NCCL: " + ", ".join(failed))
        return 1
    print(f"every check passed; records in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
