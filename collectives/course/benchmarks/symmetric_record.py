"""``bench-symmetric``'s results: the table it prints, the model fitted to them, its record.

* :func:`model_times` -- :mod:`collectives.symmetric.cost` fitted to the run itself (σ, ρ, ω
  from the one-shot's and two-shot's smallest and largest sizes, α and β of the ring from
  the ring's), and what it predicts at every size;
* :func:`print_table` -- every time, and each shared-memory algorithm's speed-up over the
  library's all-reduce (gloo's, NCCL's);
* :func:`save_record` -- the chart (time against size, the model dashed; on GPUs, who wins
  where for each dtype) and its :class:`~collectives.course.site.claims.Record`, whose
  sentences the lesson page places.
"""

from __future__ import annotations

from pathlib import Path

from ...core import timing
from ...core.cost import AlphaBeta
from ...symmetric.cost import (
    SharedLink,
    crossover,
    fit_ring,
    fit_shared,
    one_shot_seconds,
    ring_seconds,
    two_shot_seconds,
)
from ..catalog import ROOT

NAMES = {"gloo": "gloo's all_reduce", "nccl": "NCCL's all_reduce", "ring": "the course's ring",
         "one_shot": "the shared-memory one-shot", "two_shot": "the shared-memory two-shot",
         "two_shot_home": "the shared-memory two-shot, input in the segment",
         "triton_one_shot": "the lesson's Triton one-shot", "triton_two_shot": "the lesson's Triton two-shot",
         "torch_one_shot": "the plain-torch one-shot", "torch_two_shot": "the plain-torch two-shot",
         "symm_one_shot": "torch's symm_mem one-shot", "symm_two_shot": "torch's symm_mem two-shot",
         "nccl_symmetric": "NCCL's all_reduce on a symmetric window (its symmetric kernels)",
         "triton_two_shot_store": "the lesson's Triton two-shot, gathering by stores"}
BASELINES = ("gloo", "nccl")


def _baseline(times: dict) -> str:
    return next(b for b in BASELINES if b in times)


def model_times(result: dict) -> dict:
    """The model fitted to the run (σ, ρ, ω to both shared-memory algorithms at every size, α
    and β to the ring's), its predicted times, and the crossovers it predicts on a fine sweep."""
    sizes, p = result["sizes"], result["world"]
    times = result["runs"]["float32"]
    one, two, ring = times["one_shot"], times["two_shot"], times["ring"]
    link = fit_shared(p, sizes, one, two)
    ab = fit_ring(p, sizes, ring) if p > 1 else AlphaBeta(0.0, 1e-15)
    alpha, beta = ab.alpha, ab.beta
    predicted = {"one_shot": [one_shot_seconds(n, p, link) for n in sizes],
                 "two_shot": [two_shot_seconds(n, p, link) for n in sizes],
                 "ring": [ring_seconds(n, p, ab) for n in sizes]}
    fine = [2 ** k for k in range(10, 31)]
    return {"link": link, "alpha": alpha, "beta": beta, "predicted": predicted,
            "one_to_two": crossover(lambda n: one_shot_seconds(n, p, link), lambda n: two_shot_seconds(n, p, link),
                                    fine),
            "two_to_ring": crossover(lambda n: two_shot_seconds(n, p, link), lambda n: ring_seconds(n, p, ab),
                                     fine)}


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    for dtype, times in result["runs"].items():
        base = _baseline(times)
        table = Table(title=f"bench-symmetric, {result['backend']}, {result['world']} ranks, {dtype}")
        table.add_column("size", justify="right")
        for name in times:
            table.add_column(name, justify="right")
        for name in times:
            if name != base:
                table.add_column(f"{name} × {base}", justify="right")
        for i, n in enumerate(result["sizes"]):
            row = [timing.human_bytes(n)] + [timing.human_seconds(times[k][i]) for k in times]
            row += [f"{times[base][i] / times[k][i]:.2f}×" for k in times if k != base]
            table.add_row(*row)
        console.print(table)
    console.print(f"checked against dist.all_reduce on integer data: {result['checked']}")


def _speedup_fact(record, result: dict, dtype: str, name: str, nbytes: int) -> None:
    sizes, times = result["sizes"], result["runs"][dtype]
    if nbytes not in sizes or name not in times:
        return
    i, base = sizes.index(nbytes), _baseline(times)
    ratio = times[base][i] / times[name][i]
    where = f"{timing.human_bytes(nbytes)}, {result['world']} ranks, {dtype}"
    record.times(f"{name}-{dtype}-{timing.human_bytes(nbytes).replace(' ', '')}",
                 {base: times[base][i], name: times[name][i]}, baseline=base, where=where)
    record.comparisons[-1]["ratio"] = ratio


