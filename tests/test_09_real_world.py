"""Lesson 9 outside its shipped faults: the recorder under torchrun and DDP, the analyzer's other
checks, damaged dump directories, and how ranks ended.

* **recorded wherever collectives run** -- the page's recipe under ``torchrun``
  (``flight_recorder.start(DIR)`` in the script), with DDP's own all-reduces (made by its
  C++ reducer) merged from torch's Flight Recorder, and calls awaited through their futures
  completed;
* **more faults, for real** (:mod:`collectives.debugging.more_faults`): two groups with the
  same ranks, a root or a reduce op that differs, a send larger than its receive, an uneven
  all-to-all that is healthy, a rank killed while it waits, a rank that raises, a DDP rank
  that skips a backward (DDP's all-reduces seen through torch's Flight Recorder) -- each with
  the first finding it must give, and no living rank blamed for a dead one;
* **bad input** -- unreadable, foreign, truncated, mixed and missing dumps each give one line,
  never a traceback; empty rings say that nothing was recorded.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from collectives import launch
from collectives.core import flight_recorder
from collectives.course.catalog import ROOT
from collectives.course.cli.diagnose import main as diagnose_main
from collectives.debugging import LAB, diagnose, dumps_for, find_argument_mismatch, read_dumps, run_scenarios
from collectives.debugging.more_faults import FIRST, LAB_MORE, limit

LESSON = 9


# ---- recorded wherever collectives run ---------------------------------------------------------------

@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory):
    directory = tmp_path_factory.mktemp("torchrun")
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("COLLECTIVES_FLIGHT_RECORDER", None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                           "--master-port", str(port), "--monitor-interval", "0.1",
                           str(ROOT / "tests" / "recorder_under_torchrun.py"), str(directory)],
                          env=env, capture_output=True, text=True, timeout=60)
    return done, directory


def test_under_torchrun_start_records_torchs_own_calls_and_futures_and_tells_exit_from_raise(under_torchrun):
    done, directory = under_torchrun
    assert done.returncode != 0                                   # rank 1 raised
    found = read_dumps(directory)
    assert found.notes == [] and [d["rank"] for d in found.dumps] == [0, 1]
    rank0, rank1 = found.dumps
    assert rank0["reason"] == "exit" and rank0["exception"] is None
    assert rank1.get("exception") == "ValueError: rank one gives up after its last step", \
        (rank1.get("reason"), rank1.get("extras_error"), done.stderr[-1500:])
    for dump in found.dumps:
        ours = [e for e in dump["entries"] if e.get("source") != "torch"]
        theirs = [e for e in dump["entries"] if e.get("source") == "torch"]
        # the script's own calls: three all-reduces (two awaited through futures) and a barrier
        assert [(e["profiling_name"], e["state"]) for e in ours] == [("gloo:all_reduce", "completed")] * 3 + \
            [("gloo:barrier", "completed")]
        assert [e["profiling_name"] for e in theirs] == ["gloo:all_gather"] * 2     # all_gather_object's
        seqs = [e["collective_seq_id"] for e in dump["entries"]]
        assert seqs == list(range(1, len(seqs) + 1))                 # torch's numbering, every call
    findings = diagnose(found.dumps, found.world)
    assert [(f.kind, f.ranks) for f in findings] == [("raised", (1,))], [f.text for f in findings]
    assert "ValueError: rank one gives up" in findings[0].text


def calls_torch_names_otherwise():
    x = torch.ones(4)
    dist.all_gather_into_tensor(torch.zeros(8), x)           # torch: all_gather
    dist.reduce_scatter_tensor(torch.zeros(2), x)            # gloo: an all_reduce
    dist.all_to_all_single(torch.zeros(4), x)                # torch: all_to_all
    dist.all_gather_object([None, None], dist.get_rank())    # two all_gathers Python never sees
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    entries = json.loads(flight_recorder.dump().read_text())["entries"]
    return [(e["profiling_name"], e["collective_seq_id"], e.get("source"), e.get("reduce_op")) for e in entries]


def test_torchs_calls_are_merged_in_order_whatever_torch_names_ours(tmp_path):
    assert launch.run(calls_torch_names_otherwise, 2, flight_recorder=tmp_path, timeout=60)[0] == [
        ("gloo:all_gather_into_tensor", 1, None, None), ("gloo:reduce_scatter_tensor", 2, None, "SUM"),
        ("gloo:all_to_all_single", 3, None, None), ("gloo:all_gather", 4, "torch", None),
        ("gloo:all_gather", 5, "torch", None), ("gloo:all_reduce", 6, None, "MAX")]


def test_both_of_torchs_recorders_are_read_nccls_and_the_others_oldest_first_each_call_once(monkeypatch):
    """torch keeps NCCL's calls in a recorder of their own (timed with CUDA events) and every
    other backend's in another: both are read; a call found behind both names counts once."""
    from collectives.core import flight_torch

    def entry(name, t, rid):
        return {"process_group": ["0", "default_pg"], "record_id": rid, "collective_seq_id": rid + 1,
                "p2p_seq_id": 0, "profiling_name": name, "time_created_ns": t}
    gloo = [entry("gloo:all_reduce", 30, 0), entry("gloo:broadcast", 10, 1)]
    nccl = [entry("nccl:all_reduce", 20, 0), entry("gloo:all_reduce", 30, 0)]   # the last: the same call
    c10d = torch._C._distributed_c10d
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda *a: json.dumps({"entries": gloo}), raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda *a: json.dumps({"entries": nccl}), raising=False)
    got = [(e["profiling_name"], e["time_created_ns"]) for e in flight_torch.torch_entries()]
    assert got == [("gloo:broadcast", 10), ("nccl:all_reduce", 20), ("gloo:all_reduce", 30)]
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda *a: 1 / 0, raising=False)   # one fails: the other
    assert [e["time_created_ns"] for e in flight_torch.torch_entries()] == [10, 30]


