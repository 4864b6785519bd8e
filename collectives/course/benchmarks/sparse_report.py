"""``bench-sparse``'s results against the α-β model, and their tables.

* :func:`measured_crossover` -- where the measured sweep's best sparse variant meets the
  dense all-reduce;
* :func:`model_link`, :func:`model_seconds`, :func:`model_crossover` -- what
  :mod:`collectives.sparse.cost` predicts on the cluster's link (α measured, β from the
  link's rate), on the wire alone or with the processor's part as measured in the same
  world (selection interpolated between the swept densities, zeroing and pairs at the
  rates :func:`~collectives.sparse.profile.measure_compute` timed);
* ``_print`` -- the tables: each transport against ``dist.all_reduce``, the split
  transport's two partitions, the density sweep with the model's time beside it.

:mod:`collectives.course.benchmarks.sparse` measures and re-exports these names.
"""

from __future__ import annotations

import math

from ...core import cost as core_cost
from ...core import netns, timing
from ...sparse import cost, keep_count


def measured_crossover(sweep: list[dict], dense: float) -> float | None:
    """The density where the best sparse variant's time meets the dense time (log-linear
    interpolation between the two sweep points around it); None if it never does."""
    pts = [(r["density"], min(r["allgather"], r["split"])) for r in sweep]
    for (d0, t0), (d1, t1) in zip(pts, pts[1:]):
        if t0 <= dense < t1 or t0 < dense <= t1:
            f = (dense - t0) / (t1 - t0)
            return math.exp(math.log(d0) + f * (math.log(d1) - math.log(d0)))
    return None


def _print(result: dict, where: str, rate: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    table = Table(title=f"sparse all-reduce, {where}: {result['p']} ranks, n = {result['n']} float32 "
                        f"({timing.human_bytes(result['n'] * 4)}), density {result['density']:.2%}")
    for col in ("variant", "mode", "time", "selection", "wire + rest", "speed-up vs dense", "sent / rank",
                "dense ring sends"):
        table.add_column(col, justify="left" if col in ("variant", "mode") else "right")
    for r in result["rows"]:
        table.add_row(r["variant"], r["mode"], timing.human_seconds(r["seconds"]), timing.human_seconds(r["select"]),
                      timing.human_seconds(max(r["seconds"] - r["select"], 0.0)),
                      f"{result['dense'] / r['seconds']:.2f}×", timing.human_bytes(r["sent"]),
                      timing.human_bytes(result["dense_sent"]))
    if result["rows"]:
        console.print(table)
    console.print(f"dist.all_reduce: {timing.human_seconds(result['dense'])}")
    if result.get("partitions"):
        part = result["partitions"]
        console.print(f"split, equal index ranges: {timing.human_seconds(part['equal']['seconds'])} (the busiest owner "
                      f"gets {part['equal']['imbalance']:.2f}× the mean); Ok-Topk's balanced partition: "
                      f"{timing.human_seconds(part['balanced']['seconds'])} ({part['balanced']['imbalance']:.2f}×; "
                      f"found in {timing.human_seconds(part['balance_seconds'])}); rank 0's indices chosen by the "
                      f"others too: {part['overlap_with_rank0']:.0%}")
    if result["sweep"]:
        sweep = Table(title="density sweep (top-k)")
        model = rate is not None and "compute" in result
        for col in (("density",) + (("selection",) if model else ()) + ("all-gather", "split", "dense", "best / dense")
                    + (("model: best",) if model else ())):
            sweep.add_column(col, justify="right")
        for r in result["sweep"]:
            cells = [f"{r['density']:.2%}", timing.human_seconds(r["allgather"]), timing.human_seconds(r["split"]),
                     timing.human_seconds(result["dense"]), f"{min(r['allgather'], r['split']) / result['dense']:.2f}"]
            if model:
                cells.append(timing.human_seconds(model_seconds(result, model_link(result, rate), r["density"])))
                cells.insert(1, timing.human_seconds(r["select"]))
            sweep.add_row(*cells)
        console.print(sweep)


def model_link(result: dict, rate: str) -> core_cost.AlphaBeta:
    """The cluster's link as the model sees it: α measured (a one-element all-reduce), β from
    the link's rate."""
    return core_cost.AlphaBeta(alpha=result["alpha"], beta=1 / netns.rate_bytes_per_second(rate))


def _select_seconds(result: dict, density: float) -> float:
    """Selection time at ``density``, interpolated (log-log) between the swept densities."""
    pts = sorted((r["density"], r["select"]) for r in result["sweep"])
    if density <= pts[0][0]:
        return pts[0][1]
    for (d0, t0), (d1, t1) in zip(pts, pts[1:]):
        if density <= d1:
            f = math.log(density / d0) / math.log(d1 / d0)
            return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
    return pts[-1][1] * density / pts[-1][0]


def model_seconds(result: dict, link: core_cost.AlphaBeta, density: float, variant: str = "best",
                  with_compute: bool = True) -> float:
    """The model's time at ``density``: the wire (α, β), and with ``with_compute`` the
    processor -- selection as timed at the swept densities, the zeroing and the pairs' work
    at the rates :func:`measure_compute` timed."""
    if variant == "best":
        return min(model_seconds(result, link, density, v, with_compute) for v in ("allgather", "split"))
    n, p = result["n"], result["p"]
    k = keep_count(n, density)
    compute = None
    if with_compute and "compute" in result:
        compute = cost.SparseCompute(scan=result["compute"]["scan"], pick=_select_seconds(result, density) / k,
                                     pair=result["compute"]["pair"])
    return cost.sparse_seconds(variant, n, k, p, link, compute)


def model_crossover(result: dict, link: core_cost.AlphaBeta, with_compute: bool = False) -> float | None:
    """Where the model's best sparse variant (all-gather or split) meets its dense ring: the
    wire alone, or with the processor's part measured in the same world (then only within
    the swept densities; None if it does not meet there)."""
    if not with_compute:
        return cost.sparse_crossover(result["n"], result["p"], link, transport="best")
    dense = cost.sparse_cost("dense", result["n"], result["n"], result["p"]).seconds(link)
    densities = sorted(r["density"] for r in result["sweep"])
    lo, hi = densities[0], densities[-1]
    gap = lambda d: model_seconds(result, link, d) - dense  # noqa: E731
    if gap(lo) >= 0 or gap(hi) <= 0:
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return math.sqrt(lo * hi)
