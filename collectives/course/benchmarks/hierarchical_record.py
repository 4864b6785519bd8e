"""What every ``bench-hier`` run writes: the record beside its figure.

A benchmark of lesson 7 writes ``<out>/bench-hier-<suite>.json`` and ``.png``: the machine
(CPU model, cores), the versions (torch, Python), the date, the exact command, the
cluster it made, every measured row, and the comparisons the figure shows -- which is
faster, by how much, where a crossover falls -- computed from the rows, so that a page or
a lab can state them from the record and nothing else.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch

from ...core import timing
from ..catalog import ROOT

DEFAULT_OUT = ROOT / "build" / "bench"


def machine() -> dict:
    """The host the run measured: CPU model and cores, or the GPU."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    from ..site.claims import host
    out = {"cpu": cpu, "cores": os.cpu_count(), "host": platform.node(), **host()}
    if torch.cuda.is_available():
        out["gpu"] = f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    return out


def versions() -> dict:
    from ..site.claims import commit
    return {"torch": torch.__version__, "python": platform.python_version(), "commit": commit()}


def command(suite: str, argv: list[str]) -> str:
    """The command line that reruns this record."""
    rest = [a for a in argv if a != suite]
    return " ".join([".venv/bin/python -m collectives bench-hier", suite, *rest]).strip()


def ratio(slower: float, faster: float) -> float:
    return slower / faster if faster > 0 else float("nan")


def compare(what: str, a_name: str, a_seconds: float, b_name: str, b_seconds: float) -> dict:
    """One comparison: which of two is faster, and by how much (the slower's time ÷ the faster's)."""
    faster, slower = (a_name, b_name) if a_seconds <= b_seconds else (b_name, a_name)
    return {"what": what, "faster": faster, "slower": slower,
            "by": round(ratio(max(a_seconds, b_seconds), min(a_seconds, b_seconds)), 3),
            a_name: a_seconds, b_name: b_seconds,
            "text": f"{what}: {faster} is {ratio(max(a_seconds, b_seconds), min(a_seconds, b_seconds)):.2f}x "
                    f"faster than {slower} ({timing.human_seconds(min(a_seconds, b_seconds))} against "
                    f"{timing.human_seconds(max(a_seconds, b_seconds))})"}


def write(suite: str, argv: list[str], result: dict, figure=None, out: str | os.PathLike | None = None) -> Path:
    """Write ``result`` (plus machine, versions, date and command) as JSON and ``figure`` as
    PNG under ``out``; return the JSON's path."""
    from ..site.plots import DPI

    folder = Path(out) if out else DEFAULT_OUT
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"bench-hier-{suite}"
    record = {"bench": f"bench-hier {suite}", "command": command(suite, argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "versions": versions(), **result}
    if figure is not None:
        figure.savefig(stem.with_suffix(".png"), dpi=DPI, facecolor="white")
        record["figure"] = stem.with_suffix(".png").name
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
    return stem.with_suffix(".json")


def print_comparisons(result: dict) -> None:
    for c in result.get("comparisons", []):
        print(c["text"])
    for key in ("crossover", "notes"):
        if result.get(key):
            print(f"{key}: {result[key]}")
