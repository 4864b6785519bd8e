"""Lesson 8's figures and their records, drawn from the benchmarks' JSON (no re-measuring).

``bench-sparse-train`` and ``bench-sparse`` write JSON records of what they measured
(command, device, versions, date, every time). This module turns them into the figures the
lesson's page places, each saved with :func:`plots.save` beside a
:class:`~collectives.course.site.claims.Record` whose sentences are made from the JSON's values:

* ``08-time-to-accuracy``: test accuracy against training time at each link, and the time
  each run takes to dense's target (the **Measured** table);
* ``08-convergence``: test accuracy against steps, mean ± std over the seeds, and the final
  accuracies;
* ``08-density-sweep``: one sparse all-reduce of 16 Mi float32 at each density against the
  dense all-reduce, the crossover measured and predicted, and selection alone.

``.venv/bin/python tools/lesson08_figures.py`` draws all three from ``docs/data``.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from ..site import claims, plots

HEADLINE = ("wide", "sgd")      # the model and optimizer the winner is named for

RUN_NAMES = {"dense": "dense fp32", "bf16": "the bf16 hook", "powersgd1": "PowerSGD rank 1",
             "powersgd4": "PowerSGD rank 4", "topk_ef": "top-k with error feedback",
             "topk_no_ef": "top-k without error feedback", "dgc": "DGC",
             "dgc_no_mask": "DGC without factor masking"}
RUN_NAMES.update(hook_plain="the plain hook", hook_async="the asynchronous hook",
                 hook_thread="the asynchronous hook on a thread")
RUN_ALIASES = {"dense": ["the dense all-reduce", "dense"], "bf16": ["bf16"],
               "topk_ef": ["top-k with memory"], "dgc": ["DGC's corrections"]}
LINKS = {"1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s", "loopback": "loopback"}


def _meta(json_record: dict, drawn_by: str) -> dict:
    """The measurement's own meta (not the drawing's): device, versions, date, command."""
    device = json_record.get("device", "")
    m = re.match(r"(.*), (\d+) cores$", device)
    if m:
        device = f"{m.group(2)}-core x86 host ({m.group(1)})"
    return {"command": json_record["command"], "date": str(json_record["date"]).replace(" UTC", ""),
            "device": device, "torch": json_record["torch"], "python": json_record.get("python", ""),
            "backend": "gloo", "commit": json_record.get("commit"), "drawn_by": drawn_by,
            "cpus": json_record.get("cpus"), "load_average": json_record.get("load_average")}


def _legible(fig):
    from matplotlib.text import Text
    for text in fig.findobj(Text):
        if text.get_fontsize() < plots.MIN_FONT_PT:
            text.set_fontsize(plots.MIN_FONT_PT)
    return fig


MODEL_NAMES = {"wide": "the wide MLP", "mlp": "the lab’s MLP", "cnn": "the convolutional network"}


def _model(model_opt: str) -> str:
    model, opt = model_opt.split("/")
    return f"{MODEL_NAMES.get(model, model)}, {'SGD' if opt == 'sgd' else 'Adam'}"


def headline(train: dict) -> str:
    """The ``model/optimizer`` a ``bench-sparse-train`` record names its winner for."""
    return train.get("headline", "/".join(HEADLINE))


def figure_names(train: dict) -> tuple[str, str]:
    """The time-to-accuracy and convergence figures' names: the MLPs' plain, another plan's
    with the plan's name (``08-time-to-accuracy-cnn``)."""
    plan = train.get("plan", "mlps")
    suffix = "" if plan == "mlps" else f"-{plan}"
    return f"08-time-to-accuracy{suffix}", f"08-convergence{suffix}"


def _ratios(runs: dict, label: str) -> str:
    order = sorted((r for r in runs if "time_mean" in runs[r] and r != "dense"), key=lambda r: runs[r]["vs_dense"])
    parts = ", ".join(f"{RUN_NAMES.get(r, r)} {runs[r]['vs_dense']:.2f}×" for r in order)
    return f"{label}, time to the target as a multiple of dense's: {parts}."


