"""Lesson 7's figures, each with the record of what it shows, into docs/img/.

    .venv/bin/python tools/lesson07_figures.py --records docs/data/bench-hier   # the measured figures
    .venv/bin/python tools/lesson07_figures.py                                   # the two timelines (a local run)

``--records DIR`` reads the ``bench-hier-<suite>.json`` records that ``.venv/bin/python -m collectives
bench-hier <suite> --out DIR`` wrote on a quiet 16-core host (``sizes --rails`` under
``DIR/rails``) and draws from them, each as ``docs/img/07-bench-<suite>.svg`` with its
record (:mod:`collectives.course.site.claims`; device, versions, date and the bench commands in
its ``meta``): ``train`` (a DDP step, DDP's default hook against the hierarchical hook),
``inflight`` (buckets in flight), ``crossover`` (16 KiB to 16 MiB against the flat
all-reduces), ``sizes`` (every algorithm at 64 MiB, one link and rails), ``machines`` (M = 2, 4
with D = 1, 2), ``host-cost`` (the host's own work per bucket and per slice, from the records
of ``bench-hier host-cost`` under ``DIR/host-cost/before`` and ``/after``; ``--only host-cost``
draws it alone). It also writes ``docs/snippets/bench-hier-results.md``, every comparison
each bench computed, for the notes page. Nothing is typed by hand: the sentences are made
from the values.

Timelines, from real runs on 4 local gloo ranks as 2 machines × 2 (``layout=(2, 2)``), which
show an order of events, not a speed (PNGs without a record: the lesson page does not place
them; its lab draws both from its own run, §3 and §4):

* ``docs/img/07-timeline.png``: 16 MiB of float32 in 8 slices through the blocking
  pipeline, ranks 0 and 2; each bar runs from the moment a stage of a slice was issued to
  the moment the next stage of that slice waited for it;
* ``docs/img/07-inflight.png``: six buckets handed to the in-flight reducer at once, from its
  own timeline (one row per stage lane, one colour per bucket).
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from collectives import launch, timing  # noqa: E402
from collectives.course.site import claims, plots  # noqa: E402

SUITES = ("train", "inflight", "crossover", "machines", "sizes")
RESULTS = ROOT / "docs" / "snippets" / "bench-hier-results.md"


def timelines() -> None:
    from collectives.course.benchmarks.hierarchical import plot_slices, traced_slices
    from collectives.course.benchmarks.hierarchical_inflight import plot_timeline, timeline_in_rank

    numel = 4 << 20
    rows = launch.run(traced_slices, 4, args=((2, 2), numel, numel // 8), timeout=120)
    fig = plot_slices([rows[0], rows[2]], "hierarchical_all_reduce, 16 MiB float32 in 8 slices, "
                      "layout (2, 2): rank 0 (machine 0) and rank 2 (machine 1)", ranks=[0, 2])
    fig.savefig(ROOT / "docs" / "img" / "07-timeline.png", dpi=plots.DPI)
    sizes = [1 << 18, 3 << 16, 1 << 18, 1 << 17, 1 << 18, 5 << 15]
    rows = launch.run(timeline_in_rank, 4, args=((2, 2), sizes, 2 << 20, 1 << 18), timeout=120)[0]
    fig = plot_timeline(rows, "six buckets handed over at once to HierarchicalAllReducer, layout (2, 2), "
                        "4 local gloo ranks: rank 0's lanes")
    fig.savefig(ROOT / "docs" / "img" / "07-inflight.png", dpi=plots.DPI)
    print("wrote docs/img/07-timeline.png and docs/img/07-inflight.png")


def results(folder: Path) -> None:
    """The Measured section from the records in ``folder``."""
    lines = []
    for suite, path in [(s, folder / f"bench-hier-{s}.json") for s in SUITES] + [
            ("sizes --rails", folder / "rails" / "bench-hier-sizes.json")]:
        if not path.exists():
            continue
        rec = json.loads(path.read_text())
        machine = rec["machine"]
        lines += [f"**`bench-hier {suite}`**: `{rec['command']}`, {machine['cpu']} ({machine['cores']} cores), "
                  f"torch {rec['versions']['torch']}, {rec['date'][:10]}.", ""]
        lines += ["| comparison | faster | by |", "|---|---|---|"]
        lines += [f"| {c['what']} | {c['faster']} | {c['by']:.2f}× |" for c in rec.get("comparisons", [])]
        for key, value in (rec.get("crossover") or {}).items():
            lines.append(f"| crossover, {key} | {value} | |")
        lines.append("")
    if not lines:
        raise SystemExit(f"no bench-hier-*.json records in {folder}")
    RESULTS.write_text("\n".join(lines))
    print(f"wrote {RESULTS.relative_to(ROOT)}")



# --------------------------------------------------------------------------- records from bench-hier

KEYS = {"flat ring": "flat", "dist.all_reduce": "gloo", "rail ring": "rail_ring", "root-based": "root",
        "rail all-reduce": "rail_ar", "hierarchical, one slice": "one_slice",
        "hierarchical, pipelined": "hier", "hierarchical, library inside": "library_inside",
        "dist.all_reduce per bucket (DDP's default)": "gloo",
        "DDP, default hook": "ddp", "DDP, hierarchical hook": "hook", "lesson 6 reducer, hierarchical": "reducer"}
NAMES = {"flat": "lesson 4's ring", "gloo": "dist.all_reduce", "rail_ring": "the flat ring over every rail",
         "root": "the root-based hierarchy", "rail_ar": "the rail all-reduce",
         "one_slice": "the hierarchy in one slice", "hier": "the pipelined hierarchy",
         "library_inside": "the hierarchy with gloo's collectives inside",
         "ddp": "DDP's default hook", "hook": "the hierarchical hook",
         "reducer": "lesson 6's reducer on the hierarchy",
         "in1": "one bucket in flight", "in2": "2 buckets in flight", "in4": "4 buckets in flight",
         "in8": "8 buckets in flight"}
ALIASES = {"hier": ["the hierarchy", "hierarchical, pipelined"], "rail_ring": ["the rail ring", "rail-aware flat ring"],
           "gloo": ["gloo's all-reduce", "the library"], "flat": ["the flat ring"],
           "hook": ["the hook"], "ddp": ["DDP's own", "DDP's all-reduce"]}
LINK = {False: "one 1 Gbit/s link per machine", True: "a 1 Gbit/s link per rail"}
COLORS = {"flat": "#8c8c8c", "gloo": "#4c72b0", "rail_ring": "#55a868", "root": "#8172b3", "rail_ar": "#64b5cd",
          "one_slice": "#dd8452", "hier": "#c44e52", "library_inside": "#da8bc3",
          "ddp": "#4c72b0", "hook": "#c44e52", "reducer": "#dd8452"}


def _load(folder: Path, suite: str, rails_folder: bool = False) -> dict | None:
    path = folder / ("rails" if rails_folder else "") / f"bench-hier-{suite}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _meta(recs: list[dict], machines: str) -> dict:
    first = recs[0]
    return {"device": f"{first['machine']['cores']}-core host ({first['machine']['cpu']}), simulated cluster of "
                      f"{machines}, 1 Gbit/s links, "
                      f"queue {first.get('config', {}).get('queue', '50ms')}",
            "torch": first["versions"]["torch"], "python": first["versions"].get("python", ""),
            "commit": first["versions"].get("commit"),
            "backend": "gloo", "cpus": first["machine"]["cores"], "date": max(r["date"] for r in recs),
            "load_average": first["machine"].get("load_average"),
            "command": "; ".join(r["command"] for r in recs),
            "drawn_by": ".venv/bin/python tools/lesson07_figures.py --records docs/data/bench-hier"}


def _runs(rec: dict, rails: bool | None = None) -> list[dict]:
    return [r for r in rec["runs"] if rails is None or bool(r.get("rails")) == rails]


def _ms(seconds: float) -> str:
    return claims.human(seconds)


def sizes_record(folder: Path, out: Path) -> None:
    recs = [r for r in (_load(folder, "sizes"), _load(folder, "sizes", True)) if r]
    if not recs:
        return
    runs = [run for rec in recs for run in rec["runs"]]
    record = claims.Record("07-bench-sizes", names=NAMES, aliases=ALIASES, meta=_meta(recs, "2 machines × 2 ranks"),
                           title="Every algorithm at 64 MiB, 2 × 2, one link per machine and a link per rail")
    fig = plots._figure(9.5, 3.6)
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    table = {}
    for ax, run in zip(axes, runs):
        rails = bool(run.get("rails"))
        rows = [r for r in run["rows"] if r["name"] in KEYS]
        values = {KEYS[r["name"]]: r["seconds"] for r in rows}
        size = timing.human_bytes(rows[0]["nbytes"])
        record.times("rails" if rails else "one-link", values, baseline="gloo",
                     where=f"{size}, 2 × 2, {LINK[rails]}, median of {run['iters']}")
        keys = list(values)
        ax.barh(range(len(keys)), [values[k] * 1e3 for k in keys], color=[COLORS[k] for k in keys])
        ax.plot([r["model_seconds"] * 1e3 for r in rows], range(len(keys)), "k|", markersize=12, label="model")
        ax.set_yticks(range(len(keys)), [NAMES[k] for k in keys], fontsize=9)
        ax.set_xlabel(f"ms, {size} ({LINK[rails]})", fontsize=9)
        ax.legend(fontsize=9, loc="lower right")
        for r in rows:
            table.setdefault(KEYS[r["name"]], {})[rails] = (r["seconds"], r["model_seconds"])
    axes[0].invert_yaxis()
    record.table = {"head": ["algorithm", "one link", "model", "rails", "model"],
                    "rows": [[NAMES[k]] + [x for rails in (False, True) for x in
                                           ((_ms(v[rails][0]), _ms(v[rails][1])) if rails in v else ("", ""))]
                             for k, v in table.items()]}
    if "rail_ring" in table and len(table["rail_ring"]) == 2:
        one, rail = table["rail_ring"][False], table["rail_ring"][True]
        record.fact("rail-ring", f"The flat ring over every rail took {_ms(one[0])} on one link and {_ms(rail[0])} "
                    f"with a link per rail; the model gives it {_ms(rail[1])} with rails: on this cluster it "
                    f"ran {one[0] / rail[0]:.2f}× as fast with the rails.", measured=[one[0], rail[0]],
                    model=[one[1], rail[1]])
    record.caption = "Bars: median; |: the per-message model. " + record.text()
    print(plots.save(fig, out / "07-bench-sizes", record))


def crossover_record(folder: Path, out: Path) -> None:
    rec = _load(folder, "crossover")
    if not rec:
        return
    record = claims.Record("07-bench-crossover", names=NAMES, aliases=ALIASES,
                           meta=_meta([rec], "2 machines × 2 ranks"),
                           title="The pipelined hierarchy against the flat all-reduces, 16 KiB to 16 MiB")
    fig = plots._figure(9.5, 3.8)
    axes = fig.subplots(1, len(rec["runs"]), sharey=True, sharex=True, squeeze=False)[0]
    rows_out = []
    for ax, run in zip(axes, rec["runs"]):
        rails = bool(run.get("rails"))
        tag = "rails" if rails else "one-link"
        series: dict[str, list] = {}
        for r in run["rows"]:
            series.setdefault(KEYS[r["name"]], []).append(r)
        sizes = [r["nbytes"] for r in series["hier"]]
        values = {k: [r["seconds"] for r in rs] for k, rs in series.items()}
        record.sweep(tag, sizes, values, label=f"measured, {LINK[rails]}")
        for other in ("gloo", "rail_ring"):
            record.crossover(f"{tag}-{other}", sizes, other, "hier", values,
                             label=f"measured, {LINK[rails]}")
        for k, rs in series.items():
            ax.plot(sizes, [r["seconds"] * 1e3 for r in rs], "o-", color=COLORS[k], label=NAMES[k], markersize=4)
        ax.plot(sizes, [r["model_seconds"] * 1e3 for r in series["hier"]], ":", color=COLORS["hier"],
                label="model, the pipelined hierarchy")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sizes[::2] if len(sizes) > 5 else sizes
        ax.set_xticks(ticks, [timing.human_bytes(n) for n in ticks], fontsize=9)
        ax.minorticks_off()
        ax.set_title(LINK[rails], fontsize=10)
        ax.set_xlabel("bytes", fontsize=9)
        for i, n in enumerate(sizes):
            rows_out.append([timing.human_bytes(n), "rails" if rails else "one link"]
                            + [_ms(values[k][i]) for k in ("gloo", "flat", "rail_ring", "hier")])
    axes[0].set_ylabel("ms (median of 5)", fontsize=9)
    axes[-1].legend(fontsize=9)
    record.table = {"head": ["size", "links", "dist.all_reduce", "lesson 4's ring", "ring over every rail",
                             "pipelined hierarchy"], "rows": rows_out}
    record.caption = record.text()
    print(plots.save(fig, out / "07-bench-crossover", record))


def machines_record(folder: Path, out: Path) -> None:
    rec = _load(folder, "machines")
    if not rec:
        return
    record = claims.Record("07-bench-machines", names=NAMES, aliases=ALIASES,
                           meta=_meta([rec], "2 and 4 machines of 1 and 2 ranks"),
                           title="More machines: D ranks per machine, M machines, one link per machine")
    fig = plots._figure(9.5, 3.4)
    axes = fig.subplots(1, 2, squeeze=False)[0]
    table = []
    for ax, nbytes in zip(axes, sorted({r["nbytes"] for run in rec["runs"] for r in run["rows"]})):
        labels, gloo, hier, model = [], [], [], []
        for run in rec["runs"]:
            d, m = run["ranks_per_machine"], run["machines"]
            by = {KEYS[r["name"]]: r for r in run["rows"] if r["nbytes"] == nbytes}
            size = timing.human_bytes(nbytes)
            record.times(f"D{d}-M{m}-{size.replace(' ', '')}", {k: r["seconds"] for k, r in by.items()},
                         baseline="gloo", where=f"{m} machines × {d}, {size}")
            labels.append(f"{m} × {d}")
            gloo.append(by["gloo"]["seconds"] * 1e3)
            hier.append(by["hier"]["seconds"] * 1e3)
            model.append(by["hier"]["model_seconds"] * 1e3)
            table.append([f"{m} × {d}", size, _ms(by["gloo"]["seconds"]), _ms(by["hier"]["seconds"]),
                          _ms(by["hier"]["model_seconds"])])
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], gloo, 0.4, color=COLORS["gloo"], label=NAMES["gloo"])
        ax.bar([x + 0.2 for x in xs], hier, 0.4, color=COLORS["hier"], label=NAMES["hier"])
        ax.plot([x + 0.2 for x in xs], model, "k_", markersize=14, label="model, the pipelined hierarchy")
        ax.set_xticks(list(xs), labels, fontsize=9)
        ax.set_xlabel(f"machines × ranks per machine, {timing.human_bytes(nbytes)}", fontsize=9)
        ax.set_ylabel("ms (median of 5)", fontsize=9)
    axes[0].legend(fontsize=9)
    record.table = {"head": ["machines × ranks", "size", "dist.all_reduce", "pipelined hierarchy", "model"],
                    "rows": table}
    record.caption = record.text()
    print(plots.save(fig, out / "07-bench-machines", record))


def inflight_record(folder: Path, out: Path) -> None:
    rec = _load(folder, "inflight")
    if not rec:
        return
    cfg = rec["config"]
    record = claims.Record("07-bench-inflight", names=NAMES, aliases=ALIASES, meta=_meta([rec], "2 machines × 2 ranks"),
                           title=f"{cfg['buckets']} buckets of {timing.human_bytes(cfg['bucket_bytes'])}, "
                                 "handed over at once")
    fig = plots._figure(9.5, 3.4)
    axes = fig.subplots(1, len(rec["runs"]), sharey=True, squeeze=False)[0]
    table = []
    for ax, run in zip(axes, rec["runs"]):
        rails = bool(run.get("rails"))
        values = {("gloo" if "dist" in r["name"] else f"in{r['in_flight']}"): r["seconds"] for r in run["rows"]}
        model = {("gloo" if "dist" in r["name"] else f"in{r['in_flight']}"): r["model_seconds"] for r in run["rows"]}
        record.times("rails" if rails else "one-link", values, baseline="in1",
                     where=f"{run['buckets']} buckets of {timing.human_bytes(run['bucket_bytes'])}, 2 × 2, "
                           f"{LINK[rails]}")
        keys = list(values)
        ax.bar(range(len(keys)), [values[k] * 1e3 for k in keys],
               color=[COLORS["gloo"] if k == "gloo" else COLORS["hier"] for k in keys])
        ax.plot(range(len(keys)), [model[k] * 1e3 for k in keys], "k_", markersize=14, label="model")
        ax.set_xticks(range(len(keys)), ["all_reduce\nper bucket" if k == "gloo" else f"{k[2:]} in\nflight"
                                         for k in keys], fontsize=9)
        ax.set_title(LINK[rails], fontsize=10)
        table += [["rails" if rails else "one link", NAMES[k], _ms(v), _ms(model[k])] for k, v in values.items()]
    axes[0].set_ylabel("ms for all buckets (median of 5)", fontsize=9)
    axes[0].legend(fontsize=9)
    record.table = {"head": ["links", "how", "all buckets", "model"], "rows": table}
    record.caption = record.text()
    print(plots.save(fig, out / "07-bench-inflight", record))


def train_record(folder: Path, out: Path) -> None:
    rec = _load(folder, "train")
    if not rec:
        return
    record = claims.Record("07-bench-train", names=NAMES, aliases=ALIASES, meta=_meta([rec], "2 machines × 2 ranks"),
                           title="One DDP training step of lesson 6's MLP, 2 × 2")
    fig = plots._figure(9.5, 3.4)
    axes = fig.subplots(1, len(rec["runs"]), sharey=True, squeeze=False)[0]
    table = []
    for ax, run in zip(axes, rec["runs"]):
        rails = bool(run.get("rails"))
        caps = sorted({r["bucket_cap_mb"] for r in run["rows"]})
        for j, cap in enumerate(caps):
            values = {KEYS[r["name"]]: r["seconds"] for r in run["rows"] if r["bucket_cap_mb"] == cap}
            record.times(f"{'rails' if rails else 'one-link'}-{cap:g}M", values, baseline="ddp",
                         where=f"{timing.human_bytes(run['grad_bytes'])} of gradients in buckets of {cap:g} MiB, "
                               f"2 × 2, {LINK[rails]}")
            for i, (k, v) in enumerate(values.items()):
                ax.bar(j * 4 + i, v * 1e3, color=COLORS[k], label=NAMES[k] if j == 0 and ax is axes[0] else None)
                table.append(["rails" if rails else "one link", f"{cap:g} MiB", NAMES[k], _ms(v),
                              f"{values['ddp'] / v:.2f}×"])
        ax.set_xticks([j * 4 + 1 for j in range(len(caps))], [f"buckets of {c:g} MiB" for c in caps], fontsize=9)
        ax.set_title(LINK[rails], fontsize=10)
    axes[0].set_ylabel("ms per step (median of 5)", fontsize=9)
    fig.legend(fontsize=9, loc="outside lower center", ncols=3)
    record.table = {"head": ["links", "buckets", "variant", "step", "DDP's default ÷ this"], "rows": table}
    record.caption = record.text()
    print(plots.save(fig, out / "07-bench-train", record))


HOST_ROWS = {"bucket": ("bucket", "per bucket, the GPU's path (streams, every stage a collective)"),
             "slice": ("slice", "per slice, in flight (streams, messages inside)"),
             "threads": ("threads", "per bucket, threads for lanes (every thread's CPU)")}


def host_cost_record(folder: Path, out: Path) -> None:
    """``07-host-cost``: the host's own work per bucket and per slice, the reducer before its
    slices were prepared once against now, from ``bench-hier host-cost``'s two records
    (``folder/host-cost/before`` and ``/after``)."""
    recs = [_load(folder / "host-cost" / when, "host-cost") for when in ("before", "after")]
    if not all(recs):
        return
    before, after = ({(tuple(r["layout"]), r["name"]): r for r in rec["runs"][0]["rows"]} for rec in recs)
    meta = {"device": f"{recs[1]['machine']['cores']}-core host ({recs[1]['machine']['cpu']}), "
                      "4 local gloo ranks, shared with other work",
            "torch": recs[1]["versions"]["torch"], "python": recs[1]["versions"].get("python", ""),
            "backend": "gloo", "cpus": recs[1]["machine"]["cores"], "date": recs[1]["date"],
            "command": f"{recs[1]['command']} (before: the same at commit {recs[0]['commit']})",
            "commit": recs[1]["commit"],
            "drawn_by": ".venv/bin/python tools/lesson07_figures.py --records docs/data/bench-hier"}
    record = claims.Record("07-host-cost", names={"before": "the reducer before", "after": "the prepared reducer"},
                           aliases={"after": ["the reducer now"]}, meta=meta,
                           title="The host's own work, torch.distributed's calls stubbed out")
    layouts = sorted({k[0] for k in after})
    fig = plots._figure(9.5, 3.6)
    axes = fig.subplots(1, len(HOST_ROWS), sharey=True, squeeze=False)[0]
    table = []
    for ax, (name, (short, what)) in zip(axes, HOST_ROWS.items()):
        for j, layout in enumerate(layouts):
            b, a = before[(layout, name)], after[(layout, name)]
            values = {"before": b["issue_us"] * 1e-6, "after": a["issue_us"] * 1e-6}
            ident = f"{short}-{layout[0]}x{layout[1]}"
            record.times(ident, values, baseline="before", where=f"host CPU {what}, layout {layout}")
            if name != "threads":
                record.fact(f"calls-{ident}", f"Python calls {what}, layout {layout}: "
                            f"{b['issue_calls']:.0f} before, {a['issue_calls']:.0f} now.",
                            before=b["issue_calls"], after=a["issue_calls"])
            ax.bar(j * 3, b["issue_us"], color="#8c8c8c", label="before" if j == 0 else None)
            ax.bar(j * 3 + 1, a["issue_us"], color="#c44e52", label="prepared slices" if j == 0 else None)
            table.append([what, f"({layout[0]}, {layout[1]})", _ms(values["before"]), _ms(values["after"]),
                          f"{values['before'] / values['after']:.1f}×",
                          "" if name == "threads" else f"{b['issue_calls']:.0f} → {a['issue_calls']:.0f}"])
        ax.set_xticks([j * 3 + 0.5 for j in range(len(layouts))], [f"({d}, {m})" for d, m in layouts], fontsize=9)
        ax.set_title(what.replace(", the GPU's path", "\nthe GPU's path").replace(", in flight", "\nin flight")
                     .replace(", threads", "\nthreads"), fontsize=9)
    axes[0].set_ylabel("host CPU µs (median of 9 rounds)", fontsize=9)
    axes[0].legend(fontsize=9)
    record.table = {"head": ["what", "layout", "before", "now", "speed-up", "Python calls"], "rows": table}
    record.caption = ("The course's own host work per bucket and per slice with torch.distributed's calls stubbed "
                      "out (what the host pays on a GPU besides NCCL's calls), before and after the slices were "
                      "prepared once. " + record.text(*[c["id"] for c in record.comparisons if c["kind"] == "times"]))
    print(plots.save(fig, out / "07-host-cost", record))


DRAWN = {"train": train_record, "inflight": inflight_record, "crossover": crossover_record, "sizes": sizes_record,
         "machines": machines_record, "host-cost": host_cost_record}


def records(folder: Path, out: Path, only: list[str] | None = None) -> None:
    """Lesson 7's measured figures, each with its record, from the bench-hier records in ``folder``."""
    if not (folder / "bench-hier-sizes.json").exists() and not list(folder.glob("bench-hier-*.json")) \
            and not (folder / "host-cost").exists():
        raise SystemExit(f"no bench-hier-*.json records in {folder}")
    for name, draw in DRAWN.items():
        if not only or name in only:
            draw(folder, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", default="", help="folder of bench-hier-<suite>.json records "
                        "(docs/data/bench-hier): draw the measured figures from them")
    parser.add_argument("--only", default="", help=f"with --records: these figures only, e.g. host-cost "
                        f"(of {', '.join(DRAWN)})")
    args = parser.parse_args()
    if args.records:
        only = [n.strip() for n in args.only.split(",") if n.strip()]
        records(Path(args.records), ROOT / "docs" / "img", only)
        if not only:
            results(Path(args.records))
    else:
        timelines()


if __name__ == "__main__":
    main()
