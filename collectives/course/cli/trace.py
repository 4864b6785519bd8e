"""``.venv/bin/python -m collectives trace ALGO``: one traced run of an all-reduce, as a Chrome trace.

::

    .venv/bin/python -m collectives trace ring --world 4 --size 1M --out run.json
    .venv/bin/python -m collectives trace ring --impl exercise --out mine.json   # your lessons/04_ring/exercise.py
    .venv/bin/python -m collectives trace --list                                  # every name
    sudo .venv/bin/python -m collectives trace hierarchical --machines 2 --link 1gbit --out hier.json

Every all-reduce of the course's tour (:data:`collectives.course.tour.TOUR`) is here, named
by its tour name in lower case with dashes ("naive-ring", "pipelined-ring",
"sparse-top-k-1-split"); any unambiguous start of a name works ("multi", "hier"). The
world runs the algorithm once untraced (buffers, groups), then once traced, and
:func:`collectives.core.trace_export.chrome_trace` writes what it recorded: open the file
in ui.perfetto.dev or chrome://tracing. ``--machines M`` places the ranks on M simulated
machines joined by a shaped link (:mod:`collectives.core.cluster`; needs root).
``--impl exercise`` runs the function of the same name from the lesson's
``lessons/NN_topic/exercise.py``; a stub says "not written yet".

The site's trace players come from here too (:mod:`collectives.course.site.trace_player`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ...core import launch, timing, trace, trace_export
from ...core.ops import rank_device
from ..impl import resolve, spec_for
from ..site.trace_player import record_all, sparse_call
from ..tour import TOUR, TourEntry


def slug(name: str) -> str:
    """A tour name as a command-line name: "sparse top-k 1% (split)" -> "sparse-top-k-1-split"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def algorithms() -> dict[str, TourEntry]:
    """Every tour entry by its command-line name, in lesson order."""
    return {slug(e.name): e for e in sorted(TOUR, key=lambda e: e.lesson)}


def find(name: str) -> TourEntry:
    """The entry named ``name``, or the one whose name starts with it; a clear error otherwise."""
    table = algorithms()
    wanted = slug(name.replace("_", "-"))
    if wanted in table:
        return table[wanted]
    starts = [key for key in table if key.startswith(wanted)]
    if len(starts) == 1:
        return table[starts[0]]
    known = ", ".join(table)
    if starts:
        raise SystemExit(f"trace: {name!r} could be {', '.join(starts)}; say which")
    raise SystemExit(f"trace: no all-reduce named {name!r}; known: {known}")


def target_for(entry: TourEntry, impl: str) -> str:
    """``"module:function"`` of the entry: the course's, or the exercise file's function of that name."""
    if impl == "reference":
        return entry.target
    if impl != "exercise":
        raise SystemExit(f"trace: --impl must be 'reference' or 'exercise', got {impl!r}")
    return f"{spec_for(entry.lesson, 'exercise')}:{entry.target.rsplit(':', 1)[1]}"


def _sparse_mode(entry: TourEntry, x: torch.Tensor) -> tuple[str, dict]:
    """From a tour name like "sparse top-k 1% (split)": the transport and the selection."""
    transport = "split" if "(split)" in entry.name else "allgather"
    percent = float(re.search(r"([\d.]+)%", entry.name).group(1)) / 100
    if "threshold" in entry.name:
        return transport, {"threshold": float(torch.quantile(x[: 1 << 20].abs(), 1 - percent))}
    return transport, {"density": percent}


def _runner(entry: TourEntry, fn, numel: int, layout) -> tuple:
    """A closure running the entry once on this rank's data, and the tensor it reduces."""
    rank, device = dist.get_rank(), rank_device()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(device)
    name = entry.target.rsplit(":", 1)[1]
    if name == "exchange":                     # lesson 1: one ring step, to the right, from the left
        p = dist.get_world_size()
        landing = torch.empty_like(x)
        return (lambda: fn(x, landing, (rank + 1) % p, (rank - 1) % p)), x
    if name == "fused_all_reduce":             # many tensors, one call: 64 slices of x
        return (lambda: fn(list(x.chunk(64)))), x
    if name == "hierarchical_all_reduce":
        return (lambda: fn(x, layout=layout)), x
    if name == "sparse_all_reduce":
        transport, mode = _sparse_mode(entry, x)
        residual = torch.zeros_like(x)
        return (lambda: sparse_call(fn, x, residual, transport, **mode)), x
    if name == "BucketedReducer":              # one training step of an MLP of about numel floats
        from collectives.bucketing.models import make_model
        width = max(8, int((numel / 4) ** 0.5))
        torch.manual_seed(0)
        model = make_model("mlp", width=width, depth=4).to(device)
        wrapped = fn(model, bucket_cap_mb=1.0, first_bucket_cap_mb=1.0)
        batch = model.batch(16, seed=1000 + rank, device=device)

        def step():
            model.zero_grad(set_to_none=True)
            model.loss(wrapped(batch[0]), batch[1]).backward()
        return step, x
    return (lambda: fn(x)), x


