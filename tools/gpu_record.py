"""Gather one run of the GPU lane (tools/gpu_suite.sh) into one record: DIR/lane.json.

    python3 tools/gpu_record.py DIR
    python3 tools/gpu_record.py --again docs/data/gpu/lane-4x-h100.json   # judge a record anew
    python3 tools/gpu_record.py --merge OUT.json LANE.json LATER.json ...   # later runs' steps over it

The record names the machine as hardware (GPU model and count, how they are linked, from
``nvidia-smi topo -m``), the versions (torch, NCCL, driver), the date, the commit, and for
every step its command, exit status and seconds, with the JSON that step wrote (a benchmark's
rows, the tour's rows). ``docs/data/gpu/`` keeps these records; the benchmarks page reads them.

``--merge`` lays the steps of later runs on one kind of machine over a record (a step run
again counts its latest run); every step then names the commit and date of its own run, and
the record lists every commit it holds.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path


def _links(topology: str) -> str:
    """"NV18" when every pair of GPUs is joined by 18 NVLinks, else what the matrix shows."""
    kinds = set()
    for line in topology.splitlines():
        if re.match(r"^GPU\d+\s", line):
            cells = line.split()[1:]
            kinds |= {c for c in cells if re.fullmatch(r"NV\d+|PIX|PXB|PHB|NODE|SYS", c)}
    return ", ".join(sorted(kinds)) or "unknown"


def _ratio_at(rows: list, algo: str, nbytes: int) -> float | None:
    for r in rows:
        if r.get("algo") == algo and r.get("nbytes") == nbytes:
            return r.get("ratio")
    return None


def headline(step: str, data, tail: list[str]) -> tuple[str, str]:
    """(what the step measured in one line, the target it is held to) -- from its JSON."""
    if step == "tests":
        last = next((line for line in reversed(tail) if " passed" in line or " failed" in line), "")
        return last.strip(), "every gpu test passes"
    if step.startswith("tour-") and isinstance(data, list):
        ok = sum(bool(r.get("verified")) for r in data)
        return f"{ok} of {len(data)} rows verified against dist.all_reduce", "every row verified"
    if step.startswith("runner-"):
        last = next((line for line in reversed(tail) if "tasks pass" in line), "")
        return last.strip(), "every task passes on the reference"
    if step == "cheats":
        last = next((line for line in reversed(tail) if "cheat fixtures" in line), "")
        return last.strip(), "every cheat fixture scores nothing on its tasks"
    if step.startswith("ringcheck") and isinstance(data, dict) and isinstance(data.get("rule"), dict):
        p4 = step.startswith("ringcheck-p4")
        how = {"graph": "every side replayed", "eager": "every side eager"}[data["rule"]["launch"]]
        speed = f"{data['ratio']:.3f}" if data.get("ratio") else "not timed"
        host = f"{data['ring_host_s'] * 1e6:.1f} µs" if data.get("ring_host_s") else "-"
        return (f"ring ÷ NCCL (speed) {speed} at {data['bytes'] >> 20} MiB, {data['memory']} memory, {how}, "
                f"exact {data['exact']}; host per ring {host}"
                + (f"; skipped: {'; '.join(data['rule']['skipped'])}" if data["rule"]["skipped"] else ""),
                "speed ≥ 0.80 (p = 4)" if p4 else "speed ≥ 0.97 (p = 2)")
    if step.startswith("ringcheck") and isinstance(data, dict):      # a record made before the rule
        p4 = step.startswith("ringcheck-p4")
        said = (f"ring ÷ NCCL (speed) {data['ratio']:.3f} at {data['bytes'] >> 20} MiB, "
                f"{data.get('memory', 'registered')} memory, exact {data['exact']}; "
                f"host time per ring {data['ring_host_s'] * 1e3:.2f} ms")
        again = data.get("replayed")
        if again:
            said += (f"; replayed from a CUDA graph: ÷ NCCL {again['ratio']:.3f}, exact {again['exact']}, "
                     f"host per replay {again['host_s'] * 1e6:.1f} µs")
        return said, "speed ≥ 0.80; host ≤ 0.45 ms (p = 4)" if p4 else "speed ≥ 0.97; host ≤ 0.12 ms (p = 2)"
    if step.startswith("bench-") and isinstance(data, dict) and "rows" in data:
        rows = data["rows"]
        algos = sorted({r["algo"] for r in rows if r["algo"] != "nccl"})
        best = {a: _ratio_at(rows, a, 256 << 20) for a in algos}
        best = {a: v for a, v in best.items() if v is not None}
        text = ", ".join(f"{a} {v:.2f}" for a, v in sorted(best.items(), key=lambda kv: -kv[1])[:4])
        return f"speed ÷ NCCL at 256 MiB, plain memory: {text}", "the table from 4 KiB to 1 GiB"
    if step.startswith("fused") and isinstance(data, dict):
        rec = data.get("bench-fused.json", data)
        rows = {r["case"]: r for r in rec.get("rows", [])}
        flat = rows.get("flat all_reduce", {}).get("seconds")
        parts = [f"{name} {rows[name]['seconds'] / flat:.2f}×" for name in ("fused", "fused, bound", "flat + 2 copies")
                 if name in rows and flat]
        launched = rec.get("meta", {}).get("launch")
        how = {"graph": ", every case replayed", "eager": ", every case eager"}.get(launched, "")
        return f"time ÷ one flat all_reduce, 1000 × 16 KiB{how}: " + ", ".join(parts), "fused ≤ 1.5× (copy floor)"
    if step.startswith("ddp") and isinstance(data, dict):
        rec = next(iter(data.values())) if all(isinstance(v, dict) for v in data.values()) else data
        paired = rec.get("paired", {})
        how = ", every variant eager, in rounds" if (rec.get("rule") or {}).get("launch") == "eager" else ""
        return f"reducer ÷ torch DDP step {paired.get('reducer / torch DDP', float('nan')):.3f}{how}", "≤ 1.03"
    if step.startswith("hier") and isinstance(data, dict):
        parts = []
        for r in data.get("rows", []):
            parts.append(f"{tuple(r['layout'])} {r['name']} {r['nccl'] / r['seconds']:.2f}")
        launched = (data.get("rule") or {}).get("launch") if isinstance(data.get("rule"), dict) else None
        how = {"graph": ", every side replayed", "eager": ", every side eager"}.get(launched, "")
        return (f"speed ÷ NCCL{how}: " + "; ".join(parts),
                ("one slice ≥ 0.75 on (2, 2); " if step == "hier-p4" else "")
                + "pipelined ≥ one slice; 16 in flight ≥ 0.67")
    if step.startswith("recorder") and isinstance(data, dict):
        return _recorder_headline(data.get("recorder.json", data))
    if step == "lesson09" and isinstance(data, dict):
        check = data.get("check.json", {})
        what, target = _recorder_headline(data.get("recorder.json", {}))
        return (f"torchrun-style world with DDP on NCCL recorded and merged: {check.get('ok')}"
                + (f" ({'; '.join(check.get('problems', []))[:200]})" if check.get("problems") else "")
                + f"; {what}", "every check holds; " + target)
    if step.startswith("sparse") and isinstance(data, dict) and isinstance(data.get("NVLink (NCCL)"), dict):
        nv = data["NVLink (NCCL)"]
        best = min(nv.get("sweep", []), key=lambda r: r["allgather"], default=None)
        if best:
            return (f"dense {nv['dense'] * 1e3:.3f} ms; best sparse (all-gather, density {best['density']:g}) "
                    f"{best['allgather'] * 1e3:.3f} ms, its selection alone {best['select'] * 1e3:.3f} ms; "
                    f"crossover: {data.get('measured_crossover') or 'none'}", "the density below which sparse wins")
    if step == "lesson10" and isinstance(data, dict) and "10-sharded-nccl.json" in data:
        rows = {r["name"]: r for r in data["10-sharded-nccl.json"]["rows"]}
        z, f = rows.get("zero3"), rows.get("fsdp2")
        checks = data.get("10-sharded-gpu-checks.json", {}).get("checks", {})
        judged = _lesson10_judged(checks)
        bits = sum(1 for _, limit, _ in judged if limit == 0.0)
        failed = [name for name, _, ok in judged if not ok]
        t, so = rows.get("zero3_torch"), rows.get("zero3_torch_so")
        moved = _baseline_moved(rows)
        how = " (every contender eager, in rounds)" if data["10-sharded-nccl.json"].get("rule") else ""
        if z and f:
            return (f"checks holding their standard: {len(judged) - len(failed)} of {len(judged)} ({bits} bit for bit, "
                    f"the rest within 1e-6 (fp32) / 1e-4 (bf16) where the reduction orders differ)"
                    + (f"; failed: {', '.join(failed[:4])}" if failed else "")
                    + f"; ZeRO-3 (ring) ÷ FSDP2{how}: step {z['seconds'] / f['seconds']:.2f}×, "
                    + _lesson10_peak(z, f, moved)
                    + (f"; ZeRO-3 (torch collectives) ÷ FSDP2: step {t['seconds'] / f['seconds']:.2f}×, "
                       f"{_lesson10_peak(t, f, moved)}" if t else "")
                    + (f"; freed in stream order: step {so['seconds'] / f['seconds']:.2f}×, "
                       f"{_lesson10_peak(so, f, moved)}" if so else ""),
                    "step and peak memory ≤ 1.05× FSDP2's")
    if step == "lesson11" and isinstance(data, dict):
        fractions = []
        for k, local in sorted(data.items()):
            if k.startswith("bench-alltoall-local") and isinstance(local, dict):
                how = "replayed" if local.get("launch") == "graph" else "eager"
                fractions += [f"{t['nbytes'] >> 20} MiB {t['best']} {t['fraction_of_nccl']:.2f} ({how}, both sides)"
                              for t in local.get("target", []) if t.get("best")]
        checks = next((v for k, v in data.items() if k.startswith("11-gpu-checks")), {})
        failed = checks.get("failed", "?") or "none"
        return (f"checks failed: {failed}; best hand-written ÷ NCCL: " + ", ".join(fractions),
                "≥ 0.85× NCCL at ≥ 32 MiB")
    if step == "lesson12" and isinstance(data, dict):
        checks = data.get("12-gpu-checks.json", {}).get("checked", {})
        own = {f"{d}: {k}": v for d, per in checks.items() for k, v in per.items() if not k.startswith("symm_")}
        return ("the lesson's kernels exact against NCCL: " + ", ".join(k for k, v in own.items() if v is True),
                "≥ 2× NCCL ≤ 1 MiB, ≥ 0.9× at 256 MiB, within 1.2× of symm_mem")
    if step == "probe-host" and isinstance(data, dict) and isinstance(data.get("rank0"), dict):
        r = data["rank0"]
        us = lambda k: f"{r[k] * 1e6:.1f} µs"   # noqa: E731
        return (f"host time per call: a CUDA kernel {us('host_kernel_s')}, an event record "
                f"{us('host_event_record_s')}, all_reduce of 4 B {us('host_all_reduce_4B_s')}, an isend+irecv "
                f"pair {us('host_p2p_pair_4B_s')}, the course's ring of 1 KiB {us('host_ring_1KiB_s')}",
                "what bounds every host-bound target")
    return ("; ".join(tail[-1:]) if tail else ""), ""


def _baseline_moved(rows: dict) -> list[str]:
    """bench-sharded's contenders whose training steps began below what was allocated before
    them: memory of an earlier contender was released during their run, so their peak above
    that baseline reads too low, and no peak of the run compares with another."""
    return [name for name, r in rows.items()
            if any((a or {}).get("steady") is not None and a["steady"] < 0 for a in r.get("allocated") or [])]


def _lesson10_peak(z: dict, f: dict, moved: list[str]) -> str:
    if moved:
        return f"peak memory not comparable (the baseline moved under {', '.join(moved)})"
    return f"peak memory {max(z['max_memory_allocated']) / max(f['max_memory_allocated']):.2f}×"


def _lesson10_judged(checks: dict) -> list[tuple[str, float, bool]]:
    """Every check of tools/gpu_lesson10.py's record with its standard and whether it holds (the
    script's own judgement, or -- in a record older than it -- the same standard applied here)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_lesson10", Path(__file__).with_name("gpu_lesson10.py"))
    lesson10 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lesson10)
    out = []
    for p, per in checks.items():
        if not isinstance(per, list):
            out.append((f"p={p}: {per.get('error', 'no result')}", 0.0, False))
            continue
        for name, result in per[0].items():
            out.append((f"p={p}: {name}", lesson10.standard(name, int(p)), lesson10.holds(name, int(p), result)))
    return out


