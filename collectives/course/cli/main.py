"""``.venv/bin/python -m collectives <command>``: the course's command line.

  tour         every lesson's algorithm on a local world, verified and timed (make tour)
  grade        score the exercises (make grade [LESSON=04])
  check        check one all-reduce against dist.all_reduce: check collectives.ring:ring_all_reduce
  bench        all-reduce algorithms against dist.all_reduce, nccl-tests style (make bench)
  bench-fused  the fused all-reducer against one flat all-reduce and per-tensor calls
  bench-ddp    the bucketed reducer against torch DDP
  bench-hier   lesson 7 on the simulated cluster: sizes, inflight, train, crossover, machines, host-cost (--quick)
  bench-sparse lesson 8: selection, sparse variants against dist.all_reduce, density sweep (--cluster)
  bench-sparse-train  lesson 8 in training: time to accuracy on the simulated cluster, against bf16 and PowerSGD
  bench-cluster  the two tiers of a simulated cluster fitted, the flat ring predicted and measured
  bench-recorder lesson 9: what the flight recorder costs per call, off and on (and torch's DETAIL)
  bench-sharded  lesson 10: step time and memory of ZeRO-1/2/3 against torch DDP and FSDP2 (--cluster, --backend nccl)
  bench-sharded-agreement  lesson 10: ZeRO-3 against fully_shard on a larger model, values and peak memory
  bench-alltoall lesson 11: all-to-alls against dist.all_to_all_single (local, cluster), the MoE layer (moe)
  bench-symmetric lesson 12: one-shot and two-shot without messages against gloo/NCCL (--backend nccl)
  bench-tp     lesson 13: sequence-parallel MLP, sequential against async TP, DTensor and fused ops (--backend nccl)
  bench-pp     lesson 14: pipeline schedules against their formulas and torch's pipelining (--cluster: against DP)
  diagnose     lesson 9: read every rank's flight recorder dump and name the culprit: diagnose DIR
  cluster      one torchrun per machine of a simulated cluster: cluster --machines 2 -- CMD...
  helpers      an exercise's helper sheet, written from the code: helpers --lesson 4
  claims       every hand-written number on the site held to its record (docs/data/hand-claims.json)
  trace        one traced run of an all-reduce as a Chrome trace (Perfetto): trace ring --out run.json
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "tour": "collectives.course.tour:main",
    "grade": "collectives.course.grading.grade:main",
    "check": "collectives.course.cli.main:check",
    "bench": "collectives.course.benchmarks.allreduce:main",
    "bench-fused": "collectives.course.benchmarks.fused:main",
    "bench-ddp": "collectives.course.benchmarks.bucketing:main",
    "bench-hier": "collectives.course.benchmarks.hierarchical:main",
    "bench-sparse": "collectives.course.benchmarks.sparse:main",
    "bench-sparse-train": "collectives.course.benchmarks.sparse_train:main",
    "bench-cluster": "collectives.course.benchmarks.cluster:main",
    "bench-recorder": "collectives.course.benchmarks.debugging:main",
    "bench-sharded": "collectives.course.benchmarks.sharded:main",
    "bench-sharded-agreement": "collectives.course.benchmarks.sharded_agreement:main",
    "bench-alltoall": "collectives.course.benchmarks.alltoall:main",
    "bench-symmetric": "collectives.course.benchmarks.symmetric:main",
    "bench-tp": "collectives.course.benchmarks.tp:main",
    "bench-pp": "collectives.course.benchmarks.pipeline:main",
    "diagnose": "collectives.course.cli.diagnose:main",
    "cluster": "collectives.course.cli.cluster:main",
    "trace": "collectives.course.cli.trace:main",
    "helpers": "collectives.course.grading.helpers:main",
    "claims": "collectives.course.site.numbers:main",
}


def check(argv: list[str]) -> int:
    import argparse

    from .. import verify
    from ..tour import TOUR

    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives check")
    parser.add_argument("target", help='"module:function" or "path/to/file.py:function"')
    parser.add_argument("--world", default="1,2,3,4", help="world sizes, comma-separated")
    args = parser.parse_args(argv)
    ok = True
    # the naive ring's ranks may end with different bits (documented): its tour entry says so
    identical = {e.target: e.identical_bits for e in TOUR}.get(args.target, True)
    for p in [int(x) for x in args.world.split(",")]:
        report = verify.check_in_world(args.target, p, identical_bits=identical)
        print(f"world size {p}: {report.summary()}")
        ok &= report.ok
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module, func = COMMANDS[argv[0]].split(":")
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)

