"""The analyzer's four checks: who never came, who called something else, who waits on whom, who is late.

Each reads every rank's dump (:mod:`.dumps`) and answers one question, naming ranks and
sequence numbers. They are the exercise's four tasks, in its order; each uses only the
helpers of :mod:`.dumps` and the checks before it.

::

    rank 0:  ... all_reduce #4 ✓   all_reduce #5 started ─┐
    rank 1:  ... all_reduce #4 ✓   all_reduce #5 started ─┤   find_missing: rank 2 never
    rank 2:  ... all_reduce #4 ✓   (returned)             │   entered #5; 0, 1, 3 wait in it
    rank 3:  ... all_reduce #4 ✓   all_reduce #5 started ─┘

    at #3:   rank 1 broadcast [1]  vs  all_reduce [1000] on 0, 2, 3 -> find_mismatch: operation

    0 ──send──► 1 ──send──► 2 ──send──► 3 ──send──► 0        find_wait_cycle: (0, 1, 2, 3)
    (each waits for the next to receive; each next is sending)

    entry times at #k:  0 ·   1 ·   2 ·          3 ·         find_stragglers: rank 3, lag 50 ms
                        └──────── lag ───────────┘

Cost: one pass over every rank's entries per check, O(ranks × entries); the cycle search
visits each rank and each wait once.
"""

from __future__ import annotations

import statistics

from .dumps import (
    Mismatch,
    Missing,
    Straggler,
    WaitCycle,
    blocking_call,
    by_rank,
    collective_entries,
    describe,
    group_of,
    groups,
    last_seq,
    majority,
    op_of,
    pending,
    where,
)

MIN_LAG = 0.02              # seconds: a straggler keeps the others waiting at least this long (median)
MIN_COLLECTIVES = 3         # collectives every rank entered, before anyone is called a straggler
FIELDS = ("operation", "sizes", "dtype")
UNEVEN = ("all_to_all", "all_to_all_single")   # sizes that may differ from rank to rank, by design


# -- task 1 -----------------------------------------------------------------------------------------

def find_missing(dumps: list[dict]) -> list[Missing]:
    """For each group: the first collective #k some rank entered and never completed (posted,
    waited in, or failed in), and the ranks of the group whose last collective on it came
    before #k -- they never entered it. Groups where nobody is missing give nothing."""
    ranks = by_rank(dumps)
    found = []
    for group in groups(dumps):
        stuck = [e for d in dumps for e in pending(d) if not e["is_p2p"] and group_of(e) == group]
        if not stuck:
            continue
        seq = min(e["collective_seq_id"] for e in stuck)
        members = [r for r in group[1] if r in ranks]
        missing = tuple(r for r in members if last_seq(ranks[r], group) < seq)
        if not missing:
            continue
        waiting = tuple(r for r in members if seq in collective_entries(ranks[r], group)
                        and collective_entries(ranks[r], group)[seq]["state"] != "completed")
        op = op_of(min(stuck, key=lambda e: e["collective_seq_id"]))
        found.append(Missing(group[1], seq, op, missing, waiting))
    return found


# -- task 2 -----------------------------------------------------------------------------------------

def _field(entry: dict, field: str) -> str:
    if field == "operation":
        return op_of(entry)
    if field == "sizes":            # one tensor: "[1000]"; a list of tensors: "[[4], [4]]"
        sizes = entry["input_sizes"]
        return str(sizes[0] if len(sizes) == 1 else sizes)
    return ",".join(entry["input_dtypes"])


def find_mismatch(dumps: list[dict]) -> list[Mismatch]:
    """For each group: the first collective #k that every rank of the group has in its dump
    and where their calls differ -- in the operation, else the sizes (not an all-to-all's,
    whose inputs may differ by design), else the dtypes. The
    ranks whose value is not the one most ranks have are named (a tie: the lowest rank's
    value counts as the expected one)."""
    ranks = by_rank(dumps)
    found = []
    for group in groups(dumps):
        members = [r for r in group[1] if r in ranks]
        calls = {r: collective_entries(ranks[r], group) for r in members}
        common = set.intersection(*(set(c) for c in calls.values())) if calls else set()
        for seq in sorted(common):
            for field in FIELDS:
                if field == "sizes" and op_of(calls[members[0]][seq]) in UNEVEN:
                    continue                # an all-to-all's inputs may differ from rank to rank
                values = {r: _field(calls[r][seq], field) for r in members}
                if len(set(values.values())) > 1:
                    expected = majority(values)
                    differ = tuple(r for r in members if values[r] != expected)
                    found.append(Mismatch(group[1], seq, field, differ, tuple(sorted(values.items()))))
                    break
            else:
                continue
            break
    return found