def _recorder_headline(rec: dict) -> tuple[str, str]:
    """bench-recorder's record: the recorded call's cost over torch's call, per size."""
    rows = rec.get("rows", []) if isinstance(rec, dict) else []
    parts = [f"{r['call']} {r['nbytes']} B {r['recorded']['median'] / r['plain']['median']:.2f}×"
             + (f" ({r['paid'] * 1e6:+.1f} µs a call)" if "paid" in r else "")
             for r in rows if r.get("plain", {}).get("median") and r.get("recorded", {}).get("median")]
    return ("recorded call ÷ torch's call: " + ", ".join(parts) if parts else "recorder ran"), \
        "the recorder's cost per call measured"


def figures(steps: list[dict]) -> dict:
    """The lane's headline numbers as flat fields (what a page quotes, checked against them):
    at 2 GPUs without a suffix, at p GPUs with ``_p{p}``."""
    by = {s["step"]: s["data"] for s in steps if s.get("data")}
    out = {}
    for p in sorted({int(s["step"].split("-p")[1].split("-")[0]) for s in steps if "-p" in s["step"]}):
        suffix = "" if p == 2 else f"_p{p}"
        out.update(_ring_figures(by, p, suffix))       # under the rule; below, a record made before it
        ring = by.get(f"ringcheck-p{p}-256M")
        if isinstance(ring, dict) and "rule" not in ring:
            out.update({"ring_speed_vs_nccl" + suffix: ring["ratio"], "ring_host_s" + suffix: ring["ring_host_s"],
                        "ring_nccl_s" + suffix: ring["nccl_s"]})
            if isinstance(ring.get("replayed"), dict):      # registered memory, replayed from a graph
                again = ring["replayed"]
                out.update({"ring_registered_replayed_speed_vs_nccl" + suffix: again["ratio"],
                            "ring_registered_replayed_host_s" + suffix: again["host_s"],
                            "ring_registered_replayed_exact" + suffix: again["exact"]})
        replay = by.get(f"ringcheck-p{p}-replay")
        if isinstance(replay, dict) and isinstance(replay.get("replayed"), dict):
            again = replay["replayed"]      # plain memory: the eager ring beside it on the same memory
            out.update({"ring_replayed_speed_vs_nccl" + suffix: again["ratio"],
                        "ring_replayed_host_s" + suffix: again["host_s"],
                        "ring_replayed_exact" + suffix: again["exact"],
                        "ring_plain_speed_vs_nccl" + suffix: replay["ratio"]})
        ddp = by.get(f"ddp-p{p}")
        if isinstance(ddp, dict) and ddp:
            rec = next(iter(ddp.values())) if all(isinstance(v, dict) for v in ddp.values()) else ddp
            out["reducer_over_ddp_step" + suffix] = rec.get("paired", {}).get("reducer / torch DDP")
        for graph in ("", "_graph"):        # fused-p2: every case eager; fused-graph-p2: every case replayed
            fused = by.get(f"fused{graph.replace('_', '-')}-p{p}")
            if not isinstance(fused, dict):
                continue
            rows = {r["case"]: r["seconds"] for r in fused.get("bench-fused.json", fused).get("rows", [])
                    if "seconds" in r}
            flat = rows.get("flat all_reduce")
            for key, name in (("fused_over_flat", "fused"), ("bound_over_flat", "fused, bound"),
                              ("copies_over_flat", "flat + 2 copies")):
                if flat and name in rows:
                    out[key.replace("_over", graph + "_over") + suffix] = rows[name] / flat
        tour = by.get(f"tour-p{p}")
        if isinstance(tour, list):
            out["tour_rows" + suffix] = len(tour)
            out["tour_verified" + suffix] = sum(bool(r.get("verified")) for r in tour)
        for graph in ("", "-graph"):           # hier-p2: every side eager; hier-graph-p2: every side replayed
            hier = by.get(f"hier{graph}-p{p}")
            if not isinstance(hier, dict):
                continue
            for r in hier.get("rows", []):      # e.g. hier_2x2_one_slice_p4: NCCL's time over ours
                name = r["name"].replace(",", "").replace(" ", "_") + ("_replayed" if graph else "")
                out[f"hier_{r['layout'][0]}x{r['layout'][1]}_{name}{suffix}"] = r["nccl"] / r["seconds"]
    lesson10 = by.get("lesson10")
    if isinstance(lesson10, dict) and "10-sharded-nccl.json" in lesson10:
        rows = {r["name"]: r for r in lesson10["10-sharded-nccl.json"]["rows"]}
        f = rows.get("fsdp2")
        moved = _baseline_moved(rows)
        if moved:
            out["lesson10_baseline_moved"] = moved
        for name in ("zero3", "zero3_torch", "zero3_torch_so"):
            if f and name in rows:
                out[f"{name}_step_over_fsdp2"] = rows[name]["seconds"] / f["seconds"]
                if not moved:
                    peak = max(rows[name]["max_memory_allocated"])
                    out[f"{name}_peak_over_fsdp2"] = peak / max(f["max_memory_allocated"])
        judged = _lesson10_judged(lesson10.get("10-sharded-gpu-checks.json", {}).get("checks", {}))
        out["lesson10_checks"], out["lesson10_checks_held"] = len(judged), sum(ok for _, _, ok in judged)
    lesson11 = by.get("lesson11")
    if isinstance(lesson11, dict):
        for k, v in lesson11.items():
            if k.startswith("bench-alltoall-local") and isinstance(v, dict):
                world = k.rsplit("-p", 1)[-1].split(".")[0]
                # both sides launched alike in one run: eager against eager, replayed against replayed
                kind = "replayed" if v.get("launch") == "graph" else "best"
                for t in v.get("target", []):
                    if t.get("best"):
                        out[f"alltoall_{kind}_over_nccl_{t['nbytes'] >> 20}M_p{world}"] = t["fraction_of_nccl"]
    lesson09 = by.get("lesson09")
    recorder = lesson09.get("recorder.json") if isinstance(lesson09, dict) else None
    if isinstance(recorder, dict):             # torch's own call per size: what one call costs the host at least
        for r in recorder.get("rows", []):
            key = "p2p" if r["call"].startswith("isend") else r["call"]
            out[f"torch_{key}_{r['nbytes']}B_s"] = r["plain"]["median"]
    lesson12 = by.get("lesson12")
    bench12 = lesson12.get("12-bench-gpu.json") if isinstance(lesson12, dict) else None
    if isinstance(bench12, dict):              # speed over NCCL's (NCCL's time / theirs) per dtype and kernel
        sizes = bench12["sizes"]
        for dtype, runs in bench12["runs"].items():
            nccl = runs["nccl"]
            for name, times in runs.items():
                speed = [n / t if t else None for n, t in zip(nccl, times)]
                small = [v for size, v in zip(sizes, speed) if size <= 1 << 20 and v]
                if name == "nccl" or not small:
                    continue
                out[f"symm_{dtype}_{name}_le1M_min"], out[f"symm_{dtype}_{name}_le1M_max"] = min(small), max(small)
                if 256 << 20 in sizes and speed[sizes.index(256 << 20)]:
                    out[f"symm_{dtype}_{name}_256M"] = speed[sizes.index(256 << 20)]
    return out