# ---- more faults, for real ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def more_runs(tmp_path_factory):
    kinds = list(LAB_MORE)
    jobs = [(LAB_MORE[k], dict(timeout=limit(k), directory=tmp_path_factory.mktemp(k))) for k in kinds]
    return dict(zip(kinds, run_scenarios(jobs, parallel=4)))


@pytest.mark.parametrize("kind", list(LAB_MORE))
def test_each_further_fault_gives_its_first_finding_and_blames_no_living_rank_for_a_dead_one(more_runs, kind):
    outcome = more_runs[kind]
    findings = diagnose(outcome.dumps, outcome.world)
    want = FIRST[kind](outcome.params)
    if want is None:
        assert findings == [], [f.text for f in findings]
        return
    assert findings and (findings[0].kind, findings[0].ranks) == want, [f.text for f in findings]
    if kind == "waiting":
        assert all(set(f.ranks) <= {outcome.params.culprit} for f in findings), [f.text for f in findings]
        ends = {int(r): info["end"] for r, info in outcome.world["ranks"].items()}
        assert ends[outcome.params.culprit] == "killed by SIGKILL"
    if kind == "raises":
        assert "ValueError: loss is NaN at step 1" in findings[0].text
        assert outcome.world["ranks"]["2"]["end"] == "raised ValueError: loss is NaN at step 1"
    if kind == "p2p":
        assert "a send of 1000 elements" in findings[0].text and "a receive of 500" in findings[0].text
    if kind == "root":
        assert "in its root" in findings[0].text
    if kind == "op":
        assert "in its reduce op: rank 0: reduce op MAX" in findings[0].text


def test_the_healthy_uneven_run_is_synthesised_call_for_call_and_nothing_is_found_in_it(more_runs):
    from collectives.debugging.synth import scenario_dumps

    def calls(dumps):
        return [[(e["profiling_name"], e["collective_seq_id"], e["input_sizes"], e["input_dtypes"],
                  e["frames"][0]["line"], e["state"]) for e in d["entries"]] for d in dumps]
    assert calls(more_runs["uneven"].dumps) == calls(dumps_for(LAB_MORE["uneven"]))
    assert all(diagnose(scenario_dumps("uneven", seed)) == [] for seed in range(10))


