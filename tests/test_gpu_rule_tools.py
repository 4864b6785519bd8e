"""The rule for fair GPU comparisons in the ring check, lesson 7's GPU benchmark, ``bench`` on
NCCL, the tour, the GPU lane's record and its cheat sweep, where no GPU is needed: their refusals, their records'
rule fields, and their GPU code paths run eagerly under gloo in one world -- the same code a
GPU runs: every contender checked, the rank untraced, NCCL's side called directly."""

import argparse
import ast

import pytest
import torch

from collectives import launch, trace
from collectives.course import tour
from collectives.course.benchmarks import allreduce as bench
from collectives.course.benchmarks import gpu_timing as rule
from collectives.course.site import targets

from .tools_import import TOOLS, tool

gpu_hierarchical, gpu_record, gpu_ring_check = (tool(name) for name in ("gpu_hierarchical", "gpu_record",
                                                                          "gpu_ring_check"))


def _three_in_one_world():
    """The ring check's rank, lesson 7's rank and bench's rank, eager, in one gloo world."""
    import torch.distributed as dist

    cpu, out, traced = torch.device("cpu"), {}, []
    rank = dist.get_rank()
    traced.append(trace.installed())
    out["ring"] = gpu_ring_check.in_rank(4096, True, 2, "eager", [], 2, 1, False, cpu)
    traced.append(trace.installed())
    args = argparse.Namespace(plain=True, launch="eager", rounds=2, iters=1, pieces=2)
    out["ring_record"] = gpu_ring_check.record(out["ring"], args, 4096, 2, cpu)
    trace.install(rank)                 # each rank below must take the trace off itself
    out["hier"] = gpu_hierarchical._rank([(1, 2)], 64, 16, "eager", 1, 1)
    traced.append(trace.installed())
    trace.install(rank)
    out["bench"] = bench._bench_rank(["ring", "ring (exercise)"], [4096], "float32", 1, 2, {}, True, None,
                                     False, "eager", 2)
    out["traced"] = traced + [trace.installed()]
    return out


@pytest.fixture(scope="module")
def world():
    return launch.run(_three_in_one_world, 2, timeout=120)[0]


def test_the_ring_check_sets_every_contender_launched_alike_untraced_and_names_the_rule(world):
    assert world["traced"] == [True, False, False, False]     # the world starts traced; each rank untraces
    ring = world["ring"]
    assert ring["exact"] == {"nccl": True, "ring": True, "pipelined": True} and ring["skipped"] == []
    assert set(ring["seconds"]) == {"nccl", "ring", "pipelined"} and ring["launch"] == "eager"
    assert all(lo <= ring["seconds"][n] <= hi for n, (lo, hi) in ring["spread"].items())
    assert ring["speed_vs_nccl"]["ring"] == pytest.approx(ring["seconds"]["nccl"] / ring["seconds"]["ring"])
    said = world["ring_record"]
    assert said["rule"] == rule.fields("eager", "copied", []) and said["launch"] == "eager"
    assert said["ratio"] == ring["speed_vs_nccl"]["ring"] and said["exact"] is True
    assert targets.under_rule(said)
    # the same record made on GPUs: the pages accept it with its rule, and not without
    gpu = dict(said, backend="nccl", device="NVIDIA H200")
    assert targets.under_rule(gpu) and not targets.under_rule({k: v for k, v in gpu.items() if k not in
                                                               ("rule", "launch")})
    registered = gpu_ring_check.record(ring, argparse.Namespace(plain=False, launch="graph", rounds=2, iters=1,
                                                                pieces=2), 4096, 2, torch.device("cpu"))
    assert registered["rule"]["inputs"] == "resident" and registered["rule"]["launch"] == "graph"


def test_the_ring_check_refuses_what_the_rule_forbids(capsys):
    for argv, says in ((["--replay"], "use --launch graph"), (["--profile"], "are for --launch graph"),
                       (["--replay-pieces", "2,4"], "are for --launch graph"),
                       (["--launch", "mixed"], "invalid choice"), (["--rounds", "0"], "at least 1")):
        with pytest.raises(SystemExit) as stop:
            gpu_ring_check.parse(argv)
        assert stop.value.code == 2 and says in capsys.readouterr().err, argv
    args = gpu_ring_check.parse(["--launch", "graph", "--replay-pieces", "2,4", "--plain"])
    assert args.replay_pieces == [2, 4] and args.launch == "graph" and args.rounds == rule.ROUNDS
    with pytest.raises(ValueError, match="launch must be one of"):
        gpu_ring_check.in_rank(4096, True, 2, "replayed", [], 1, 1, False, torch.device("cpu"))