def _ring_figures(by: dict, p: int, suffix: str) -> dict:
    """The ring checks' figures under the rule: NCCL launched as the ring is in each."""
    out = {}
    for memory, key in (("256M", "ring"), ("256M-graph", "ring_registered_replayed"),
                        ("plain", "ring_plain"), ("plain-graph", "ring_replayed")):
        ring = by.get(f"ringcheck-p{p}-{memory}")
        if isinstance(ring, dict) and isinstance(ring.get("rule"), dict):
            out.update({f"{key}_speed_vs_nccl{suffix}": ring["ratio"], f"{key}_host_s{suffix}": ring["ring_host_s"],
                        f"{key}_nccl_s{suffix}": ring["nccl_s"], f"{key}_exact{suffix}": ring["exact"]})
    return out


COMPARES_NOTHING = ("tests", "runner-", "tour-", "cheats")     # steps that verify and time no contender against another
RULE_FIELDS = ("launch", "inputs", "untraced", "multicast", "skipped")


def _compares_nothing(data) -> bool:
    """A record that says it times no contender against another (``"compares": "nothing: ..."``,
    :func:`collectives.course.benchmarks.gpu_timing.compares_nothing`): a script's checks."""
    return isinstance(data, dict) and str(data.get("compares", "")).startswith("nothing")


