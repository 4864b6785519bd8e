"""The rule for fair GPU comparisons in the benchmarks that time whole training steps --
``bench-ddp`` (lesson 6) and ``bench-sharded`` (lesson 10) on NCCL -- where no GPU is needed:
their GPU code paths run under gloo in one world, the trace installed as every world starts
(each rank must take it off itself), every contender timed once per round, in turn; their
records name the rule and the GPU lane's record accepts them."""

import argparse
import json

import pytest
import torch
import torch._dynamo  # noqa: F401 - torch DDP imports it on first use (3 s): once, before the world forks
import torch.distributed as dist

from collectives import launch, trace
from collectives.course.benchmarks import bucketing, sharded, steps_gpu
from collectives.course.benchmarks import gpu_timing as rule

from .tools_import import tool

gpu_record = tool("gpu_record")

DDP_CFG = dict(world=2, backend="gloo", bucket_cap_mb=0.01, first_bucket_cap_mb=0.01, steps=3, warmup=2,
               model="mlp", sizes=dict(width=16, depth=2), batch=4, impl="reference", launch="eager")
SHARDED = ["ddp", "fsdp2", "zero1", "zero2", "zero3", "zero3_torch"]


def _steps_in_one_world():
    cpu, out, order = torch.device("cpu"), {}, []
    out["traced at start"] = trace.installed()
    out["ddp"] = bucketing.run_rank(DDP_CFG)
    trace.install(dist.get_rank())          # the next rank function must take the trace off itself
    out["sharded"] = sharded._rule_in_rank(SHARDED, 2, 8, 4, 2, "gloo")
    out["traced at end"] = trace.installed()
    steps = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    out["rounds"] = steps_gpu.in_rounds(steps, 2, cpu, warmup=1)
    out["order"] = list(order)
    try:
        steps_gpu.in_rounds({"a": steps["a"], "broken": lambda: (_ for _ in ()).throw(RuntimeError("no"))}, 1, cpu)
    except RuntimeError as exc:
        out["broken"] = str(exc)
    return out


@pytest.fixture(scope="module")
def world():
    return launch.run(_steps_in_one_world, 2, timeout=120)


def test_training_steps_are_timed_once_per_round_in_turn_and_a_broken_one_is_named(world):
    out = world[0]
    # warm-up once each, then per round: measure_back_to_back's untimed step and its timed one, a then b
    assert out["order"] == ["a", "b"] + ["a", "a", "b", "b"] * 2
    for name, timed in out["rounds"].items():
        assert len(timed["times"]) == 2 and timed["spread"] == [min(timed["times"]), max(timed["times"])]
        assert timed["seconds"] == pytest.approx(sum(timed["times"]) / 2)
    assert out["broken"] == "training steps that could not be timed: broken: no"
    with pytest.raises(ValueError, match="at least 1"):
        steps_gpu.in_rounds({}, 0, torch.device("cpu"))
    assert steps_gpu.fields() == dict(rule.fields("eager", "copied", []), why_eager=steps_gpu.NO_GRAPH)


def test_bench_ddp_on_gpus_times_every_variant_untraced_in_rounds_and_names_the_rule(world):
    assert world[0]["traced at start"] is True
    result = world[0]["ddp"]
    assert result["traced"] is False
    assert list(result["times"]) == list(bucketing.VARIANTS)
    for v, times in result["times"].items():
        assert len(times) == DDP_CFG["steps"] and result["spread"][v] == [min(times), max(times)]
        assert result["diff"][v] <= 1e-5, (v, result["diff"])
    assert world[1]["ddp"]["times"] == result["times"]       # every rank keeps the slowest rank's times
    saved = bucketing.record(result, DDP_CFG, ["--backend", "nccl", "--launch", "eager"])
    assert saved["rule"] == steps_gpu.fields() and saved["command"].endswith("--launch eager")
    assert saved["rule"]["launch"] == "eager" and saved["rule"]["inputs"] == "copied" and saved["rule"]["untraced"]
    lane = {"bench-ddp-mlp-nccl-p2.json": json.loads(json.dumps(saved))}
    assert gpu_record.step_rule(lane)["per file"]["bench-ddp-mlp-nccl-p2.json"]["launch"] == "eager"
    assert gpu_record.headline("ddp-p2", lane, [])[0].endswith(", every variant eager, in rounds")
    # the CPU record is as it was: no rule, and the lane would list such a step as outside it
    cpu = {k: v for k, v in DDP_CFG.items() if k != "launch"}
    plain = bucketing.record(dict(result, spread=None), cpu, [])
    assert "rule" not in plain and gpu_record.step_rule({"bench-ddp.json": plain}) is None


