"""Lesson 14, pipeline parallelism: every schedule equal to one process and to torch's.

The graded tasks are judged by :mod:`collectives.course.grading.tasks.lesson14` outside the
ranks; ``tests/test_grader.py`` and ``tests/test_grader_lesson14.py`` run those judges on the
reference, the stubs, every partial solution and the natural mistakes. Here: the simulator
against the formulas and on a deadlock; then, in one world of 2 and one of 4, every
schedule's gradients equal one process's bit for bit (and torch's ``pipelining`` schedules'
on 2 ranks), its messages as the design says (shapes once, one activation forward and one
gradient back per micro-batch and boundary, tagged), its memory as the schedule's, and a
deadlocking or malformed schedule refused before any message.
"""

import pytest
import torch
import torch.distributed as dist

from collectives import launch, trace
from collectives.core import cluster
from collectives.course.catalog import world_timeout
from collectives.pipeline import (
    Deadlock,
    InvalidSchedule,
    cost,
    from_orders,
    interleaved_1f1b,
    measure,
    one_f_one_b_order,
    schedule,
    simulate,
)

LESSON = 14
WORLD_TIMEOUT = world_timeout(60.0)
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))


# ---- on paper -------------------------------------------------------------------------

@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 4), (4, 8), (8, 16)])
def test_simulated_bubbles_equal_the_formulas(p, m):
    for name, v in SCHEDULES:
        timeline = simulate(schedule(name, p, m, v), m)
        assert timeline.bubble() == pytest.approx(cost.bubble(name, p, m, v)), name
    assert simulate(schedule("zb-h1", p, m), m).bubble() <= simulate(schedule("1f1b", p, m), m).bubble() / 2


def test_the_bubble_of_a_trace_is_the_ranks_idle_share_between_first_start_and_last_end():
    # rank 0 busy 0-1 and 4.5-6.5, rank 1 busy 1.5-2.5 and 2.5-4: 5.5 of 2 × 6.5 busy
    trace = [[("F", 0, 0, 0.0, 1.0), ("B", 0, 0, 4.5, 6.5)], [("F", 0, 1, 1.5, 2.5), ("B", 0, 1, 2.5, 4.0)]]
    assert measure.bubble(trace) == pytest.approx(7.5 / 13)
    shifted = [[(k, i, c, s + 7, e + 7) for k, i, c, s, e in rank] for rank in trace]
    assert measure.bubble(shifted) == pytest.approx(7.5 / 13)
    assert measure.message_time(trace, 2) == pytest.approx(0.5)     # both messages: 1.0 -> 1.5, 4.0 -> 4.5
    assert measure.overhead(trace, 2) == pytest.approx(0.0)         # rank 1's B0 follows its F0 at once
    assert measure.unit_times(trace) == [{"F": 1.0, "BW": 2.0}, {"F": 1.0, "BW": 1.5}]


def test_stages_of_different_speeds_pace_gpipe_at_the_slowest():
    # a flow of m equal jobs through stages of times t_r ends after Σ t_r + (m − 1)·max t_r
    p, m = 3, 5
    costs = [{"F": 1.0, "BW": 2.0}, {"F": 1.5, "BW": 3.0}, {"F": 1.2, "BW": 2.2}]
    timeline = simulate(schedule("gpipe", p, m), m, costs)
    assert timeline.makespan == pytest.approx(3.7 + 4 * 1.5 + 7.2 + 4 * 3.0)
    busy = sum(m * (c["F"] + c["BW"]) for c in costs)
    assert timeline.bubble() == pytest.approx(1 - busy / (p * timeline.makespan))
    with pytest.raises(ValueError, match="2 ranks' costs"):
        simulate(schedule("gpipe", p, m), m, costs[:2])


@pytest.mark.parametrize("name,v", SCHEDULES)
def test_measured_costs_read_back_from_a_trace_predict_its_bubble(name, v):
    p, m = 4, 8
    sched = schedule(name, p, m, v)
    costs = [{"F": 1.0 + 0.3 * r, "B": 1.1 + 0.2 * r, "W": 0.9 + 0.1 * r} for r in range(p)]
    for c in costs:
        c["BW"] = c["B"] + c["W"]
    played = simulate(sched, m, costs, message=0.05, overhead=0.02)
    trace = played.spans
    assert measure.bubble(trace) == pytest.approx(played.bubble())
    assert measure.message_time(trace, p * v) == pytest.approx(0.05)
    assert measure.overhead(trace, p * v) == pytest.approx(0.02)
    split = name == "zb-h1"
    for got, want in zip(measure.unit_times(trace, v), costs):
        assert got == pytest.approx({k: want[k] for k in (("F", "B", "W") if split else ("F", "BW"))})
    parts = measure.explain(sched, m, trace, p * v)
    assert parts["model"] == pytest.approx(parts["measured"])
    assert parts["stages"] < parts["model"]               # the messages and gaps idle the ranks too
    # equal stages of unit steps, messages free: the textbook formula
    unit = simulate(sched, m).spans
    assert measure.predict(sched, m, unit, p * v, uniform=True, messages=False) == pytest.approx(
        cost.bubble(name, p, m, v))


