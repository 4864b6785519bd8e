"""Lesson 9: every injected fault ends within its time limit, and the analyzer names the culprit.

What is checked:

* **the recorder** -- every call of a world, with torch's Flight Recorder fields: a sequence
  number per group (collectives and point-to-point counted apart), sizes, dtypes, peers,
  states, times, the caller's line; a ring that keeps the last N; dumps on request, on a
  signal while the rank is stuck in a C++ wait, after ``dump_after`` seconds in one call, and
  from the launcher however the world ends; the calls of a rank killed by SIGKILL or by
  gloo's SIGABRT recovered from its ring; the trace's listener told of every stage;
* **the faults, for real** -- each of the lab's scenarios on a local world (and a link going
  down, a killed rank and a size mismatch on a simulated cluster) ends within its limit, and
  the diagnosis' first finding is the expected kind and names exactly the ranks the fault was
  put into; torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` catches a swapped order and misses a
  deadlock;
* **the synthesised dumps** match real runs call for call (the lab's scenarios and two drawn
  on subgroups), so the grader's scenarios are the real ones';
* **the analyzer's four checks** (the implementation under test: the reference, or the
  exercise under ``--impl exercise``) find exactly what each scenario put there -- worked out
  from its parameters, not from a dump -- on the lab's scenarios and 20 seeds of every kind,
  and behave on hand-made edge cases: a ring that came round, a rank with no dump, a tie, a
  transfer both ends are in, a deadlock that timed out;
* ``python -m collectives diagnose`` and ``bench-recorder`` at a tiny size.
"""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from collectives import launch, trace
from collectives.core import cluster as cl
from collectives.core import flight_recorder
from collectives.course.impl import resolve
from collectives.debugging import (
    FINDING,
    HANGS,
    KINDS,
    LAB,
    Outcome,
    Params,
    blame,
    detail,
    diagnose,
    draw,
    dumps_for,
    expected,
    run_scenarios,
    scenario_dumps,
)

LESSON = 9
LIMIT = 2.5               # seconds a local scenario that hangs may run (the watchdog stops it then)
ENDS_ITSELF = 5.0         # the limit of one that ends by itself (a death, an error, the loop's end)
CLUSTER_LIMIT = 3.0
SLACK = 5.0               # the dumps after the limit, and a loaded 2-core machine's slowness
TORCH_FIELDS = {"record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id",
                "profiling_name", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "state",
                "time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns", "duration_ms",
                "retired", "frames", "is_p2p"}
needs_cluster = pytest.mark.skipif(cl.unavailable_reason() is not None, reason=cl.unavailable_reason() or "")


# ---- the recorder, in one world -------------------------------------------------------------------

