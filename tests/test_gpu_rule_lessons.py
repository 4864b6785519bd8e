"""The rule for fair GPU comparisons in lesson 8's and lesson 9's GPU benchmarks and in the GPU
lane's steps for lessons 8, 9 and 12, where no GPU is needed: their GPU code paths run under
gloo in one world with the trace installed -- the same code a GPU runs: NCCL's side called
directly, the rank untraced, every contender timed in interleaved rounds, the records naming
the rule -- and the lane's record accepting each step's JSON."""


import pytest
import torch

from collectives import launch, trace
from collectives.course.benchmarks import debugging, sparse, sparse_gpu
from collectives.course.benchmarks import gpu_timing as rule

from .tools_import import tool

gpu_record = tool("gpu_record")


def _both_in_one_world():
    """Lesson 8's GPU comparison and lesson 9's, as on NCCL, in one gloo world."""
    import torch.distributed as dist

    out, seen = {"traced": [trace.installed()]}, []
    x = torch.randn(4096, generator=torch.Generator().manual_seed(dist.get_rank()))
    out["sparse"] = sparse_gpu.compare_on_gpu(x, 0.05, (0.02,), 2, ("allgather", "split"), "topk",
                                              sparse.IMPLS["reference"], sparse.wire_bytes)
    out["traced"].append(trace.installed())
    trace.install(dist.get_rank())
    def listener(kind, peer, tensors, group):        # the timed all-reduce's 16 elements, not timing's own
        if kind == "all_reduce" and sum(t.numel() for t in tensors) == 16:
            seen.append(group is None)               # wrapped: the default group; recorded: the recorder's
    remove = trace.add_listener(listener)
    out["recorder"] = debugging.compare_in_world([64], 3, 2, under_rule=True)
    remove()
    out["all_reduces_seen"] = [seen.count(True), seen.count(False)]
    return out


@pytest.fixture(scope="module")
def world():
    return launch.run(_both_in_one_world, 2, timeout=120)[0]


def test_lesson8_on_nccl_sets_the_sparse_all_reduce_against_nccl_called_directly_in_rounds(world):
    got = world["sparse"]
    assert world["traced"] == [True, False]          # the rank counted its bytes traced, then untraced itself
    assert got["rule"] == rule.fields("eager", "copied", []) and set(got["includes"]) == {"dense", "sparse", "select"}
    assert [(r["variant"], r["mode"]) for r in got["rows"]] == [
        ("allgather", "top-k (topk)"), ("split", "top-k (topk)"), ("allgather", "top-k (sample)"),
        ("allgather", "top-k (reuse)"), ("allgather", "threshold")]
    k = 205                                          # ⌈0.05 · 4096⌉ pairs (int32 index, float32 value) a rank
    topk = got["rows"][0]
    assert topk["sent"] == (2 - 1) * k * (4 + 4) and topk["used"] == "allgather"
    assert [r["density"] for r in got["sweep"]] == [0.02]
    for name, (lo, hi) in got["spread"].items():     # every contender, the dense one included, in the rounds
        assert 0 < lo <= hi, name
    assert got["spread"]["dense"][0] <= got["dense"] <= got["spread"]["dense"][1]
    assert len(got["spread"]) == 1 + 5 + 4 + 2 + 1   # dense, five rows, their four selections, the sweep's three
    results = {"NVLink (NCCL)": got, "NVLink (NCCL), recorded gradients": dict(got, rule=rule.fields(
        "eager", "copied", ["split 0.02: out of memory"]))}
    results["rule"] = sparse_gpu.record_rule(results)
    assert results["rule"]["skipped"] == ["split 0.02: out of memory"]
    assert gpu_record.step_rule(results)["launch"] == "eager"
    assert "dense" in gpu_record.headline("sparse-p2", results, [])[0]


