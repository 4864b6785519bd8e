"""``.venv/bin/python -m collectives bench-sparse-train``: time to accuracy on the simulated cluster.

Lesson 8's question asked of training itself: does sending 1 % of the gradient get a model
to a given accuracy sooner than sending all of it -- and sooner than what torch users pick
today (the bf16 compression hook, PowerSGD)? On 2 simulated machines × 2 ranks joined by one
shaped link (:mod:`collectives.core.cluster`; needs root), at 1 Gbit/s and at 10 Gbit/s:

1. **Convergence**: every run of :mod:`collectives.sparse.lab` (dense fp32, bf16, PowerSGD
   rank 1 and 4, top-k 1 % with and without error feedback, top-k with DGC's corrections),
   for ``--seeds`` seeds, on the lab's MLP and on the wide MLP (3.3 MB of gradients), with
   SGD-momentum; dense, top-k and DGC with Adam too. Test accuracy a few times an epoch;
   the final accuracy is the last of ``--epochs`` epochs' evaluations.
2. **The target**: dense's final accuracy (mean over seeds) less one point, per model and
   optimizer. **Time to accuracy** is the training time (evaluations not counted) until the
   first evaluation at or above it, per seed; its mean and spread over the seeds. A run
   that has not reached it when the epochs are over goes on, up to twice as many: the time
   to an accuracy is not bounded by dense's schedule. On the second link the same runs stop
   at the target (their accuracy is the first link's, bit for bit: the arithmetic does not
   depend on the link).
3. **Overlap**: the wide model's step with the plain hook, with the asynchronous one, and
   without communication: the share of the communication the asynchronous hook hides.

Written: a JSON record (command, device, versions, date, every curve, the summary and the
winner per link), the figures, and a Markdown snippet of the tables for the lesson's page
(``--publish`` puts them where the site reads them). ``--quick``: one seed, two epochs --
to see it run, not to measure.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ...core import launch, netns
from ...sparse import lab
from ..catalog import ROOT
from ..site.claims import commit, host
from .sparse_record import HEADLINE, headline, plot_convergence, plot_time_to_accuracy


# --publish: the figures as SVG with their records (:mod:`.sparse_record`), where the page reads them
def published(plan: str = "mlps") -> dict:
    """Where ``--publish`` writes a plan's record, figures and tables (the MLPs' unsuffixed)."""
    suffix = "" if plan == "mlps" else f"-{plan}"
    return dict(json=ROOT / "docs" / "data" / f"08-sparse-train{suffix}.json", records=ROOT / "docs" / "img",
                snippet=ROOT / "docs" / "snippets" / f"sparse-train{suffix}.md")


SETTINGS = dict(epochs=12, batch=32, density=0.01, warmup_epochs=1.0, evals_per_epoch=4, bucket_cap_mb=1.0,
                hook_thread=True)
RANKS = 4
# Intra-op threads per rank (``--threads``): one by default. The processor's share matters
# to the answer -- selection is processor work the other hooks do not have -- so the record
# says which share it ran with. The published records use one: with more, the ranks'
# arithmetic competes with gloo's own threads, which move the bytes.
THREADS = 1
LR = {"sgd": 0.05, "adam": 1e-3}
# (model, optimizer, runs, the link it trains to the end on): on that link every run goes the
# whole way (its final accuracy, the target from dense's); on a later link it stops at the
# target. The first is the one the winner is named for.
PLAN = (("wide", "sgd", lab.RUNS, 0), ("mlp", "sgd", lab.RUNS, 0), ("wide", "adam", ("dense", "topk_ef", "dgc"), 1))
# ``--plan``: the MLPs (above) or the convolutional network, each a record of its own (the
# first entry's model and optimizer is the one its winner is named for)
PLANS = {"mlps": PLAN, "cnn": (("cnn", "sgd", lab.RUNS, 0),)}


def machine() -> str:
    """The CPU, as the machine names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


# ---- in the world -------------------------------------------------------------------------------

def _train_plan(plan: list[dict], common: dict) -> list[dict]:
    """On every rank: each configuration in turn. ``target="dense"`` is a target to be read
    from this plan's own dense runs of the same model and optimizer, which come first (every
    rank computes it from its own results: the replicas agree)."""
    out = []
    for config in plan:
        if config.get("target") == "dense":
            config = dict(config, target=targets_from(out)[f"{config['model']}/{config['optimizer']}"])
        out.append(lab.train(**{**common, **config}))
    return out


