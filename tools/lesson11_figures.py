"""Lesson 11's figures, each with the record of what it shows, into docs/img/.

    .venv/bin/python tools/lesson11_figures.py --records docs/data/11-alltoall

reads the ``bench-alltoall-<suite>.json`` records that ``.venv/bin/python -m collectives
bench-alltoall <suite> --out DIR`` wrote and draws from them, each as ``docs/img/11-<name>.svg``
with its claims record (:mod:`collectives.course.site.claims`; the device, versions, date,
command and commit come from the bench record's ``meta``):

* ``11-alltoall-local``: linear, pairwise, Bruck and ``dist.all_to_all_single`` over the
  sizes, the winner at each size, where pairwise overtakes Bruck, and the α–β fit beside;
* ``11-alltoall-cluster``: the hierarchical all-to-all against the flat ones and the library
  on the simulated 2 × 2 and 4 × 2 clusters, the two-tier model beside;
* ``11-alltoall-moe``: the MoE layer's dispatch + combine against its expert compute, and the
  slowest rank's step as the routing skews.

Nothing is typed by hand: every sentence is made from the values.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from collectives import timing  # noqa: E402
from collectives.course.site import claims, plots  # noqa: E402

NAMES = {"dist.all_to_all_single": "gloo's all_to_all_single", "linear": "the linear all-to-all",
         "pairwise": "the pairwise exchange", "bruck": "Bruck's all-to-all",
         "hierarchical": "the hierarchical all-to-all"}
KEYS = {"dist.all_to_all_single": "library", "linear": "linear", "pairwise": "pairwise", "bruck": "bruck",
        "hierarchical": "hierarchical"}
COLORS = {"library": "tab:gray", "linear": "tab:blue", "pairwise": "tab:orange", "bruck": "tab:green",
          "hierarchical": "tab:purple"}


def _names() -> dict:
    return {KEYS[k]: v for k, v in NAMES.items()}


def _ms(seconds: float) -> str:
    return claims.human(seconds)


def _meta(raw: dict) -> dict:
    meta = dict(raw["meta"])
    meta.setdefault("device", "machine not recorded")
    return meta


def local_record(raw: dict, out: Path) -> None:
    rows = raw["rows"]
    sizes = sorted({r["nbytes"] for r in rows})
    values = {KEYS[n]: [next(r["seconds"] for r in rows if r["name"] == n and r["nbytes"] == s) for s in sizes]
              for n in NAMES if any(r["name"] == n for r in rows)}
    p = raw["world_size"]
    record = claims.Record("11-alltoall-local", names=_names(), meta=_meta(raw),
                           aliases={"bruck": ["Bruck"], "pairwise": ["pairwise"]},
                           title=f"All-to-all on {p} local ranks, input bytes per rank",
                           alt="Time of each all-to-all against the input size per rank, log-log")
    record.sweep("winners", sizes, values, label=f"measured on {p} local gloo ranks")
    record.crossover("bruck-pairwise", sizes, "bruck", "pairwise", values,
                     label=f"measured on {p} local ranks")
    record.fact("fit", f"A least-squares fit of the pairwise times gives α = {_ms(raw['alpha'])} per message and "
                f"1/β = {timing.human_bytes(1 / raw['beta'])}/s; with them the model puts the crossover below which "
                f"Bruck's fewer messages win at {timing.human_bytes(raw['predicted_crossover'])} of input per rank.",
                alpha=raw["alpha"], beta=raw["beta"], predicted=raw["predicted_crossover"])
    fig = plots._figure(7.5, 3.6)
    ax = fig.subplots()
    for key, ys in values.items():
        ax.loglog(sizes, [y * 1e3 for y in ys], "o-", color=COLORS[key], label=_names()[key])
    ax.set_xlabel("input bytes per rank", fontsize=9)
    ax.set_ylabel("ms (median, slowest rank)", fontsize=9)
    ax.set_xticks(sizes, [timing.human_bytes(s) for s in sizes], fontsize=9)
    ax.tick_params(labelsize=9)
    ax.legend(fontsize=9)
    head = ["size"] + [_names()[k] for k in values]
    record.table = {"head": head, "rows": [[timing.human_bytes(s)] + [_ms(values[k][i]) for k in values]
                                           for i, s in enumerate(sizes)]}
    record.caption = record.text()
    print(plots.save(fig, out / "11-alltoall-local", record))


def cluster_record(raw: dict, out: Path) -> None:
    record = claims.Record("11-alltoall-cluster", names=_names(), meta=_meta(raw),
                           aliases={"hierarchical": ["the hierarchy", "hierarchical dispatch"]},
                           title=f"All-to-all on the simulated clusters, {raw['link']} per machine",
                           alt="Time of each all-to-all on 2 x 2 and 4 x 2 machines, measured and modelled")
    runs = raw["runs"]
    fig = plots._figure(9.5, 3.6)
    axes = fig.subplots(1, len(runs), squeeze=False)[0]
    table_rows = []
    for ax, run in zip(axes, runs):
        D, M = run["layout"]
        sizes = sorted({r["nbytes"] for r in run["rows"]})
        for s in sizes:
            at = {KEYS[r["name"]]: r for r in run["rows"] if r["nbytes"] == s}
            where = f"{timing.human_bytes(s)} per rank, {M} machines × {D} ranks, {raw['link']}"
            record.times(f"M{M}-D{D}-{timing.human_bytes(s).replace(' ', '')}",
                         {k: r["seconds"] for k, r in at.items()}, baseline="linear", where=where)
            table_rows.append([f"{M} × {D}", timing.human_bytes(s)]
                              + [f"{_ms(at[k]['seconds'])} ({_ms(at[k]['model_seconds'])})" if "model_seconds"
                                 in at[k] else _ms(at[k]["seconds"]) for k in ("library", "linear", "pairwise",
                                                                                   "hierarchical")])
        for name in ("dist.all_to_all_single", "linear", "pairwise", "hierarchical"):
            ys = [next(r["seconds"] for r in run["rows"] if r["name"] == name and r["nbytes"] == s) for s in sizes]
            ax.loglog(sizes, [y * 1e3 for y in ys], "o-", color=COLORS[KEYS[name]], label=NAMES[name])
            if name in ("linear", "hierarchical"):
                model = [next(r["model_seconds"] for r in run["rows"] if r["name"] == name and r["nbytes"] == s)
                         for s in sizes]
                ax.loglog(sizes, [y * 1e3 for y in model], ":", color=COLORS[KEYS[name]])
        ax.set_title(f"{M} machines × {D} ranks (dotted: model)", fontsize=9)
        ax.set_xticks(sizes, [timing.human_bytes(s) for s in sizes], fontsize=9)
        ax.set_xlabel("input bytes per rank", fontsize=9)
        ax.tick_params(labelsize=9)
    axes[0].set_ylabel("ms (median, slowest rank)", fontsize=9)
    axes[0].legend(fontsize=9)
    record.table = {"head": ["machines × ranks", "size", "library", "linear (model)", "pairwise (model)",
                             "hierarchical (model)"], "rows": table_rows}
    record.caption = "Solid: measured; dotted: the two-tier model. " + record.text()
    print(plots.save(fig, out / "11-alltoall-cluster", record))


def _moe_row(r: dict) -> dict:
    """From one sweep row: the busiest rank's expert time, the mean rank's, the layer call."""
    experts = [s["experts"] for s in r["per_rank"]]
    return dict(busiest=max(experts), mean_experts=sum(experts) / len(experts), layer=r["slowest"])


def moe_record(raw: dict, out: Path) -> None:
    rows = raw["rows"]
    names = {"communication": "dispatch + combine", "experts": "the expert compute",
             "busiest": "the busiest rank's experts", "mean_experts": "the mean rank's experts"}
    record = claims.Record("11-alltoall-moe", names=names, meta=_meta(raw),
                           title=f"The MoE layer on {raw['world_size']} ranks, as routing skews",
                           alt="Expert time of the busiest and the mean rank, and the layer call, against skew")
    factors = sorted({r["factor"] for r in rows})
    fig = plots._figure(9.5, 3.4)
    axes = fig.subplots(1, len(factors), squeeze=False, sharey=True)[0]
    table_rows = []
    for ax, factor in zip(axes, factors):
        mine = [r for r in rows if r["factor"] == factor]
        derived = [_moe_row(r) for r in mine]
        skews = [r["skew"] for r in mine]
        uniform, worst = mine[0], mine[-1]
        label = f"capacity factor {factor:g}"
        record.times(f"split-{factor:g}", {"communication": uniform["communication"], "experts": uniform["experts"]},
                     where=f"uniform routing, {raw['tokens']} tokens per rank, hidden {raw['hidden']}, {label}, "
                           "slowest rank of each")
        first, last = derived[0], derived[-1]
        record.fact(f"skew-{factor:g}", f"With {label}, skewing the routing (bias {worst['skew']:g}) took the busiest "
                    f"rank from {max(uniform['received'])} to {max(worst['received'])} received rows and its expert "
                    f"compute from {_ms(first['busiest'])} to {_ms(last['busiest'])}, while the mean rank's went from "
                    f"{_ms(first['mean_experts'])} to {_ms(last['mean_experts'])}; {worst['dropped']} choices were "
                    f"dropped (uniform: {uniform['dropped']}), and the layer call, which every rank waits out, "
                    f"went from {_ms(first['layer'])} to {_ms(last['layer'])}.",
                    skews=skews, busiest=[d["busiest"] for d in derived], layer=[d["layer"] for d in derived])
        ax.plot(skews, [d["layer"] * 1e3 for d in derived], "o-", color="tab:gray", label="layer call")
        ax.plot(skews, [d["busiest"] * 1e3 for d in derived], "o-", color="tab:red", label="busiest rank's experts")
        ax.plot(skews, [d["mean_experts"] * 1e3 for d in derived], "o--", color="tab:blue",
                label="mean rank's experts")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("router bias towards expert 0 (0: uniform)", fontsize=9)
        ax.tick_params(labelsize=9)
        for r, d in zip(mine, derived):
            table_rows.append([f"{factor:g}", f"{r['skew']:g}", str(max(r["received"])), str(min(r["received"])),
                               str(r["dropped"]), _ms(d["busiest"]), _ms(d["mean_experts"]), _ms(d["layer"])])
    axes[0].set_ylabel("ms", fontsize=9)
    axes[0].legend(fontsize=9)
    record.table = {"head": ["capacity", "skew", "most rows", "fewest rows", "dropped", "busiest experts",
                             "mean experts", "layer call"], "rows": table_rows}
    record.caption = record.text()
    print(plots.save(fig, out / "11-alltoall-moe", record))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", default=str(ROOT / "docs" / "data" / "11-alltoall"))
    parser.add_argument("--out", default=str(claims.IMG))
    args = parser.parse_args()
    folder, out = Path(args.records), Path(args.out)
    for suite, draw in (("local", local_record), ("cluster", cluster_record), ("moe", moe_record)):
        path = folder / f"bench-alltoall-{suite}.json"
        if path.exists():
            draw(json.loads(path.read_text()), out)
        else:
            print(f"no {path}: run .venv/bin/python -m collectives bench-alltoall {suite} --out {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
