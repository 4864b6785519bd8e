"""Lesson 9 on GPUs: the flight recorder on NCCL -- what it records, and what it costs per call.

    .venv/bin/python tools/gpu_lesson09.py --out DIR             # every GPU of the machine (at least 2)
    .venv/bin/python tools/gpu_lesson09.py --out DIR --world 2

Writes into DIR, each record with the device, GPU count, torch and NCCL versions, date,
command and git commit:

* ``check.json`` -- a world of NCCL ranks with ``launch.run(..., flight_recorder=...)``: a DDP
  model trained 3 steps (its all-reduces are made by its C++ reducer), an all-reduce awaited
  through its future, a broadcast; each rank's dump must hold the Python calls completed,
  DDP's all-reduces merged from torch's own Flight Recorder, and the merged calls' durations
  taken from CUDA events (``"duration_source": "cuda events"``); the analyzer must find
  nothing. ``ok`` says whether every check held, ``problems`` what did not;
  It times nothing (``"compares": "nothing: ..."``);
* ``recorder.json`` and ``09-bench-recorder.json`` -- ``bench-recorder`` on NCCL under the rule
  for fair GPU comparisons (``docs/benchmarks.md``): NCCL called directly against the call a
  user of the recorder makes (the trace wrapper and the recorder listening), the wrapped call
  between them, every side eager, in interleaved blocks: median, quartiles and spread; each
  record names the rule (``launch``, ``inputs``) and what each side includes.

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from collectives import launch  # noqa: E402
from collectives.core import flight_recorder  # noqa: E402
from collectives.course.benchmarks import debugging as bench  # noqa: E402
from collectives.course.benchmarks import gpu_timing as rule  # noqa: E402
from collectives.course.site import claims  # noqa: E402
from collectives.debugging import diagnose, read_dumps  # noqa: E402


def _meta(world: int) -> dict:
    commit = claims.commit()
    return {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "world_size": world,
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join([".venv/bin/python", *sys.argv]), "commit": commit}


def _rank() -> list:
    device = torch.device("cuda", torch.cuda.current_device())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8).to(device), device_ids=[device])
    for _ in range(3):
        model(torch.ones(4, 64, device=device)).sum().backward()
    x = torch.ones(1 << 20, device=device)
    dist.all_reduce(x, async_op=True).get_future().wait()
    dist.broadcast(x, 0)
    torch.cuda.synchronize()
    return [(e["profiling_name"], e["state"]) for e in flight_recorder.active().entries()]


def check(world: int) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="collectives-gpu-lesson09-"))
    problems = []
    rings = launch.run(_rank, world, backend="nccl", flight_recorder=directory, timeout=300)
    found = read_dumps(directory)
    if found.notes:
        problems += found.notes
    for rank, ring in enumerate(rings):
        if [state for _, state in ring] != ["completed"] * len(ring) or len(ring) < 2:
            problems.append(f"rank {rank}: its ring holds {ring}, not the completed calls it made")
    for dump in found.dumps:
        theirs = [e for e in dump["entries"] if e.get("source") == "torch"]
        if sum("all_reduce" in e["profiling_name"] or "allreduce" in e["profiling_name"] for e in theirs) < 3:
            problems.append(f"rank {dump['rank']}: DDP's all-reduces are not all merged ({len(theirs)} from torch)")
        timed = [e for e in dump["entries"] if e.get("duration_source") == "cuda events"]
        if not timed:
            problems.append(f"rank {dump['rank']}: no call timed with CUDA events")
    findings = diagnose(found.dumps, found.world)
    problems += [f"finding on a healthy run: {f.text}" for f in findings]
    return {"ok": not problems, "problems": problems, "rings": rings,
            "dumps": {d["rank"]: [(e["profiling_name"], e["collective_seq_id"], e["state"], e.get("source"),
                                   e.get("duration_ms"), e.get("duration_source")) for e in d["entries"]]
                      for d in found.dumps}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the JSON records")
    parser.add_argument("--world", type=int, default=None, help="GPUs to use (default: all, at least 2)")
    parser.add_argument("--sizes", default="4,4K,1M,64M")
    args = parser.parse_args()
    world = args.world or torch.cuda.device_count()
    if world < 2 or torch.cuda.device_count() < world:
        print(f"needs at least 2 GPUs, found {torch.cuda.device_count()}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"meta": _meta(world), **rule.compares_nothing(), **check(world)}
    (out / "check.json").write_text(json.dumps(result, indent=1))
    print("check:", "ok" if result["ok"] else "; ".join(result["problems"]))
    code = bench.main(["--world", str(world), "--backend", "nccl", "--sizes", args.sizes, "--no-detail",
                       "--out", str(out), "--record", str(out)])
    record = json.loads((out / "recorder.json").read_text())
    record["meta"].update(_meta(world))
    (out / "recorder.json").write_text(json.dumps(record, indent=1))
    return 0 if result["ok"] and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
