"""``.venv/bin/python -m collectives bench-symmetric``: lesson 12's all-reduces without messages.

On CPUs (the default, gloo): the shared-memory one-shot and two-shot
(:mod:`collectives.symmetric.shared`) against gloo's ``all_reduce`` and the course's ring
(lesson 4), and the two-shot of a tensor that lives in the segment from the start
(``two_shot_home``: each rank's home, no copy in; every other algorithm takes an ordinary
tensor), ``--world`` forked ranks, float32, sizes ``--sizes`` (4 KiB to 64 MiB), side by
side in one world. Every algorithm is first checked against ``dist.all_reduce`` bit for
bit on integer data at one size; then each size is timed: the median of :data:`BATCHES`
batches of runs issued back to back (up to ``--iters`` each, each batch the slowest rank's,
:func:`collectives.core.timing.measure_back_to_back`), one batch of every algorithm per
round, so that a change of the machine's load falls on all of them alike. The α–β model of
:mod:`collectives.symmetric.cost` is fitted to the same run -- σ, ρ, ω from the shared-memory
times at the smallest and largest sizes, α and β from the ring's -- and its crossovers are
put beside the measured ones.

On GPUs (``--backend nccl``, one process per GPU): the lesson's Triton one-shot and
two-shot, its plain-torch versions and torch's own ``symm_mem`` one-shot and two-shot
against NCCL's ``all_reduce`` (and NCCL's symmetric kernels where torch can register a
window), bf16 and fp32, 4 KiB to 1 GiB, under the course's rule for GPU comparisons
(:mod:`collectives.course.benchmarks.symmetric_gpu`; ``--launch eager|graph``, every
contender the same way; ``--inputs copied|resident``). Never NVLink multicast: the
variables that keep it off are set before anything initialises -- so NCCL's own best
algorithm on NVSwitch machines (NVLS) is off too, in every number this measures.

``--json PATH`` writes every time with device, versions, date, command and commit;
``--record NAME`` draws the chart of who wins where and writes the record the lesson page
reads (``docs/img/NAME.svg`` and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ...core import launch, timing
from ...symmetric.gpu import no_multicast

CPU_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
CPU_ALGOS = ("gloo", "ring", "one_shot", "two_shot", "two_shot_home")
BATCHES = 5         # each time: the median of 5 batches of runs issued back to back, in rounds
def iterations(nbytes: int, iters: int) -> int:
    """Runs per batch: ``iters`` up to 64 KiB, fewer above (each run is longer), at least 3."""
    if nbytes <= 64 << 10:
        return iters
    return max(3, iters // 5 if nbytes <= 1 << 20 else iters // 20)


def _check_in_rank(home) -> dict[str, bool]:
    """Each algorithm against ``dist.all_reduce`` on integer data, 1001 float32 elements
    (``home``: the workspace whose homes the two-shot at home reduces)."""
    from ...ring import ring_all_reduce
    from ...symmetric import one_shot_all_reduce, two_shot_all_reduce

    rank = dist.get_rank()
    base = torch.arange(1001, dtype=torch.float32) % 17 + rank
    expected = base.clone()
    dist.all_reduce(expected)
    out = {}
    for name, fn in (("ring", ring_all_reduce), ("one_shot", one_shot_all_reduce), ("two_shot", two_shot_all_reduce)):
        x = base.clone()
        fn(x)
        out[name] = bool(torch.equal(x, expected))
    x = home.home(1001)
    x.copy_(base)
    two_shot_all_reduce(x, workspace=home)
    out["two_shot_home"] = bool(torch.equal(x, expected))
    return out


def cpu_rank(sizes: list[int], iters: int) -> dict:
    """In each rank: check, then time every algorithm at every size (float32, in place)."""
    from ...ring import ring_all_reduce
    from ...symmetric import SharedWorkspace, one_shot_all_reduce, two_shot_all_reduce, workspace

    workspace(None, max(sizes))                   # made once: no message in any timed call
    home = SharedWorkspace(None, max(sizes), home=True)
    checked = _check_in_rank(home)
    algos = {"gloo": dist.all_reduce, "ring": ring_all_reduce,
             "one_shot": one_shot_all_reduce, "two_shot": two_shot_all_reduce,
             "two_shot_home": lambda t: two_shot_all_reduce(t, workspace=home)}
    times: dict[str, list[float]] = {name: [] for name in CPU_ALGOS}
    for nbytes in sizes:
        # zeros: summed in place run after run they stay zeros (random data would grow to inf
        # and through denormals, which are slow); an add takes as long on any normal values
        bufs = {name: torch.zeros(nbytes // 4) for name in CPU_ALGOS if name != "two_shot_home"}
        bufs["two_shot_home"] = home.home(nbytes // 4).zero_()     # the input lives in the segment
        batches: dict[str, list[float]] = {name: [] for name in CPU_ALGOS}
        for _ in range(BATCHES):                  # in rounds, one batch of each: a change of load falls on all
            for name in CPU_ALGOS:
                batches[name].append(timing.measure_back_to_back(
                    lambda: algos[name](bufs[name]), iters=iterations(nbytes, iters), device=torch.device("cpu")))
        for name in CPU_ALGOS:
            times[name].append(statistics.median(batches[name]))
    return {"times": times, "checked": checked}


def run_cpu(args) -> dict:
    sizes = timing.parse_sizes(args.sizes)
    world = launch.run(cpu_rank, args.world, args=(sizes, args.iters), timeout=args.timeout)
    result = world[0]
    return {"backend": "gloo", "world": args.world, "sizes": sizes, "runs": {"float32": result["times"]},
            "checked": result["checked"], "iters": args.iters}


def _meta(backend: str, argv: list[str]) -> dict:
    from ..site import claims
    command = " ".join([".venv/bin/python -m collectives bench-symmetric"] + argv)
    return claims.environment(backend=backend, command=command, commit=claims.commit())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives bench-symmetric",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: 4 on CPU, every GPU under NCCL)")
    parser.add_argument("--sizes", default=None, help=f"sizes in bytes (default {CPU_SIZES}; GPUs 4K..1G)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="GPUs only: dtypes to time")
    parser.add_argument("--iters", type=int, default=100, help="runs per batch up to 64 KiB (fewer above)")
    parser.add_argument("--launch", choices=("eager", "graph"), default="eager",
                        help="GPUs only: every contender issued from Python, or every one replayed from a CUDA graph")
    parser.add_argument("--inputs", choices=("copied", "resident"), default="copied",
                        help="GPUs only: time the copies into and out of symmetric memory, or give every "
                             "contender its input where it reads it")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", type=Path, default=None, help="write the times, with their meta, here")
    parser.add_argument("--record", default=None, help="draw docs/img/NAME.svg and write its record NAME.json")
    parser.add_argument("--img", type=Path, default=None, help="where --record writes (default docs/img)")
    args = parser.parse_args(argv)
    if args.backend == "nccl":
        no_multicast()
        from .symmetric_gpu import run_gpu
        result = run_gpu(args)
    else:
        args.world = args.world or 4
        args.sizes = args.sizes or CPU_SIZES
        result = run_cpu(args)
    result["meta"] = _meta(args.backend, argv)
    from . import symmetric_record
    symmetric_record.print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.record:
        print(f"wrote {symmetric_record.save_record(result, args.record, args.img)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