def _trace_rank(entry: TourEntry, target: str, numel: int, layout) -> dict:
    """On every rank: one untraced run, one traced; this rank's events (or why it could not run)."""
    try:
        fn = resolve(target)
        run, _ = _runner(entry, fn, numel, layout)
        with trace.paused():
            run()                                # buffers, groups and caches made once, untraced
        dist.barrier()
        with trace.recording() as t:
            run()
    except NotImplementedError as exc:
        return {"not_written": str(exc) or target}
    except AttributeError as exc:
        return {"missing": str(exc)}
    return {"events": t.to_dicts()}


def record(name: str, world: int = 4, nbytes: int = 1 << 20, *, impl: str = "reference",
           machines: int | None = None, link: str = "1gbit", backend: str = "gloo", command: str = "") -> dict:
    """Run the all-reduce ``name`` once, traced, on ``world`` ranks; its Chrome trace document."""
    entry = find(name)
    target = target_for(entry, impl)
    if machines:
        layout = (world // machines, machines)
    else:
        layout = (world // 2, 2) if world % 2 == 0 else (world, 1)
    numel = max(nbytes // 4, 1)
    kwargs = dict(machines=machines, link=link) if machines else {}
    results = launch.run(_trace_rank, world, args=(entry, target, numel, layout), timeout=300,
                         backend=backend, **kwargs)
    first = results[0]
    if "not_written" in first:
        raise SystemExit(f"trace: {target} is not written yet ({first['not_written']})")
    if "missing" in first:
        raise SystemExit(f"trace: {first['missing']}")
    traces = [trace.Trace.from_dicts(rank, r["events"]) for rank, r in enumerate(results)]
    meta = dict(algorithm=entry.name, target=target, world_size=world, bytes=numel * 4, dtype="float32",
                layout=f"{layout[0]} x {layout[1]}" if "hierarchical" in entry.target else "",
                machines=machines or "", link=link if machines else "", torch=torch.__version__,
                device=torch.cuda.get_device_name(0) if backend == "nccl" else platform.processor() or "cpu",
                host=platform.node(), cpus=os.cpu_count(), backend=backend,
                nccl=".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else "",
                date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                command=command or f".venv/bin/python -m collectives trace {slug(entry.name)} --world {world}")
    return trace_export.chrome_trace(traces, metadata=meta)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives trace", description=__doc__.splitlines()[0])
    parser.add_argument("algo", nargs="?", help="an all-reduce of the course (--list names them)")
    parser.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--size", default="1M", help="bytes reduced, e.g. 64K, 1M (default 1M)")
    parser.add_argument("--machines", type=int, default=None,
                        help="simulated machines joined by a shaped link (needs root); default: one host")
    parser.add_argument("--link", default="1gbit", help="the link's rate with --machines (tc syntax, default 1gbit)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: nccl when there is a GPU per rank, else gloo")
    parser.add_argument("--impl", choices=("reference", "exercise"), default="reference",
                        help="the course's function (default) or your lessons/NN_*/exercise.py's")
    parser.add_argument("--out", default="trace.json", help="the Chrome trace to write (default trace.json)")
    parser.add_argument("--list", action="store_true", help="list the algorithms and exit")
    parser.add_argument("--players", metavar="DIR", help="record the site's trace players into DIR")
    args = parser.parse_args(argv)
    if args.list:
        for key, entry in algorithms().items():
            print(f"{key:34s} lesson {entry.lesson}: {entry.target}")
        return 0
    if args.players:
        names = record_all(Path(args.players))
        print(f"recorded {len(names)} players into {args.players}: {', '.join(names)}")
        return 0
    if not args.algo:
        parser.error("name an algorithm (--list names them)")
    if args.world < 1 or (args.machines and args.world % args.machines):
        parser.error(f"--world {args.world} does not split over --machines {args.machines}")
    command = ".venv/bin/python -m collectives trace " + " ".join(sys.argv[2:] if argv is None else argv)
    doc = record(args.algo, args.world, timing.parse_size(args.size), impl=args.impl, machines=args.machines,
                 link=args.link, backend=args.backend or launch.auto_backend(args.world), command=command)
    problems = trace_export.validate(doc)
    if problems:       # a bug here, not in the run: say so rather than write a file Perfetto rejects
        raise SystemExit("trace: the document does not validate:\n  " + "\n  ".join(problems[:10]))
    trace_export.write(args.out, doc)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    flows = sum(1 for e in doc["traceEvents"] if e["ph"] == "s")
    sent = sum(e["args"]["bytes"] for e in xs if e["args"]["Collective name"] == "send")
    collectives = sum(1 for e in xs if e["cat"] == "collective")
    print(f"wrote {args.out}: {len(xs)} calls on {args.world} ranks -- {flows} messages "
          f"({timing.human_bytes(sent)}), {collectives} collective calls; "
          "open it in ui.perfetto.dev or chrome://tracing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