def test_all_gather_and_reduce_scatter_sizes_are_checked_against_the_group_size():
    dumps = copy.deepcopy(dumps_for(LAB["straggler"]))         # 4 ranks, all_reduce of 1000
    for d in dumps:
        e = d["entries"][2]
        e.update(profiling_name="gloo:all_gather", output_sizes=[[1000]] * 4)
    dumps[1]["entries"][2]["output_sizes"] = [[1000]] * 3        # rank 1 gathers into too little
    found = find_argument_mismatch(dumps)
    assert [(m.seq, m.field, m.differ) for m in found] == [(3, "sizes for the group", (1,))]


def test_torchs_fr_trace_reads_the_exported_dumps_and_names_what_it_sees():
    from collectives.debugging.fr_compare import compare

    skip = compare("skip", (2,), dumps_for(LAB["skip"]))
    assert (skip.fr_trace.named, skip.fr_trace.said, skip.analyzer) == ((2,), "#5: missing ranks 2", "missing: 2")
    order = compare("order", (1,), dumps_for(LAB["order"]))
    assert order.fr_trace.named == (1,) and "COLLECTIVE_TYPE_MISMATCH" in order.fr_trace.said
    assert compare("straggler", (3,), dumps_for(LAB["straggler"])).fr_trace.said == "no error found"


# ---- bad input -------------------------------------------------------------------------------------

def _write(directory: Path, dumps, run_id="run-a"):
    directory.mkdir(parents=True, exist_ok=True)
    for d in dumps:
        (directory / f"rank{d['rank']}.json").write_text(json.dumps(dict(d, run_id=run_id)))


def _cli(directory, capsys):
    code = diagnose_main([str(directory)])
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "could not analyse" not in out.err, out.err
    return code, out.out


def test_damaged_directories_give_one_line_each_and_never_a_traceback(tmp_path, capsys):
    dumps = dumps_for(LAB["skip"])                             # rank 2 never enters #5 of 4 ranks
    _write(tmp_path, dumps)
    (tmp_path / "rank0.json").write_bytes(b"\xff\xfe not text")
    (tmp_path / "rank1.json").write_text('{"rank": 1, "entries": [')
    (tmp_path / "rank3.json").write_text(json.dumps({"rank": 3, "pg_config": {}}))
    (tmp_path / "rank4.ring").write_bytes(b"CFR1" + bytes(40))
    (tmp_path / "rank5.ring").write_bytes(b"CFR2" + bytes(20))
    code, out = _cli(tmp_path, capsys)
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith("input: rank 0: unreadable dump, UnicodeDecodeError")
    assert lines[1].startswith("input: rank 1: unreadable dump, JSONDecodeError")
    assert lines[2].startswith("input: rank 3: not a flight recorder dump (no list of entries)")
    assert lines[3] == "input: rank 4: unreadable ring, rank4.ring is not a flight recorder ring (an older format)"
    assert lines[4].startswith("input: rank 5: unreadable ring, rank5.ring is")
    assert "died" not in out


def test_dumps_damaged_field_by_field_never_give_a_traceback(tmp_path, capsys):
    import random

    rng = random.Random(9)
    odd = [None, "x", -1, 1.5, [], {}, [[None]], [1, "a"], True]
    for trial in range(300):
        dumps = copy.deepcopy(dumps_for(LAB[rng.choice(sorted(LAB))]))
        for _ in range(rng.randint(1, 3)):
            dump = rng.choice(dumps)
            entries = dump.get("entries")
            if isinstance(entries, list) and entries and isinstance(entries[0], dict) and rng.random() < 0.8:
                entry = rng.choice(dump["entries"])
                key = rng.choice(sorted(entry))
                if rng.random() < 0.3:
                    del entry[key]
                else:
                    entry[key] = rng.choice(odd)
            else:
                dump[rng.choice(sorted(dump))] = rng.choice(odd)
        directory = tmp_path / str(trial)
        _write(directory, [d for d in dumps if isinstance(d.get("rank"), int)])
        if trial % 3 == 0:                # and the launcher's record, damaged too
            world = {"run_id": "run-a", "world_size": len(dumps), "reason": "timeout", "failed_rank": 1,
                     "stderr_tail": "", "ranks": {str(r): {"dumped": True, "end": "hung"} for r in range(len(dumps))}}
            target = world if rng.random() < 0.5 else world["ranks"]["0"]
            target[rng.choice(sorted(target))] = rng.choice(odd)
            (directory / "world.json").write_text(json.dumps(world))
        code, _ = _cli(directory, capsys)
        assert code in (0, 1, 2)


