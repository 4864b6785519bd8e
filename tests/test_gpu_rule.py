"""The rule for fair GPU comparisons, where no GPU is needed: the shared pieces
(:mod:`collectives.course.benchmarks.gpu_timing`), and the GPU paths of ``bench-fused``,
``bench-alltoall`` and ``tools/gpu_probe.py`` run eagerly under gloo -- the same code a GPU
runs, its checks, its interleaved rounds and its record."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from collectives import launch, trace
from collectives.course.benchmarks import gpu_timing as rule

from .tools_import import tool

ROOT = Path(__file__).resolve().parent.parent


def test_the_rule_refuses_what_it_lacks_and_its_record_names_every_point():
    with pytest.raises(ValueError, match="launch must be one of"):
        rule.check_launch("replayed-for-one-side")
    with pytest.raises(ValueError, match="inputs must be one of"):
        rule.check_inputs("untimed")
    with pytest.raises(ValueError, match="inputs must be one of"):
        rule.fields("eager", {"nccl": "resident", "mine": "half"}, [])
    with pytest.raises(ValueError, match="launch must be one of"):
        rule.launched({"nccl": lambda: None}, "mixed")
    said = rule.fields("graph", "copied", ["x: why"])
    assert said == {"launch": "graph", "inputs": "copied", "rule": rule.RULE, "untraced": True,
                    "multicast": rule.MULTICAST, "skipped": ["x: why"]}
    assert "NVLS" in said["multicast"] and (ROOT / rule.RULE.split("#")[0]).exists()
    assert "## The rule for fair GPU comparisons" in (ROOT / "docs" / "benchmarks.md").read_text()
    # the ranks' environment: multicast off always, NCCL's registration of captured buffers off for graphs
    assert rule.rank_env("eager") == {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0",
                                      "NVSHMEM_DISABLE_NVLS": "1"}
    assert rule.rank_env("graph")["NCCL_GRAPH_REGISTER"] == "0"
    # graph: every contender replayed, but one that replays a graph of its own is called as a caller calls it
    own, other = (lambda: None), (lambda: None)
    runs = rule.launched({"fused": own, "nccl": other}, "graph", own_graphs=("fused",))
    assert runs["fused"] is own and isinstance(runs["nccl"], rule.Replayed) and runs["nccl"].run is other
    assert rule.launched({"nccl": other}, "eager") == {"nccl": other}
    assert rule.summary([3.0, 1.0, 2.0, 5.0, 4.0]) == (3.0, [1.0, 5.0])


def _rounds_in_rank():
    """Interleaved rounds: each contender once per round, in turn; one that raises is dropped whole."""
    order, calls = [], {"a": 0}

    def a():
        calls["a"] += 1
        order.append("a")

    def broken():
        order.append("broken")
        raise RuntimeError("refused at this size\nsecond line")
    skipped = []
    samples = rule.rounds({"a": a, "broken": broken, "b": lambda: order.append("b")}, iters={"a": 2, "broken": 1,
                          "b": 1}, skipped=skipped, where=" (float32)", count=3, device=torch.device("cpu"))
    return samples, skipped, order, calls["a"]


def _three_in_one_world():
    """The rounds, lesson 5's GPU path (eager) and a probe's two launches, in one gloo world."""
    return {"rounds": _rounds_in_rank(), "fused": _fused_in_rank("eager"), "both": _both_in_rank()}


@pytest.fixture(scope="module")
def world():
    return launch.run(_three_in_one_world, 2, timeout=120)[0]


def test_rounds_interleave_the_contenders_and_drop_one_that_raises(world):
    samples, skipped, order, a_calls = world["rounds"]
    assert sorted(samples) == ["a", "b"] and all(len(v) == 3 and min(v) > 0 for v in samples.values())
    assert skipped == ["broken (float32): refused at this size"]
    # measure_back_to_back: one untimed run, then the batch; a round times a, then b, in turn
    assert a_calls == 3 * (1 + 2)
    assert order == ["a", "a", "a", "broken", "b", "b"] + ["a", "a", "a", "b", "b"] * 2


def _fused_in_rank(launch_mode: str):
    from collectives.course.benchmarks import fused_gpu
    out = fused_gpu.measure(12, 10, 160, 3, 1, 2, launch_mode, "exercise", torch.device("cpu"))
    out["traced_after"] = trace.installed()
    # the check on its own: a case that leaves the wrong sum, or raises, is named
    t = torch.zeros(5)
    cases = {"right": (None, [t]), "wrong": (None, [t]), "raises": (None, [t])}
    runs = {"right": lambda: dist.all_reduce(t), "wrong": lambda: t.mul_(2),
            "raises": lambda: (_ for _ in ()).throw(RuntimeError("no graph here"))}
    out["judged"] = fused_gpu.check(runs, cases)
    return out


def test_bench_fused_gpu_path_checks_every_case_times_it_untraced_and_names_the_rule(world):
    from collectives.course.benchmarks import fused_gpu

    out = world["fused"]
    rows = {r["case"]: r for r in out["rows"]}
    assert list(rows) == ["separate calls", "flat all_reduce", "flat + 2 copies", "cat + copy_ loop", *fused_gpu.FUSED,
                          "fused (exercise)"]
    assert rows.pop("fused (exercise)")["missing"].startswith("not written yet (Lesson 5, task")
    assert all(r["checked"] is True for r in rows.values()) and set(out["checked"]) == set(rows)
    for r in rows.values():
        assert r["launched"] == "eager" and len(r["times"]) == 2 and r["spread"] == [min(r["times"]), max(r["times"])]
        assert r["seconds"] == pytest.approx(sum(r["times"]) / 2)
        assert r["iters"] == (1 if r["case"] == "separate calls" else 3)
    assert rows["flat all_reduce"]["vs_flat"] == 1.0 and rows["flat + 2 copies"]["vs_copy_floor"] == 1.0
    assert "vs_copy_floor" in rows["fused"] and "vs_copy_floor" not in rows["fused, bound"]
    said = out["rule"]
    assert said["launch"] == "eager" and said["untraced"] and not out["traced_after"]
    assert said["inputs"]["fused"] == "copied" and said["inputs"]["fused, bound"] == "resident"
    assert said["inputs"]["flat all_reduce"] == "resident"
    assert any(s.startswith(fused_gpu.WINDOW + ": NCCL window registration") for s in said["skipped"])
    judged = out["judged"]
    assert judged["right"] is True and judged["wrong"] is False
    assert judged["raises"] == "raised RuntimeError: no graph here"


def test_bench_fused_refuses_a_launch_mode_on_cpus(capsys):
    from collectives.course.benchmarks import fused as bench

    with pytest.raises(SystemExit) as stop:
        bench.main(["--backend", "gloo", "--launch", "graph", "--world", "2"])
    assert stop.value.code == 2 and "--launch is for GPUs" in capsys.readouterr().err
    from collectives.course.benchmarks import fused_gpu
    with pytest.raises(ValueError, match="launch must be one of"):
        fused_gpu.measure(2, 2, 8, 1, 1, 1, "replayed", "reference", torch.device("cpu"))


def test_the_gpu_paths_import_without_a_gpu():
    import importlib
    for name in ("fused_gpu", "gpu_timing", "symmetric_gpu"):
        importlib.import_module(f"collectives.course.benchmarks.{name}")


def _alltoall_in_rank():
    from collectives.course.benchmarks import alltoall_gpu
    out = alltoall_gpu.measure([4096, 65536], 3, "eager", "resident", 2, torch.device("cpu"))
    out["traced_after"] = trace.installed()
    x, y = torch.zeros(6), torch.zeros(6)
    places = dict.fromkeys(("dist.all_to_all_single", "right", "wrong"), (x, y))
    runs = {"dist.all_to_all_single": lambda n: dist.all_to_all_single(y[:n], x[:n]),
            "right": lambda n: dist.all_to_all_single(y[:n], x[:n]), "wrong": lambda n: y[:n].copy_(x[:n])}
    out["judged"] = alltoall_gpu.check(runs, places, 6)
    return out


def test_bench_alltoall_gpu_path_checks_every_exchange_times_it_untraced_and_names_the_rule():
    from collectives.course.benchmarks import alltoall_gpu

    out = launch.run(_alltoall_in_rank, 3, timeout=120)[0]
    rows = out["rows"]
    # 4096 and 65536 bytes per rank: p = 3 equal blocks of whole elements
    assert [(r["name"], r["nbytes"]) for r in rows] == [(name, n) for n in (4092, 65532)
                                                        for name in (alltoall_gpu.NCCL, *alltoall_gpu.OURS)]
    for r in rows:
        assert r["verified"] and r["launch"] == "eager" and len(r["times"]) == 2
        assert r["spread"] == [min(r["times"]), max(r["times"])] and r["seconds"] == pytest.approx(sum(r["times"]) / 2)
        assert (r["messages"] is None) == (r["name"] == alltoall_gpu.NCCL)
    assert {r["name"]: r["messages"] for r in rows}["linear"] == 2      # one message to each other rank
    assert all(v is True for judged in out["checked"].values() for v in judged.values())
    assert out["launch"] == "eager" and out["inputs"] == "resident" and out["untraced"] and not out["traced_after"]
    assert out["rule"] == rule.RULE and any(s.startswith(alltoall_gpu.WINDOW + ": ") for s in out["skipped"])
    assert out["judged"] == {"dist.all_to_all_single": True, "right": True, "wrong": False}


def test_bench_alltoall_refuses_the_rules_switches_off_gpus_and_names_a_replayed_record(tmp_path, capsys):
    from collectives.course.benchmarks import alltoall as bench
    from collectives.course.benchmarks import alltoall_gpu

    for argv in (["local", "--launch", "graph"], ["moe", "--backend", "nccl", "--inputs", "resident"]):
        with pytest.raises(SystemExit) as stop:
            bench.main(argv)
        assert stop.value.code == 2 and "are for the local suite on GPUs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="inputs must be one of"):
        alltoall_gpu.measure([4096], 1, "eager", "half", 1, torch.device("cpu"))
    made = bench.write("local", ["local"], "nccl", {"rows": [], "launch": "graph"}, str(tmp_path))
    assert made.name == "bench-alltoall-local-nccl-graph.json"
    assert bench.write("local", ["local"], "nccl", {"rows": [], "launch": "eager"}, str(tmp_path)).name == \
        "bench-alltoall-local-nccl.json"


def test_the_lessons_target_compares_rows_of_one_run_only():
    gpu_lesson11 = tool("gpu_lesson11")
    rows = [dict(name=name, nbytes=n, seconds=s) for n, times in (
        (1 << 20, {"dist.all_to_all_single": 1.0, "linear": 2.0}),
        (64 << 20, {"dist.all_to_all_single": 8.0, "linear": 10.0, "pairwise": 9.0,
                    "dist.all_to_all_single, NCCL window": 4.0}),
        (256 << 20, {"linear": 30.0})) for name, s in times.items()]
    target = gpu_lesson11._target(rows)
    assert target[0] == {"nbytes": 64 << 20, "best": "pairwise", "fraction_of_nccl": 8.0 / 9.0, "meets_0.85": True}
    assert target[1]["best"] is None and "missing" in target[1]["why_none"]


def _both_in_rank():
    def refuses():
        raise RuntimeError("operation not permitted when stream is capturing")
    skipped = []
    timed = rule.both_launches({"nccl": lambda: None, "ring": lambda: None},
                               {"nccl": lambda: None, "ring": refuses}, iters=2, skipped=skipped, count=2,
                               device=torch.device("cpu"))
    return timed, skipped


def test_a_probe_times_each_launch_in_rounds_of_its_own_and_compares_a_column_with_itself(world):
    timed, skipped = world["both"]
    assert set(timed["nccl"]) == {"b2b_s", "b2b_spread", "graph_s", "graph_spread"}
    assert set(timed["ring"]) == {"b2b_s", "b2b_spread"}
    assert skipped == ["ring (graph): operation not permitted when stream is capturing"]
    said = rule.columns({"nccl": {"b2b_s": 2.0, "b2b_spread": [1.9, 2.1], "graph_s": 1.0, "graph_spread": [1, 1]},
                         "ring": {"b2b_s": 4.0, "b2b_spread": [4, 4], "graph_s": 0.5, "graph_spread": [0.5, 0.6]}},
                        ("nccl", "ring"))
    assert said["ring_speed_vs_nccl_eager"] == 0.5 and said["ring_speed_vs_nccl_replayed"] == 2.0
    assert said["gpu_ring_graph_s"] == 0.5 and said["gpu_nccl_eager_spread"] == [1.9, 2.1]
    # a column missing on one side: no ratio across launches is made up from the other
    said = rule.columns({"nccl": {"b2b_s": 2.0, "b2b_spread": [2, 2]},
                         "ring": {"graph_s": 0.5, "graph_spread": [0.5, 0.5]}}, ("nccl", "ring"))
    assert not any("speed" in key for key in said)
    assert rule.fields(rule.BOTH, "resident", [])["launch"] == rule.BOTH


def test_the_probes_import_without_a_gpu_and_follow_the_rule_in_every_rank():
    import ast
    gpu_fused_profile, gpu_probe = tool("gpu_fused_profile"), tool("gpu_probe")
    profile = (ROOT / "tools" / "gpu_fused_profile.py").read_text()
    assert "rule.both_launches(" in profile and callable(gpu_fused_profile.main)
    source = (ROOT / "tools" / "gpu_probe.py").read_text()
    for name in ("host_rank", "graph_rank", "triton_rank", "barrier_rank"):
        body = ast.get_source_segment(source, next(n for n in ast.parse(source).body
                                                   if isinstance(n, ast.FunctionDef) and n.name == name))
        assert "rule.untrace_rank()" in body, name
        timed = body[body.index("rule.untrace_rank()"):]
        # once the rule applies, NCCL is called directly and nothing is timed by waiting on each call
        assert "dist.all_reduce(" not in timed and "dist.all_to_all_single(" not in timed, name
        assert "timing.measure(" not in timed and "measure_back_to_back" not in timed, name
    assert callable(gpu_probe.host_rank)


def _fused_on_gpus():
    from collectives.course.benchmarks import fused_gpu
    return [fused_gpu.bench_gpu(50, 64, 4096, 5, 1, 2, launch, "reference") for launch in rule.LAUNCHES]


def _alltoall_on_gpus():
    from collectives.course.benchmarks import alltoall_gpu
    return [alltoall_gpu.in_rank([4096, 1 << 20], 5, launch, inputs, 2)
            for launch, inputs in (("eager", "copied"), ("graph", "resident"))]


@pytest.mark.gpu
def test_the_gpu_paths_check_every_contender_as_launched_on_gpus():
    """Both benchmarks' GPU paths at p = 2, each launch mode: every contender exact against
    NCCL as launched (a replay included), timed, and the record says how."""
    for fn, key in ((_fused_on_gpus, "case"), (_alltoall_on_gpus, "name")):
        runs = launch.run(fn, 2, backend="nccl", timeout=300, env=rule.rank_env("graph"))[0]
        for out, mode in zip(runs, rule.LAUNCHES):
            said = out["rule"] if "rule" in out and isinstance(out["rule"], dict) else out
            assert said["launch"] == mode and said["untraced"], said
            names = {r[key] for r in out["rows"]}
            assert {"flat all_reduce", "fused", "fused, bound"} <= names or \
                {"dist.all_to_all_single", "linear", "pairwise", "bruck"} <= names, (mode, names, said["skipped"])
            assert all(r["seconds"] > 0 for r in out["rows"]), out["rows"]
