"""The whole diagnosis: the four checks of :mod:`.analyze`, dead ranks, a link down, and what is left.

``.venv/bin/python -m collectives diagnose DIR`` prints :func:`report` of :func:`diagnose`::

    Diagnosis of 4 ranks (dumped on timeout), 1 finding:
    1. missing: rank 2 never entered all_reduce #5 of the world; ranks 0, 1, 3 wait in it.
       ranks 0, 1, 3 at faults.py:78 (skipped_collective); rank 2 last made all_reduce #4 ...

Findings come cause first: a mismatch or a missing rank explains the hang it causes; a
rank killed by gloo's abort is a consequence of the mismatch reported above it.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from . import analyze
from .arguments import find_argument_mismatch, find_state_split, find_unpaired
from .dumps import by_rank, collective_entries, describe, group_name, groups, is_dead, last_seq, pending, where

_LOST = re.compile(r"closed by peer|Connection reset|Broken pipe|Connection refused", re.I)


@dataclass(frozen=True)
class Finding:
    """One thing the analyzer found, in a sentence, with whom and where."""

    kind: str                        # mismatch, unpaired, raised, dead, missing, cycle, link, stuck, straggler, empty
    ranks: tuple[int, ...]           # the ranks it names as the cause
    text: str                        # the sentence
    where: tuple[str, ...] = ()      # source lines, "file.py:42 (function)"
    group: tuple[int, ...] | None = None
    seq: int | None = None


def _ranks_text(ranks) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _world_size(dumps: list[dict], world: dict | None) -> int | None:
    if world:
        return world["world_size"]
    sizes = {d.get("world_size") for d in dumps}
    return sizes.pop() if len(sizes) == 1 else None


def _last_call_text(dump: dict) -> str:
    call = next(iter(reversed(dump["entries"])), None)
    if call is None:
        return f"rank {dump['rank']} made no call"
    state = "" if call["state"] == "completed" else f" ({call['state']})"
    return f"rank {dump['rank']} last made {describe(call)}{state} at {where(call)}"


def find_dead(dumps: list[dict], world: dict | None = None, skipped=frozenset()) -> list[Finding]:
    """Ranks that died (their dump was recovered from their ring) or left no dump at all
    (``skipped``: ranks whose dump exists but could not be used -- not called dead)."""
    found, ranks = [], by_rank(dumps)
    p = _world_size(dumps, world)
    failed_peers = sorted(d["rank"] for d in dumps if not is_dead(d)
                          and any("closed" in (e.get("error") or "") or "reset" in (e.get("error") or "")
                                  for e in d["entries"]))
    echo = f"; {_ranks_text(failed_peers)} lost the connection to it" if failed_peers else ""
    for rank, dump in sorted(ranks.items()):
        if not is_dead(dump):
            continue
        how = dump["reason"].split(": ", 1)[-1]
        end = ((world or {}).get("ranks", {}).get(str(rank)) or {}).get("end")
        if end and end not in how:
            how = f"{how}; {end}"
        call = next(iter(reversed(dump["entries"])), None)
        inside = (f" in {describe(call)} of {group_name(tuple(call['pg_ranks']), p)}"
                  f" ({call['state']}) at {where(call)}") if call else ""
        note = ""
        if world and world.get("failed_rank") == rank and "size doesn't match" in world.get("stderr_tail", ""):
            note = "; gloo: received data size doesn't match expected size"
        found.append(Finding("dead", (rank,), f"rank {rank} died ({how}){inside}{note}{echo}.",
                             (where(call),) if call else (), tuple(call["pg_ranks"]) if call else None,
                             call["collective_seq_id"] if call and not call["is_p2p"] else None))
    said = world.get("ranks", {}) if world else {}
    for rank in range(p or 0):
        if rank in ranks or rank in skipped:
            continue
        info = said.get(str(rank)) or said.get(rank) or {}
        if info.get("dumped"):
            found.append(Finding("missing dump", (rank,), f"rank {rank}'s dump is not in the directory, though "
                                 f"world.json says it dumped ({info.get('end', 'its end unknown')}): it was "
                                 "deleted or not copied; its calls are unknown."))
        elif info:
            found.append(Finding("dead", (rank,), f"rank {rank} left no dump ({info.get('end', '?')}): it ended "
                                 "before it recorded anything."))
        else:
            found.append(Finding("missing dump", (rank,), f"rank {rank} left no dump: it ended before it recorded "
                                 "anything, or its directory was not shared."))
    return found


def find_link_down(dumps: list[dict]) -> list[Finding]:
    """Ranks whose network interface is down, or has lost its carrier (the other end is down)."""
    down = sorted(d["rank"] for d in dumps if d.get("network") and not d["network"]["up"])
    no_carrier = sorted(d["rank"] for d in dumps if d.get("network") and d["network"]["up"]
                        and not d["network"]["running"])
    if not down and not no_carrier:
        return []
    named = down or no_carrier
    ranks = by_rank(dumps)
    machines = sorted({ranks[r].get("machine") for r in named} - {None})
    interface = ranks[named[0]]["network"]["interface"]
    on = f"machine{'s' if len(machines) > 1 else ''} {', '.join(map(str, machines))}'s " if machines else ""
    text = f"{on}link ({interface}) is down: {_ranks_text(named)} cannot reach the other machines"
    if down and no_carrier:
        text += f"; {_ranks_text(no_carrier)} see no carrier on theirs"
    stuck = [e for r in named for e in pending(ranks[r]) if not e["is_p2p"]]
    if stuck:
        first = min(stuck, key=lambda e: e["collective_seq_id"])
        text += (f"; they were in {describe(first)} of {group_name(tuple(first['pg_ranks']), _world_size(dumps, None))}"
                 f" at {where(first)}")
    return [Finding("link", tuple(named), text + ".", tuple(sorted({where(e) for e in stuck}))[:3])]


def find_stuck(dumps: list[dict], explained: set[tuple]) -> list[Finding]:
    """Collectives every rank of the group entered and none completed, unexplained by the rest."""
    found, ranks = [], by_rank(dumps)
    p = _world_size(dumps, None)
    for group in groups(dumps):
        members = [r for r in group[1] if r in ranks and not is_dead(ranks[r])]
        stuck = [e for r in members for e in pending(ranks[r]) if not e["is_p2p"] and
                 (e["process_group"][0], tuple(e["pg_ranks"])) == group]
        if not stuck:
            continue
        seq = min(e["collective_seq_id"] for e in stuck)
        if (group[1], seq) in explained or any(last_seq(ranks[r], group) < seq for r in members):
            continue
        call = collective_entries(ranks[members[0]], group).get(seq) or stuck[0]
        unknown = [r for r in group[1] if r not in ranks]
        if unknown:           # what a rank without a dump did is not known: no claim about it
            found.append(Finding("stuck", (), f"{_ranks_text(members)} of {group_name(group[1], p)} entered "
                                 f"{describe(call)} and none completed it; {_ranks_text(unknown)} left no dump, so "
                                 "whether it entered is not known: find its log or its dump first",
                                 (where(call),), group[1], seq))
            continue
        found.append(Finding("stuck", (), f"every rank of {group_name(group[1], p)} entered {describe(call)} "
                             "with the same arguments and none completed it: the ranks agree, the transport "
                             "does not move (a link, a frozen peer)", (where(call),), group[1], seq))
    return found


def find_raised(dumps: list[dict], world: dict | None = None) -> list[Finding]:
    """Ranks whose code raised, quoting the exception (their dump's, else world.json's)."""
    said = (world or {}).get("ranks", {})
    found = []
    for rank, dump in sorted(by_rank(dumps).items()):
        exception = dump.get("exception") or (said.get(str(rank)) or {}).get("exception")
        if not exception:
            continue
        last = next(iter(reversed(dump["entries"])), None)
        text = f"rank {rank} raised {exception}" + (f"; its last call: {describe(last)} ({last['state']}) at "
                                                     f"{where(last)}" if last else "")
        found.append(Finding("raised", (rank,), text + "."))
    return found


def _group_at(dumps: list[dict], ranks: tuple[int, ...], seq: int, who) -> tuple[str, tuple[int, ...]] | None:
    """The group of ``ranks`` (several may have them: the default group and a new_group of
    every rank) in which every rank of ``who`` has collective #seq."""
    members = by_rank(dumps)
    for group in groups(dumps):
        if group[1] == tuple(ranks) and all(seq in collective_entries(members[r], group) for r in who if r in members):
            return group
    return None


