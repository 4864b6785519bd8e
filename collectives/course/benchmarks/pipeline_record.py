"""``bench-pp``'s figures and the claims they show, drawn from its record alone.

* ``14-timeline`` (local suite): every schedule's last measured step, one lane per rank, F, B
  and W as bars on one time axis; its record holds the table (step time of the course's
  runner and of torch's schedule, the bubble measured on both, the simulator's with the measured
  costs and the textbook formula's, micro-batches held) and one comparison per schedule;
* ``14-cluster`` (cluster suite): step time and bytes across the slow link of the pipeline
  and of data parallel, each beside the cost model's prediction.

:func:`figures` takes the JSON the benchmark wrote (or the same dict), so a figure can be
drawn again from a committed record without running anything.
"""

from __future__ import annotations

from pathlib import Path

from ..site import claims, plots

TITLES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B (v = 2)", "zb-h1": "ZB-H1"}
COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "BW": "#c44e52"}


def figures(suite: str, result: dict, meta: dict, img: Path) -> list[Path]:
    img.mkdir(parents=True, exist_ok=True)
    if suite == "cluster":
        record, fig = cluster_figure(result, meta)
        return [plots.save(fig, img / "14-cluster", record)]
    record, fig = timeline_figure(result, meta)
    name = "14-timeline-nccl" if suite == "nccl" else "14-timeline"
    record.name = name
    return [plots.save(fig, img / name, record)]


def _kind(kind: str, mb: int, chunk: int, row: dict, spans_of_rank: list) -> str:
    if kind != "B":
        return kind
    split = any(k == "W" and i == mb and c == chunk for k, i, c, _, _ in spans_of_rank)
    return "B" if split else "BW"


def timeline_figure(result: dict, meta: dict):
    rows = result["rows_by_schedule"]
    p, m = result["world_size"], result["m"]
    ranks = f"{p} GPUs" if result.get("backend") == "nccl" else f"{p} ranks"
    where = f"{ranks}, {m} micro-batches, {result['layers']} layers of width {result['width']}"
    record = claims.Record("14-timeline", names={"ours": "the course's runner", "torch": "torch's pipelining"},
                           aliases={"torch": ["torch.distributed.pipelining"]}, meta=meta,
                           title=f"bench-pp: one step of each schedule, {where}",
                           alt="Timelines of GPipe, 1F1B, interleaved 1F1B and ZB-H1: per rank, bars of F, B and W")
    for row in rows:
        if row.get("torch_seconds"):
            record.times(row["name"], {"ours": row["seconds"], "torch": row["torch_seconds"]}, baseline="torch",
                         where=f"{TITLES[row['name']]}, {where}")
    record.fact("bubble", "Bubble (the ranks' idle share of a step, read from its trace) measured, then as the "
                "simulator plays the schedule with that step's measured costs -- each rank's F, B and W, the message "
                "time -- then the textbook formula's (equal stages, free messages): "
                + "; ".join(f"{TITLES[r['name']]} {r['bubble']:.3f}, {r['model']:.3f}, {r['formula']:.3f}"
                            for r in rows) + ".",
                measured={r["name"]: r["bubble"] for r in rows}, model={r["name"]: r["model"] for r in rows},
                formula={r["name"]: r["formula"] for r in rows},
                torch={r["name"]: r["torch_bubble"] for r in rows if r.get("torch_bubble") is not None})
    one = next(r for r in rows if r["name"] == "1f1b")
    forward = [u["F"] for u in one["unit_seconds"]]
    record.fact("stages", "In the last 1F1B step the stages' forward took "
                + ", ".join(claims.human(f) for f in forward) + " (rank 0 to the last; equal layers), a message "
                + claims.human(one["message_seconds"]) + f"; equal stages of those costs would idle "
                f"{one['model_parts']['fill']:.3f} of the step, these {one['model_parts']['stages']:.3f}.",
                forward=forward, slowest=max(forward) / min(forward), message=one["message_seconds"],
                fill=one["model_parts"]["fill"], stages=one["model_parts"]["stages"])
    record.fact("held", "Micro-batches held at most, rank 0 to the last: "
                + "; ".join(f"{TITLES[r['name']]} {[max(h) for h in r['peak_held']]}" for r in rows) + ".",
                held={r["name"]: [max(h) for h in r["peak_held"]] for r in rows})

    def share(x):
        return "" if x is None else f"{x:.2f}"
    head = ["schedule", "step", "torch's step", "bubble", "torch's bubble", "with measured costs", "textbook",
            "held, rank 0"]
    record.table = {"head": head, "rows": [
        [TITLES[r["name"]], claims.human(r["seconds"]),
         claims.human(r["torch_seconds"]) if r.get("torch_seconds") else "",
         share(r["bubble"]), share(r.get("torch_bubble")), share(r["model"]), share(r["formula"]),
         str(max(r["peak_held"][0]))] for r in rows]}
    record.caption = record.text("bubble")
    fig = plots._figure(7.5, 1.0 + 0.42 * p * len(rows))
    axes = fig.subplots(len(rows), 1, sharex=True)
    for ax, row in zip(axes, rows):
        for rank, spans in enumerate(row["spans"]):
            for kind, mb, chunk, start, end in spans:
                shown = _kind(kind, mb, chunk, row, spans)
                ax.barh(rank, (end - start) * 1e3, left=start * 1e3, height=0.8, color=COLOURS[shown],
                        edgecolor="white", linewidth=0.4)
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=9)
        ax.invert_yaxis()
        ax.set_title(f"{TITLES[row['name']]}: bubble {row['bubble']:.2f}; with the measured costs "
                     f"{row['model']:.2f}; textbook {row['formula']:.2f}",
                     fontsize=9, loc="left")
        ax.tick_params(labelsize=9)
    axes[-1].set_xlabel("milliseconds from the step's start", fontsize=9)
    from matplotlib.patches import Patch
    names = {"F": "F (forward)", "BW": "B + W (backward)", "B": "B (input gradient)", "W": "W (weight gradient)"}
    fig.legend(handles=[Patch(color=COLOURS[k], label=v) for k, v in names.items()], loc="outside lower center",
               ncols=4, fontsize=9)
    return record, fig