def test_1f1b_holds_p_minus_r_and_gpipe_holds_m():
    p, m = 4, 8
    assert simulate(schedule("gpipe", p, m), m).peak_held == [m] * p
    assert simulate(schedule("1f1b", p, m), m).peak_held == [cost.held("1f1b", p, m, r) for r in range(p)]


def test_a_deadlocking_schedule_is_named_with_its_cycle():
    # rank 0 runs 1F1B's order of a last rank: it waits for micro-batch 0's gradient
    # while rank 1 waits for micro-batch 1's activation
    orders = [one_f_one_b_order(2, 2, 1), one_f_one_b_order(2, 2, 0)]
    with pytest.raises(Deadlock) as err:
        simulate(from_orders(orders), 2)
    text = str(err.value)
    assert "stage 0 waits at step 1 (B of micro-batch 0) for stage 1's B of micro-batch 0" in text
    assert "stage 1 waits at step 1 (F of micro-batch 1) for stage 0's F of micro-batch 1" in text


@pytest.mark.parametrize("orders,says", [
    ([[("F", 0), ("B", 0)], [("F", 0), ("F", 0), ("B", 0)]], "twice"),
    ([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]], "comes before its F"),
    ([[("F", 0), ("B", 0)], [("F", 0)]], "never runs B of micro-batch 0"),
    ([[("F", 0), ("B", 0), ("W", 1)], [("F", 0), ("B", 0)]], "out of range"),
])
def test_a_malformed_schedule_is_refused_with_its_first_problem(orders, says):
    with pytest.raises(InvalidSchedule, match=says):
        simulate(from_orders(orders), 1)


def test_bad_schedule_arguments_are_refused():
    with pytest.raises(ValueError, match="multiple of p"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="p ≥ 1"):
        schedule("1f1b", 0, 4)
    with pytest.raises(ValueError, match="no schedule"):
        schedule("pipedream", 2, 4)


# ---- in a world ---------------------------------------------------------------------------

def _data(m, rows=3, width=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, width, generator=gen) for _ in range(m)]
    return xs, [torch.randn(rows, width, generator=gen) for _ in range(m)]


def _mismatches(pipe, ref, per):
    return [c for c, st in pipe.stages.items()
            if not all(torch.equal(a, b) for got, want in zip(st.grads, ref[c * per:(c + 1) * per])
                       for a, b in zip(got, want))]