def _step(ddp, opt, x, y) -> float:
    """Seconds of one training step (forward, backward with its communication, optimizer)."""
    import torch.nn.functional as F
    t0 = time.perf_counter()
    opt.zero_grad()
    F.cross_entropy(ddp(x), y).backward()
    opt.step()
    return time.perf_counter() - t0


def measure_overlap(steps: int = 30, batch: int = 32, seed: int = 0) -> dict:
    """On every rank: the wide model's step with the plain and the asynchronous hook, and the
    asynchronous one on a thread of its own (:func:`~collectives.sparse.on_a_thread`), at
    density 1 % and with everything kept (all communication, no selection), and the step
    without any communication (``no_sync``). ``hidden``: the share of the plain hook's time
    (its communication and its selection) the asynchronous one takes off the step;
    ``hidden_thread``: the same on a thread.

    The four models take their steps in turn -- plain, asynchronous, thread, none, ... each
    after a barrier -- so that whatever else the host does in a while weighs on all four
    alike; each one's time is the median of its ``steps`` steps (after two of warm-up)."""
    from torch.nn.parallel import DistributedDataParallel

    from ...sparse import SparseHookState, on_a_thread, register_sparse_hook, sparse_hook, sparse_hook_async
    x_train, y_train, _, _ = lab.load_digits_split(seed)
    rank, p = dist.get_rank(), dist.get_world_size()
    x, y = x_train[rank::p][:batch], y_train[rank::p][:batch]

    def model(hook=None, density=None):
        torch.manual_seed(seed)
        ddp = DistributedDataParallel(lab.WideMLP(), bucket_cap_mb=SETTINGS["bucket_cap_mb"])
        if hook is not None:
            register_sparse_hook(ddp, SparseHookState(density=density), hook)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01)

    out = {}
    for density in (0.01, 1.0):
        runs = {"plain": model(sparse_hook, density), "async": model(sparse_hook_async, density),
                "thread": model(on_a_thread(sparse_hook_async), density), "no_communication": model()}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(steps + 2):
            for name, (ddp, opt) in runs.items():
                dist.barrier()
                with ddp.no_sync() if name == "no_communication" else contextlib.nullcontext():
                    times[name].append(_step(ddp, opt, x, y))
        row = {name: statistics.median(ts[2:]) for name, ts in times.items()}
        communication = row["plain"] - row["no_communication"]
        row["hidden"] = (row["plain"] - row["async"]) / communication if communication > 0 else None
        row["hidden_thread"] = (row["plain"] - row["thread"]) / communication if communication > 0 else None
        out[f"density {density:g}"] = row
    return out


# ---- the summary ---------------------------------------------------------------------------------

def time_to(curve: list, target: float) -> float | None:
    """Training seconds at the first evaluation at or above ``target`` (None: never)."""
    for _, seconds, accuracy in curve:
        if accuracy >= target:
            return seconds
    return None


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def targets_from(runs: list[dict]) -> dict[str, float]:
    """``"model/optimizer"`` -> dense's final accuracy, mean over seeds, less one point."""
    out = {}
    for model, optimizer in dict.fromkeys((r["model"], r["optimizer"]) for r in runs):
        finals = [r["final"] for r in runs if (r["model"], r["optimizer"], r["run"]) == (model, optimizer, "dense")
                  and r["final"] is not None]
        if finals:
            out[f"{model}/{optimizer}"] = statistics.fmean(finals) - 0.01
    return out


def summarize(runs: list[dict], targets: dict[str, float]) -> dict:
    """Per ``model/optimizer`` and run: final accuracy (mean, std), time to the target (mean,
    std over the seeds that reach it; how many do), bytes per step, and × dense's time."""
    groups: dict[str, dict[str, list[dict]]] = {}
    for r in runs:
        groups.setdefault(f"{r['model']}/{r['optimizer']}", {}).setdefault(r["run"], []).append(r)
    out = {}
    for key, by_run in groups.items():
        target = targets.get(key)
        rows = {}
        for run, seeds in by_run.items():
            # a final accuracy only from runs trained to the end (a later link's runs stop at
            # the target; one that needed more than the epochs to get there has a final too,
            # which would stand for all the seeds)
            finals = [r["final"] for r in seeds if r["final"] is not None and r.get("complete", True)]
            times = [time_to(r["curve"], target) for r in seeds] if target is not None else []
            reached = [t for t in times if t is not None]
            row = dict(seeds=len(seeds), reached=len(reached), bytes_per_step=seeds[0]["bytes_per_step"],
                       seconds_per_step=statistics.fmean(r["seconds"] / max(r["steps"], 1) for r in seeds))
            if finals:
                row["final_mean"], row["final_std"] = _mean_std(finals)
            if reached:
                row["time_mean"], row["time_std"] = _mean_std(reached)
            rows[run] = row
        dense = rows.get("dense", {}).get("time_mean")
        for row in rows.values():
            if dense and "time_mean" in row and row["reached"] == row["seeds"]:
                row["vs_dense"] = row["time_mean"] / dense
        out[key] = dict(target=target, runs=rows)
    return out


