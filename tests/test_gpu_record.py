"""tools/gpu_record.py: the GPU lane's record, gathered from several runs (no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .tools_import import tool as load_tool

ROOT = Path(__file__).resolve().parent.parent


def _lane(commit: str, date: str, runners: dict, hardware="2× NVIDIA H200, NVLink (NV18)") -> dict:
    steps = [dict(step=f"runner-{nn}", exit=0 if ok else 1, seconds=30, command=f"runner {nn}", passed=ok,
                  headline="", target="", data=None,
                  tail=[f"lesson {int(nn)}: {4 if ok else 3} of 4 tasks pass"]) for nn, ok in runners.items()]
    return dict(hardware=hardware, device=hardware, torch="2.11.0+cu130", nccl="2.28.9", commit=commit, date=date,
                command=f"tools/gpu_suite.sh {commit}",
                steps=steps, rows=[], figures={})


def test_a_merged_lane_keeps_each_steps_latest_run_and_names_its_commit(tmp_path):
    tool = load_tool("gpu_record")
    old = _lane("aaa1111", "2026-11-28T04:00:00+00:00", {"01": True, "02": False})
    new = _lane("bbb2222", "2026-11-28T06:00:00+00:00", {"02": True, "03": True})
    paths = []
    for name, record in (("old", old), ("new", new)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(record))
    out = tmp_path / "lane.json"
    assert tool.main(["--merge", str(out), *map(str, paths)]) == 0      # every step's latest run passes
    merged = json.loads(out.read_text())
    by_step = {s["step"]: s for s in merged["steps"]}
    assert sorted(by_step) == ["runner-01", "runner-02", "runner-03"]
    assert by_step["runner-02"]["passed"] and by_step["runner-02"]["commit"] == "bbb2222"    # rerun: the later counts
    assert by_step["runner-01"]["commit"] == "aaa1111" and by_step["runner-01"]["date"].startswith("2026-11-28T04")
    assert merged["commits"] == ["aaa1111", "bbb2222"] and merged["commit"] == "bbb2222"
    rows = {r["part"]: r for r in merged["rows"]}
    assert rows["runner-02"]["result"] == "PASS" and rows["runner-01"]["commit"] == "aaa1111"
    assert rows["runner-02"]["measured"] == "lesson 2: 4 of 4 tasks pass"       # judged anew from its tail
    # a merged record merges again; a later failure is kept as a failure
    worse = _lane("ccc3333", "2026-11-28T07:00:00+00:00", {"03": False})
    paths.append(tmp_path / "worse.json")
    paths[-1].write_text(json.dumps(worse))
    assert tool.main(["--merge", str(out), str(out), str(paths[-1])]) == 1
    again = json.loads(out.read_text())
    assert again["commits"] == ["aaa1111", "bbb2222", "ccc3333"]
    assert [s["passed"] for s in again["steps"] if s["step"] == "runner-03"] == [False]


def test_records_of_different_machines_are_not_merged():
    tool = load_tool("gpu_record")
    with pytest.raises(ValueError, match="different machines"):
        tool.merge([_lane("a", "2026-11-28", {"01": True}),
                    _lane("b", "2026-11-28", {"01": True}, hardware="4× NVIDIA H100, NVLink (NV18)")])


def test_lesson10_peaks_are_not_compared_when_a_baseline_moved():
    """A contender whose steps began below what was allocated before it (an earlier
    contender's memory freed during its run) has a peak that reads too low: the record says
    so and gives no peak ratio, where a clean run gives one."""
    tool = load_tool("gpu_record")

    def row(name, peak, steady):
        return dict(name=name, seconds=1.0, max_memory_allocated=[peak, peak],
                    allocated=[dict(before=8, steady=steady, after=steady)] * 2)

    def lesson10(fsdp2_steady):
        rows = [row("fsdp2", 800, fsdp2_steady), row("zero3", 880, 390)]
        return {"10-sharded-nccl.json": {"rows": rows}, "10-sharded-gpu-checks.json": {"checks": {}}}

    clean = tool.figures([dict(step="lesson10", data=lesson10(380))])
    assert clean["zero3_peak_over_fsdp2"] == pytest.approx(1.1)
    moved = tool.figures([dict(step="lesson10", data=lesson10(-128))])
    assert moved["lesson10_baseline_moved"] == ["fsdp2"] and "zero3_peak_over_fsdp2" not in moved
    said, _ = tool.headline("lesson10", lesson10(-128), [])
    assert "not comparable" in said and "peak memory 1.10" not in said


def test_a_merged_lanes_table_names_each_commit_short_and_its_steps_in_full(tmp_path):
    tool = load_tool("gpu_record")
    full = "0123456789abcdef0123456789abcdef01234567"
    path = tmp_path / "lane.json"
    path.write_text(json.dumps(_lane(full, "2026-11-28T09:00:00+00:00", {"01": True})))
    out = tmp_path / "merged.json"
    assert tool.main(["--merge", str(out), str(path)]) == 0
    merged = json.loads(out.read_text())
    assert merged["steps"][0]["commit"] == full and merged["commit"] == full
    assert merged["rows"][0]["commit"] == full[:7]           # a table cell the page can fit


def test_the_all_to_all_target_sets_replayed_against_replayed_and_eager_against_eager():
    """The lane's all-to-all figures come from two runs, each launching every contender the
    same way (the rule for fair GPU comparisons): the best exchange called from Python against
    NCCL called from Python, and the best replayed from a CUDA graph against NCCL replayed."""
    tool = load_tool("gpu_record")
    eager = dict(launch="eager", target=[dict(nbytes=64 << 20, best="pairwise", fraction_of_nccl=0.78)])
    graph = dict(launch="graph", target=[dict(nbytes=64 << 20, best="linear", fraction_of_nccl=0.97),
                                         dict(nbytes=256 << 20, best=None, why_none="skipped")])
    data = {"bench-alltoall-local-nccl-p2.json": eager, "bench-alltoall-local-nccl-graph-p2.json": graph,
            "11-gpu-checks-p2.json": {"failed": []}}
    figures = tool.figures([dict(step="lesson11", data=data)])
    assert figures["alltoall_best_over_nccl_64M_p2"] == 0.78
    assert figures["alltoall_replayed_over_nccl_64M_p2"] == 0.97
    assert not any("256M" in key for key in figures)
    said, _ = tool.headline("lesson11", data, [])
    assert "64 MiB pairwise 0.78 (eager, both sides)" in said and "64 MiB linear 0.97 (replayed, both sides)" in said


def test_the_fused_figures_keep_the_replayed_run_apart_from_the_eager_one():
    tool = load_tool("gpu_record")

    def run(launch, fused):
        rows = [dict(case="flat all_reduce", seconds=1e-4), dict(case="fused", seconds=fused),
                dict(case="fused (exercise)", missing="not written yet")]
        return {"bench-fused.json": dict(meta=dict(launch=launch), rows=rows)}
    figures = tool.figures([dict(step="fused-p2", data=run("eager", 3e-4)),
                            dict(step="fused-graph-p2", data=run("graph", 1.4e-4))])
    assert figures["fused_over_flat"] == pytest.approx(3.0)
    assert figures["fused_graph_over_flat"] == pytest.approx(1.4)
    said, _ = tool.headline("fused-graph-p2", run("graph", 1.4e-4), [])
    assert "every case replayed" in said and "fused 1.40×" in said


def test_the_ring_checks_headline_names_its_memory_and_the_replayed_ring():
    tool = load_tool("gpu_record")
    data = dict(ratio=0.85, bytes=256 << 20, memory="plain", exact=True, ring_host_s=2.6e-4,
                replayed=dict(ratio=0.96, exact=True, host_s=1.76e-5, seconds=1.05e-3))
    said, target = tool.headline("ringcheck-p2-replay", data, [])
    assert "plain memory" in said and "replayed from a CUDA graph: ÷ NCCL 0.960, exact True" in said
    assert "17.6 µs" in said and "(p = 2)" in target
    registered, _ = tool.headline("ringcheck-p4-256M", dict(data, memory="registered", replayed=None), [])
    assert "registered memory" in registered and "replayed" not in registered


def test_the_replayed_ring_has_figures_of_its_own_beside_the_registered_ring():
    """The page quotes the replayed ring from the lane record: its own fields, at each count,
    never in place of the registered-memory ring's."""
    tool = load_tool("gpu_record")
    replay = dict(ratio=0.77, memory="plain", exact=True, ring_host_s=2.4e-4, nccl_s=1e-3,
                  replayed=dict(ratio=0.92, exact=True, host_s=9.6e-6, seconds=1.07e-3))
    registered = dict(replay, ratio=0.86, memory="registered", replayed=None)
    at4 = dict(replay, replayed=dict(replay["replayed"], ratio=0.8))
    figures = tool.figures([dict(step="ringcheck-p2-256M", data=registered),
                            dict(step="ringcheck-p2-replay", data=replay),
                            dict(step="ringcheck-p4-replay", data=at4)])
    assert figures["ring_speed_vs_nccl"] == 0.86 and figures["ring_replayed_speed_vs_nccl"] == 0.92
    assert figures["ring_plain_speed_vs_nccl"] == 0.77 and figures["ring_replayed_host_s"] == 9.6e-6
    assert figures["ring_replayed_speed_vs_nccl_p4"] == 0.8 and figures["ring_replayed_exact_p4"] is True