def _named(dumps: list[dict], group, p) -> str:
    """The group in words; with torch's name when another group has the same ranks."""
    if group is None:
        return "its group"
    twins = [g for g in groups(dumps) if g[1] == group[1]]
    return group_name(group[1], p) + (f" (process group {group[0]!r})" if len(twins) > 1 else "")


def _mismatch_finding(m, dumps, p) -> Finding | None:
    ranks = by_rank(dumps)
    values = dict(m.values)
    group = _group_at(dumps, m.group, m.seq, [r for r in values if r in ranks])
    if group is None:
        return None
    call = {r: collective_entries(ranks[r], group)[m.seq] for r in values if r in ranks}
    differ = "; ".join(f"rank {r}: {m.field} {values[r]} at {where(call[r])}" for r in m.differ if r in call)
    others = sorted(set(call) - set(m.differ))
    op = describe(call[m.differ[0] if m.differ and m.differ[0] in call else next(iter(call))])
    text = f"collective #{m.seq} of {_named(dumps, group, p)} ({op}) does not match in its {m.field}: {differ}"
    if others:
        text += f"; {_ranks_text(others)}: {m.field} {values[others[0]]} at {where(call[others[0]])}"
    return Finding("mismatch", m.differ, text + ".", tuple(where(call[r]) for r in m.differ if r in call),
                   m.group, m.seq)