def test_lesson9_on_nccl_sets_the_recorders_call_path_against_nccl_called_directly(world):
    got = world["recorder"]
    (row,) = [r for r in got["rows"] if r["call"] == "all_reduce"]
    # the plain side never reaches the trace (NCCL's function called directly); wrapped and
    # recorded do, every call: 2 blocks of (3 timed + 1 warm-up) calls each; the recorded ones on
    # a group of their own, made as a recorded world makes its group
    assert world["all_reduces_seen"] == [2 * (3 + 1), 2 * (3 + 1)]
    assert row["paid"] == pytest.approx(row["recorded"]["median"] - row["plain"]["median"])
    assert row["added"] == pytest.approx(row["recorded"]["median"] - row["wrapped"]["median"])
    for mode in debugging.MODES:
        lo, hi = row["spread"][mode]
        assert lo == min(row[mode]["blocks"]) and hi == max(row[mode]["blocks"]) and len(row[mode]["blocks"]) == 2
    meta = dict(command="bench-recorder", date="2026-01-01", python="3", backend="nccl", world_size=2, iters=3,
                blocks=2, host="h", device="2× GPU", nccl="2.28", gpus=2, commit="c", torch="2", cpus=16)
    record = {"meta": meta, "listener_seconds": got["listener"], "rows": got["rows"],
              "rule": rule.fields(debugging.LAUNCH, debugging.INPUTS, []), "includes": debugging.INCLUDES,
              "excludes": debugging.EXCLUDES}
    page = debugging.page_record(record).to_dict()
    assert page["meta"]["launch"] == "eager" and page["meta"]["inputs"] == "resident"
    assert "paid" in page["meta"]["includes"]
    folder = {"check.json": dict(rule.compares_nothing(), ok=True), "recorder.json": record,
              "09-bench-recorder.json": page}
    assert set(gpu_record.step_rule(folder)["per file"]) == {"recorder.json", "09-bench-recorder.json"}
    assert gpu_record.step_rule({"recorder.json": record})["per file"]["recorder.json"]["launch"] == "eager"
    assert f"{row['paid'] * 1e6:+.1f} µs a call" in gpu_record.headline("lesson09", folder, [])[0]
    gloo = {k: v for k, v in record.items() if k not in ("rule", "includes", "excludes")}
    assert "launch" not in debugging.page_record(gloo).to_dict()["meta"]   # a CPU record stays as it was
    assert gpu_record.step_rule({"recorder.json": gloo}) is None


def test_the_lane_accepts_lesson12s_step_and_no_folder_of_checks_alone():
    checks = dict(rule.compares_nothing(), checked={})
    bench = {"backend": "nccl", "launch": "graph", "inputs": "copied", "rule": rule.RULE, "runs": {}}
    said = gpu_record.step_rule({"12-gpu-checks.json": checks, "12-bench-gpu.json": bench})
    assert said == {"per file": {"12-bench-gpu.json": {"launch": "graph", "inputs": "copied"}}}
    assert gpu_record.step_rule({"12-gpu-checks.json": checks}) is None       # checks alone compare nothing
    assert gpu_record.step_rule({"12-gpu-checks.json": {"checked": {}}, "12-bench-gpu.json": bench}) is None
    lane = gpu_record.lane_rule([dict(step="lesson12", data={"12-gpu-checks.json": checks, "12-bench-gpu.json": bench}),
                                 dict(step="lesson09", data={"check.json": checks, "recorder.json": {
                                     "rule": rule.fields("eager", "resident", [])}})])
    assert lane["outside"] == [] and lane["launch"] == "per step"


def _on_gpus():
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1 << 20, device=device)
    return {"sparse": sparse_gpu.compare_on_gpu(x, 0.01, (0.01,), 3, ("allgather", "split"), "topk",
                                                sparse.IMPLS["reference"], sparse.wire_bytes),
            "recorder": debugging.compare_in_world([4096], 20, 3)}


@pytest.mark.gpu
def test_lessons_8_and_9_on_nccl_time_every_contender_under_the_rule():
    """p = 2: every contender of lesson 8 timed on NCCL with nothing dropped; lesson 9's rows
    carry what a user pays, with the spread of the blocks."""
    out = launch.run(_on_gpus, 2, backend="nccl", timeout=300, env=rule.rank_env("eager"))[0]
    got = out["sparse"]
    assert got["rule"]["skipped"] == [] and len(got["rows"]) == 5 and got["sweep"], got
    assert all(r["seconds"] > 0 and r["select"] > 0 for r in got["rows"])
    assert all("paid" in r and "spread" in r for r in out["recorder"]["rows"]), out["recorder"]
