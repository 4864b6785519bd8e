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
  slowest rank's step as the routing skews;
* ``11-alltoall-host``: the host's CPU time per call of each all-to-all, before its plan and
  with it, alone and on local ranks, beside what its messages alone cost (``bench-alltoall host``);
* ``11-alltoall-gpu-gap`` (a record, no image): NCCL's ``all_to_all_single`` against the
  hand-written ones on GPUs (``bench-alltoall-local-nccl-p4.json``, from ``tools/gpu_lesson11.py``).

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


def _us(seconds) -> str:
    return "n/a" if seconds is None else claims.human(seconds)


def host_record(raw: dict, out: Path) -> None:
    """The host's work per call, before the plans and now: alone (no message) and at p ranks."""
    before = raw.get("before") or {}
    was_alone = {r["name"]: r for r in before.get("alone") or []}
    was = {r["name"]: r for r in before.get("rows") or []}
    now_alone = {r["name"]: r for r in raw.get("alone") or []}
    rows = {r["name"]: r for r in raw["rows"]}
    p = raw["world_size"]
    names = [n for n in NAMES if n in rows and n != "dist.all_to_all_single"]
    record = claims.Record("11-alltoall-host", names={KEYS[n]: NAMES[n] for n in NAMES}, meta=_meta(raw),
                           title=f"Host CPU time per call, tiny tensors: alone and on {p} local ranks",
                           alt="Bars: host time per call of each all-to-all before and after its plan; "
                               "stacked: messages through torch, the trace's wrappers, the algorithm's own work")
    table_rows = []
    for n in names:
        a0, a1 = was_alone.get(n, {}).get("host_seconds"), now_alone.get(n, {}).get("host_seconds")
        r0, r1 = was.get(n, {}), rows[n]
        table_rows.append([NAMES[n], _us(a0), _us(a1), f"{a0 / a1:.1f}×" if a0 and a1 else "n/a",
                           f"{r0.get('python_calls_total', 'n/a')} → {r1['python_calls_total']}",
                           _us(r1["host_seconds"]), _us(r1["floor_seconds"]), _us(r1["untraced_floor_seconds"])])
    record.table = {"head": ["all-to-all", "alone, before", "alone, now", "before ÷ now",
                             f"Python calls per call ({p} ranks)", f"host, {p} ranks", "its messages alone",
                             "the same, untraced"], "rows": table_rows}
    lin, lin_alone = rows["linear"], now_alone.get("linear", {})
    if "linear" in was_alone and lin_alone:
        record.fact("alone-linear", f"Alone -- one rank, nothing sent -- a call of the linear all-to-all took "
                    f"{_us(was_alone['linear']['host_seconds'])} of host CPU before its plan and "
                    f"{_us(lin_alone['host_seconds'])} with it: "
                    f"{was_alone['linear']['host_seconds'] / lin_alone['host_seconds']:.1f}× less.",
                    before=was_alone["linear"]["host_seconds"], now=lin_alone["host_seconds"])
    record.fact("floor-linear", f"On {p} ranks a call of the linear all-to-all took {_us(lin['host_seconds'])} of "
                f"host CPU; its {lin['messages']} sends and as many receives alone, replayed, took "
                f"{_us(lin['floor_seconds'])}, and {_us(lin['untraced_floor_seconds'])} through torch's own "
                f"isend/irecv past the course's trace.", host=lin["host_seconds"], floor=lin["floor_seconds"],
                untraced=lin["untraced_floor_seconds"])
    if (was.get("linear") or {}).get("own_seconds") and lin.get("own_seconds"):
        record.fact("own-linear", f"On {p} ranks the linear all-to-all's own work -- a call's time minus its "
                    f"messages' alone, the slowest rank -- was {_us(was['linear']['own_seconds'])} before its plan "
                    f"and {_us(lin['own_seconds'])} with it; the two runs were made on the same host.",
                    before=was["linear"]["own_seconds"], now=lin["own_seconds"])
    lib = rows.get("dist.all_to_all_single")
    if lib:
        record.fact("library", f"The library's all_to_all_single, one C++ call for all of its messages, took "
                    f"{_us(lib['host_seconds'])} of host CPU per call on the same ranks.",
                    library=lib["host_seconds"])
    fig = plots._figure(9.0, 3.4)
    left, right = fig.subplots(1, 2)
    xs = range(len(names))
    if was_alone:
        left.bar([x - 0.2 for x in xs], [was_alone[n]["host_seconds"] * 1e6 for n in names], 0.4,
                 color="tab:gray", label="before the plans")
    left.bar([x + 0.2 for x in xs], [now_alone[n]["host_seconds"] * 1e6 for n in names], 0.4,
             color="tab:blue", label="with the plans")
    left.set_title("alone: one rank, no message", fontsize=9)
    bare = [rows[n]["untraced_floor_seconds"] * 1e6 for n in names]
    wrap = [max(0.0, (rows[n]["floor_seconds"] - rows[n]["untraced_floor_seconds"]) * 1e6) for n in names]
    own = [max(0.0, (rows[n]["host_seconds"] - rows[n]["floor_seconds"]) * 1e6) for n in names]
    right.bar(xs, bare, color="tab:gray", label="messages, torch's own isend/irecv")
    right.bar(xs, wrap, bottom=bare, color="tab:orange", label="the course's trace wrappers")
    right.bar(xs, own, bottom=[a + b for a, b in zip(bare, wrap)], color="tab:blue", label="the algorithm's own")
    right.set_title(f"{p} ranks, with the plans", fontsize=9)
    for ax in (left, right):
        ax.set_xticks(list(xs), [KEYS[n] for n in names], fontsize=9)
        ax.tick_params(labelsize=9)
        ax.legend(fontsize=9)
    left.set_ylabel("host CPU µs per call", fontsize=9)
    record.caption = record.text()
    print(plots.save(fig, out / "11-alltoall-host", record))


