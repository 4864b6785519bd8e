"""The trace records every message and collective a rank makes, as the rank made it."""

import pytest

from collectives import launch
from collectives.core.trace import Trace, step_table

from . import workers


@pytest.fixture(scope="module")
def traces():
    rows = launch.run(workers.traced_messages, world_size=3)
    return [Trace.from_dicts(rank, r) for rank, r in enumerate(rows)]


def by_label(t, label):
    return [e for e in t.events if e.label == label]


def test_a_blocking_send_is_recorded_once_with_peer_and_bytes(traces):
    sends = by_label(traces[0], "blocking")
    assert [(e.kind, e.peer, e.numel, e.nbytes) for e in sends] == [("send", 1, 5, 20)]
    recvs = by_label(traces[1], "blocking")
    assert [(e.kind, e.peer) for e in recvs] == [("recv", 0)]
    assert by_label(traces[2], "blocking") == []


def test_immediate_messages_complete_when_waited(traces):
    for rank, t in enumerate(traces):
        events = by_label(t, "immediate")
        assert [(e.kind, e.peer) for e in events] == [("irecv", (rank - 1) % 3), ("isend", (rank + 1) % 3)]
        assert all(e.nbytes == 7 * 8 and e.dtype == "float64" for e in events)
        assert all(e.t1 is not None and e.t1 >= e.t0 for e in events)


def test_batched_messages_are_recorded_one_by_one(traces):
    for rank, t in enumerate(traces):
        kinds = [(e.kind, e.peer, e.numel) for e in by_label(t, "batched")]
        assert kinds == [("isend", (rank + 1) % 3, 3), ("irecv", (rank - 1) % 3, 3)]


def test_collectives_are_recorded_with_their_root_and_async_ones_complete_on_wait(traces):
    for t in traces:
        coll = [e for e in by_label(t, "collectives") if e.group is None]
        assert [(e.kind, e.peer, e.numel) for e in coll] == [
            ("all_reduce", None, 11), ("broadcast", 1, 2), ("all_reduce", None, 4)]
        assert all(e.t1 is not None for e in coll)


def test_subgroup_peers_are_reported_as_global_ranks(traces):
    sub = [e for e in traces[0].events if e.group == (0, 2)]
    assert [(e.kind, e.peer) for e in sub] == [("send", 2)]
    sub = [e for e in traces[2].events if e.group == (0, 2)]
    assert [(e.kind, e.peer) for e in sub] == [("recv", 0)]


def test_paused_calls_are_not_recorded_and_order_is_kept(traces):
    for t in traces:
        assert all(e.label for e in t.events), "the paused all_reduce must not appear"
        assert [e.seq for e in t.events] == sorted(e.seq for e in t.events)


def test_step_table_pairs_each_ranks_kth_send(traces):
    steps = step_table(traces)
    # step 0: rank 0's blocking send, ranks 1 and 2's first isend
    assert sorted(steps[0]) == [(0, 1, 5), (1, 2, 7), (2, 0, 7)]