def refresh(record: dict) -> dict:
    """``record``'s summaries and winners computed again from its runs (``--render``: a record
    written by an older summary gets today's)."""
    for link, measured in record["links"].items():
        record["summary"][link] = summarize(measured["runs"], record["targets"])
        record["winner"][link] = winner(record["summary"][link], headline(record))
    return record


def winner(summary: dict, key: str = "/".join(HEADLINE)) -> dict:
    """The fastest run to the target (every seed reaching it), the best sparse run, and how
    the best sparse run compares with dense and with bf16: the performance question."""
    rows = summary.get(key, {}).get("runs", {})
    timed = {run: r["time_mean"] for run, r in rows.items() if "time_mean" in r and r["reached"] == r["seeds"]}
    if not timed:
        return dict(fastest=None)
    fastest = min(timed, key=timed.get)
    sparse = {run: t for run, t in timed.items() if run in lab.SPARSE_RUNS}
    out = dict(fastest=fastest, fastest_vs_dense=timed[fastest] / timed["dense"] if "dense" in timed else None)
    if sparse:
        best = min(sparse, key=sparse.get)
        out.update(best_sparse=best, best_sparse_vs_dense=sparse[best] / timed["dense"] if "dense" in timed else None,
                   best_sparse_vs_bf16=sparse[best] / timed["bf16"] if "bf16" in timed else None)
    return out


# ---- figures and the page's tables --------------------------------------------------------------

def _seconds(mean, std) -> str:
    return f"{mean:.2f} ± {std:.2f} s"