def diagnose(dumps: list[dict], world: dict | None = None, checks=analyze, skipped=frozenset()) -> list[Finding]:
    """Every finding, cause first: mismatches (the exercise's fields, then root, reduce op,
    outputs, state), point-to-point sizes, exceptions, dead ranks, missing ranks, wait cycles,
    links down, collectives stuck for no reason the dumps show, stragglers.

    ``checks`` holds the four checks of lesson 9 (``find_mismatch``, ``find_missing``,
    ``find_wait_cycle``, ``find_stragglers``): the course's by default, the exercise's in
    a lab (``checks=Lab(9, "exercise")``). ``skipped``: ranks whose dump could not be used."""
    p = _world_size(dumps, world)
    if dumps and not any(d["entries"] for d in dumps):
        return [Finding("empty", (), "nothing was recorded: no rank's dump holds a call (was the recorder "
                        "started before the first call, on every rank?).")]
    ranks = by_rank(dumps)
    findings: list[Finding] = []
    explained: set[tuple] = set()
    mismatches = checks.find_mismatch(dumps)
    seen = {m.group for m in mismatches}
    mismatches += [m for m in find_argument_mismatch(dumps) if m.group not in seen]
    for m in mismatches:
        finding = _mismatch_finding(m, dumps, p)
        if finding is not None:
            findings.append(finding)
            explained.add((m.group, m.seq))
    for u in find_unpaired(dumps):
        findings.append(Finding("unpaired", (u.sender, u.receiver), f"message {u.k} from rank {u.sender} to rank "
                                f"{u.receiver} of {group_name(u.group, p)}: a send of {u.sent} elements at "
                                f"{u.send_at} against a receive of {u.received} at {u.recv_at}.",
                                (u.send_at, u.recv_at), u.group))
    dead = find_dead(dumps, world, skipped)
    dead_ranks = {f.ranks[0] for f in dead if f.kind == "dead"}
    # a rank that raised because a dead peer's connection closed is the death's echo, said with it
    findings += [f for f in find_raised(dumps, world) if not (dead_ranks and _LOST.search(f.text))]
    findings += dead
    for f in dead:
        if f.group is not None and f.seq is not None:
            explained.add((f.group, f.seq))
    for m in checks.find_missing(dumps):
        alive_waiting = [r for r in m.waiting if r not in dead_ranks]
        if not alive_waiting or set(m.missing) <= dead_ranks or (m.group, m.seq) in explained:
            continue        # a dead rank's call, or a dead rank missing: its death explains it
        group = _group_at(dumps, m.group, m.seq, alive_waiting)
        waiting_at = {where(collective_entries(ranks[r], group)[m.seq]) for r in alive_waiting} if group else set()
        waits = "waits" if len(m.waiting) == 1 else "wait"
        text = (f"{_ranks_text(m.missing)} never entered {m.op} #{m.seq} of {_named(dumps, group, p)}; "
                f"{_ranks_text(m.waiting)} {waits} in it at {', '.join(sorted(waiting_at))}. "
                + "; ".join(_last_call_text(ranks[r]) for r in m.missing if r in ranks))
        findings.append(Finding("missing", m.missing, text + ".", tuple(sorted(waiting_at)), m.group, m.seq))
        explained.add((m.group, m.seq))
    cycle = checks.find_wait_cycle(dumps)
    if cycle is not None:
        arrows = " -> ".join(map(str, cycle.ranks + cycle.ranks[:1]))
        findings.append(Finding("cycle", cycle.ranks, f"a cycle of waits, {arrows}: " + "; ".join(cycle.waits)
                                + ". Each waits for the next, none can move (post a receive before the "
                                "send, or pair them: batch_isend_irecv).", tuple(w.rsplit(", ", 1)[-1]
                                                                                 for w in cycle.waits)))
    link = find_link_down(dumps)
    findings += link
    if not link and not dead_ranks:
        for m in find_state_split(dumps):
            if (m.group, m.seq) in explained:
                continue
            states = dict(m.values)
            done = sorted(r for r, state in states.items() if state == "completed")
            findings.append(Finding("stuck", (), f"{_ranks_text(m.differ)} still wait in collective #{m.seq} of "
                                    f"{group_name(m.group, p)}, which {_ranks_text(done)} completed: their part "
                                    "of it never arrived (a link, a frozen peer).", (), m.group, m.seq))
            explained.add((m.group, m.seq))
        findings += find_stuck(dumps, explained)
    for s in checks.find_stragglers(dumps):
        group = _group_at(dumps, s.group, s.worst_seq, [s.rank])
        if group is None:
            continue
        noise = run_noise(ranks, group, s.rank)
        if s.median_lag < NOISE_MARGIN * noise:
            continue                 # late by no more than the punctual ranks differ among themselves
        late = collective_entries(ranks[s.rank], group)[s.worst_seq]
        findings.append(Finding("straggler", (s.rank,), f"rank {s.rank} entered {s.late_in} of {s.of} collectives "
                                f"of {group_name(s.group, p)} last, keeping the others waiting "
                                f"{s.median_lag * 1e3:.0f} ms (median; longest at #{s.worst_seq}, {where(late)}; "
                                f"the others entered within {noise * 1e3:.0f} ms of each other).",
                                (where(late),), s.group, s.worst_seq))
    return findings