def recorder_program():
    """Calls of every kind, a listener of our own, a failing call; then a dump on request."""
    rank, p = dist.get_rank(), dist.get_world_size()
    stages = []
    remove = trace.add_listener(lambda kind, peer, tensors, group:
                                lambda stage, error=None: stages.append((kind, stage, type(error).__name__
                                                                         if error else None)))
    x = torch.ones(5)
    dist.all_reduce(x)                                        # world collective #1
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        dist.broadcast(torch.zeros(3, dtype=torch.int64), 0, group=pair)   # the pair's collective #1
    works = [dist.irecv(torch.zeros(2, dtype=torch.float64), (rank - 1) % p),
             dist.isend(torch.ones(2, dtype=torch.float64), (rank + 1) % p)]
    for w in works:
        w.wait()
    dist.all_reduce(x)                                        # world collective #2
    if rank == 0:
        try:
            dist.send(x, 0)                                   # to itself: refused, recorded as failed
        except ValueError:
            pass
        dist.irecv(torch.zeros(1), 2)                         # posted, never waited on: scheduled
    remove()
    dist.all_reduce(x)                                        # the listener is gone; the recorder still hears
    path = flight_recorder.dump()
    return stages, json.loads(path.read_text())["reason"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("recorder")
    results = launch.run(recorder_program, 3, flight_recorder=directory, timeout=30)
    dumps = [json.loads((directory / f"rank{r}.json").read_text()) for r in range(3)]
    return results, dumps, json.loads((directory / "world.json").read_text())


def _ops(dump):
    return [(e["profiling_name"], e["process_group"][0], e["collective_seq_id"], e["p2p_seq_id"], e["state"])
            for e in dump["entries"]]


def test_every_call_is_recorded_with_torchs_fields_and_a_sequence_number_per_group(recorded):
    _, dumps, _ = recorded
    rank0 = dumps[0]
    assert all(TORCH_FIELDS <= set(e) for d in dumps for e in d["entries"])
    assert _ops(rank0) == [
        ("gloo:all_reduce", "0", 1, 0, "completed"),
        ("gloo:broadcast", "1", 1, 0, "completed"),          # the pair counts its own collectives
        ("gloo:irecv 0<-2", "0", 1, 1, "completed"),          # point-to-point counted apart, per group
        ("gloo:isend 0->1", "0", 1, 2, "completed"),
        ("gloo:all_reduce", "0", 2, 2, "completed"),
        ("gloo:send 0->0", "0", 2, 3, "started"),             # failed: it stays started, with its error
        ("gloo:irecv 0<-2", "0", 2, 4, "scheduled"),          # posted, never waited on
        ("gloo:all_reduce", "0", 3, 4, "completed")]
    assert [e["record_id"] for e in rank0["entries"]] == list(range(8))
    assert rank0["entries"][5]["error"].startswith("ValueError")
    assert _ops(dumps[2])[1] == ("gloo:irecv 2<-1", "0", 1, 1, "completed")   # rank 2 is not in the pair
    broadcast = rank0["entries"][1]
    assert (broadcast["pg_ranks"], broadcast["peer"], broadcast["input_sizes"], broadcast["input_dtypes"]) == \
        ([0, 1], 0, [[3]], ["Long"])
    assert rank0["entries"][2]["peer"] == 2 and rank0["entries"][2]["input_dtypes"] == ["Double"]


def test_each_entry_names_the_line_that_made_the_call_and_its_times_are_in_order(recorded):
    _, dumps, _ = recorded
    for e in dumps[1]["entries"]:
        frame = e["frames"][0]
        assert frame["filename"] == __file__ and frame["name"] == "recorder_program", frame
        assert e["time_created_ns"] <= e["time_discovered_started_ns"] <= e["time_discovered_completed_ns"]
    lines = {e["frames"][0]["line"] for e in dumps[1]["entries"] if e["profiling_name"] == "gloo:all_reduce"}
    assert len(lines) == 3       # three call sites, three lines


def test_the_launcher_dumps_every_rank_as_the_world_ends_and_a_rank_can_dump_on_request(recorded):
    results, dumps, world = recorded
    assert [reason for _, reason in results] == ["request"] * 3
    assert [d["reason"] for d in dumps] == ["exit"] * 3          # the launcher's, at the end
    assert world["reason"] == "exit" and all(r["dumped"] for r in world["ranks"].values())


def test_the_trace_tells_its_listeners_of_every_stage_until_removed(recorded):
    results, _, _ = recorded
    stages = results[0][0]
    assert stages[:2] == [("all_reduce", "started", None), ("all_reduce", "completed", None)]
    assert ("send", "failed", "ValueError") in stages
    posted = [s for s in stages if s[0] in ("isend", "irecv")]
    assert posted == [("irecv", "started", None), ("irecv", "completed", None),
                      ("isend", "started", None), ("isend", "completed", None)]   # told at wait()
    assert stages.count(("all_reduce", "completed", None)) == 2    # not the third: removed before it


def stuck_until_dumped():
    """Rank 1 blocks in a recv; rank 0 waits for its timeout dump, signals it, then releases it."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"pid{dist.get_rank()}", str(os.getpid()))
    x = torch.ones(3)
    for _ in range(10):
        dist.all_reduce(x)
    if dist.get_rank() == 1:
        dist.recv(x, 0)
        return None
    path = flight_recorder.active().directory / "rank1.json"
    reasons = []
    for wanted, poke in (("timeout", False), ("signal", True)):
        if poke:
            path.unlink()
            os.kill(int(store.get("pid1")), flight_recorder.DUMP_SIGNAL)
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        reasons.append(json.loads(path.read_text()))
    dist.send(x, 1)
    return reasons


def test_a_rank_stuck_in_a_wait_dumps_on_a_signal_and_after_dump_after_and_keeps_the_last_n(tmp_path):
    env = {flight_recorder.ENV_BUFFER: "4", flight_recorder.ENV_DUMP_AFTER: "0.2"}
    by_timeout, by_signal = launch.run(stuck_until_dumped, 2, env=env, flight_recorder=tmp_path, timeout=30)[0]
    assert (by_timeout["reason"], by_signal["reason"]) == ("timeout", "signal")
    for dump in (by_timeout, by_signal):
        assert len(dump["entries"]) == 4                      # the ring keeps the last 4 of 11
        assert [e["collective_seq_id"] for e in dump["entries"][:3]] == [8, 9, 10]
        assert (dump["entries"][-1]["profiling_name"], dump["entries"][-1]["state"]) == ("gloo:recv 1<-0", "started")


# ---- the faults, for real ------------------------------------------------------------------------------

LOCAL = [k for k in KINDS if k != "link"]
ENDS = {"skip": "timed out", "order": "timed out", "deadlock": "timed out", "size": "failed", "dtype": "finished",
        "straggler": "finished", "killed": "failed"}


def _limit(kind: str, cluster: bool = False) -> float:
    return (CLUSTER_LIMIT if cluster else LIMIT) if kind in HANGS else ENDS_ITSELF


def _subgroup_seed(kind):
    return next(s for s in range(200) if not draw(kind, s, max_world=4).is_world)


DRAWN = {kind: _subgroup_seed(kind) for kind in ("dtype", "straggler")}
ON_CLUSTER = ("link", "killed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every real run of this file, several at once (a hang spends its limit waiting): the lab's
    scenarios on local worlds, two drawn ones on subgroups, two on simulated clusters of
    their own (where root and iproute2 allow), and the swapped order under torch's DETAIL."""
    jobs = {kind: (LAB[kind], dict(timeout=_limit(kind))) for kind in LOCAL}
    jobs |= {f"drawn {kind}": (draw(kind, seed, max_world=4), dict(timeout=_limit(kind)))
             for kind, seed in DRAWN.items()}
    if cl.unavailable_reason() is None:
        jobs |= {f"cluster {kind}": (LAB[kind], dict(timeout=_limit(kind, True), machines=2)) for kind in ON_CLUSTER}
    jobs["detail order"] = (LAB["order"], dict(timeout=2.0, env=detail.DETAIL, group_timeout=0.5))
    for name, (_, kwargs) in jobs.items():
        kwargs["directory"] = tmp_path_factory.mktemp(name.replace(" ", "-"))
    outcomes = run_scenarios(list(jobs.values()), parallel=5)
    return dict(zip(jobs, outcomes))


@pytest.fixture(scope="module")
def local_runs(runs):
    return {kind: runs[kind] for kind in LOCAL}


@pytest.mark.parametrize("kind", LOCAL)
def test_every_fault_ends_within_its_limit_and_the_diagnosis_names_the_culprit(local_runs, kind):
    outcome = local_runs[kind]
    assert outcome.ended.startswith(ENDS[kind]) and outcome.seconds < _limit(kind) + SLACK, outcome.ended
    findings = diagnose(outcome.dumps, outcome.world)
    assert findings, f"{kind}: nothing found"
    first = findings[0]
    assert (first.kind, first.ranks) == (FINDING[kind], blame(LAB[kind])), first.text
    assert "faults.py:" in first.text                                    # it names the source line


@pytest.mark.parametrize("kind", ["killed", "size"])
def test_a_rank_that_died_is_read_back_from_its_ring(local_runs, kind):
    outcome = local_runs[kind]
    died = [r for r, info in outcome.world["ranks"].items() if info["exit"]]
    assert died and all(outcome.dumps[int(r)]["reason"].startswith("recovered from its ring: killed by SIG")
                        for r in died)
    for r in died:
        last = outcome.dumps[int(r)]["entries"][-1]
        assert last["state"] != "completed" and last["collective_seq_id"] == LAB[kind].step + 1
    dead = [f for f in diagnose(outcome.dumps, outcome.world) if f.kind == "dead"]
    assert {f.ranks[0] for f in dead} == {int(r) for r in died}


def _calls(dumps, ignore_last: bool = False):
    """What a dump says was called, with the states (the times differ from run to run)."""
    rows = []
    for d in dumps:
        entries = d["entries"][:-1] if ignore_last else d["entries"]
        rows.append([(e["profiling_name"], e["process_group"][0], tuple(e["pg_ranks"]), e["collective_seq_id"],
                      e["p2p_seq_id"], e["peer"], e["input_sizes"], e["input_dtypes"], e["frames"][0]["line"],
                      e["state"]) for e in entries])
    return rows


@pytest.mark.parametrize("kind", LOCAL)
def test_synthesised_dumps_match_a_real_run_call_for_call(local_runs, kind):
    real, made = local_runs[kind].dumps, dumps_for(LAB[kind])
    if kind == "killed":     # did the others finish the all-reduce the culprit posted as it died? a race
        real, made = [r for r in real if not r["reason"].startswith("recovered")], made[:2] + made[3:]
        assert [_calls([d], ignore_last=True)[0][:LAB[kind].step] for d in real] == \
            [_calls([d])[0][:LAB[kind].step] for d in made]
        return
    assert _calls(real) == _calls(made)
    assert [d["reason"].startswith("recovered") for d in real] == [d["reason"].startswith("recovered") for d in made]


@pytest.mark.parametrize("kind", sorted(DRAWN))
def test_synthesised_dumps_match_real_runs_of_drawn_scenarios_on_subgroups(runs, kind):
    outcome = runs[f"drawn {kind}"]
    assert _calls(outcome.dumps) == _calls(scenario_dumps(kind, DRAWN[kind], max_world=4))
    assert diagnose(outcome.dumps)[0].ranks == (outcome.params.culprit,)


@needs_cluster
def test_on_a_cluster_a_link_down_and_a_killed_rank_are_named(runs):
    for kind in ON_CLUSTER:
        outcome = runs[f"cluster {kind}"]
        assert outcome.seconds < _limit(kind, True) + SLACK, (kind, outcome.seconds)
        first = diagnose(outcome.dumps, outcome.world)[0]
        assert (first.kind, first.ranks) == (FINDING[kind], blame(LAB[kind])), first.text
    link = runs["cluster link"]
    assert {d["rank"]: d["network"]["up"] for d in link.dumps} == {0: True, 1: True, 2: False, 3: False}
    assert _calls(link.dumps, ignore_last=True)[2] == _calls(dumps_for(LAB["link"]), ignore_last=True)[2]


@needs_cluster
def test_a_cluster_whose_link_went_down_gets_it_back():
    with cl.Cluster(2, 1) as cluster:
        cluster.set_link(1, False)
        assert "DOWN" in cluster.run_in(1, "ip", "-br", "link", "show", "dev", "eth0")
        cluster.set_link(1, True)
        assert "UP" in cluster.run_in(1, "ip", "-br", "link", "show", "dev", "eth0")


def test_torch_detail_catches_a_swapped_order_and_the_analyzer_names_the_same_rank(runs):
    order = detail.compare(runs["detail order"])
    assert order.detail.caught and order.detail_names_culprit, order.detail
    assert order.analyzer_names_culprit, order.finding


def test_torch_detail_has_nothing_to_say_of_a_timeout_or_a_lost_peer():
    def verdict(errors, ended="failed"):
        return detail.detail_verdict(Outcome(LAB["deadlock"], ended, 1.0, errors=errors))
    timed_out = verdict({0: "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 500ms "
                            "for send operation to complete"})
    assert (timed_out.caught, timed_out.named) == (False, ())
    barrier = verdict({0: "RuntimeError: [Rank 0]: Ranks 2, 3 failed to pass monitoredBarrier in 500 ms"})
    assert (barrier.caught, barrier.named) == (True, (2, 3))
    assert verdict({}, "timed out after 2 s").message.startswith("nothing")


# ---- the analyzer's checks (the implementation under test) ----------------------------------------------

@pytest.fixture(scope="module")
def checks(impl):
    return {name: resolve(f"{impl}:{name}") for name in
            ("find_missing", "find_mismatch", "find_wait_cycle", "find_stragglers", "wait_for_graph")}


def _answers(checks, dumps) -> dict:
    cycle = checks["find_wait_cycle"](dumps)
    return {"missing": [(m.group, m.seq, m.op, m.missing, m.waiting) for m in checks["find_missing"](dumps)],
            "mismatch": [(m.group, m.seq, m.field, m.differ, m.values) for m in checks["find_mismatch"](dumps)],
            "cycle": cycle.ranks if cycle else None,
            "stragglers": [(s.group, s.rank) for s in checks["find_stragglers"](dumps)]}


@pytest.mark.parametrize("kind", KINDS)
def test_each_check_finds_exactly_what_the_scenario_put_there(checks, kind):
    cases = [(LAB[kind], dumps_for(LAB[kind]))] + [(draw(kind, s), scenario_dumps(kind, s)) for s in range(20)]
    for params, dumps in cases:
        assert _answers(checks, dumps) == expected(params), params


def test_the_lab_and_the_grader_draw_different_scenarios():
    assert all(draw(kind, s) != LAB[kind] for kind in KINDS for s in range(100))
    assert draw("skip", 11) == draw("skip", 11) and draw("skip", 11) != draw("skip", 12)


def test_checks_read_what_is_left_in_a_ring_that_came_round_and_a_world_with_a_rank_missing(checks):
    dumps = dumps_for(LAB["skip"])                       # rank 2 never enters #5 of ranks 0-3
    worn = copy.deepcopy(dumps)
    worn[2]["entries"] = worn[2]["entries"][-1:]          # only #4 left in its ring
    assert _answers(checks, worn)["missing"] == [((0, 1, 2, 3), 5, "all_reduce", (2,), (0, 1, 3))]
    without_rank_3 = copy.deepcopy(dumps)[:3]
    assert _answers(checks, without_rank_3)["missing"] == [((0, 1, 2, 3), 5, "all_reduce", (2,), (0, 1))]
    order = copy.deepcopy(dumps_for(LAB["order"]))       # the swap at #5: drop #5 from rank 0's ring
    order[0]["entries"] = [e for e in order[0]["entries"] if e["collective_seq_id"] != 5]
    assert _answers(checks, order)["mismatch"] == []      # #5 is not in every ring: it cannot be compared


def test_a_tie_expects_the_lowest_ranks_value_and_a_mismatch_names_the_first_field_that_differs(checks):
    dumps = dumps_for(Params("size", 2, (0, 1), culprit=1, step=0, steps=2, numel=8, wrong_numel=9))
    assert _answers(checks, dumps)["mismatch"] == [((0, 1), 1, "sizes", (1,), ((0, "[8]"), (1, "[9]")))]
    both = copy.deepcopy(dumps)
    call = both[1]["entries"][0]
    call["input_dtypes"], call["profiling_name"] = ["Long"], "gloo:broadcast"
    assert _answers(checks, both)["mismatch"] == [((0, 1), 1, "operation", (1,), ((0, "all_reduce"), (1, "broadcast")))]


def test_a_transfer_both_ends_are_in_is_no_wait_and_a_send_that_timed_out_still_waits(checks):
    dumps = copy.deepcopy(dumps_for(LAB["deadlock"]))    # every rank of 4 in send to its right
    for e in dumps[1]["entries"][-1:]:                   # rank 1 receives from 0 instead
        e.update(profiling_name="gloo:recv 1<-0", peer=0)
    assert checks["find_wait_cycle"](dumps) is None
    assert checks["wait_for_graph"](dumps)[0] == []      # rank 0's send is matched by rank 1's recv
    timed_out = copy.deepcopy(dumps_for(LAB["deadlock"]))
    for d in timed_out:
        d["entries"][-1]["error"] = "RuntimeError: Timed out waiting 500ms for send operation to complete"
    assert checks["find_wait_cycle"](timed_out).ranks == (0, 1, 2, 3)


def test_a_straggler_needs_enough_collectives_and_a_clear_lag(checks):
    dumps = dumps_for(LAB["straggler"])                  # rank 3, 50 ms late at each of 5; #1 not counted
    assert [(s.rank, s.late_in, s.of) for s in checks["find_stragglers"](dumps)] == [(3, 4, 4)]
    assert checks["find_stragglers"](dumps, min_lag=0.2) == []
    short = copy.deepcopy(dumps)
    for d in short:
        d["entries"] = d["entries"][:3]                   # #2 and #3: too few to call anyone slow
    assert checks["find_stragglers"](short) == []


# ---- the command line ----------------------------------------------------------------------------

def test_diagnose_reads_a_dump_directory_and_says_what_it_found(tmp_path, capsys):
    from collectives.course.cli.diagnose import main

    for dump in scenario_dumps("order", 4):
        (tmp_path / f"rank{dump['rank']}.json").write_text(json.dumps(dump))
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    params = draw("order", 4)
    assert f"1. mismatch: collective #{2 * params.step + 1} " in out
    assert f"rank {params.culprit}: operation broadcast" in out
    assert main([str(tmp_path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["findings"][0]["ranks"] == [params.culprit]
    assert main([str(tmp_path / "nothing-here")]) == 2


def test_bench_recorder_writes_its_measurements_with_device_versions_date_and_command(tmp_path):
    from collectives.course.benchmarks.debugging import MODES, main

    assert main(["--iters", "5", "--blocks", "3", "--sizes", "4", "--no-detail", "--out", str(tmp_path),
                 "--record", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "recorder.json").read_text())
    assert {"command", "date", "device", "torch", "python", "backend", "world_size", "commit"} <= set(data["meta"])
    assert data["listener_seconds"] > 0
    assert [(r["call"], r["nbytes"]) for r in data["rows"]] == [("all_reduce", 4), ("isend+irecv", 4)]
    for r in data["rows"]:             # torch's call, wrapped, recorded: each with its spread over 3 blocks
        for mode in MODES:
            spread = r[mode]
            assert len(spread["blocks"]) == 3 and spread["q1"] <= spread["median"] <= spread["q3"]
        assert r["added"] == r["recorded"]["median"] - r["wrapped"]["median"]
    page = json.loads((tmp_path / "09-bench-recorder.json").read_text())
    assert {c["id"] for c in page["comparisons"]} == {"call-path", "alpha", "added", "listener", "source"}
    assert page["comparisons"][1]["microseconds"] == data["rows"][0]["plain"]["median"] * 1e6