def _cpu_record(result: dict, name: str):
    from ..site import claims, plots

    sizes, times = result["sizes"], result["runs"]["float32"]
    model = model_times(result)
    link: SharedLink = model["link"]
    meta = dict(result["meta"], ranks=result["world"], iters=result["iters"], sigma_s=link.sigma,
                rho_s_per_byte=link.rho, omega_s_per_byte=link.omega, alpha_s=model["alpha"],
                beta_s_per_byte=model["beta"], checked=result["checked"])
    record = claims.Record(name, names={k: NAMES[k] for k in times},
                           aliases={"one_shot": ["the one-shot"], "two_shot": ["the two-shot"],
                                    "two_shot_home": ["the two-shot at home"],
                                    "gloo": ["gloo"], "ring": ["the ring"]},
                           title=f"All-reduce on {result['world']} ranks of one CPU host: reading shared memory "
                                 "against sending messages", meta=meta)
    record.sweep("measured", sizes, times)
    for n in (4 << 10, 16 << 10, 4 << 20):
        for algo in ("one_shot", "two_shot"):
            _speedup_fact(record, result, "float32", algo, n)
    _speedup_fact(record, result, "float32", "two_shot_home", 4 << 20)
    record.crossover("one-to-two", sizes, "one_shot", "two_shot", times)
    record.crossover("one-to-two-model", sizes, "one_shot", "two_shot", model["predicted"], label="predicted",
                     at=model["one_to_two"])
    record.sweep("predicted", sizes, model["predicted"], label="predicted by the fitted model")
    # the ring against the two-shot: where (if anywhere) sending overtakes reading, measured and predicted
    record.crossover("ring-over-two", sizes, "two_shot", "ring", times)
    record.crossover("ring-over-two-model", sizes, "two_shot", "ring", model["predicted"], label="predicted",
                     at=model["two_to_ring"])
    record.crossover("gloo-over-two", sizes, "two_shot", "gloo", times)
    record.fact("model", f"Fitted to this run: a barrier σ = {claims.human(link.sigma)}, "
                         f"{link.rho * 1e12:.3g} µs per MB read from a peer and combined (ρ), "
                         f"{link.omega * 1e12:.3g} µs per MB copied in (ω); the ring's α = "
                         f"{claims.human(model['alpha'])}.",
                sigma=link.sigma, rho=link.rho, omega=link.omega, alpha=model["alpha"], beta=model["beta"])
    base = _baseline(times)
    record.table = {"head": ["size"] + [NAMES[k] for k in times] + [f"best ÷ {base}"],
                    "rows": [[timing.human_bytes(n)] + [claims.human(times[k][i]) for k in times]
                             + [f"{times[base][i] / min(times['one_shot'][i], times['two_shot'][i]):.1f}×"]
                             for i, n in enumerate(sizes)]}
    fig = plots.plot_times(sizes, times, model["predicted"],
                           title=f"{result['world']} ranks on one CPU host, float32 (dashed: the fitted model)")
    return fig, record


def _gpu_record(result: dict, name: str):
    from ..site import claims, plots

    sizes, runs = result["sizes"], result["runs"]
    every = sorted({k for times in runs.values() for k in times})
    record = claims.Record(name, names={k: NAMES[k] for k in every},
                           aliases={"nccl": ["NCCL"], "triton_two_shot": ["the Triton two-shot"],
                                    "triton_one_shot": ["the Triton one-shot"]},
                           title=f"All-reduce on {result['world']} GPUs without multicast: who wins where",
                           meta=dict(result["meta"], ranks=result["world"], iters=result["iters"],
                                     checked=result["checked"], host_seconds=result.get("host", {}),
                                     launcher=result.get("launcher", {}), launch=result.get("launch"),
                                     inputs=result.get("inputs"), rule=result.get("rule"),
                                     spread=result.get("spread", {}), skipped=result.get("skipped", [])))
    for dtype, times in runs.items():
        record.sweep(f"measured-{dtype}", sizes, times, label=f"measured, {dtype}")
        for n in (64 << 10, 1 << 20, 16 << 20, 256 << 20):
            for algo in ("triton_two_shot", "symm_two_shot"):
                _speedup_fact(record, result, dtype, algo, n)
        _targets(record, sizes, dtype, times)
    head = ["size"] + [f"{NAMES[k]} ({d})" for d in runs for k in runs[d]]
    record.table = {"head": head, "rows": [[timing.human_bytes(n)] + [claims.human(runs[d][k][i])
                                                                      for d in runs for k in runs[d]]
                                           for i, n in enumerate(sizes)]}
    how = "each replayed from a CUDA graph" if result.get("launch") == "graph" else "each launched from Python"
    fig = plots.plot_winners(sizes, runs, title=f"{result['world']} GPUs: the fastest all-reduce at each size ({how})",
                             names=NAMES)
    return fig, record


def _targets(record, sizes: list[int], dtype: str, times: dict) -> None:
    """The lesson's Triton two-shot against NCCL up to 1 MiB and at 256 MiB, and against
    torch's symm_mem two-shot at every size, read off the run (the facts' ids keep the
    names the page quotes them by)."""
    for algo, tag in (("triton_two_shot", ""), ("triton_two_shot_store", "-store")):
        mine = times.get(algo)
        if mine is None:
            continue
        small = [times["nccl"][i] / mine[i] for i, n in enumerate(sizes) if n <= 1 << 20]
        if small:
            record.fact(f"target-small-{dtype}{tag}", f"{dtype}, up to 1 MiB: {NAMES[algo]} ran at "
                        f"{min(small):.2f}× to {max(small):.2f}× NCCL's speed.", lowest=min(small))
        if 256 << 20 in sizes:
            i = sizes.index(256 << 20)
            ratio = times["nccl"][i] / mine[i]
            record.fact(f"target-256M-{dtype}{tag}", f"{dtype}, 256 MiB: {NAMES[algo]} ran at {ratio:.2f}× "
                        "NCCL's speed.", ratio=ratio)
        if "symm_two_shot" in times:
            worst = max(mine[i] / times["symm_two_shot"][i] for i in range(len(sizes)))
            record.fact(f"target-symm-{dtype}{tag}", f"{dtype}: {NAMES[algo]} took at most {worst:.2f}× the "
                        "time of torch's symm_mem two-shot at any size.", worst=worst)


def save_record(result: dict, name: str, img: Path | None = None) -> Path:
    """Draw the run's chart and write it with its record under ``docs/img`` (or ``img``)."""
    from ..site import plots

    fig, record = (_gpu_record if result["backend"] == "nccl" else _cpu_record)(result, name)
    return plots.save(fig, Path(img or ROOT / "docs" / "img") / name, record)
