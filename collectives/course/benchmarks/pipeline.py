"""``.venv/bin/python -m collectives bench-pp``: lesson 14's schedules measured against the formulas
and against ``torch.distributed.pipelining``.

::

    .venv/bin/python -m collectives bench-pp                      # 4 local gloo ranks
    sudo .venv/bin/python -m collectives bench-pp --cluster       # 2 machines x 2 ranks, 1 Gbit/s
    .venv/bin/python -m collectives bench-pp --backend nccl       # every GPU of this host
    .venv/bin/python -m collectives bench-pp --quick              # tiny sizes: tries the script

One model of ``--layers`` equal layers (``--width`` square, tanh), cut into p stages (2p
chunks for the interleaved schedule), ``--m`` micro-batches of ``--rows`` rows. Every
schedule -- GPipe, 1F1B, interleaved 1F1B (v = 2), ZB-H1 -- runs on the course's runner and
on torch's own schedule of the same name with the same stages, in interleaved rounds (each
round runs every contender once, so a slow moment of the host hits them all alike). Each
rank's computing thread is pinned to a core of its own (``--no-pin`` leaves it): equal stages
should run at equal speeds. Each row: the median step time over the rounds and its spread
(min, max); the bubble, one definition for all (``collectives.pipeline.measure.bubble``: the ranks' idle
share between a step's first start and its last end, from the spans), on the course's runner
and on torch's schedule; beside it the bubble the simulator plays with that step's measured
costs -- each rank's own F, B and W, the message time and the gap between steps
(``measure.explain``) -- and the textbook formula's (equal stages, equal unit steps, free
messages); the micro-batches each rank held at most. The timed steps skip the schedule's
check (done once, in the warm-up). The last round's spans are the timeline figure's.

``--cluster`` runs :mod:`.pipeline_cluster` instead: the pipeline across the slow link against
data parallel across it.

On GPUs (``--backend nccl``) the timed rounds do not wait for the GPU between steps, as
torch's schedules do not; one more step of each schedule, waiting after every F, B and W,
gives the timeline and the bubble.

Writes ``docs/data/14-pipeline-<suite>.json`` (suite ``local``, ``nccl`` or ``cluster``: device,
versions, date, command, commit, host cores and load, rows) and, with ``--img``, the page's
figures and claims (:mod:`.pipeline_record`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ...core import launch, ops
from ...pipeline import cost as pcost
from ...pipeline import make_layers, make_pipeline, measure, schedule
from ...pipeline.torch_pp import TorchPipeline
from ..catalog import ROOT
from ..site import claims
from .pipeline_world import data, timed

DATA = ROOT / "docs" / "data"
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
V = 2            # chunks per rank of the interleaved schedule


def _zero(pipe) -> None:
    for stage in pipe.stages.values():
        for dw, db in stage.grads:
            dw.zero_()
            db.zero_()


def _pin(rank: int, p: int) -> list[int]:
    """Pin this rank's computing thread to a core of its own (one per physical core where
    the host says which CPUs share one), so that equal stages run at equal speed; the
    threads gloo started before stay free. Returns the CPUs, [] when there are too few."""
    allowed = sorted(os.sched_getaffinity(0))
    cores: dict[str, int] = {}
    for cpu in allowed:
        try:
            key = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            key = str(cpu)
        cores.setdefault(key, cpu)
    first = list(cores.values()) if len(cores) >= p else allowed
    if len(first) < p:
        return []
    os.sched_setaffinity(0, {first[rank]})
    return [first[rank]]


def _bench_in_rank(layers: int, width: int, rows: int, m: int, rounds: int, with_torch: bool,
                   pin: bool = True) -> dict:
    warnings.filterwarnings("ignore")
    rank, p = dist.get_rank(), dist.get_world_size()
    device = ops.rank_device()              # its GPU under NCCL
    cpus = _pin(rank, p) if pin and device.type == "cpu" else []
    weights = make_layers(layers, width, seed=0, device=device)
    xs, ts = data(m, rows, width, device)
    ours, theirs = {}, {}
    for name in SCHEDULES:
        C = p * (V if name == "interleaved" else 1)
        ours[name] = (make_pipeline(weights, C), schedule(name, p, m, V))
        if with_torch:
            theirs[name] = TorchPipeline(weights, name, C, m)
    batch, target = torch.cat(xs), torch.cat(ts)

    def run_ours(name, check=False):
        pipe, steps = ours[name]
        _zero(pipe)
        pipe.step(steps, xs, ts, check=check)

    contenders = [(f"ours:{n}", lambda n=n: run_ours(n)) for n in SCHEDULES]
    contenders += [(f"torch:{n}", lambda n=n: theirs[n].step(batch, target)) for n in theirs]
    for name in SCHEDULES:              # warm-up: each schedule checked once, shapes agreed, buffers made
        run_ours(name, check=True)
    for key, fn in contenders[len(SCHEDULES):]:
        fn()
    # on a GPU the timed rounds run as torch's do, without waiting for the GPU after every step;
    # one more round per schedule, waiting, gives the timeline and the bubble
    gpu = device.type == "cuda"
    for pipe, _ in ours.values():
        pipe.synchronize = False
    times = {key: [] for key, _ in contenders}
    traces = {key: [] for key, _ in contenders}     # per round, this rank's spans from the step's start

    def spans_of(key):
        if key.startswith("ours:"):
            return [(st.kind, st.mb, st.chunk, s, e) for st, s, e in ours[key[5:]][0].spans]
        return list(theirs[key[6:]].spans)

    for _ in range(rounds):
        for key, fn in contenders:
            start, end = timed(fn, device)
            times[key].append(end - start)
            if not gpu:
                traces[key].append([(k, i, c, s - start, e - start) for k, i, c, s, e in spans_of(key)])
    if gpu:
        for name in SCHEDULES:
            pipe = ours[name][0]
            pipe.synchronize = True
            start, end = timed(lambda n=name: run_ours(n), device)
            spans = spans_of(f"ours:{name}")
            traces[f"ours:{name}"].append([(k, i, c, s - start, e - start) for k, i, c, s, e in spans])
    return dict(times=times, traces=traces, cpus=cpus,
                peak={n: [st.peak_held for st in ours[n][0].stages.values()] for n in SCHEDULES},
                peak_bytes={n: sum(st.peak_bytes for st in ours[n][0].stages.values()) for n in SCHEDULES})


def _median(values):
    return statistics.median(values) if values else None


def summarise(per_rank: list[dict], p: int, m: int) -> list[dict]:
    """One row per schedule from every rank's measurements: step times, and per round the
    bubble read from the trace (``measure.bubble``) beside what the simulator plays with
    that round's measured costs (``measure.explain``), the medians over the rounds."""
    rows = []
    for name in SCHEDULES:
        v = V if name == "interleaved" else 1
        C = p * v
        sched = schedule(name, p, m, v)
        ours_t = per_rank[0]["times"][f"ours:{name}"]
        torch_t = per_rank[0]["times"].get(f"torch:{name}")
        rounds = [[r["traces"][f"ours:{name}"][k] for r in per_rank]
                  for k in range(len(per_rank[0]["traces"][f"ours:{name}"]))]
        parts = [measure.explain(sched, m, trace, C) for trace in rounds]
        torch_rounds = [[r["traces"][f"torch:{name}"][k] for r in per_rank]
                        for k in range(len(per_rank[0]["traces"].get(f"torch:{name}", [])))]
        torch_bubbles = [measure.bubble(trace) for trace in torch_rounds if all(trace)]
        last = rounds[-1]
        units = measure.unit_times(last, v)
        rows.append(dict(name=name, v=v, seconds=_median(ours_t), spread=[min(ours_t), max(ours_t)],
                         torch_seconds=_median(torch_t) if torch_t else None,
                         torch_spread=[min(torch_t), max(torch_t)] if torch_t else None,
                         bubble=_median([x["measured"] for x in parts]),
                         bubble_rounds=[x["measured"] for x in parts],
                         model=_median([x["model"] for x in parts]), model_rounds=[x["model"] for x in parts],
                         model_parts={k: _median([x[k] for x in parts]) for k in ("fill", "stages", "model")},
                         formula=pcost.bubble(name, p, m, v),
                         torch_bubble=_median(torch_bubbles),
                         unit_seconds=units, message_seconds=measure.message_time(last, C),
                         torch_unit_seconds=measure.unit_times(torch_rounds[-1], v) if torch_bubbles else None,
                         overhead_seconds=measure.overhead(last, C),
                         peak_held=[r["peak"][name] for r in per_rank],
                         peak_bytes=[r["peak_bytes"][name] for r in per_rank],
                         spans=last, torch_spans=torch_rounds[-1] if torch_rounds else None))
    return rows


