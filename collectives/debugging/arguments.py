"""What the exercise's four checks leave to the analyzer: the rest of a call's arguments.

The exercise compares a collective's operation, input sizes and dtypes across ranks
(:func:`.analyze.find_mismatch`). A call has more that every rank must agree on, and the
flight recorder keeps it (as torch's ``fr_trace`` checks, and a little more)::

    root        broadcast / reduce / scatter / gather: the same source or destination everywhere
    reduce op   all_reduce / reduce / reduce_scatter: SUM everywhere, not MAX on one rank
    outputs     the same output sizes and dtypes; an all_gather's output holds input × group
                size elements, a reduce_scatter's input output × group size
    state       a call every rank entered that some completed and others still wait in
    send/recv   the k-th send from a to b meets the k-th recv on b from a: the same size

An ``all_to_all_single`` with uneven splits has different sizes on different ranks by
design: its sizes are not compared (its dtype and operation are). Each check answers with
the exercise's :class:`~.dumps.Mismatch` (the field says which), and point-to-point pairs
with :class:`Unpaired`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .dumps import Mismatch, by_rank, group_of, groups, is_dead, majority, op_of, where

ROOTED = ("broadcast", "reduce", "scatter", "gather")
UNEVEN = ("all_to_all", "all_to_all_single")         # sizes may differ from rank to rank
SYMMETRIC = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "barrier")                               # no rank can finish before every rank entered
SENDS, RECVS = ("send", "isend"), ("recv", "irecv")


@dataclass(frozen=True)
class Unpaired:
    """The k-th send from ``sender`` to ``receiver`` met a receive of another size."""

    group: tuple[int, ...]
    sender: int
    receiver: int
    k: int                        # the k-th message from sender to receiver on the group (from 1)
    sent: int                     # elements sent
    received: int                 # elements the receive expected
    send_at: str
    recv_at: str


def _numel(sizes) -> int:
    return sum(math.prod(s) for s in sizes or [])


def _values(entry: dict, group_size: int) -> dict[str, object]:
    """The fields of one call compared across ranks; a field the entry does not know is left out."""
    op = op_of(entry)
    values: dict[str, object] = {}
    if op in ROOTED and entry.get("peer") is not None:
        values["root"] = entry["peer"]
    if entry.get("reduce_op") is not None:
        values["reduce op"] = entry["reduce_op"]
    if entry.get("output_sizes") is not None and op not in UNEVEN:
        values["output sizes"] = str(entry["output_sizes"])
    if entry.get("output_dtypes"):
        values["output dtype"] = ",".join(entry["output_dtypes"])
    return values


def _count_problem(entry: dict, group_size: int) -> str | None:
    """An all_gather or reduce_scatter whose own sizes cannot fit the group."""
    op, inputs, outputs = op_of(entry), _numel(entry.get("input_sizes")), _numel(entry.get("output_sizes"))
    if entry.get("output_sizes") is None or entry.get("source") == "torch":
        return None
    if op in ("all_gather", "all_gather_into_tensor") and outputs != inputs * group_size:
        return f"{op} of {inputs} elements into {outputs} (a group of {group_size} needs {inputs * group_size})"
    if op in ("reduce_scatter", "reduce_scatter_tensor") and inputs != outputs * group_size:
        return f"{op} of {inputs} elements into {outputs} (a group of {group_size} needs {outputs * group_size})"
    return None


def find_argument_mismatch(dumps: list[dict]) -> list[Mismatch]:
    """Per group, the first collective whose root, reduce op, outputs or sizes for the group
    differ between ranks (the exercise's fields are :func:`.analyze.find_mismatch`'s)."""
    ranks = by_rank(dumps)
    found = []
    for group in groups(dumps):
        members = [r for r in group[1] if r in ranks]
        calls = {r: {e["collective_seq_id"]: e for e in ranks[r]["entries"]
                     if not e["is_p2p"] and group_of(e) == group} for r in members}
        common = set.intersection(*(set(c) for c in calls.values())) if calls else set()
        for seq in sorted(common):
            here = {r: calls[r][seq] for r in members}
            if len({op_of(e) for e in here.values()}) > 1:
                break                                  # the exercise's check says it
            problem = _first_difference(group, seq, here, len(group[1]))
            if problem is not None:
                found.append(problem)
                break
    return found


def _first_difference(group, seq: int, here: dict[int, dict], size: int) -> Mismatch | None:
    members = sorted(here)
    wrong = {r: text for r, e in here.items() if (text := _count_problem(e, size))}
    if wrong:
        return Mismatch(group[1], seq, "sizes for the group", tuple(sorted(wrong)),
                        tuple((r, wrong.get(r, "fits")) for r in members))
    values = {r: _values(e, size) for r, e in here.items()}
    for field in ("root", "reduce op", "output sizes", "output dtype"):
        if not all(field in v for v in values.values()):
            continue
        by = {r: str(values[r][field]) for r in members}
        if len(set(by.values())) > 1:
            expected = majority(by)
            return Mismatch(group[1], seq, field, tuple(r for r in members if by[r] != expected),
                            tuple(sorted(by.items())))
    return None


def find_state_split(dumps: list[dict]) -> list[Mismatch]:
    """Per group, the first collective every rank entered that some completed while others
    still wait in it (a symmetric one: nobody finishes before everyone has sent its part).
    Dead ranks and calls that failed are left out: their state says how they ended."""
    ranks = by_rank(dumps)
    found = []
    for group in groups(dumps):
        members = [r for r in group[1] if r in ranks]
        if any(is_dead(ranks[r]) for r in members):
            continue
        calls = {r: {e["collective_seq_id"]: e for e in ranks[r]["entries"]
                     if not e["is_p2p"] and group_of(e) == group and e.get("source") != "torch"} for r in members}
        common = set.intersection(*(set(c) for c in calls.values())) if calls else set()
        for seq in sorted(common):
            here = {r: calls[r][seq] for r in members}
            states = {r: e["state"] for r, e in here.items()}
            failed = any(e.get("error") for e in here.values())
            if op_of(here[members[0]]) in SYMMETRIC and "completed" in states.values() \
                    and any(s != "completed" for s in states.values()) and not failed:
                found.append(Mismatch(group[1], seq, "state", tuple(r for r in members if states[r] != "completed"),
                                      tuple(sorted(states.items()))))
                break
    return found


def find_unpaired(dumps: list[dict]) -> list[Unpaired]:
    """Point-to-point messages whose two ends disagree on the size: the k-th send from a to b
    (on a group) against the k-th receive on b from a. One per pair of ranks, the first."""
    ranks = by_rank(dumps)
    sends: dict[tuple, list[dict]] = {}
    recvs: dict[tuple, list[dict]] = {}
    for rank, dump in ranks.items():
        for e in dump["entries"]:
            if not e["is_p2p"] or e.get("peer") is None:
                continue
            op = op_of(e)
            name = e["process_group"][0]
            if op in SENDS:
                sends.setdefault((name, rank, e["peer"]), []).append(e)
            elif op in RECVS:
                recvs.setdefault((name, e["peer"], rank), []).append(e)
    found = []
    for key in sorted(set(sends) & set(recvs)):
        name, sender, receiver = key
        if not (_whole(ranks[sender]) and _whole(ranks[receiver])):
            continue                                  # a ring that came round: k-th is not known
        for k, (s, r) in enumerate(zip(sends[key], recvs[key]), start=1):
            sent, received = _numel(s["input_sizes"]), _numel(r["input_sizes"])
            if sent != received:
                found.append(Unpaired(tuple(s["pg_ranks"]), sender, receiver, k, sent, received, where(s), where(r)))
                break
    return found


def _whole(dump: dict) -> bool:
    """Does the dump hold every call the rank made (its ring never came round)?"""
    recorded, size = dump.get("entries_recorded"), dump.get("buffer_size")
    return recorded is None or size is None or recorded <= size


__all__ = ["find_argument_mismatch", "find_unpaired", "find_state_split", "Unpaired", "ROOTED", "UNEVEN", "SYMMETRIC"]