# -- task 3 -----------------------------------------------------------------------------------------

def _matches(mine: dict, theirs: dict, me: int) -> bool:
    """Is ``theirs`` (a peer's pending call) the other half of my point-to-point ``mine``?"""
    if not theirs["is_p2p"] or theirs["peer"] != me or group_of(theirs) != group_of(mine):
        return False
    sending = op_of(mine) in ("send", "isend")
    return op_of(theirs) in (("recv", "irecv") if sending else ("send", "isend"))


def wait_for_graph(dumps: list[dict]) -> dict[int, list[tuple[int, str]]]:
    """``{rank: [(rank it waits for, what it waits in), ...]}``. A rank waits for:

    * the peer of the point-to-point call it waits in, unless that peer has the matching
      call posted (then both are in the transfer, and neither waits for the other);
    * the ranks of the group that never entered the collective it waits in (task 1's rule).

    Dead ranks and ranks that wait in nothing wait for nobody."""
    ranks = by_rank(dumps)
    graph: dict[int, list[tuple[int, str]]] = {r: [] for r in ranks}
    for rank, dump in ranks.items():
        call = blocking_call(dump)
        if call is None:
            continue
        what = f"rank {rank} in {describe(call)}, {where(call)}"
        if call["is_p2p"]:
            peer = call["peer"]
            posted = [e for e in pending(ranks[peer]) if not e.get("error")] if peer in ranks else []
            if peer in ranks and not any(_matches(call, e, rank) for e in posted):
                graph[rank].append((peer, what))
        else:
            group = group_of(call)
            for other in group[1]:
                if other in ranks and last_seq(ranks[other], group) < call["collective_seq_id"]:
                    graph[rank].append((other, what))
    return graph


def find_wait_cycle(dumps: list[dict]) -> WaitCycle | None:
    """A cycle of the wait-for graph (:func:`wait_for_graph`): ranks each waiting for the next.
    Searched from the lowest rank up, following waits in rank order; the cycle is given from
    its smallest rank, in the direction of the waits. None when there is no cycle."""
    graph = wait_for_graph(dumps)
    for start in sorted(graph):
        # depth-first from `start`, through ranks above it only: a cycle found is one whose
        # smallest rank is `start`, so each cycle is found once, from its smallest rank
        path, whats, seen = [start], [], set()

        def search(rank: int) -> bool:
            for other, what in sorted(graph[rank]):
                if other == start:
                    whats.append(what)
                    return True
                if other > start and other not in seen and other not in path:
                    seen.add(other)
                    path.append(other)
                    whats.append(what)
                    if search(other):
                        return True
                    path.pop()
                    whats.pop()
            return False

        if search(start):
            return WaitCycle(tuple(path), tuple(whats))
    return None


# -- task 4 -----------------------------------------------------------------------------------------

def find_stragglers(dumps: list[dict], min_lag: float = MIN_LAG) -> list[Straggler]:
    """For each group: over the collectives every rank of it entered (at least
    ``MIN_COLLECTIVES``, not counting #1, which measures how the ranks started, not how they
    run), the rank that entered last in more than half of them, when the others had already
    waited ``min_lag`` seconds or more for it (median over those)."""
    ranks = by_rank(dumps)
    found = []
    for group in groups(dumps):
        members = [r for r in group[1] if r in ranks]
        calls = {r: collective_entries(ranks[r], group) for r in members}
        common = sorted(set.intersection(*(set(c) for c in calls.values())) - {1}) if len(members) > 1 else []
        if len(common) < MIN_COLLECTIVES:
            continue
        lags: dict[int, list[tuple[float, int]]] = {r: [] for r in members}
        for seq in common:
            entered = {r: calls[r][seq]["time_created_ns"] for r in members}
            last = max(members, key=lambda r: (entered[r], -r))
            lag = (entered[last] - max(t for r, t in entered.items() if r != last)) / 1e9
            lags[last].append((lag, seq))
        rank = max(members, key=lambda r: (len(lags[r]), -r))
        late = lags[rank]
        if len(late) * 2 > len(common) and statistics.median(lag for lag, _ in late) >= min_lag:
            found.append(Straggler(group[1], rank, len(late), len(common),
                                   statistics.median(lag for lag, _ in late), max(late)[1]))
    return found


__all__ = ["find_missing", "find_mismatch", "wait_for_graph", "find_wait_cycle", "find_stragglers",
           "MIN_LAG", "MIN_COLLECTIVES", "FIELDS"]