def run_local(args) -> dict:
    p = torch.cuda.device_count() if args.backend == "nccl" else args.world
    per_rank = launch.run(_bench_in_rank, p, args=(args.layers, args.width, args.rows, args.m, args.rounds,
                                                   not args.no_torch, not args.no_pin), backend=args.backend,
                          timeout=1800, env={"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    return dict(world_size=p, backend=args.backend, layers=args.layers, width=args.width, rows=args.rows, m=args.m, v=V,
                rounds=args.rounds, cpus=[r["cpus"] for r in per_rank],
                rows_by_schedule=summarise(per_rank, p, args.m))


def write(suite: str, argv, result: dict, out: Path, img: Path | None) -> Path:
    from . import pipeline_record
    command = " ".join([".venv/bin/python -m collectives bench-pp", *argv]).strip()
    meta = claims.environment(backend=result.get("backend", "gloo"), command=command,
                              commit=claims.commit())
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"14-pipeline-{suite}.json"
    path.write_text(json.dumps({"bench": "bench-pp", "suite": suite, "meta": meta, **result}, indent=1) + "\n")
    if img is not None:
        pipeline_record.figures(suite, result, meta, img)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives bench-pp",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4, help="local ranks (gloo), one stage each")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="nccl: one rank per GPU of this host, the stages on the GPUs")
    parser.add_argument("--cluster", action="store_true", help="pipeline against data parallel across the "
                        "simulated cluster's slow link (needs root)")
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--ranks-per-machine", type=int, default=2)
    parser.add_argument("--link", default="1gbit", help="rate of each cross-machine link (tc syntax)")
    parser.add_argument("--layers", type=int, default=16, help="equal layers, cut into the stages")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64, help="rows of one micro-batch")
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median and spread)")
    parser.add_argument("--no-torch", action="store_true", help="leave out torch's schedules")
    parser.add_argument("--no-pin", action="store_true", help="leave each rank's thread where the OS puts it")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds: to try the script")
    parser.add_argument("--out", default=str(DATA), help="folder of the JSON record (default docs/data)")
    parser.add_argument("--img", default="", help="folder of the page's figures and claims (e.g. docs/img)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.rows, args.m, args.rounds = 8, 32, 4, 4, 2
    if args.cluster and args.backend != "gloo":
        parser.error("--cluster runs on gloo")
    if args.cluster:
        from . import pipeline_cluster
        result = pipeline_cluster.run(args)
        suite = "cluster"
    else:
        result = run_local(args)
        suite = "nccl" if args.backend == "nccl" else "local"
    path = write(suite, argv, result, Path(args.out), Path(args.img) if args.img else None)
    for row in result["rows_by_schedule"]:
        print(row_line(suite, row))
    print(f"wrote {path}")
    return 0


def row_line(suite: str, row: dict) -> str:
    if suite == "cluster":
        return (f"{row['label']:26s} step {claims.human(row['seconds']):>9s} (model {claims.human(row['model'])}), "
                f"across {row['bytes_across'] / 2**20:8.2f} MiB (model {row['model_bytes'] / 2**20:.2f} MiB)")
    torch_part = f", torch {claims.human(row['torch_seconds'])}" if row["torch_seconds"] else ""
    torch_bubble = f", torch's {row['torch_bubble']:.3f}" if row.get("torch_bubble") is not None else ""
    return (f"{row['name']:12s} step {claims.human(row['seconds']):>9s}{torch_part}; bubble {row['bubble']:.3f}"
            f"{torch_bubble} (measured costs {row['model']:.3f}, textbook {row['formula']:.3f}); "
            f"held {[max(h) for h in row['peak_held']]}; F per rank "
            f"{[round(u['F'] * 1e3, 2) for u in row['unit_seconds']]} ms, a message "
            f"{row['message_seconds'] * 1e6:.0f} µs")


def tour_runner(nbytes: int) -> dict:
    """The tour's row for lesson 14: one 1F1B step on the course's runner, its gradients checked
    against torch's ``Schedule1F1B`` on the same stages bit for bit and timed against it; bytes
    sent per rank from the trace against the design's (one activation forward and one gradient
    back per micro-batch, and the shape once). ``nbytes``: what a middle stage sends per step."""
    from ...core import timing, trace
    warnings.filterwarnings("ignore")
    r, p = dist.get_rank(), dist.get_world_size()
    m, width = 4, 64
    rows = max(1, nbytes // (2 * m * width * 4))
    weights = make_layers(p, width, seed=0)
    xs, ts = data(m, rows, width)
    pipe, steps = make_pipeline(weights, p), schedule("1f1b", p, m)
    theirs = TorchPipeline(weights, "1f1b", p, m)
    batch, target = torch.cat(xs), torch.cat(ts)
    with trace.recording() as t:
        pipe.step(steps, xs, ts)
    theirs.step(batch, target)
    same = all(torch.equal(a, b) for got, want in zip(pipe.stages[r].grads, theirs.grads()[r])
               for a, b in zip(got, want))
    sent = timing.max_over_ranks(t.bytes_sent())
    ours = timing.measure(lambda: pipe.step(steps, xs, ts, check=False), warmup=1, iters=3)
    ref = timing.measure(lambda: theirs.step(batch, target), warmup=1, iters=3)
    act = rows * width * 4
    theory = 0 if p == 1 else (m if p == 2 else 2 * m) * act + 8 * 4
    ok = bool(timing.max_over_ranks(0.0 if same else 1.0) == 0.0)
    return dict(verified=ok, detail="" if ok else "gradients differ from torch's Schedule1F1B",
                seconds=timing.median(ours), ref_seconds=timing.median(ref), nbytes=2 * m * act,
                bytes_sent=sent, bytes_theory=theory, baseline="torch Schedule1F1B")
