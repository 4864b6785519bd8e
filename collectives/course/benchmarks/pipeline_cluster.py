"""``sudo .venv/bin/python -m collectives bench-pp --cluster``: the pipeline across a slow link
against data parallel across it, for the same model.

The simulated cluster (:class:`~collectives.core.cluster.Cluster`: one network namespace per
machine, links shaped with ``tc``, addresses from 198.18.0.0/15, removed afterwards) with
``--machines`` × ``--ranks-per-machine`` ranks, machine-major. Two ways to train one step of
the same ``--layers``-layer model on the same ``--m`` micro-batches:

* **pipeline** -- 1F1B over all ranks, one stage each: the only cut that crosses between
  machines carries one activation and one gradient per micro-batch;
* **data parallel** -- every rank holds the whole model, runs m/p of the micro-batches, then
  ``dist.all_reduce`` of the flat gradients: the whole gradient crosses.

Each row: the median step time over interleaved rounds and its spread, the bytes that left
every machine's link during the step (``/proc/net/dev`` of its namespace, read by its first
rank), and the cost model's prediction of both (:mod:`collectives.pipeline.cost`, the link's
α of 100 µs and its β from the ``tc`` rate; the compute per micro-batch measured in the run).
The two gradients are checked against each other first.
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from ...core import launch, netns
from ...core.cost import AlphaBeta
from ...pipeline import Stage, make_layers, make_pipeline, schedule
from ...pipeline import cost as pcost
from .pipeline_world import data, timed

ALPHA_ACROSS = 100e-6
LABELS = {"pp": "pipeline (1F1B)", "dp": "data parallel (dist.all_reduce)"}


def link_bytes() -> int:
    """Bytes this namespace's link to the other machines has sent (0 when there is none)."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == iface:
                return int(fields.split()[8])
    return 0


def _in_rank(layers: int, width: int, rows: int, m: int, rounds: int, rpm: int) -> dict:
    rank, p = dist.get_rank(), dist.get_world_size()
    weights = make_layers(layers, width, seed=0)
    xs, ts = data(m, rows, width)
    pipe, steps = make_pipeline(weights, p), schedule("1f1b", p, m)
    whole = Stage(weights)
    mine = list(range(rank, m, p))

    def zero(stage):
        for dw, db in stage.grads:
            dw.zero_()
            db.zero_()

    def pp():
        zero(pipe.stages[rank])
        pipe.step(steps, xs, ts)

    def dp():
        zero(whole)
        for i in mine:
            y = whole.forward(xs[i], i)
            whole.backward(whole.loss_grad(y, ts[i], m), i)
        flat = whole.flat_grads()
        dist.all_reduce(flat)
        at = 0
        for pair in whole.grads:
            for t in pair:
                t.copy_(flat[at:at + t.numel()].view_as(t))
                at += t.numel()

    pp()
    dp()
    per = layers // p
    mine_pp = torch.cat([t.reshape(-1) for pair in pipe.stages[rank].grads for t in pair])
    mine_dp = torch.cat([t.reshape(-1) for pair in whole.grads[rank * per:(rank + 1) * per] for t in pair])
    diff = float((mine_pp - mine_dp).abs().max())
    first_of_machine = rank % rpm == 0
    out = {"diff": diff, "seconds": {"pp": [], "dp": []}, "bytes": {"pp": [], "dp": []}}
    for _ in range(rounds):
        for name, fn in (("pp", pp), ("dp", dp)):
            dist.barrier()
            before = link_bytes() if first_of_machine else 0
            start, end = timed(fn)
            dist.barrier()
            sent = torch.tensor([link_bytes() - before if first_of_machine else 0], dtype=torch.float64)
            dist.all_reduce(sent)
            out["seconds"][name].append(end - start)
            out["bytes"][name].append(float(sent))
    spans = pipe.spans
    out["per_microbatch"] = statistics.median(e - s for st, s, e in spans if st.kind == "F") + \
        statistics.median(e - s for st, s, e in spans if st.kind == "B")
    return out


def run(args) -> dict:
    from ...core.cluster import Cluster
    machines, rpm = args.machines, args.ranks_per_machine
    p = machines * rpm
    if args.layers % p or args.m % p:
        raise SystemExit(f"--layers ({args.layers}) and --m ({args.m}) must be multiples of the {p} ranks")
    with Cluster(machines, rpm, link=args.link) as made:
        per_rank = launch.run(_in_rank, p, args=(args.layers, args.width, args.rows, args.m, args.rounds, rpm),
                              cluster=made, timeout=1800)
    across = AlphaBeta(ALPHA_ACROSS, 1 / netns.rate_bytes_per_second(args.link))
    act = 4 * args.rows * args.width
    grad = 4 * args.layers * (args.width * args.width + args.width)
    t = statistics.median(r["per_microbatch"] for r in per_rank)
    model = {"pp": pcost.pp_step_seconds(p, args.m, t, act, across, pcost.bubble_gpipe(p, args.m)),
             "dp": pcost.dp_step_seconds(p, args.m, t, grad, across)}
    model_bytes = {"pp": pcost.pp_bytes_across(args.m, act, cuts=machines - 1),
                   "dp": pcost.dp_bytes_across(grad, p, machines)}
    rows = []
    for name in ("pp", "dp"):
        secs = per_rank[0]["seconds"][name]
        rows.append(dict(name=name, label=LABELS[name], seconds=statistics.median(secs),
                         spread=[min(secs), max(secs)], bytes_across=statistics.median(per_rank[0]["bytes"][name]),
                         model=model[name], model_bytes=model_bytes[name]))
    return dict(world_size=p, layers=args.layers, width=args.width, rows=args.rows, m=args.m, rounds=args.rounds,
                cluster=dict(machines=machines, ranks_per_machine=rpm, link=args.link, alpha_across=ALPHA_ACROSS),
                activation_bytes=act, gradient_bytes=grad, per_microbatch_seconds=t,
                max_grad_diff=max(r["diff"] for r in per_rank), rows_by_schedule=rows)