def _world_checks(with_torch: bool):
    import collectives.pipeline as pl
    p = dist.get_world_size()
    m, out = 4, {}
    xs, ts = _data(m)
    for name, v in SCHEDULES:
        C = p * v
        layers = pl.make_layers(2 * C, 8, seed=3)
        ref, ref_losses = pl.one_process(layers, xs, ts)
        pipe = pl.make_pipeline(layers, C)
        steps = pl.schedule(name, p, m, v)
        with trace.recording() as first:
            losses = pipe.step(steps, xs, ts)
        wrong = _mismatches(pipe, ref, len(layers) // C)
        with trace.recording() as second:
            pipe.step(steps, xs, ts)                    # shapes known: no shape message now
        msgs = [(e.kind, e.peer, e.numel, e.tag) for e in first if e.kind in ("isend", "irecv", "send", "recv")]
        again = [(e.kind, e.peer, e.numel, e.tag) for e in second if e.kind in ("isend", "irecv")]
        out[name] = {"wrong": wrong,
                     "losses_ok": losses == ref_losses if C - 1 in pipe.stages
                     else losses == [],
                     "msgs": msgs, "again": again, "peak": [s.peak_held for s in pipe.stages.values()],
                     "peak_bytes": sum(s.peak_bytes for s in pipe.stages.values()),
                     "log": [s.log for s in pipe.stages.values()]}
    # refused before any message: a deadlocking schedule, one for another world size
    orders = [one_f_one_b_order(p, m, p - 1 - q) for q in range(p)]
    pipe = pl.make_pipeline(pl.make_layers(p, 8), p)
    with trace.recording() as t:
        for bad in (pl.from_orders(orders), pl.schedule("1f1b", p + 1, m)):
            try:
                pipe.step(bad, xs, ts)
                out.setdefault("refused", []).append("ran")
            except (Deadlock, ValueError) as exc:
                out.setdefault("refused", []).append(type(exc).__name__)
    out["refused_msgs"] = len(t.events)
    if with_torch:
        import warnings
        warnings.filterwarnings("ignore")
        from collectives.pipeline.torch_pp import TorchPipeline
        for name, v in SCHEDULES:
            C = p * v
            layers = pl.make_layers(2 * C, 8, seed=3)
            ref, _ = pl.one_process(layers, xs, ts)
            theirs = TorchPipeline(layers, name, C, len(xs))
            theirs.step(torch.cat(xs), torch.cat(ts))
            got = theirs.grads()
            out["torch spans " + name] = sorted((k, i, c) for k, i, c, s, e in theirs.spans if s <= e)
            per = len(layers) // C
            out["torch " + name] = [c for c, gs in got.items()
                                    if not all(torch.equal(a, b) for g, w in zip(gs, ref[c * per:(c + 1) * per])
                                               for a, b in zip(g, w))]
    return out


def _check_world(results, p, m=4):
    for r, out in enumerate(results):
        for name, v in SCHEDULES:
            C, seen = p * v, out[name]
            assert seen["wrong"] == [] and seen["losses_ok"], (p, r, name, seen["wrong"])
            sends = [x for x in seen["msgs"] if x[0] == "isend"]
            shapes = [x for x in sends if x[2] == 4]
            acts = [x for x in sends if x[2] == 24 and x[3] % 2 == 0]
            grads = [x for x in sends if x[2] == 24 and x[3] % 2 == 1]
            mine = range(r, C, p)
            # shapes once per boundary leaving this rank's chunks; then one activation forward
            # and one gradient back per micro-batch and boundary, to the next (previous) chunk's rank
            assert len(shapes) == sum(1 for c in mine if c < C - 1), (p, r, name, shapes)
            assert sorted(acts) == sorted(("isend", (c + 1) % p, 24, 2 * (i * C + c))
                                          for c in mine if c < C - 1 for i in range(m)), (p, r, name)
            assert sorted(grads) == sorted(("isend", (c - 1) % p, 24, 2 * (i * C + c) + 1)
                                           for c in mine if c > 0 for i in range(m)), (p, r, name)
            assert len(sends) == len(shapes) + len(acts) + len(grads), "nothing else is sent"
            assert all(x[2] != 4 for x in seen["again"]), "the shapes are agreed once, at the first step"
        assert out["1f1b"]["peak"] == [min(m, p - r)] and out["gpipe"]["peak"] == [m]
        less = out["1f1b"]["peak_bytes"] < out["gpipe"]["peak_bytes"]
        assert less if p - r < m else out["1f1b"]["peak_bytes"] == out["gpipe"]["peak_bytes"], (p, r)
        assert all(k == "BW" for log in out["1f1b"]["log"] for k, _ in log if k != "F")
        assert {k for log in out["zb-h1"]["log"] for k, _ in log} == {"F", "B", "W"}
        assert out["refused"] == ["Deadlock", "ValueError"] and out["refused_msgs"] == 0


def _one_rank():
    import collectives.pipeline as pl
    xs, ts = _data(4)
    out = {}
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 3), ("zb-h1", 1)):
        layers = pl.make_layers(6, 8, seed=3)
        pipe = pl.make_pipeline(layers, v)
        with trace.recording() as t:
            losses = pipe.step(pl.schedule(name, 1, 4, v), xs, ts)
        ref, ref_losses = pl.one_process(layers, xs, ts)
        out[name] = (_mismatches(pipe, ref, 6 // v), losses == ref_losses, len(t.events))
    return out


def test_one_rank_runs_every_schedule_its_chunks_passing_activations_without_messages():
    # p = 1: an interleaved rank holds consecutive chunks; gloo cannot send to itself, so
    # the runner hands the activation over in memory
    for name, (wrong, losses_ok, messages) in launch.run(_one_rank, 1, timeout=WORLD_TIMEOUT)[0].items():
        assert wrong == [] and losses_ok and messages == 0, (name, wrong, losses_ok, messages)


def test_every_schedule_equals_one_process_and_torch_bit_for_bit_on_2_ranks():
    results = launch.run(_world_checks, 2, args=(True,), timeout=WORLD_TIMEOUT)
    _check_world(results, 2)
    for r, out in enumerate(results):
        for name, v in SCHEDULES:
            assert out["torch " + name] == [], f"torch's {name} differs on chunks {out['torch ' + name]}"
            # torch's steps are timed as the runner's: each F and B (W too, split) once per micro-batch and chunk
            kinds = "BFW" if name == "zb-h1" else "BF"
            assert out["torch spans " + name] == sorted((k, i, c) for k in kinds for i in range(4)
                                                        for c in range(r, 2 * v, 2)), (r, name)


def test_every_schedule_equals_one_process_with_its_messages_on_4_ranks():
    _check_world(launch.run(_world_checks, 4, args=(False,), timeout=WORLD_TIMEOUT), 4)


def test_bench_pp_writes_a_record_with_its_environment_and_draws_the_timeline_from_it(tmp_path):
    import json

    from collectives.course.benchmarks import pipeline as bench
    assert bench.main(["--quick", "--world", "2", "--no-torch", "--rounds", "1", "--out", str(tmp_path),
                       "--img", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "14-pipeline-local.json").read_text())
    assert {"device", "torch", "date", "command", "commit", "cpus", "load_average"} <= set(record["meta"])
    rows = {r["name"]: r for r in record["rows_by_schedule"]}
    assert set(rows) == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert rows["1f1b"]["peak_held"] == [[2], [1]] and rows["gpipe"]["peak_held"] == [[4], [4]]
    assert rows["gpipe"]["formula"] == pytest.approx(cost.bubble_gpipe(2, 4))
    for row in rows.values():       # the last round's bubble is its trace's, its model the simulator's with its costs
        assert row["bubble_rounds"][-1] == pytest.approx(measure.bubble(row["spans"]))
        sched = schedule(row["name"], 2, 4, row["v"])
        assert row["model_rounds"][-1] == pytest.approx(measure.predict(sched, 4, row["spans"], 2 * row["v"]))
        assert row["torch_bubble"] is None and len(row["unit_seconds"]) == 2
    figure = json.loads((tmp_path / "14-timeline.json").read_text())
    assert figure["table"]["rows"][0][0] == "GPipe" and (tmp_path / "14-timeline.svg").exists()


@pytest.mark.skipif(cluster.unavailable_reason() is not None, reason=str(cluster.unavailable_reason()))
def test_bench_pp_cluster_sends_less_across_the_link_than_data_parallel_and_as_the_model_says(tmp_path):
    import json

    from collectives.course.benchmarks import pipeline as bench
    assert bench.main(["--cluster", "--quick", "--rounds", "1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "14-pipeline-cluster.json").read_text())
    assert record["max_grad_diff"] < 1e-5, "the pipeline's and data parallel's gradients agree"
    rows = {r["name"]: r for r in record["rows_by_schedule"]}
    assert rows["pp"]["bytes_across"] < rows["dp"]["bytes_across"]
    # the gradients' bytes dominate data parallel's traffic: the model within packet headers
    assert 0.9 < rows["dp"]["bytes_across"] / rows["dp"]["model_bytes"] < 1.4, rows["dp"]
    assert rows["pp"]["bytes_across"] >= rows["pp"]["model_bytes"]
    import os

    left = [name for name in cluster.our_namespaces() if name.startswith(f"{cluster.PREFIX}-{os.getpid()}-")]
    assert not left, f"the cluster's namespaces were not removed: {left}"


def _gpu_checks():
    import collectives.pipeline as pl
    from collectives import ops
    p, device, m = dist.get_world_size(), ops.rank_device(), 4
    xs, ts = _data(m)
    xs, ts = [x.to(device) for x in xs], [t.to(device) for t in ts]
    worst = {}
    for name, v in SCHEDULES:
        C = p * v
        layers = pl.make_layers(2 * C, 8, seed=3, device=device)
        ref, _ = pl.one_process(layers, xs, ts)
        pipe = pl.make_pipeline(layers, C)
        pipe.step(pl.schedule(name, p, m, v), xs, ts)
        per = len(layers) // C
        worst[name] = max(float((a - b).abs().max()) for c, st in pipe.stages.items()
                          for got, want in zip(st.grads, ref[c * per:(c + 1) * per]) for a, b in zip(got, want))
    return worst


@pytest.mark.gpu
def test_every_schedule_equals_one_process_on_gpus_through_nccl():
    # within float32 rounding: cuBLAS may choose another kernel for the same product
    for worst in launch.run(_gpu_checks, 2, backend="nccl", timeout=WORLD_TIMEOUT,
                            env={"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}):
        assert all(w < 1e-5 for w in worst.values()), worst