def _best_sparse(w: dict, runs: dict, target: float, link: str) -> str:
    """The best sparse run against dense and bf16, the bar it is held to (half of dense's
    time, and under bf16's), and whether it ends where it reached: the sentence is the data's."""
    best = w["best_sparse"]
    name = RUN_NAMES.get(best, best)
    met = w["best_sparse_vs_dense"] <= 0.5 and w["best_sparse_vs_bf16"] < 1.0
    text = (f"Over {LINKS.get(link, link)} the best sparse run, {name}, took {w['best_sparse_vs_dense']:.2f}× "
            f"dense's time and {w['best_sparse_vs_bf16']:.2f}× the bf16 hook's: "
            + ("within half of dense's time and under bf16's" if met else
               "not within half of dense's time and under bf16's") + "; the fastest run, "
            f"{RUN_NAMES.get(w['fastest'], w['fastest'])}, took {w['fastest_vs_dense']:.2f}× dense's.")
    final = runs.get(best, {}).get("final_mean")
    if final is not None and final < target:
        text += (f" {name[0].upper() + name[1:]} reaches the target and does not stay there: its final "
                 f"accuracy is {final:.3f}, under the target's {target:.3f}.")
    return text


def train_figures(train: dict, img: Path, drawn_by: str) -> list[Path]:
    """``08-time-to-accuracy`` and ``08-convergence`` (SVG and record) from a
    ``bench-sparse-train`` JSON record."""

    key = headline(train)
    tta_name, conv_name = figure_names(train)
    meta = _meta(train, drawn_by)
    seeds = train["settings"]["seeds"]
    record = claims.Record(tta_name, names=RUN_NAMES, aliases=RUN_ALIASES, meta=meta,
                           title="Time to accuracy, dense against bf16, PowerSGD and sparse top-k",
                           alt="test accuracy against training seconds, one panel per link")
    shown = []
    for link, summary in train["summary"].items():
        for model_opt, v in summary.items():
            if not (model_opt == key or model_opt.endswith("/adam")) or v.get("target") is None:
                continue
            runs = v["runs"]
            times = {r: row["time_mean"] for r, row in runs.items()
                     if "time_mean" in row and row["reached"] == row["seeds"]}
            where = (f"to {v['target']:.3f} test accuracy over {LINKS.get(link, link)} "
                     f"({_model(model_opt)}, mean of {seeds} seeds)")
            cid = link if model_opt == key else f"{link}-adam"
            record.times(cid, times, baseline="dense", where=where)
            record.fact(f"{cid}-ratios", _ratios(runs, f"Over {LINKS.get(link, link)}"
                                                 + ("" if model_opt == key else " with Adam")),
                        values_vs_dense={r: row.get("vs_dense") for r, row in runs.items()})
            if model_opt == key:
                shown.append(cid)
                w = train.get("winner", {}).get(link, {})
                if w.get("best_sparse") and w.get("best_sparse_vs_bf16") is not None:
                    record.fact(f"{link}-best-sparse", _best_sparse(w, runs, v["target"], link), **w)
    overlap = train.get("overlap") or {}
    for label, o in overlap.items():
        density = float(label.split()[-1])
        cid = f"overlap-{density * 100:g}pct"
        hooks = {"hook_plain": o["plain"], "hook_async": o["async"]}
        if "thread" in o:
            hooks["hook_thread"] = o["thread"]
        record.times(cid, hooks, baseline="hook_plain",
                     where=f"one step of the wide MLP at {LINKS.get(next(iter(train['links'])), '')}, density "
                     f"{density:.0%} (median)")
        if o.get("hidden") is not None:
            hidden = format(o["hidden"], ".0%") if o["hidden"] >= 0.005 else "none"
            communication = claims.human(o["plain"] - o["no_communication"])
            text = (f"At density {density:.0%} the plain hook added {communication} to the step (its "
                    f"selection and its communication; the step without communication took "
                    f"{claims.human(o['no_communication'])}); the asynchronous hook took {hidden} of that off")
            if o.get("hidden_thread") is not None:
                text += f", and on a thread of its own {max(o['hidden_thread'], 0):.0%}"
            record.fact(f"{cid}-hidden", text + ".", hidden=o["hidden"], hidden_thread=o.get("hidden_thread"))
    head_runs = list(train["summary"][next(iter(train["summary"]))][key]["runs"])
    rows = []
    for run in (r for r in head_runs if r in RUN_NAMES):
        row = [RUN_NAMES.get(run, run)]
        first = train["summary"][next(iter(train["summary"]))][key]["runs"][run]
        row.append(f"{first['bytes_per_step'] / 1e3:,.0f} kB")
        for link in train["summary"]:
            r = train["summary"][link][key]["runs"].get(run, {})
            row += [claims.human(r["time_mean"]) if "time_mean" in r else "not reached",
                    f"{r['vs_dense']:.2f}×" if "vs_dense" in r else "--"]
        row.append(f"{first['final_mean']:.3f}" if "final_mean" in first else "--")
        rows.append(row)
    head = ["run", "bytes per step per rank"]
    for link in train["summary"]:
        head += [f"time to target, {LINKS.get(link, link)}", "× dense"]
    record.table = {"head": head + ["final accuracy"], "rows": rows}
    record.caption = record.text(*shown)
    out = [plots.save(_legible(plot_time_to_accuracy(train)), img / tta_name, record)]

    conv = claims.Record(conv_name, names=RUN_NAMES, aliases=RUN_ALIASES, meta=meta,
                         title="Test accuracy against steps, mean ± std over the seeds",
                         alt="test accuracy against steps for each model and optimizer")
    finals = {}
    for summary in train["summary"].values():
        for model_opt, v in summary.items():
            for run, row in v["runs"].items():
                if "final_mean" in row:
                    finals.setdefault(model_opt, {})[run] = row["final_mean"]
    for model_opt, values in finals.items():
        order = sorted(values, key=values.get, reverse=True)
        said = ", ".join(f"{RUN_NAMES.get(r, r)} {values[r]:.3f}" for r in order)
        conv.fact(f"final-{model_opt.replace('/', '-')}",
                  f"Final test accuracy ({_model(model_opt)}, mean of {seeds} seeds): {said}.",
                  accuracy=values)
    out.append(plots.save(_legible(plot_convergence(train)), img / conv_name, conv))
    return out