def snippet(record: dict, figures: dict[str, str] | None = None) -> str:
    """The page's tables, written from the record: every number here is the JSON's."""
    s = record["settings"]
    where = "4 ranks on loopback" if list(record["links"]) == ["loopback"] else "2 simulated machines × 2 ranks"
    lines = [f"`{record['command']}` on {record['device']}, torch {record['torch']}, {record['date']}: "
             f"{where}" + (f" ({s['threads_per_rank']} thread{'s' * (s['threads_per_rank'] > 1)} each)"
                           if s.get("threads_per_rank") else "")
             + f", {s['seeds']} seeds, {s['epochs']} epochs of {s['batch']} "
             "examples per rank per step, density 1 %"
             + ("; the sparse hooks select on a thread of their own, torch's hooks run as torch ships them"
                if s.get("hook_thread") else "") + ".", ""]
    finals = {}                              # model/optimizer -> run -> row with the final accuracy
    for summary in record["summary"].values():
        for key, v in summary.items():
            for run, row in v["runs"].items():
                if "final_mean" in row:
                    finals.setdefault(key, {})[run] = row
    lines += ["**Final test accuracy** (mean ± std over the seeds; the last epoch's evaluations):", "",
              "| run | " + " | ".join(k.replace("/", ", ") for k in finals) + " |", "|---|" + "---|" * len(finals)]
    for run in dict.fromkeys(run for rows in finals.values() for run in rows):
        cells = [f"{rows[run]['final_mean']:.3f} ± {rows[run]['final_std']:.3f}" if run in rows else "--"
                 for rows in finals.values()]
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    head = headline(record)
    for link, summary in record["summary"].items():
        for key, v in summary.items():
            if v["target"] is None or not (key == head or key.endswith("/adam")):
                continue
            lines += ["", f"**Time to {v['target']:.3f} test accuracy at {link}** ({key.replace('/', ', ')}; "
                      "training seconds, mean ± std of the seeds that reach it):", "",
                      "| run | time to accuracy | reached | × dense | seconds per step | bytes per step per rank |",
                      "|---|---|---|---|---|---|"]
            for run, row in v["runs"].items():
                t = _seconds(row["time_mean"], row["time_std"]) if "time_mean" in row else "never"
                ratio = f"{row['vs_dense']:.2f}" if "vs_dense" in row else "--"
                lines.append(f"| {run} | {t} | {row['reached']} of {row['seeds']} | {ratio} | "
                             f"{row['seconds_per_step'] * 1e3:.1f} ms | {row['bytes_per_step'] / 1e3:,.1f} kB |")
            w = winner(summary, key)
            if w.get("fastest"):
                text = f"Fastest to the target at {link} ({key.replace('/', ', ')}): **{w['fastest']}**"
                if w.get("best_sparse") and w.get("best_sparse_vs_dense") is not None:
                    text += (f"; the best sparse run, {w['best_sparse']}, takes "
                             f"{w['best_sparse_vs_dense']:.2f}× dense's time")
                    if w.get("best_sparse_vs_bf16") is not None:
                        text += f" and {w['best_sparse_vs_bf16']:.2f}× bf16's"
                lines += ["", text + "."]
    if record.get("overlap"):
        lines += ["", "**Overlap** (wide model, 1 step, median; the asynchronous hook, and the same on a "
                  "thread of its own, against the plain one):", "",
                  "| | plain hook | asynchronous hook | on a thread | no communication | hidden | "
                  "hidden on a thread |", "|---|---|---|---|---|---|---|"]
        for name, row in record["overlap"].items():
            hidden = ["--" if row.get(key) is None else f"{row[key]:.0%}" for key in ("hidden", "hidden_thread")]
            thread = f"{row['thread'] * 1e3:.1f} ms" if "thread" in row else "--"
            lines.append(f"| {name} | {row['plain'] * 1e3:.1f} ms | {row['async'] * 1e3:.1f} ms | {thread} | "
                         f"{row['no_communication'] * 1e3:.1f} ms | {hidden[0]} | {hidden[1]} |")
    for alt, path in (figures or {}).items():
        lines += ["", f"![{alt}]({path})"]
    return "\n".join(lines) + "\n"


# ---- the command ------------------------------------------------------------------------------------

def _configs(quick: bool, seeds: int, plan_name: str = "mlps") -> list[dict]:
    plan = PLANS[plan_name][:1] if quick else PLANS[plan_name]
    return [dict(model=model, optimizer=opt, run=run, seed=seed, lr=LR[opt], full_on=full_on)
            for model, opt, runs, full_on in plan for run in runs for seed in range(seeds)]


def _world(configs: list[dict], common: dict, overlap: bool) -> dict:
    results = _train_plan(configs, common)
    return dict(runs=results, overlap=measure_overlap() if overlap else None)


