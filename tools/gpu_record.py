"""Gather one run of the GPU lane (tools/gpu_suite.sh) into one record: DIR/lane.json.

    python3 tools/gpu_record.py DIR

The record names the machine as hardware (GPU model and count, how they are linked, from
``nvidia-smi topo -m``), the versions (torch, NCCL, driver), the date, the commit, and for
every step its command, exit status and seconds, with the JSON that step wrote (a benchmark's
rows, the tour's rows). ``docs/data/gpu/`` keeps these records; the benchmarks page reads them.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from pathlib import Path


def _links(topology: str) -> str:
    """"NV18" when every pair of GPUs is joined by 18 NVLinks, else what the matrix shows."""
    kinds = set()
    for line in topology.splitlines():
        if re.match(r"^GPU\d+\s", line):
            cells = line.split()[1:]
            kinds |= {c for c in cells if re.fullmatch(r"NV\d+|PIX|PXB|PHB|NODE|SYS", c)}
    return ", ".join(sorted(kinds)) or "unknown"


def gather(out: Path) -> dict:
    import torch

    steps_dir = out / "steps"
    topology = (steps_dir / "topology.txt").read_text() if (steps_dir / "topology.txt").exists() else ""
    n = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0) if n else "none"
    links = _links(topology)
    steps = []
    for line in (steps_dir / "status.tsv").read_text().splitlines() if (steps_dir / "status.tsv").exists() else []:
        step, rc, seconds, command = line.split("\t", 3)
        data = None
        for candidate in (steps_dir / f"{step}.json", steps_dir / step / "allreduce.json"):
            if candidate.is_file():
                try:
                    data = json.loads(candidate.read_text())
                except ValueError:
                    data = None
                break
        if data is None and (steps_dir / step).is_dir():
            found = {p.name: json.loads(p.read_text()) for p in sorted((steps_dir / step).glob("*.json"))}
            data = found or None
        tail = (steps_dir / f"{step}.txt").read_text(errors="replace").splitlines()[-15:] \
            if (steps_dir / f"{step}.txt").exists() else []
        steps.append(dict(step=step, exit=int(rc), seconds=int(seconds), command=command,
                          passed=int(rc) == 0, data=data, tail=tail))
    return dict(
        hardware=f"{n}× {name}" + (f", NVLink ({links})" if "NV" in links else f", {links}"),
        gpus=n, gpu=name, links=links, topology=topology,
        torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())) if n else None,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=os.environ.get("COLLECTIVES_COMMIT", "unknown"),
        command="tools/gpu_suite.sh " + str(out),
        multicast="off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1)",
        steps=steps)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "build/gpu")
    record = gather(out)
    (out / "lane.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"{record['hardware']}, torch {record['torch']}, NCCL {record['nccl']}, commit {record['commit']}")
    for s in record["steps"]:
        print(f"  {'PASS' if s['passed'] else 'FAIL'}  {s['step']:<22} {s['seconds']:>4} s   exit {s['exit']}")
    failed = [s["step"] for s in record["steps"] if not s["passed"]]
    print(f"{len(record['steps']) - len(failed)} of {len(record['steps'])} steps pass"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
