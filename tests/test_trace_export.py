"""Traces as Chrome Trace Event JSON, the site's trace players, and torch profiler ranges.

The exports are made from real runs: one world of 4 ranks records the ring, the tree,
the hierarchical all-reduce (subgroups, two slices in flight) and the sparse split
transport (collectives and messages of packed pairs), one of 3 ranks halving-doubling with
its fold (blocking send and recv). Every document must pass the format check, pair every
send with its receive, and carry the trace's bytes.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch._dynamo  # noqa: F401 - torch.profiler imports it on first use (seconds): once, before the worlds fork
import torch.distributed as dist

from collectives import launch, trace
from collectives.core import trace_export, trace_steps
from collectives.course.catalog import ROOT
from collectives.course.cli import trace as trace_cli
from collectives.course.impl import resolve
from collectives.course.site import trace_player

RUNS = {   # name -> (target, world, keyword arguments)
    "ring": ("collectives.ring:ring_all_reduce", 4, {}),
    "tree": ("collectives.topologies:tree_all_reduce", 4, {}),
    "hierarchical": ("collectives.hierarchical:hierarchical_all_reduce", 4, dict(layout=(2, 2), slice_numel=1000)),
    "sparse split": ("collectives.sparse:sparse_all_reduce", 4, dict(density=0.05, transport="split")),
    "halving-doubling, p = 3": ("collectives.topologies:halving_doubling_all_reduce", 3, {}),
}


def _traced_runs(names: list[str]) -> dict:
    """On every rank: each run once untraced (groups, buffers), once traced."""
    out = {}
    for name in names:
        target, _, kw = RUNS[name]
        fn = resolve(target)
        kw = dict(kw)
        x = torch.randn(2003, generator=torch.Generator().manual_seed(dist.get_rank()))
        if "transport" in kw:
            transport = kw.pop("transport")
            call = lambda buf: trace_player.sparse_call(fn, buf, None, transport, **kw)  # noqa: E731
        else:
            call = lambda buf: fn(buf, **kw)  # noqa: E731
        with trace.paused():
            call(x.clone())
        dist.barrier()
        buf = x.clone()
        with trace.recording() as t, trace_steps.Capture(buf, t) as cap:
            call(buf)
        out[name] = (t.to_dicts(), cap.log)
    return out


@pytest.fixture(scope="module")
def exported():
    """name -> (the per-rank traces, the Chrome trace document, round-tripped through JSON)."""
    docs = {}
    for world in (4, 3):
        names = [n for n, (_, p, _) in RUNS.items() if p == world]
        per_rank = launch.run(_traced_runs, world, args=(names,))
        for name in names:
            traces = [trace.Trace.from_dicts(r, rows[name][0]) for r, rows in enumerate(per_rank)]
            doc = json.loads(json.dumps(trace_export.chrome_trace(traces, metadata={"run": name})))
            docs[name] = (traces, doc, [rows[name][1] for rows in per_rank])
    return docs


def _x(doc):
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def test_every_export_passes_the_format_check(exported):
    for name, (_, doc, _) in exported.items():
        assert trace_export.validate(doc) == [], name
        assert doc["otherData"] == {"run": name}


def test_a_process_per_rank_and_a_track_per_group_and_role(exported):
    for name, (traces, doc, _) in exported.items():
        meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
        names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
        assert names == {r + 1: f"rank {r}" for r in range(len(traces))}, name
        assert {e["pid"] for e in _x(doc)} == set(names)
    _, doc, _ = exported["hierarchical"]
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"
              and e["pid"] == 1}
    # rank 0's stages: inside its machine {0, 1}, on its rail {0, 2}; each group's sends and receives apart
    assert {"group 0,1 · sends", "group 0,1 · recvs", "group 0,2 · sends", "group 0,2 · recvs"} <= tracks


def test_every_send_has_its_receive(exported):
    for name, (traces, doc, _) in exported.items():
        flows, unmatched = trace_export.match_messages(traces)
        assert unmatched == [], name
        assert len(flows) == sum(len(t.sends()) for t in traces) == sum(len(t.recvs()) for t in traces)
        starts = {e["id"]: e for e in doc["traceEvents"] if e["ph"] == "s"}
        ends = {e["id"]: e for e in doc["traceEvents"] if e["ph"] == "f"}
        assert set(starts) == set(ends) and len(starts) == len(flows), name
        by_track = {}
        for e in _x(doc):
            by_track.setdefault((e["pid"], e["tid"]), []).append(e)
        for fid, s in starts.items():        # the arrow leaves a send to B and lands in B's receive from A
            send = next(e for e in by_track[(s["pid"], s["tid"])] if e["ts"] <= s["ts"] <= e["ts"] + e["dur"])
            f = ends[fid]
            recv = next(e for e in by_track[(f["pid"], f["tid"])] if e["ts"] <= f["ts"] <= e["ts"] + e["dur"])
            assert send["args"]["Collective name"] == "send" and recv["args"]["Collective name"] == "recv"
            assert send["args"]["Dst Rank"] == f["pid"] - 1 and recv["args"]["Src Rank"] == s["pid"] - 1
            assert send["args"]["bytes"] == recv["args"]["bytes"]


def test_byte_totals_equal_the_trace(exported):
    for name, (traces, doc, _) in exported.items():
        for t in traces:
            mine = [e for e in _x(doc) if e["pid"] == t.rank + 1]
            sent = sum(e["args"]["bytes"] for e in mine if e["args"]["Collective name"] == "send")
            received = sum(e["args"]["bytes"] for e in mine if e["args"]["Collective name"] == "recv")
            assert (sent, received) == (t.bytes_sent(), t.bytes_received()), (name, t.rank)
            assert sum(e["args"]["bytes"] for e in mine) == sum(e.nbytes for e in t.events)
            assert len(mine) == len(t.events)


def test_calls_carry_the_arguments_torch_profiler_gives_collectives(exported):
    keys = {"Collective name", "In msg nelems", "Out msg nelems", "Group size", "dtype", "Process Group Ranks"}
    for name, (_, doc, _) in exported.items():
        for e in _x(doc):
            assert keys <= set(e["args"]), (name, e["name"])
    _, doc, _ = exported["sparse split"]
    kinds = {e["args"]["Collective name"]: e["args"] for e in _x(doc)}
    assert kinds["allgather"]["Out msg nelems"] == 4 * kinds["allgather"]["In msg nelems"]   # p = 4
    assert kinds["alltoall_base"]["dtype"] == "Long" and kinds["send"]["dtype"] == "Byte"   # counts; packed pairs
    _, doc, _ = exported["hierarchical"]
    inside = [e for e in _x(doc) if e["pid"] == 1 and e["args"]["Process Group Ranks"] == "[0, 1]"]
    assert inside and all(e["args"]["Group size"] == 2 and e["args"]["dtype"] == "Float" for e in inside)


def _doc(*events):
    return {"traceEvents": list(events), "displayTimeUnit": "ms"}


def _slice(ts, dur, tid=1, pid=1, name="x"):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}


def test_the_format_check_finds_what_perfetto_would_reject():
    good = _doc(_slice(0, 10), _slice(2, 3), _slice(0, 5, tid=2),
                {"ph": "s", "id": 1, "pid": 1, "tid": 1, "ts": 1, "cat": "m", "name": "m"},
                {"ph": "f", "id": 1, "pid": 1, "tid": 2, "ts": 4, "cat": "m", "name": "m", "bp": "e"})
    assert trace_export.validate(good) == []
    broken = {
        "overlap": _doc(_slice(0, 10), _slice(5, 10)),
        "no duration": _doc({"ph": "X", "pid": 1, "tid": 1, "ts": 0, "name": "x"}),
        "negative time": _doc(_slice(-1, 1)),
        "a flow without its end": _doc(_slice(0, 10), {"ph": "s", "id": 1, "pid": 1, "tid": 1, "ts": 1,
                                                       "cat": "m", "name": "m"}),
        "a flow end outside any slice": _doc(
            _slice(0, 2), {"ph": "s", "id": 1, "pid": 1, "tid": 1, "ts": 1, "cat": "m", "name": "m"},
            {"ph": "f", "id": 1, "pid": 1, "tid": 1, "ts": 5, "cat": "m", "name": "m", "bp": "e"}),
        "an unknown metadata event": _doc({"ph": "M", "pid": 1, "tid": 0, "name": "rank_name", "args": {}}),
        "a string pid": _doc({"ph": "X", "pid": "1", "tid": 1, "ts": 0, "dur": 1, "name": "x"}),
        "no events": {"events": []},
    }
    for what, doc in broken.items():
        assert trace_export.validate(doc), f"{what} must be reported"


def test_causal_steps_number_the_rounds_as_the_algorithms_draw_them(exported):
    traces, _, logs = exported["ring"]
    levels = trace_steps.step_levels(traces, logs)
    for t in traces:   # the ring: its k-th message in step k, 2(p - 1) of them, each taken in its step
        assert [levels[(t.rank, e.seq)] for e in t.sends()] == list(range(1, 7))
        assert [levels[(t.rank, e.seq)] for e in t.recvs()] == list(range(1, 7))
    traces, _, logs = exported["tree"]
    levels = trace_steps.step_levels(traces, logs)
    sends = {(t.rank, e.peer): levels[(t.rank, e.seq)] for t in traces for e in t.sends()}
    # up: leaves 2 and 3 first, then rank 1 with 3's sum; down: 0 to its children, then 1 to 3
    assert sends == {(2, 0): 1, (3, 1): 1, (1, 0): 2, (0, 1): 3, (0, 2): 3, (1, 3): 4}
    traces, _, logs = exported["sparse split"]
    levels = trace_steps.step_levels(traces, logs)
    for t in traces:   # a collective is one step on all its members
        steps = [levels[(t.rank, e.seq)] for e in t.collectives()]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
    firsts = {levels[(t.rank, t.collectives()[0].seq)] for t in traces}
    assert firsts == {1}


@pytest.fixture(scope="module")
def players():
    """The recordings the site shows: the site build's, when it made them for this code
    (build/trace-players/, tools/mkdocs_hooks.py), else made now the same way."""
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "tools" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    hooks.start_recording_players()
    folder = hooks.finish_recording_players()
    names = [p.name[: -len(".player.json")] for p in folder.glob("*.player.json")]
    return folder, {n: json.loads((folder / f"{n}.player.json").read_text()) for n in names}


def test_every_player_is_recorded_and_ends_with_the_all_reduce_result(players):
    folder, docs = players
    assert set(docs) == {p.name for p in trace_player.PLAYERS}
    for name, doc in docs.items():
        p, n = doc["world"], doc["numel"]
        assert doc["start"] == [[1 << r] * n for r in range(p)], name
        assert doc["steps"][-1]["state"] == doc["final"] == doc["expected"], name
        assert all(s["messages"] or s["collectives"] for s in doc["steps"]), name
        if not name.startswith("sparse"):   # dense: every element sums every rank's input
            assert doc["expected"] == [[(1 << p) - 1] * n] * p, name
        chrome = json.loads((folder / doc["trace"]).read_text())
        assert trace_export.validate(chrome) == [], name


def test_players_show_the_steps_of_each_algorithm(players):
    _, docs = players
    steps = {name: len(doc["steps"]) for name, doc in docs.items()}
    assert steps["naive_ring"] == 3 and steps["ring"] == 6 and steps["recursive_doubling_p4"] == 2
    assert steps["halving_doubling_p4"] == 4 and steps["hierarchical"] == 5
    ring = docs["ring"]
    after_reduce_scatter = ring["steps"][2]["state"]       # rank r holds chunk r, and only it, complete
    for r, row in enumerate(after_reduce_scatter):
        assert [c for c, bits in enumerate(row) if bits == 15] == [r]
    for step in ring["steps"]:                              # one message per rank, to its right
        assert sorted((m["src"], m["dst"]) for m in step["messages"]) == [(r, (r + 1) % 4) for r in range(4)]
    tree = docs["tree"]   # leaves 2 and 3 send first; rank 1 forwards 1 + 3 (0b1010) next
    assert sorted((m["src"], m["dst"]) for m in tree["steps"][0]["messages"]) == [(2, 0), (3, 1)]
    assert tree["steps"][1]["messages"][0]["payload"] == {"bits": [0b1010] * 4}
    split = docs["sparse_split"]   # pairs travel as messages to the owner of their piece
    pairs = [m for s in split["steps"] for m in s["messages"] if "pairs" in m["payload"]]
    bounds = {g["name"]: (g["lo"], g["hi"]) for g in split["groups"]}
    assert pairs and all(bounds[f"piece {m['dst']}"][0] <= i < bounds[f"piece {m['dst']}"][1]
                         for m in pairs for i, _ in m["payload"]["pairs"])


def test_the_trace_command_writes_a_valid_file_and_names_what_it_cannot_run(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert trace_cli.main(["ring", "--world", "2", "--size", "4K", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert trace_export.validate(doc) == []
    assert doc["otherData"]["algorithm"] == "ring" and doc["otherData"]["torch"] == torch.__version__
    assert len([e for e in doc["traceEvents"] if e["ph"] == "s"]) == 2 * 2 * (2 - 1)   # 2(p-1) per rank
    with pytest.raises(SystemExit, match="not written yet"):
        trace_cli.main(["naive-ring", "--world", "2", "--size", "1K", "--impl", "exercise", "--out", str(out)])
    with pytest.raises(SystemExit, match="could be"):
        trace_cli.main(["sparse", "--out", str(out)])
    assert trace_cli.find("multi").name.startswith("multi-ring")
    assert set(trace_cli.algorithms()) >= {"naive-ring", "ring", "hierarchical-2-machines", "fused",
                                           "bucketed-reducer", "sparse-top-k-1-split"}


def _profiled_step() -> list[str]:
    """One training step of lesson 6's reducer and one ring all-reduce under torch.profiler."""
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from collectives.bucketing import BucketedReducer
    from collectives.bucketing.models import SmallMLP
    from collectives.ring import ring_all_reduce

    quiet = trace.label("outside any profile") is trace._NO_LABEL    # no profiler, no recording: free
    torch.manual_seed(0)
    model = SmallMLP().double()
    reducer = BucketedReducer(model, bucket_cap_mb=544 / 2**20, first_bucket_cap_mb=544 / 2**20)
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.mse_loss(reducer(x), y).backward()
        ring_all_reduce(torch.ones(8))
    return [quiet] + sorted({e.name for e in prof.events()})