def gpu_gap_record(raw: dict, out: Path) -> None:
    """NCCL's all_to_all_single against the hand-written ones on GPUs: the fixed gap and the large sizes."""
    rows = raw["rows"]
    meta = dict(raw.get("gpu_meta") or raw["meta"])
    for key in ("command", "commit", "date", "device", "torch", "nccl"):
        meta.setdefault(key, raw["meta"].get(key))
    record = claims.Record("11-alltoall-gpu-gap", names=_names() | {"library": "NCCL's all_to_all_single"},
                           meta=meta, title="All-to-all on GPUs: NCCL's against the hand-written ones")
    at = lambda n, s: next(r["seconds"] for r in rows if r["name"] == n and r["nbytes"] == s)   # noqa: E731
    sizes = sorted({r["nbytes"] for r in rows})
    small, large = sizes[0], [s for s in sizes if s >= 32 << 20]
    where = f"{raw['world_size']} GPUs"
    for s in [small] + large:
        record.times(f"at-{timing.human_bytes(s).replace(' ', '')}",
                     {KEYS[n]: at(n, s) for n in ("dist.all_to_all_single", "linear", "pairwise")},
                     baseline="library", where=f"{timing.human_bytes(s)} per rank, {where}")
    gaps = {s: at("linear", s) - at("dist.all_to_all_single", s) for s in [small] + large}
    record.fact("gap", f"The linear all-to-all's time minus NCCL's: {_us(gaps[small])} at "
                f"{timing.human_bytes(small)}, where neither moves many bytes; "
                + ", ".join(f"{_us(gaps[s])} at {timing.human_bytes(s)}" for s in large)
                + ". Most of the gap is the same at every size: a fixed cost per call.",
                gaps={str(k): v for k, v in gaps.items()})
    record.table = {"head": ["size per rank", "NCCL", "linear", "pairwise", "NCCL ÷ linear"],
                    "rows": [[timing.human_bytes(s), _us(at("dist.all_to_all_single", s)), _us(at("linear", s)),
                              _us(at("pairwise", s)), f"{at('dist.all_to_all_single', s) / at('linear', s):.2f}"]
                             for s in [small] + large]}
    record.caption = record.text()
    print(record.save(out / "11-alltoall-gpu-gap"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", default=str(ROOT / "docs" / "data" / "11-alltoall"))
    parser.add_argument("--out", default=str(claims.IMG))
    args = parser.parse_args()
    folder, out = Path(args.records), Path(args.out)
    for suite, draw in (("local", local_record), ("cluster", cluster_record), ("moe", moe_record),
                        ("host", host_record), ("local-nccl-p4", gpu_gap_record)):
        path = folder / f"bench-alltoall-{suite}.json"
        if path.exists():
            draw(json.loads(path.read_text()), out)
        else:
            print(f"no {path}: run .venv/bin/python -m collectives bench-alltoall {suite} --out {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