def test_a_deleted_dump_is_missing_not_dead_and_other_runs_are_left_out(tmp_path, capsys):
    dumps = dumps_for(LAB["skip"])
    _write(tmp_path, dumps)
    world = {"run_id": "run-a", "world_size": 4, "reason": "timeout",
             "ranks": {str(r): {"dumped": True, "end": "hung (in all_reduce)"} for r in range(4)}}
    (tmp_path / "world.json").write_text(json.dumps(world))
    (tmp_path / "rank1.json").unlink()
    code, out = _cli(tmp_path, capsys)
    assert "rank 1's dump is not in the directory, though world.json says it dumped" in out
    assert "rank 1 died" not in out and "rank 1 left no dump" not in out
    other = copy.deepcopy(dumps[1])
    for e in other["entries"]:
        e["time_created_ns"] += 169_000_000
    _write(tmp_path, [other], run_id="run-b")
    found = read_dumps(tmp_path)
    assert found.notes == ["rank 1: a dump of another run (run run-b, the directory's is run-a), left out"]
    findings = diagnose(found.dumps, found.world, skipped=found.left_out)
    assert not any(f.kind == "straggler" for f in findings)
    assert findings[0].kind == "missing" and findings[0].ranks == (2,)


def test_a_dump_is_written_with_its_exception_when_torchs_entries_cannot_be_read(tmp_path, monkeypatch):
    from collectives.core import flight_torch

    def broken():
        raise RuntimeError("the process group is gone")
    monkeypatch.setattr(flight_torch, "torch_entries", broken)
    recorder = flight_recorder.FlightRecorder(tmp_path, 1, 2, buffer_size=4)
    recorder.merge_torch = True
    recorder.exception = "ValueError: rank one gives up"
    try:
        recorder.dump("exception: ValueError: rank one gives up")
    finally:
        recorder._ring.close()
    found = read_dumps(tmp_path)
    assert found.notes == [] and found.dumps[0]["exception"] == "ValueError: rank one gives up"
    assert found.dumps[0]["extras_error"] == "RuntimeError: the process group is gone"
    # an entry of torch's holding a value JSON has no form for is written as text, not lost
    monkeypatch.setattr(flight_torch, "torch_entries", lambda: [])
    monkeypatch.setattr(flight_torch, "merge", lambda ours, theirs, wrapped: (
        ours + [{"record_id": 0, "profiling_name": "gloo:all_reduce", "process_group": ["0", "default_pg"],
                 "pg_ranks": "[0, 1]", "frames": b"\x00raw"}], 1))
    recorder = flight_recorder.FlightRecorder(tmp_path, 1, 2, buffer_size=4)
    recorder.exception = "ValueError: rank one gives up"
    try:
        recorder.dump("exception: ValueError: rank one gives up")
    finally:
        recorder._ring.close()
    dump = json.loads((tmp_path / "rank1.json").read_text())
    assert dump["exception"] == "ValueError: rank one gives up" and dump["entries"][-1]["frames"] == "b'\\x00raw'"


def test_empty_rings_say_that_nothing_was_recorded(tmp_path, capsys):
    for r in range(2):
        recorder = flight_recorder.FlightRecorder(tmp_path, r, 2, buffer_size=4)
        recorder._ring.close()
    code, out = _cli(tmp_path, capsys)
    assert "1. empty: nothing was recorded" in out and "died" not in out
    shutil.rmtree(tmp_path)