def step_rule(data) -> dict | None:
    """The rule's fields a step's JSON names (in its ``rule``, its ``meta``, at its top or in
    its ``rank0``'s ``rule``; a folder of records: in every one of them, one per file, but for
    the files that say they compare nothing -- at least one must name it), or None where it
    names none."""
    if not isinstance(data, dict):
        return None
    rank0 = data.get("rank0") if isinstance(data.get("rank0"), dict) else {}     # tools/gpu_probe.py's
    for place in (data.get("rule"), data.get("meta"), data, rank0.get("rule")):
        if isinstance(place, dict) and place.get("launch") and place.get("inputs"):
            return {k: place[k] for k in RULE_FIELDS if k in place}
    files = {name: step_rule(v) for name, v in data.items() if name.endswith(".json") and not _compares_nothing(v)}
    if files and all(files.values()):
        return {"per file": files}
    return None


def lane_rule(steps: list[dict]) -> dict:
    """Each comparing step's rule fields, and which steps name none. ``launch`` and ``inputs``
    at the top (what the pages' check reads) only where every step that compares names them."""
    said, outside = {}, []
    for s in steps:
        if s["step"].startswith(COMPARES_NOTHING):
            continue
        found = step_rule(s.get("data"))
        s["rule"] = found
        if found is None:
            outside.append(s["step"])
        else:
            said[s["step"]] = found
    out = {"steps": said, "outside": outside}
    if said and not outside:
        out.update(launch="per step", inputs="per step")
    return out