def cluster_figure(result: dict, meta: dict):
    rows = result["rows_by_schedule"]
    c = result["cluster"]
    where = (f"{c['machines']} machines x {c['ranks_per_machine']} ranks, {c['link']}, {result['layers']} layers "
             f"of width {result['width']}, {result['m']} micro-batches")
    names = {r["name"]: r["label"] for r in rows}
    record = claims.Record("14-cluster", names=names, aliases={"pp": ["the pipeline"], "dp": ["data parallel"]},
                           meta=meta, title=f"bench-pp --cluster: across the slow link, {where}",
                           alt="Bars of step time and of bytes across the link, pipeline and data parallel, "
                               "measured and predicted")
    record.times("step", {r["name"]: r["seconds"] for r in rows}, baseline="dp", where=where)
    record.fact("bytes", "Bytes across the link per step: " + "; ".join(
        f"{r['label']} {r['bytes_across'] / 2**20:.2f} MiB (model {r['model_bytes'] / 2**20:.2f} MiB)" for r in rows)
        + ".", measured={r["name"]: r["bytes_across"] for r in rows},
        model={r["name"]: r["model_bytes"] for r in rows})
    record.fact("model", "The cost model's step time: " + "; ".join(
        f"{r['label']} {claims.human(r['model'])}" for r in rows) + ".", model={r["name"]: r["model"] for r in rows})
    record.table = {"head": ["", "step", "model", "MiB across", "model MiB"], "rows": [
        [r["label"], claims.human(r["seconds"]), claims.human(r["model"]), f"{r['bytes_across'] / 2**20:.2f}",
         f"{r['model_bytes'] / 2**20:.2f}"] for r in rows]}
    record.caption = record.text()
    fig = plots._figure(7.0, 2.4)
    ax1, ax2 = fig.subplots(1, 2)
    labels = [r["label"] for r in rows]
    ys = range(len(rows))
    ax1.barh([y - 0.2 for y in ys], [r["seconds"] * 1e3 for r in rows], height=0.4, color="#4c72b0", label="measured")
    ax1.barh([y + 0.2 for y in ys], [r["model"] * 1e3 for r in rows], height=0.4, color="#bbbbbb", label="model")
    ax1.set_yticks(list(ys), labels, fontsize=9)
    ax1.set_xlabel("step time (ms)", fontsize=9)
    ax2.barh([y - 0.2 for y in ys], [r["bytes_across"] / 2**20 for r in rows], height=0.4, color="#dd8452",
             label="measured")
    ax2.barh([y + 0.2 for y in ys], [r["model_bytes"] / 2**20 for r in rows], height=0.4, color="#bbbbbb",
             label="model")
    ax2.set_yticks(list(ys), [])
    ax2.set_xlabel("MiB across the link per step", fontsize=9)
    for ax in (ax1, ax2):
        ax.invert_yaxis()
        ax.tick_params(labelsize=9)
        ax.legend(fontsize=9, loc="lower right")
    fig.suptitle(record.title, fontsize=9)
    return record, fig