def test_labels_and_calls_are_ranges_in_a_torch_profiler_trace():
    quiet, *names = launch.run(_profiled_step, 2)[0]
    assert quiet
    assert {"bucket 0", "bucket 1", "bucket 2"} <= set(names)                 # the reducer's labels
    assert {"reduce-scatter 0: c1", "all-gather 0: c0"} <= set(names)         # the ring's, rank 0
    assert {"all_reduce", "wait: all_reduce", "isend to rank 1", "irecv from rank 1"} <= set(names)


def test_the_sparse_transport_is_passed_under_the_name_the_function_takes():
    def new(tensor, residual, *, transport="auto", density=None):
        return ("transport", transport, density)

    def old(tensor, residual, *, method="auto", density=None):
        return ("method", method, density)

    assert trace_player.sparse_call(new, None, None, "split", density=0.5) == ("transport", "split", 0.5)
    assert trace_player.sparse_call(old, None, None, "split", density=0.5) == ("method", "split", 0.5)


def _profiled_ring_on_nccl() -> tuple[list[str], bool, float]:
    from torch.profiler import ProfilerActivity, profile

    from collectives.ring import ring_all_reduce

    x = torch.ones(1 << 16, device="cuda")
    ring_all_reduce(x)                                    # the communicator, made once
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ring_all_reduce(x)
        torch.cuda.synchronize()
    with torch.autograd.profiler.emit_nvtx():             # what nsys records: the labels as NVTX ranges
        nvtx = trace.label("step") is not trace._NO_LABEL
        ring_all_reduce(x)
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events()}), nvtx, x[0].item()


