"""``python -m collectives bench``: the registry, and a tiny run end to end (table, JSON, plot)."""

import json
import time

import torch._dynamo  # noqa: F401 - torch DDP imports it on first use (seconds): once, before the worlds fork

from collectives.course.benchmarks import allreduce as bench
from collectives.course.impl import resolve


def test_the_registry_names_every_lesson_3_and_4_algorithm_and_the_baselines():
    for name in ("naive_ring", "ring", "pipelined_ring", "multi_ring", "recursive_doubling",
                 "halving_doubling", "tree", "gloo", "nccl"):
        assert callable(resolve(bench.ALGORITHMS[name])), name


def _table_rows(text: str) -> dict[str, list[list[str]]]:
    """nccl-tests' text: '# name: target' opens a block, lines without '#' are rows."""
    blocks, name = {}, None
    for line in text.splitlines():
        if line.startswith("# ") and ": " in line and not line.startswith(("# Avg", "# Out", "# #wrong")):
            name = line[2:].split(": ", 1)[0]
        elif line.strip() and not line.startswith("#") and name is not None:
            blocks.setdefault(name, []).append(line.split())
    return blocks


def test_a_tiny_run_prints_nccl_tests_columns_and_writes_the_json_and_the_plot(tmp_path, capsys):
    # 2 sizes x (the baseline + 2 algorithms) on 2 ranks, one timed run each: a few seconds
    code = bench.main(["--algo", "ring,halving_doubling", "--world", "2", "--sizes", "1K,64K",
                       "--iters", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert code == 0
    text = capsys.readouterr().out
    header = next(line.split()[1:] for line in text.splitlines() if "#wrong" in line and "size" in line)
    assert header == ["size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong", "ratio"]
    assert "# Out of bounds values : 0 OK" in text

    saved = json.loads((tmp_path / "allreduce.json").read_text())
    rows = saved["rows"]
    assert [(r["nbytes"], r["algo"]) for r in rows] == [
        (1024, "gloo"), (1024, "ring"), (1024, "halving_doubling"),
        (65536, "gloo"), (65536, "ring"), (65536, "halving_doubling")]
    for r in rows:
        assert r["seconds"] > 0 and r["world_size"] == 2
        assert (r["ok"], r["wrong"]) == ((None, None) if r["algo"] == "gloo" else (True, 0))
        assert abs(r["busbw"] - r["algbw"]) < 1e-6 * r["algbw"]       # p = 2: 2(p-1)/p = 1
        assert abs(r["ratio"] - r["baseline_seconds"] / r["seconds"]) < 1e-9
    assert saved["meta"]["torch"] and saved["meta"]["backend"] == "gloo"
    assert "-core " in saved["meta"]["device"] and len(saved["meta"]["load_average_before"]) == 3

    printed = _table_rows(text)                 # the same rows, as nccl-tests prints them
    assert list(printed) == ["gloo", "ring", "halving_doubling"]
    for r in rows:
        size, count, kind, redop, us, algbw, busbw, wrong, ratio = printed[r["algo"]].pop(0)
        assert (int(size), int(count), kind, redop) == (r["nbytes"], r["numel"], "float", "sum")
        assert float(us) == round(r["seconds"] * 1e6, 2)
        assert float(algbw) == round(r["nbytes"] / r["seconds"] / 1e9, 3)      # GB = 10^9 bytes
        assert wrong == ("N/A" if r["algo"] == "gloo" else "0")

    png = (tmp_path / "allreduce.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_json_and_the_exercise_beside_the_reference(tmp_path, capsys, monkeypatch):
    """--impl exercise times each algorithm's exercise too: a solved one like the reference, a
    stub as "not written yet"; --json prints the document alone on stdout."""
    lesson = tmp_path / "lessons" / "04_ring"
    lesson.mkdir(parents=True)
    (lesson / "exercise.py").write_text(
        "from collectives.ring import ring_all_reduce  # noqa: F401 - solved: the reference itself\n"
        "def tree_all_reduce(tensor, op=None, group=None):\n"
        "    raise NotImplementedError('Lesson 4, task 7: tree_all_reduce')\n")
    monkeypatch.setenv("COLLECTIVES_EXERCISE_DIR", str(tmp_path / "lessons"))
    code = bench.main(["--algo", "ring,tree", "--world", "2", "--sizes", "4K", "--iters", "1", "--warmup", "0",
                       "--impl", "exercise", "--json", "--out", str(tmp_path / "out")])
    assert code == 0
    saved = json.loads(capsys.readouterr().out)     # nothing but the JSON on stdout
    rows = {r["algo"]: r for r in saved["rows"]}
    assert list(rows) == ["gloo", "ring", "ring (exercise)", "tree", "tree (exercise)"]
    assert rows["ring (exercise)"]["wrong"] == 0 and rows["ring (exercise)"]["seconds"] > 0
    assert rows["tree (exercise)"]["seconds"] is None
    assert rows["tree (exercise)"]["missing"] == "not written yet (Lesson 4, task 7: tree_all_reduce)"
    assert saved == json.loads((tmp_path / "out" / "allreduce.json").read_text())
    bench.render(saved["rows"], "title")
    text = capsys.readouterr().out
    assert "# tree (exercise): " in text and "not written yet" in text
    assert [row[0] for row in _table_rows(text)["ring (exercise)"]] == ["4096"]


def test_a_stub_reducer_is_listed_as_not_written_in_bench_ddp():
    from collectives import launch
    from collectives.course.benchmarks import bucketing as bucketing_bench

    cfg = dict(world=2, backend="gloo", bucket_cap_mb=0.01, first_bucket_cap_mb=0.01, steps=1, warmup=1,
               model="mlp", sizes=dict(width=16, depth=2), batch=4, impl="exercise")
    result = launch.run(bucketing_bench.run_rank, 2, args=(cfg,))[0]
    assert list(result["times"]) == list(bucketing_bench.VARIANTS)
    assert result["missing"][bucketing_bench.EXERCISE].startswith("not written yet (Lesson 6, task")


def test_a_tiny_fused_run_prints_every_case_and_writes_the_json_and_the_plot(tmp_path, capsys):
    from collectives.course.benchmarks import fused as fused_bench

    # 40 tensors of 100 elements on 2 ranks, 4 runs a case (one per round): a few seconds
    code = fused_bench.main(["--world", "2", "--count", "40", "--numel", "100", "--split", "4K",
                             "--iters", "4", "--separate-iters", "1", "--impl", "exercise", "--out", str(tmp_path)])
    assert code == 0
    table = capsys.readouterr().out
    saved = json.loads((tmp_path / "bench-fused.json").read_text())
    cases = [r["case"] for r in saved["rows"]]
    assert cases == ["separate calls", "flat all_reduce", "flat + 2 copies", "cat + copy_ loop", "fused",
                     "fused, double buffer", "fused, one buffer", "fused, bound", "fused (exercise)"]
    stub = saved["rows"].pop()                      # lessons/05_fused/exercise.py is still a stub
    assert stub["missing"].startswith("not written yet (Lesson 5, task") and "not written yet" in table
    for r in saved["rows"]:
        assert r["seconds"] > 0 and r["cpu_per_rank"] > 0 and r["iters"] == (1 if r["case"] == "separate calls" else 4)
        assert r["case"].split(",")[0] in table        # the table wraps long names
    assert "faster than separate calls" in table
    ahead = {r["case"]: r for r in saved["rows"] if "back_to_back" in r}
    assert sorted(ahead) == sorted(fused_bench.BACK_TO_BACK)
    assert all(r["back_to_back"] > 0 for r in ahead.values())
    assert ahead["flat all_reduce"]["back_to_back_vs_flat"] == 1.0 and "back to back" in table
    flat = next(r for r in saved["rows"] if r["case"] == "flat all_reduce")
    assert flat["vs_flat"] == 1.0 and saved["meta"]["backend"] == "gloo" and saved["meta"]["count"] == 40
    assert (tmp_path / "bench-fused.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sparse_benchmark_model_adds_the_measured_processor_time_to_the_wire():
    """bench-sparse's model on a recorded sweep (no world needed): selection as timed at the
    swept densities (interpolated between them), zeroing and pair work at the measured
    rates, the wire from α and the link's rate -- and the crossover it puts below the
    wire's alone, where the model's best sparse time meets the dense ring's."""
    import pytest

    from collectives.course.benchmarks import sparse as sb
    from collectives.sparse import cost

    n, p = 16 << 20, 4
    result = dict(n=n, p=p, alpha=100e-6, compute=dict(scan=0.3e-9, pair=8e-9),
                  sweep=[dict(density=0.01, select=0.07), dict(density=0.1, select=0.16),
                         dict(density=0.5, select=0.86)])
    link = sb.model_link(result, "1gbit")
    assert link.beta == pytest.approx(1 / 125e6)
    assert sb._select_seconds(result, 0.1) == pytest.approx(0.16)          # at a swept density
    assert 0.07 < sb._select_seconds(result, 0.03) < 0.16                   # between two
    wire = sb.model_seconds(result, link, 0.1, "allgather", with_compute=False)
    assert wire == pytest.approx(cost.sparse_cost("allgather", n, n // 10, p).seconds(link))
    k = sb.keep_count(n, 0.1)
    processor = 0.3e-9 * n + 0.16 + 8e-9 * (k + p * k)                      # scan + selection + pairs
    assert sb.model_seconds(result, link, 0.1, "allgather") == pytest.approx(wire + processor)
    wire_only, with_cpu = sb.model_crossover(result, link), sb.model_crossover(result, link, True)
    assert wire_only == pytest.approx(cost.sparse_crossover(n, p, link, transport="best"))
    assert with_cpu is not None and 0.01 < with_cpu < wire_only
    dense = cost.sparse_cost("dense", n, n, p).seconds(link)
    assert sb.model_seconds(result, link, with_cpu) == pytest.approx(dense, rel=1e-6)


def test_measure_issue_is_the_median_host_time_of_one_call():
    from collectives.core import timing
    pauses = iter([0.0, 0.02, 0.002, 0.002, 0.002])       # one slow run: the median ignores it
    took = timing.measure_issue(lambda: time.sleep(next(pauses)), iters=5, device=torch.device("cpu"))
    assert 0.002 <= took < 0.015


def test_capture_graph_warms_on_a_side_stream_then_records_once_with_the_trace_paused(monkeypatch):
    # torch's CUDA streams and graphs stood in for: what runs where, and in which order
    import contextlib

    from collectives.core import timing, trace
    log = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    current = Stream("current")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext(log.append(f"on {s.name}")))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")

    @contextlib.contextmanager
    def graph(g, capture_error_mode):
        log.append(f"capture {g} ({capture_error_mode})")
        yield
        log.append("end capture")
    monkeypatch.setattr(torch.cuda, "graph", graph)
    got = timing.capture_graph(lambda: log.append(f"run, trace {'paused' if trace._paused else 'on'}"),
                               warm=2, device=torch.device("cpu"))
    assert got == "graph"
    assert log == ["side waits current", "on side", "run, trace on", "run, trace on", "current waits side", "sync",
                   "capture graph (thread_local)", "run, trace paused", "end capture", "sync"]


def test_ranks_that_capture_point_to_point_calls_start_with_nccls_graph_registration_off(monkeypatch):
    from collectives.core import timing

    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    assert timing.graph_env() == {"NCCL_GRAPH_REGISTER": "0"}
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")          # the caller's own choice wins
    assert timing.graph_env() == {"NCCL_GRAPH_REGISTER": "1"}