def run_link(link: str | None, configs: list[dict], common: dict, overlap: bool, timeout: float,
             threads: int = THREADS) -> dict:
    """One world on ``link`` (None: loopback, no cluster): every configuration; rank 0's results."""
    kwargs = dict(timeout=timeout, threads=threads)
    if link is not None:
        kwargs.update(machines=2, link=link)
    return launch.run(_world, RANKS, args=(configs, common, overlap), **kwargs)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives bench-sparse-train",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="1gbit,10gbit", help="the cluster's link rates, first one full runs")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=SETTINGS["epochs"])
    parser.add_argument("--plan", choices=sorted(PLANS), default="mlps",
                        help="the lab's MLP and the wide MLP (default), or the convolutional network")
    parser.add_argument("--threads", type=int, default=THREADS,
                        help="intra-op threads per rank (default %(default)s): the processor's share")
    parser.add_argument("--quick", action="store_true",
                        help="the plan's first model and optimizer only, one seed, two epochs: to see it run")
    parser.add_argument("--loopback", action="store_true", help="no cluster (no root needed): one link, loopback")
    parser.add_argument("--json", default="build/bench/sparse-train.json")
    parser.add_argument("--figure", default="build/bench/08-time-to-accuracy.png")
    parser.add_argument("--snippet", default="", help="also write the page's tables here")
    parser.add_argument("--publish", action="store_true",
                        help="write the JSON, the figures and the snippet where the site reads them")
    parser.add_argument("--render", default="", help="only redraw figures and snippet from this JSON")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    paths = dict(json=Path(args.json), figure=Path(args.figure),
                 convergence=Path(args.figure).with_name("08-convergence.png"),
                 snippet=Path(args.snippet) if args.snippet else None)
    if args.publish:
        paths = published(args.plan)
    if args.render:
        record = refresh(json.loads(Path(args.render).read_text()))
        return _write(record, paths, write_json=Path(args.render).resolve() == paths["json"].resolve())
    seeds, epochs = (1, 2) if args.quick else (args.seeds, args.epochs)
    links = [None] if args.loopback else args.links.split(",")
    if not args.loopback and netns.unavailable_reason():
        print(f"the simulated cluster is unavailable: {netns.unavailable_reason()} (try --loopback)", file=sys.stderr)
        return 2
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401 - its first import takes seconds: once, here
    settings = dict(SETTINGS, epochs=epochs, seeds=seeds, lr=LR, threads_per_rank=args.threads)
    common = dict(epochs=epochs, batch=SETTINGS["batch"], density=SETTINGS["density"],
                  warmup_epochs=SETTINGS["warmup_epochs"], evals_per_epoch=SETTINGS["evals_per_epoch"],
                  bucket_cap_mb=SETTINGS["bucket_cap_mb"], hook_thread=SETTINGS["hook_thread"],
                  data=lab.load_digits_split(0))
    configs = _configs(args.quick, seeds, args.plan)
    model, optimizer, _, _ = PLANS[args.plan][0]
    record = dict(command=".venv/bin/python -m collectives bench-sparse-train " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:]),
                  device=machine(), **host(), python=platform.python_version(), commit=commit(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                  settings=settings, plan=args.plan, headline=f"{model}/{optimizer}", links={}, summary={},
                  winner={})
    t0 = time.time()
    targets: dict[str, float] = {}
    for i, link in enumerate(links):
        name = link or "loopback"
        start = time.time()
        # trained to the end on the link named in the plan (or the last one there is); on a
        # later link a run stops at its target; before it, it waits
        last = len(links) - 1
        plan = []
        for c in configs:
            full_on = min(c["full_on"], last)
            key = f"{c['model']}/{c['optimizer']}"
            config = {k: v for k, v in c.items() if k != "full_on"}
            if full_on == i:          # dense to the end; the others past it if they must, to dense's target
                plan.append(config if c["run"] == "dense" else dict(config, target="dense", max_epochs=2 * epochs))
            elif full_on < i and key in targets:
                plan.append(dict(config, target=targets[key], stop_at_target=True, max_epochs=2 * epochs))
        result = run_link(link, plan, common, overlap=i == 0 and model == "wide", timeout=1800,
                          threads=args.threads)
        for r, c in zip(result["runs"], plan):
            r["complete"] = not c.get("stop_at_target", False)
        record["links"][name] = dict(runs=result["runs"], seconds=time.time() - start)
        if result["overlap"]:
            record["overlap"] = result["overlap"]
        targets.update(targets_from([r for r in result["runs"] if r["complete"]]))
        record["summary"][name] = summarize(result["runs"], targets)
        record["winner"][name] = winner(record["summary"][name], record["headline"])
        print(f"{name}: {len(plan)} runs in {time.time() - start:.0f} s; winner {record['winner'][name]}", flush=True)
    record["targets"] = targets
    record["seconds"] = time.time() - t0
    return _write(record, paths, write_json=True)


def _write(record: dict, paths: dict, write_json: bool) -> int:
    import matplotlib
    matplotlib.use("Agg")
    from ..site.plots import DPI
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    if write_json:
        paths["json"].write_text(json.dumps(record, indent=1))
    if paths.get("records"):
        from .sparse_record import train_figures
        figures = train_figures(record, paths["records"], ".venv/bin/python -m collectives bench-sparse-train "
                                "--publish")
    else:
        figures = [paths["figure"], paths["convergence"]]
        figures[0].parent.mkdir(parents=True, exist_ok=True)
        plot_time_to_accuracy(record).savefig(figures[0], dpi=DPI)
        plot_convergence(record).savefig(figures[1], dpi=DPI)
    if paths.get("snippet"):
        paths["snippet"].parent.mkdir(parents=True, exist_ok=True)
        paths["snippet"].write_text(snippet(record))
    print(snippet(record))
    print(f"wrote {paths['json']}, " + ", ".join(map(str, figures))
          + (f", {paths['snippet']}" if paths.get("snippet") else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