def gather(out: Path) -> dict:
    import torch

    steps_dir = out / "steps"
    topology = (steps_dir / "topology.txt").read_text() if (steps_dir / "topology.txt").exists() else ""
    n = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0) if n else "none"
    if not topology:
        try:
            topology = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
        except OSError:
            topology = ""
    links = _links(topology)
    latest = {}                            # a step run again: its last run counts
    for line in (steps_dir / "status.tsv").read_text().splitlines() if (steps_dir / "status.tsv").exists() else []:
        latest[line.split("\t", 1)[0]] = line
    steps = []
    for line in latest.values():
        step, rc, seconds, command = line.split("\t", 3)
        data = None
        for candidate in (steps_dir / f"{step}.json", steps_dir / step / "allreduce.json"):
            if candidate.is_file():
                try:
                    data = json.loads(candidate.read_text())
                except ValueError:
                    data = None
                break
        if data is None and (steps_dir / step).is_dir():
            found = {p.name: json.loads(p.read_text()) for p in sorted((steps_dir / step).glob("*.json"))}
            data = found or None
        tail = (steps_dir / f"{step}.txt").read_text(errors="replace").splitlines()[-15:] \
            if (steps_dir / f"{step}.txt").exists() else []
        what, target = headline(step, data, tail)
        steps.append(dict(step=step, exit=int(rc), seconds=int(seconds), command=command,
                          passed=int(rc) == 0, headline=what, target=target, data=data, tail=tail))
    hardware = f"{n}× {name}" + (f", NVLink ({links})" if "NV" in links else f", {links}")
    return dict(
        title=f"The GPU lane on {hardware}",
        rows=[dict(part=s["step"], result="PASS" if s["passed"] else f"FAIL (exit {s['exit']})",
                   seconds=s["seconds"], measured=s["headline"], target=s["target"]) for s in steps],
        device=hardware,
        figures=figures(steps),
        hardware=hardware,
        gpus=n, gpu=name, links=links, topology=topology,
        torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())) if n else None,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=os.environ.get("COLLECTIVES_COMMIT", "unknown"),
        command="tools/gpu_suite.sh " + str(out),
        multicast="off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1)",
        rule=lane_rule(steps), steps=steps)