NOISE_MARGIN = 3
"""A straggler's median lag is at least this many times the run's own noise (:func:`run_noise`)."""


def run_noise(ranks: dict, group: tuple, straggler: int) -> float:
    """The run's own noise in a group: the median, over the collectives every rank of it
    entered (but #1), of the seconds between the first and the last of the *other* ranks
    to enter. On a loaded machine ranks drift apart for no reason; a straggler stands out
    from that, or it is not one."""
    members = [r for r in group[1] if r in ranks]
    calls = {r: collective_entries(ranks[r], group) for r in members}
    common = sorted(set.intersection(*(set(c) for c in calls.values())) - {1}) if members else []
    spreads = []
    for seq in common:
        times = sorted(calls[r][seq]["time_created_ns"] for r in members if r != straggler)
        if len(times) > 1:
            spreads.append((times[-1] - times[0]) / 1e9)
    return statistics.median(spreads) if spreads else 0.0


def report(findings: list[Finding], dumps: list[dict], notes: list[str] = ()) -> str:
    """The diagnosis as text: what could not be read, a headline, then one numbered
    paragraph per finding."""
    reasons = sorted({"recovered from rings" if is_dead(d) else d["reason"].split(":")[0] for d in dumps})
    head = (f"Diagnosis of {len(dumps)} rank dump{'s' if len(dumps) != 1 else ''}"
            + (f" (dumped on {', '.join(reasons)})" if reasons else "") + ": "
            + (f"{len(findings)} finding{'s' if len(findings) != 1 else ''}" if findings else "no problem found"))
    lines = [f"input: {note}" for note in notes] + [head]
    for i, f in enumerate(findings, start=1):
        lines.append(f"{i}. {f.kind}: {f.text}")
    return "\n".join(lines)