@pytest.mark.gpu
def test_labels_are_ranges_in_a_profile_of_an_nccl_run():
    names, nvtx, first = launch.run(_profiled_ring_on_nccl, 2, backend="nccl", timeout=150)[0]
    assert {"reduce-scatter 0: c1", "all-gather 0: c0"} <= set(names)
    assert nvtx                                           # under emit_nvtx a label is a range
    assert first == 2.0 ** 3                              # three all-reduces of ones on 2 ranks


def test_the_labs_profiler_cell_shows_the_ranges_and_no_log_lines():
    """Lab 6's last cell, as the site shows it (the copy tests/test_notebooks.py or the site
    build executed for this code): the reducer's ranges, and no stderr (Kineto's log lines)."""
    from collectives.course.site import labs

    notebook = ROOT / "notebooks" / "06_bucketing.ipynb"
    nb = labs._cached(notebook, labs.source_key(notebook))
    if nb is None:
        pytest.skip("no executed copy of lab 6 for this code: tests/test_notebooks.py makes one")
    cell = [c for c in nb.cells if c.cell_type == "code"][-1]
    assert "torch.autograd.profiler.profile()" in cell.source
    text = {}
    for out in cell.outputs:
        text[out.get("name", out.output_type)] = text.get(out.get("name", out.output_type), "") + out.get("text", "")
    assert "stderr" not in text, text.get("stderr")
    ranges = [line.split()[0:2] for line in text["stdout"].splitlines()[1:] if line[:1].isalpha()]
    assert ["bucket", "0"] in ranges and ["bucket", "2"] in ranges
    assert ["wait:", "all_reduce"] in ranges