def test_lesson7s_gpu_benchmark_sets_each_contender_beside_nccl_launched_alike(world, capsys):
    rows, skipped = world["hier"]
    assert skipped == []
    assert [r["name"] for r in rows] == ["one slice", "pipelined", "pipelined, inside as messages",
                                         "16 buckets, one slice each", "16 buckets, 1 in flight",
                                         "16 buckets, 8 in flight"]
    for r in rows:
        assert r["exact"] is True and r["launch"] == "eager" and r["nccl"] > 0 and r["spread"][0] <= r["seconds"]
        assert r["nbytes"] == (16 * 16 * 4 if "bucket" in r["name"] else 64 * 4)
    buckets = {r["name"]: r["nccl"] for r in rows if "bucket" in r["name"]}
    assert len(set(buckets.values())) == 1       # every bucket row beside NCCL's sixteen calls, timed once a round
    assert "issue_per_bucket" in rows[-1] and "slices" in rows[0]
    for argv in (["--launch", "replayed"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as stop:
            gpu_hierarchical.main(argv)
        assert stop.value.code == 2
    capsys.readouterr()


def test_bench_on_nccl_times_every_contender_in_rounds_untraced_and_its_record_names_the_rule(world, capsys):
    rows = {r["algo"]: r for r in world["bench"]}
    assert list(rows) == ["gloo", "ring", "ring (exercise)"]
    base, ring = rows["gloo"], rows["ring"]
    assert base["ratio"] == 1.0 and ring["ok"] is True and ring["launch"] == "eager"
    assert ring["ratio"] == pytest.approx(base["seconds"] / ring["seconds"])
    assert ring["spread"][0] <= ring["seconds"] <= ring["spread"][1]
    assert rows["ring (exercise)"]["missing"].startswith("not written yet")
    said = rule.fields_of_rows("graph", "copied", world["bench"] + [dict(algo="tree", nbytes=4096, missing="no capture",
                                                                    skipped=True)])
    assert said["rule"] == rule.fields("graph", "copied", ["tree at 4096 B: no capture"])
    assert rule.fields_of_rows(None, "copied", world["bench"]) == {}
    assert rule.fields_of_rows("eager", "resident", [])["rule"]["inputs"] == "resident"
    with pytest.raises(SystemExit) as stop:
        bench.main(["--backend", "gloo", "--launch", "graph", "--world", "2"])
    assert stop.value.code == 2 and "--launch and --batch are for GPUs" in capsys.readouterr().err
    assert {"launch", "inputs"} <= set(_charts_meta())     # a chart's record copies them from the meta


def _charts_meta():
    return tool("bench_charts").META


def test_once_the_rule_applies_nccl_is_called_directly_and_nothing_is_timed_one_run_at_a_time():
    for path, name in (("tools/gpu_ring_check.py", "in_rank"), ("tools/gpu_hierarchical.py", "_rank")):
        source = (TOOLS.parent / path).read_text()
        body = ast.get_source_segment(source, next(n for n in ast.parse(source).body
                                                   if isinstance(n, ast.FunctionDef) and n.name == name))
        timed = body[body.index("rule.untrace_rank()"):]
        assert "dist.all_reduce(" not in timed and "timing.measure(" not in timed, path
        assert "rule.launched(" in timed and "rule.rounds(" in timed, path


def test_the_tour_on_gpus_keeps_no_time_and_prints_no_speed(monkeypatch):
    fields = dict(verified=True, seconds=2.0, ref_seconds=1.0, nbytes=1 << 20, bytes_sent=1.0, bytes_theory=1.0)
    backends = []
    monkeypatch.setattr(tour.launch, "run",
                        lambda *a, **k: backends.append(k["backend"]) or [dict(fields, world_size=2)])
    gpu = tour.run_tour(2, 1 << 20, "nccl", only=["ring"], progress=False, repeat=3)
    assert backends == ["nccl"]             # untimed: one run, not three
    cpu = tour.run_tour(2, 1 << 20, None, only=["ring"], progress=False, repeat=3)
    assert backends[1:] == ["gloo"] * 3     # no backend named: gloo, as launch.run, timed
    assert cpu[0].ratio == 0.5 and cpu[0].extra["ratios"] == [0.5, 0.5, 0.5]
    row = gpu[0]
    assert row.verified and row.ratio != row.ratio and row.seconds != row.seconds
    assert row.extra == {"timed": tour.UNTIMED}
    from io import StringIO

    from rich.console import Console
    shown = StringIO()
    tour.render(gpu, 2, "nccl", console=Console(file=shown, width=tour.WIDTH))
    text = shown.getvalue()
    assert "×" not in text and "No time and no speed on GPUs" in text
    shown = StringIO()
    tour.render(cpu, 2, "gloo", console=Console(file=shown, width=tour.WIDTH))
    assert "0.50×" in shown.getvalue() and "No time and no speed" not in shown.getvalue()


def test_the_lane_names_each_steps_rule_and_is_under_it_only_when_every_comparing_step_is():
    fair = dict(rule=rule.fields("graph", "resident", []), ratio=0.9, bytes=256 << 20, memory="registered",
                exact=True, ring_host_s=1e-5, nccl_s=1e-3)
    steps = [dict(step="tests", data=None), dict(step="tour-p2", data=[{"verified": True}]),
             dict(step="ringcheck-p2-256M-graph", data=fair),
             dict(step="bench-p2", data={"meta": {"launch": "eager", "inputs": "copied"}, "rows": []}),
             dict(step="fused-p2", data={"bench-fused.json": {"rule": rule.fields("eager", "copied", [])}}),
             dict(step="probe-host", data={"rank0": {"rule": rule.fields("eager", "copied", [])}})]
    said = gpu_record.lane_rule(steps)
    assert said["outside"] == [] and said["launch"] == "per step"
    assert set(said["steps"]) == {"ringcheck-p2-256M-graph", "bench-p2", "fused-p2", "probe-host"}
    assert steps[2]["rule"]["launch"] == "graph" and "per file" in steps[4]["rule"]
    lane = dict(device="2× NVIDIA H200, NVLink (NV18)", rule=said)
    assert targets.under_rule(lane)
    unfair = gpu_record.lane_rule(steps + [dict(step="ddp-p2", data={"paired": {}})])
    assert unfair["outside"] == ["ddp-p2"] and "launch" not in unfair
    assert not targets.under_rule(dict(lane, rule=unfair))
    line, target = gpu_record.headline("ringcheck-p2-256M-graph", fair, [])
    assert "every side replayed" in line and "0.900" in line and "registered memory" in line
    figures = gpu_record.figures([dict(step="ringcheck-p2-256M-graph", data=fair),
                                  dict(step="ringcheck-p2-plain", data=dict(fair, ratio=0.7, memory="plain"))])
    assert figures["ring_registered_replayed_speed_vs_nccl"] == 0.9 and figures["ring_plain_speed_vs_nccl"] == 0.7


def _on_gpus():
    device = torch.device("cuda", torch.cuda.current_device())
    out = {name: gpu_ring_check.in_rank(16 << 20, True, 2, mode, [], 2, 2, False, device) for name, mode in
           (("ring eager", "eager"), ("ring graph", "graph"))}
    out["hier graph"] = gpu_hierarchical._rank([(1, 2)], 1 << 20, 1 << 16, "graph", 2, 2)
    out["bench graph"] = bench._bench_rank(["ring", "tree"], [1 << 20], "float32", 1, 2, {}, True, None,
                                           False, "graph", 2)
    return out


@pytest.mark.gpu
def test_the_three_gpu_paths_check_every_contender_as_launched_on_gpus():
    """p = 2: the ring check each launch, lesson 7 and bench replayed: every contender exact
    against NCCL as launched, NCCL's replay included, and timed."""
    out = launch.run(_on_gpus, 2, backend="nccl", timeout=300, env=rule.rank_env("graph"))[0]
    for name in ("ring eager", "ring graph"):
        assert out[name]["exact"] == {"nccl": True, "ring": True, "pipelined": True}, (name, out[name])
    rows, skipped = out["hier graph"]
    assert rows and all(r["exact"] and r["launch"] == "graph" for r in rows), (rows, skipped)
    assert all(r["ok"] and r["launch"] == "graph" for r in out["bench graph"] if r["algo"] != "nccl"), out



def test_the_cheat_sweep_judges_as_the_grader_test_expects_and_keeps_tree_writers_apart(tmp_path, monkeypatch):
    """``tools/gpu_cheats.py`` under gloo: fixtures judged as ``CHEAT_TARGETS`` expects, a verdict
    against the expectation is BAD, and a fixture that writes into the course's tree is judged
    after the others (beside them it failed their control tasks; here it is not run at all)."""
    gpu_cheats = tool("gpu_cheats")
    ok, line = gpu_cheats.judge("lesson09_any_cycle", tmp_path, "gloo")
    assert ok and line.startswith("OK "), line
    monkeypatch.setitem(gpu_cheats.CHEAT_TARGETS, "lesson09_any_cycle", (9, (1,), None))   # its task 1 is honest
    ok, line = gpu_cheats.verdict("lesson09_any_cycle", (tmp_path / "lesson09_any_cycle.log").read_text())
    assert not ok and line.startswith("BAD"), line
    order = []
    monkeypatch.setattr(gpu_cheats, "judge", lambda name, out, backend: (order.append(name) or True, name))
    assert gpu_cheats.main([str(tmp_path), "planted_module,lesson09_any_cycle,patched_judge_at_import"]) == 0
    assert order[-1] == "planted_module" and sorted(order[:-1]) == ["lesson09_any_cycle", "patched_judge_at_import"]