def test_bench_ddp_refuses_a_replay_and_a_launch_on_cpus(capsys):
    for argv, says in ((["--backend", "nccl", "--launch", "graph"], "not offered for training steps"),
                       (["--launch", "eager"], "--launch is for --backend nccl"),
                       (["--backend", "nccl", "--launch", "replayed"], "invalid choice")):
        with pytest.raises(SystemExit) as stop:
            bucketing.main(argv)
        assert stop.value.code == 2 and says in capsys.readouterr().err, argv


def test_bench_sharded_on_gpus_times_every_contender_in_rounds_and_measures_memory_alone(world, tmp_path,
                                                                                        monkeypatch):
    rows = [w["sharded"] for w in world]
    assert world[0]["traced at end"] is False
    for row in rows[0]:
        assert row["traced"] is False and len(row["times"]) == 2, row["name"]
        assert row["seconds"] == pytest.approx(sum(row["times"]) / 2)
        assert row["spread"] == [min(row["times"]), max(row["times"])]
        assert sum(row["memory"].values()) > 0 and row["peak_bytes"] > 0        # measured alone, as before
    assert [r["name"] for r in rows[0]] == SHARDED and rows[1][0]["times"] == rows[0][0]["times"]
    # the record, as bench-sharded --backend nccl writes it (the world's rows stand in for the GPUs')
    called = []
    monkeypatch.setattr(sharded.launch, "run", lambda fn, p, **kw: called.append((fn, kw.get("env"))) or rows)
    args = argparse.Namespace(world=2, cluster=False, only=",".join(SHARDED), backend="nccl", layers=2, width=8,
                              batch=4, iters=2)
    result = sharded.run(args, [])
    assert called == [(sharded._rule_in_rank, rule.rank_env("eager"))]
    assert result["rule"] == steps_gpu.fields() and result["world_size"] == 2
    assert [r["spread"] for r in result["rows"]] == [r["spread"] for r in rows[0]]
    path = sharded.write(args, ["--backend", "nccl"], result, tmp_path, None)
    checks = {"meta": {}, **rule.compares_nothing(), "checks": {"2": [{"ZeRO-3 (ring) vs DDP": {"bit_equal": True}}]}}
    lane = {"10-sharded-gpu-checks.json": checks, path.name: json.loads(path.read_text())}
    said = {k: v for k, v in steps_gpu.fields().items() if k in gpu_record.RULE_FIELDS}
    assert gpu_record.step_rule(lane) == {"per file": {path.name: said}}
    assert gpu_record.lane_rule([dict(step="lesson10", data=lane)])["outside"] == []
    record = lane[path.name]
    for r in record["rows"]:           # what a GPU's run holds besides: the allocator's peaks
        r["max_memory_allocated"] = [2.0, 3.0]
    line = gpu_record.headline("lesson10", lane, [])[0]
    assert "ZeRO-3 (ring) ÷ FSDP2 (every contender eager, in rounds): step" in line
    # a record of checks that does not say it times nothing, or a folder of checks alone, names no rule
    assert gpu_record.step_rule({**lane, "10-sharded-gpu-checks.json": {"checks": {}}}) is None
    assert gpu_record.step_rule({"10-sharded-gpu-checks.json": checks}) is None
    # on gloo the ranks run as they did, and the record names no rule
    cpu = sharded.run(argparse.Namespace(**{**vars(args), "backend": "gloo"}), [])
    assert called[-1] == (sharded._bench_in_rank, None) and "rule" not in cpu


def _on_gpus():
    cfg = dict(DDP_CFG, backend="nccl", bucket_cap_mb=1.0, first_bucket_cap_mb=1.0)
    return dict(ddp=bucketing.run_rank(cfg), sharded=sharded._rule_in_rank(SHARDED + ["zero3_torch_so"], 2, 256,
                                                                            16, 2, "nccl"))


@pytest.mark.gpu
def test_both_training_benchmarks_run_their_rule_paths_on_two_gpus():
    out = launch.run(_on_gpus, 2, backend="nccl", timeout=300, env=rule.rank_env("eager"))[0]
    assert out["ddp"]["device"].startswith("cuda") and out["ddp"]["traced"] is False
    assert all(len(t) == DDP_CFG["steps"] for t in out["ddp"]["times"].values())
    assert all(r["seconds"] > 0 and r["traced"] is False and r["max_memory_allocated"] > 0 for r in out["sharded"])