def again(record: dict) -> dict:
    """A record's headlines, targets, rows and figures judged anew from the data its steps hold
    (the measurements stay as they were): for a record taken before a judgement changed."""
    for s in record["steps"]:
        s["headline"], s["target"] = headline(s["step"], s["data"], s["tail"])
    record["rows"] = [dict(part=s["step"], result="PASS" if s["passed"] else f"FAIL (exit {s['exit']})",
                           seconds=s["seconds"], measured=s["headline"], target=s["target"]) for s in record["steps"]]
    record["figures"] = figures(record["steps"])
    record["rule"] = lane_rule(record["steps"])
    return record


def merge(records: list[dict]) -> dict:
    """``records`` (oldest first, one kind of machine) as one: each step its latest run's, with
    that run's commit and date; the headlines, rows and figures judged anew."""
    hardware = {r["hardware"] for r in records}
    if len(hardware) != 1:
        raise ValueError(f"records of different machines cannot be merged: {sorted(hardware)}")
    steps: dict[str, dict] = {}
    for r in records:
        for s in r["steps"]:
            steps.pop(s["step"], None)           # its latest run, in the order the runs came
            steps[s["step"]] = dict(s, commit=s.get("commit", r["commit"]), date=s.get("date", r["date"]))
    out = dict(records[-1], steps=list(steps.values()))
    order = list(dict.fromkeys(c for r in records for c in r.get("commits", [r["commit"]])))   # a merged one too
    out["commits"] = sorted({s["commit"] for s in out["steps"]}, key=order.index)
    out["commit"] = out["commits"][-1]
    out["date"] = max(s["date"] for s in out["steps"])
    out["command"] = "; ".join(dict.fromkeys(r["command"] for r in records))
    out = again(out)
    for row, s in zip(out["rows"], out["steps"]):
        row.update(commit=s["commit"][:7], date=s["date"][:10])        # a table cell: the short form
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("-") and argv[0] not in ("--merge", "--again"):
        print(__doc__)
        return 0 if argv[0] in ("-h", "--help") else 2
    if argv[:1] == ["--merge"]:            # tools/gpu_record.py --merge OUT LANE LATER...: later steps over it
        record = merge([json.loads(Path(p).read_text()) for p in argv[2:]])
        Path(argv[1]).write_text(json.dumps(record, indent=1, default=str))
    elif argv[:1] == ["--again"]:            # tools/gpu_record.py --again lane.json: judge a record anew
        path = Path(argv[1])
        record = again(json.loads(path.read_text()))
        path.write_text(json.dumps(record, indent=1, default=str))
    else:
        out = Path(argv[0] if argv else "build/gpu")
        record = gather(out)
        (out / "lane.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"{record['hardware']}, torch {record['torch']}, NCCL {record['nccl']}, commit {record['commit']}")
    for s in record["steps"]:
        print(f"  {'PASS' if s['passed'] else 'FAIL'}  {s['step']:<22} {s['seconds']:>4} s   exit {s['exit']}")
    failed = [s["step"] for s in record["steps"] if not s["passed"]]
    print(f"{len(record['steps']) - len(failed)} of {len(record['steps'])} steps pass"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
