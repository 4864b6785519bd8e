"""The charts that open the benchmarks notes, drawn from the records the benchmark wrote.

    .venv/bin/python tools/bench_charts.py      # writes docs/img/bench-ratio-*.svg and their records

Reads two JSON records of ``.venv/bin/python -m collectives bench --json FILE`` (:data:`RECORDS`:
the CPU run on this course's host, the GPU run on NVIDIA GPUs) and draws each algorithm's speed
ratio to the library's ``dist.all_reduce`` -- the record's ``baseline_seconds / seconds``, above 1
is faster -- against the tensor size. Nothing is measured here and nothing is typed in: the
chart's record (:mod:`collectives.course.site.claims`) takes the run's device, versions, date,
command and commit from the benchmark record's meta, and says the fastest at each size, which
the page's caption states. Rerun after rerunning either benchmark.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collectives.course.site import claims, plots  # noqa: E402

IMG = ROOT / "docs" / "img"
# chart name -> the benchmark record it is drawn from
RECORDS = {
    "bench-ratio-cpu": ROOT / "docs" / "data" / "bench-cpu.json",
    "bench-ratio-gpu": ROOT / "docs" / "data" / "gpu" / "bench-2x-h200.json",
}
LIBRARY = {"gloo": "gloo's all_reduce", "nccl": "NCCL's all_reduce"}
META = ("command", "date", "device", "torch", "nccl", "commit", "backend", "world_size", "dtype",
        "iters", "warmup", "registered_memory", "cpus", "load_average_before", "load_average", "commit_note",
        "launch", "inputs", "batch")     # launch, inputs: the rule for fair GPU comparisons, read by the pages


def load(path: Path) -> tuple[dict, list[int], dict[str, list[float | None]]]:
    """A bench record's meta, its sizes, and each algorithm's speed ratio at each size
    (``None`` where it has no time or failed its check); the library's own rows are left out."""
    record = json.loads(path.read_text(encoding="utf-8"))
    meta, rows = record["meta"], record["rows"]
    library = meta["backend"]
    sizes = sorted({r["nbytes"] for r in rows})
    ratios: dict[str, list[float | None]] = {}
    for r in rows:
        if r["algo"] == library:
            continue
        values = ratios.setdefault(r["algo"], [None] * len(sizes))
        if r["seconds"] and r["baseline_seconds"] and r["ok"] is not False:
            values[sizes.index(r["nbytes"])] = r["baseline_seconds"] / r["seconds"]
    return meta, sizes, ratios


def title(meta: dict) -> str:
    library = LIBRARY.get(meta["backend"], meta["backend"])
    if meta["backend"] == "nccl":
        memory = "registered memory" if meta.get("registered_memory") else "plain memory"
        return f"GPU: {meta['device']}, {memory}, against {library}"
    return f"CPU: {meta['world_size']} gloo ranks on {meta['cpus']} cores, against {library}"


def _ticks(ratios: dict[str, list[float | None]]) -> list[float]:
    values = [v for vs in ratios.values() for v in vs if v] + [1.0]
    lo, hi = math.floor(math.log2(min(values))), math.ceil(math.log2(max(values)))
    return [2.0 ** k for k in range(lo, hi + 1)]


def draw(name: str, source: Path) -> Path:
    meta, sizes, ratios = load(source)
    library = LIBRARY.get(meta["backend"], meta["backend"])
    fig = plots._figure(8.5, 4.2)
    ax = fig.subplots()
    for i, (algo, values) in enumerate(ratios.items()):
        points = [(s, v) for s, v in zip(sizes, values) if v is not None]
        ax.plot([s for s, _ in points], [v for _, v in points], "o-", color=f"C{i % 10}",
                ms=4, lw=1.5, label=algo.replace("_", " "))
    ax.axhline(1.0, color="black", lw=1.2, ls="--", label="the library (= 1)")
    plots._size_axis(ax, sizes)
    ax.set_yscale("log", base=2)
    ticks = _ticks(ratios)
    ax.set_yticks(ticks, [f"{t:g}×" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("tensor size")
    ax.set_ylabel("library time / algorithm time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title(meta), fontsize=11)
    names = {algo: algo.replace("_", " ") for algo in ratios} | {"library": library}
    aliases = {"library": ["the library", "dist.all_reduce", meta["backend"]]}
    run = {k: meta[k] for k in META if meta.get(k) is not None}
    run["source"] = str(source.relative_to(ROOT))
    record = claims.Record(name, names=names, aliases=aliases, meta=run, title=title(meta))
    # times relative to the library's: 1 / ratio (lower is faster), the library itself 1
    relative = {algo: [1 / v if v else float("inf") for v in values] for algo, values in ratios.items()}
    relative["library"] = [1.0] * len(sizes)
    record.sweep("relative time", sizes, relative, label="measured")
    record.caption = (f"Each algorithm's speed as a fraction of the library's ({library}) on the same "
                      f"tensor in the same world, from `{run['source']}`: above 1 is faster. "
                      + record.text())
    return plots.save(fig, IMG / name, record)


def main() -> None:
    for name, source in RECORDS.items():
        print(draw(name, source).relative_to(ROOT))


if __name__ == "__main__":
    main()
