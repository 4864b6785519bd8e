"""The whole diagnosis: the four checks of :mod:`.analyze`, dead ranks, a link down, and what is left.

``.venv/bin/python -m collectives diagnose DIR`` prints :func:`report` of :func:`diagnose`::

    Diagnosis of 4 ranks (dumped on timeout), 1 finding:
    1. missing: rank 2 never entered all_reduce #5 of the world; ranks 0, 1, 3 wait in it.
       ranks 0, 1, 3 at faults.py:78 (skipped_collective); rank 2 last made all_reduce #4 ...

Findings come cause first: a mismatch or a missing rank explains the hang it causes; a
rank killed by gloo's abort is a consequence of the mismatch reported above it.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import analyze
from .dumps import by_rank, collective_entries, describe, group_name, groups, is_dead, last_seq, pending, where


@dataclass(frozen=True)
class Finding:
    """One thing the analyzer found, in a sentence, with whom and where."""

    kind: str                        # mismatch, missing, cycle, dead, link, stuck, straggler
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


def find_dead(dumps: list[dict], world: dict | None = None) -> list[Finding]:
    """Ranks that died (their dump was recovered from their ring) or left no dump at all."""
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
        call = next(iter(reversed(dump["entries"])), None)
        inside = (f" in {describe(call)} of {group_name(tuple(call['pg_ranks']), p)}"
                  f" ({call['state']}) at {where(call)}") if call else ""
        note = ""
        if world and world.get("failed_rank") == rank and "size doesn't match" in world.get("stderr_tail", ""):
            note = "; gloo: received data size doesn't match expected size"
        found.append(Finding("dead", (rank,), f"rank {rank} died ({how}){inside}{note}{echo}.",
                             (where(call),) if call else (), tuple(call["pg_ranks"]) if call else None,
                             call["collective_seq_id"] if call and not call["is_p2p"] else None))
    for rank in range(p or 0):
        if rank not in ranks:
            found.append(Finding("dead", (rank,), f"rank {rank} left no dump: it died before it "
                                 "recorded anything, or its directory was not shared."))
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
        found.append(Finding("stuck", (), f"every rank of {group_name(group[1], p)} entered {describe(call)} "
                             "with the same arguments and none completed it: the ranks agree, the transport "
                             "does not move (a link, a frozen peer)", (where(call),), group[1], seq))
    return found


def diagnose(dumps: list[dict], world: dict | None = None, checks=analyze) -> list[Finding]:
    """Every finding, cause first: mismatches, missing ranks, wait cycles, dead ranks, links
    down, collectives stuck for no reason the dumps show, stragglers.

    ``checks`` holds the four checks of lesson 9 (``find_mismatch``, ``find_missing``,
    ``find_wait_cycle``, ``find_stragglers``): the course's by default, the exercise's in
    a lab (``checks=Lab(9, "exercise")``)."""
    p = _world_size(dumps, world)
    ranks = by_rank(dumps)
    findings: list[Finding] = []
    explained: set[tuple] = set()
    for m in checks.find_mismatch(dumps):
        values = dict(m.values)
        call = {r: collective_entries(ranks[r], (_name(ranks[r], m.group), m.group))[m.seq] for r in values}
        differ = "; ".join(f"rank {r} {values[r]} at {where(call[r])}" for r in m.differ)
        others = sorted(set(values) - set(m.differ))
        text = f"collective #{m.seq} of {group_name(m.group, p)} does not match in its {m.field}: {differ}"
        if others:
            text += f"; {_ranks_text(others)} {values[others[0]]} at {where(call[others[0]])}"
        findings.append(Finding("mismatch", m.differ, text + ".", tuple(where(call[r]) for r in m.differ),
                                m.group, m.seq))
        explained.add((m.group, m.seq))
    for m in checks.find_missing(dumps):
        group = (_name(ranks[m.waiting[0]], m.group), m.group) if m.waiting else None
        waiting_at = {where(collective_entries(ranks[r], group)[m.seq]) for r in m.waiting} if group else set()
        text = (f"{_ranks_text(m.missing)} never entered {m.op} #{m.seq} of {group_name(m.group, p)}; "
                f"{_ranks_text(m.waiting)} wait in it at {', '.join(sorted(waiting_at))}. "
                + "; ".join(_last_call_text(ranks[r]) for r in m.missing))
        findings.append(Finding("missing", m.missing, text + ".", tuple(sorted(waiting_at)), m.group, m.seq))
        explained.add((m.group, m.seq))
    cycle = checks.find_wait_cycle(dumps)
    if cycle is not None:
        arrows = " -> ".join(map(str, cycle.ranks + cycle.ranks[:1]))
        findings.append(Finding("cycle", cycle.ranks, f"a cycle of waits, {arrows}: " + "; ".join(cycle.waits)
                                + ". Each waits for the next, none can move (post a receive before the "
                                "send, or pair them: batch_isend_irecv).", tuple(w.rsplit(", ", 1)[-1]
                                                                                 for w in cycle.waits)))
    dead = find_dead(dumps, world)
    findings += dead
    for f in dead:
        if f.group is not None and f.seq is not None:
            explained.add((f.group, f.seq))
    link = find_link_down(dumps)
    findings += link
    if not link:
        findings += find_stuck(dumps, explained)
    for s in checks.find_stragglers(dumps):
        late = collective_entries(ranks[s.rank], (_name(ranks[s.rank], s.group), s.group))[s.worst_seq]
        findings.append(Finding("straggler", (s.rank,), f"rank {s.rank} entered {s.late_in} of {s.of} collectives "
                                f"of {group_name(s.group, p)} last, keeping the others waiting "
                                f"{s.median_lag * 1e3:.0f} ms (median; longest at #{s.worst_seq}, {where(late)}).",
                                (where(late),), s.group, s.worst_seq))
    return findings


def _name(dump: dict, ranks: tuple[int, ...]) -> str:
    """torch's name for the group of ``ranks``, as this rank's entries give it."""
    return next((e["process_group"][0] for e in dump["entries"] if tuple(e["pg_ranks"]) == ranks), "0")


def report(findings: list[Finding], dumps: list[dict]) -> str:
    """The diagnosis as text: a headline, then one numbered paragraph per finding."""
    reasons = sorted({d["reason"].split(":")[0] for d in dumps})
    head = (f"Diagnosis of {len(dumps)} rank dumps (dumped on {', '.join(reasons)}): "
            + (f"{len(findings)} finding{'s' if len(findings) != 1 else ''}" if findings else "no problem found"))
    lines = [head]
    for i, f in enumerate(findings, start=1):
        lines.append(f"{i}. {f.kind}: {f.text}")
    return "\n".join(lines)