# ---- the grader's feedback -------------------------------------------------------------------------

NEWCOMER = '''
import dataclasses
from collectives.debugging import analyze
from collectives.debugging.analyze import find_wait_cycle, wait_for_graph  # noqa: F401
LESSON = 9


def find_missing(dumps):
    return [dataclasses.replace(m, op="banana") for m in analyze.find_missing(dumps)]


def find_mismatch(dumps):
    return [dataclasses.replace(m, values=()) for m in analyze.find_mismatch(dumps)]


def find_stragglers(dumps, min_lag=0.02):
    return [dataclasses.replace(s, median_lag=s.median_lag * 2) for s in analyze.find_stragglers(dumps, min_lag)]
'''


def test_every_field_is_judged_and_a_failure_names_fields_seed_and_a_replay(tmp_path, monkeypatch):
    from collectives.course.grading import grade as grading

    student = tmp_path / "lessons"
    shutil.copytree(ROOT / "lessons", student)
    (student / "09_debugging" / "exercise.py").write_text(NEWCOMER)
    monkeypatch.setenv("COLLECTIVES_EXERCISE_DIR", str(student))
    scores = {s.task: s.verdict for s in grading.grade([9], "exercise")[2]}
    assert not scores[1].ok and not scores[2].ok and scores[3].ok and not scores[4].ok
    assert any("median_lag=" in p for p in scores[4].problems)
    skip = next(p for p in scores[1].problems if "a skip scenario" in p)
    assert "op='all_reduce'" in skip and "op='banana'" in skip and "(seed " in skip
    command = skip.split("replay: ", 1)[1]
    assert command.startswith(".venv/bin/python -c ") and "_dumps('skip', " in command
    assert any("values=()" in p for p in scores[2].problems)
    code = command.split(" -c ", 1)[1].strip('"').replace("'exercise:", "'reference:")
    replayed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert replayed.returncode == 0 and "Missing(group=" in replayed.stdout, replayed.stderr


# ---- what the analyzer may claim -------------------------------------------------------------------

def test_with_a_dump_missing_nothing_is_claimed_of_that_rank_and_the_finding_names_it():
    from collectives.debugging import LAB

    dumps = copy.deepcopy(dumps_for(LAB["straggler"]))       # 4 ranks; every rank waits in its last call
    for d in dumps:
        d["entries"][-1]["state"] = "started"
    assert "the transport does not move" in diagnose(dumps)[0].text
    found = diagnose([d for d in dumps if d["rank"] != 2])
    missing = [f for f in found if f.kind == "missing dump"]
    assert [f.ranks for f in missing] == [(2,)], found
    stuck = next(f for f in found if f.kind == "stuck")
    assert "every rank" not in stuck.text and "transport" not in stuck.text, stuck.text
    assert "rank 2 left no dump, so whether it entered is not known" in stuck.text, stuck.text


@pytest.mark.parametrize("spread_ms, reported", [(20, False), (1, True)])
def test_a_straggler_stands_out_from_the_runs_own_noise(spread_ms, reported):
    # rank 1 enters every collective of a healthy run 29 ms after the others: a straggler
    # when the others enter together, noise when they are 20 ms apart themselves
    from collectives.debugging.dumps import collective_entries, groups

    dumps = copy.deepcopy(dumps_for(LAB_MORE["uneven"]))     # 3 ranks, 4 collectives of the world
    world = next(g for g in groups(dumps) if len(g[1]) == 3)
    calls = {d["rank"]: collective_entries(d, world) for d in dumps}
    start = min(e["time_created_ns"] for c in calls.values() for e in c.values())
    for seq in sorted(calls[0]):
        t = start + seq * 10**9
        for rank, offset in ((0, 0), (2, spread_ms), (1, spread_ms + 29)):
            calls[rank][seq]["time_created_ns"] = t + offset * 10**6
    stragglers = [f for f in diagnose(dumps) if f.kind == "straggler"]
    assert [f.ranks for f in stragglers] == ([(1,)] if reported else []), stragglers