SWEEP_NAMES = {"dense": "the dense all-reduce", "allgather": "the sparse all-gather",
               "split": "the split transport"}
SELECTION_NAMES = {"topk": "torch.topk", "sort": "a full sort", "kthvalue": "kthvalue",
                   "reuse": "a reused threshold", "sample": "a sampled threshold", "threshold": "a fixed threshold"}


def sweep_figure(bench: dict, img: Path, drawn_by: str, loopback: dict | None = None) -> Path:
    """``08-density-sweep`` (SVG and record) from a ``bench-sparse --cluster --sweep`` record."""
    cluster_key = next(k for k in bench if k.startswith("cluster") and bench[k].get("sweep"))
    cluster = bench[cluster_key]
    sweep = cluster["sweep"]
    names = dict(SWEEP_NAMES, **{f"select_{m}": f"selection by {n}" for m, n in SELECTION_NAMES.items()})
    record = claims.Record("08-density-sweep", names=names, meta=_meta(bench, drawn_by),
                           aliases={"allgather": ["the all-gather"], "split": ["split"]},
                           title="One sparse all-reduce against the dense one, by density",
                           alt="seconds per call against density, 1 Gbit/s between 2 machines")
    mib = cluster["n"] * 4 / 2 ** 20
    where = f"{cluster['n'] / 2 ** 20:.0f} Mi float32 ({mib:.0f} MiB), 2 machines × 2 ranks over 1 Gbit/s"
    ids = []
    for d in (0.01, max(s["density"] for s in sweep)):
        s = next(s for s in sweep if s["density"] == d)
        cid = f"density-{d * 100:g}pct"
        record.times(cid, {"dense": cluster["dense"], "allgather": s["allgather"], "split": s["split"]},
                     baseline="dense", where=f"top-k at density {d:.0%} of {where}")
        ids.append(cid)
    record.fact("crossover",
                f"Measured, the best sparse transport meets the dense all-reduce at a density of about "
                f"{bench['measured_crossover']:.1%}; the bytes alone put it at {bench['model_crossover']:.1%}, "
                f"the model with the processor's share at {bench['model_crossover_with_compute']:.1%}.",
                measured=bench["measured_crossover"], bytes_only=bench["model_crossover"],
                with_compute=bench["model_crossover_with_compute"])
    ids.append("crossover")
    if bench.get("selection"):
        record.times("selection", {f"select_{s['method']}": s["seconds"] for s in bench["selection"]},
                     baseline="select_topk",
                     where=f"choosing 1 % of {cluster['n'] / 2 ** 20:.0f} Mi float32 in one process on the host")
    if loopback and loopback.get("loopback"):
        lb = loopback["loopback"]
        rows = {r["variant"]: r["seconds"] for r in lb["rows"] if r["mode"] == "top-k (sample)"}
        record.times("loopback", {"dense": lb["dense"], "allgather": rows["allgather"], "split": rows["split"]},
                     baseline="dense", where=f"the same call at 1 % over loopback, no shaping "
                     f"(`{loopback['command']}`)")
    record.caption = record.text(*ids)

    fig = plots._figure(6.4, 4.0)
    ax = fig.subplots()
    density = [s["density"] for s in sweep]
    for key, color in (("allgather", "tab:blue"), ("split", "tab:orange")):
        ax.plot(density, [s[key] for s in sweep], "o-", color=color, label=SWEEP_NAMES[key].removeprefix("the "))
    ax.plot(density, [s["select"] for s in sweep], "s:", color="tab:gray", label="selection alone")
    ax.axhline(cluster["dense"], color="black", ls="--", lw=1.0, label="dense all_reduce")
    ax.axvline(bench["measured_crossover"], color="tab:red", lw=0.8, alpha=0.6)
    ax.set(xscale="log", yscale="log", xlabel="density (share of entries sent)", ylabel="seconds per call (median)",
           title=f"{mib:.0f} MiB float32, 2 machines × 2 ranks, 1 Gbit/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=9, loc="upper left")
    return plots.save(_legible(fig), img / "08-density-sweep", record)


def runs_snippet(records: dict[str, dict]) -> str:
    """Every row of each ``bench-sparse`` record, as tables for the notes page."""
    lines = []
    for label, rec in records.items():
        lines += [f"**{label}**: `{rec['command']}` on {rec['device']}, torch {rec['torch']}, {rec['date']}.", ""]
        for world, v in rec.items():
            if not isinstance(v, dict) or "rows" not in v:
                continue
            lines += [f"*{world}*, {v['n'] / 2 ** 20:g} Mi float32, density {v['density']:.0%}, {v['gradients']} "
                      f"gradients; `dist.all_reduce` {claims.human(v['dense'])}:", "",
                      "| transport | selection | time | of it selection | bytes sent per rank | × dense |",
                      "|---|---|---|---|---|---|"]
            for r in v["rows"]:
                lines.append(f"| {r['variant']} | {r['mode']} | {claims.human(r['seconds'])} | "
                             f"{claims.human(r['select'])} | {r['sent'] / 1e6:.2f} MB | "
                             f"{r['seconds'] / v['dense']:.2f} |")
            lines.append("")
    return "\n".join(lines)


# ---- the training figures ---------------------------------------------------------------------

COLORS = dict(dense="black", bf16="tab:gray", powersgd1="tab:olive", powersgd4="tab:green",
              topk_ef="tab:blue", topk_no_ef="tab:cyan", dgc="tab:red", dgc_no_mask="tab:orange")


def _mean_curve(seeds: list[dict]) -> tuple[list, list, list, list]:
    """(steps, mean seconds, mean accuracy, std accuracy) over the evaluations all seeds have."""
    length = min(len(r["curve"]) for r in seeds)
    steps = [seeds[0]["curve"][i][0] for i in range(length)]
    secs = [statistics.fmean(r["curve"][i][1] for r in seeds) for i in range(length)]
    accs = [[r["curve"][i][2] for r in seeds] for i in range(length)]
    return steps, secs, [statistics.fmean(a) for a in accs], [statistics.pstdev(a) for a in accs]


def plot_time_to_accuracy(record: dict, key: str | None = None):
    """Test accuracy against training time, one panel per link on shared axes, mean of the
    seeds; the dashed line is the target, a dot where each run's mean reaches it."""
    from ..site.plots import _figure
    key = key or headline(record)
    links = list(record["links"])
    fig = _figure(5.2 * len(links), 4.2)
    axes = fig.subplots(1, len(links), sharex=True, sharey=True, squeeze=False)[0]
    target = record["targets"].get(key)
    for ax, link in zip(axes, links):
        runs = [r for r in record["links"][link]["runs"] if f"{r['model']}/{r['optimizer']}" == key]
        for run in dict.fromkeys(r["run"] for r in runs):
            seeds = [r for r in runs if r["run"] == run]
            _, secs, acc, _ = _mean_curve(seeds)
            ax.plot(secs, acc, color=COLORS.get(run), lw=1.4, label=run)
            row = record["summary"][link][key]["runs"][run]
            if "time_mean" in row and row["reached"] == row["seeds"]:
                ax.plot([row["time_mean"]], [target], "o", color=COLORS.get(run), ms=5)
        if target is not None:
            ax.axhline(target, color="k", ls="--", lw=0.8)
        best = record["winner"].get(link, {}).get("fastest")
        ax.set(title=f"{link}: fastest to the target {best or 'none'}", xlabel="training seconds (mean of seeds)")
        ax.set_ylim(max(0.0, (target or 0.5) - 0.35), 1.0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"test accuracy ({key.replace('/', ', ')})")
    axes[-1].legend(fontsize=8, loc="lower right")
    return fig


def plot_convergence(record: dict):
    """Test accuracy against steps, mean ± one standard deviation over the seeds, per model
    and optimizer (the runs trained to the end)."""
    from ..site.plots import _figure
    epochs = record["settings"]["epochs"]
    first = [dict(r, curve=[c for c in r["curve"] if c[0] <= epochs * r["steps_per_epoch"]])
             for link in record["links"].values() for r in link["runs"] if r.get("complete", True)]
    keys = list(dict.fromkeys(f"{r['model']}/{r['optimizer']}" for r in first))
    fig = _figure(4.6 * len(keys), 3.8)
    axes = fig.subplots(1, len(keys), sharey=True, squeeze=False)[0]
    for ax, key in zip(axes, keys):
        runs = [r for r in first if f"{r['model']}/{r['optimizer']}" == key]
        for run in dict.fromkeys(r["run"] for r in runs):
            steps, _, acc, spread = _mean_curve([r for r in runs if r["run"] == run])
            ax.plot(steps, acc, color=COLORS.get(run), lw=1.3, label=run)
            ax.fill_between(steps, [a - s for a, s in zip(acc, spread)], [a + s for a, s in zip(acc, spread)],
                            color=COLORS.get(run), alpha=0.15, lw=0)
        ax.set(title=key.replace("/", ", "), xlabel="step")
        ax.set_ylim(0.5, 1.0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"test accuracy, mean ± std of {record['settings']['seeds']} seeds")
    axes[-1].legend(fontsize=8, loc="lower right")
    return fig
