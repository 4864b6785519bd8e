"""Lesson 1's timed tasks, ping-pong and the α–β fit, judged on consistency, never on speed.

A returned round trip must lie between the tap's times of the two messages it timed and
those of the calls around them -- so it is in seconds, and it was measured, not made up --
and the α–β fit is recomputed here from the returned table. The inputs and the message
helpers are lesson 1's (:mod:`.lesson01`).
"""

from __future__ import annotations

import math
import socket
import statistics
import time

from ....core import cost
from .allreduce import messages_only
from .lesson01_messages import _members, refused
from .world import Grading, Probe, Run, Verdict, outcome_problem

HERE = __name__
PING_BYTES, PING_ITERS = 1000, 5          # the world's ping-pong
GROUP_BYTES, GROUP_ITERS = 24, 3          # ... and a pair's inside a group
SIZES = [8, 4 << 10, 256 << 10]           # measure_alpha_beta's sweep: distinct sizes
SWEEP_ITERS = 3
SLACK = 1e-6                              # seconds: float rounding of the clock's readings

# ---- task 3: ping_pong ---------------------------------------------------------------------

def _ping_cases(p: int) -> list[tuple]:
    """(key, nbytes, iters, group): the world (ranks above 1 watch), a pair inside a group
    whose first rank is not rank 0, and a group of one (ValueError)."""
    cases = [("world", PING_BYTES, PING_ITERS, None)]
    if p >= 3:
        cases.append(("group (1, 2)", GROUP_BYTES, GROUP_ITERS, (1, 2)))
    return cases


def _timed(probe: Probe, key: str, fn, *args, **kwargs):
    """``probe.call`` between two readings of the clock the tap reads, and this rank's host
    (the clocks of two ranks compare only on one host)."""
    before = time.perf_counter()
    outcome = probe.call(key, fn, *args, **kwargs)
    return outcome, before, time.perf_counter(), socket.gethostname()


def probe_ping_pong(probe: Probe) -> dict:
    import torch.distributed as dist

    fn = probe.student("ping_pong")
    cases = _ping_cases(probe.size)
    groups = {c[3]: dist.new_group(list(c[3])) for c in cases if c[3] is not None}
    solo = dist.new_group([0])
    out = {}
    for key, nbytes, iters, group in cases:
        if group is None or probe.rank in group:
            out[key] = _timed(probe, key, fn, nbytes, iters, **({} if group is None else {"group": groups[group]}))
    if probe.rank == 0:
        out["group of one"] = probe.call("group of one", fn, 8, 1, group=solo)
    return out


def round_trips(run: Run, key: str, first: int, second: int, nbytes: int) -> list[tuple[float, float]]:
    """The shortest and the longest each round trip of ``nbytes`` from ``first`` to ``second``
    can have lasted, by the times its calls reached the process group; in order.

    A round trip is a send to ``second`` followed at once by a receive of as many bytes
    from it. Whatever timed it started before the send and ended after the receive, and
    after the echo that ``second`` sent back had started: it lasted at least as long as
    from the send to the later of the two. It started after ``first``'s call before the
    send and ended before its call after the receive (or the probe's own readings of the
    clock around the call): at most that long.
    """
    _, before, after, host = run.results[first][key]
    timed = [c for c in run.of(first, key) if c.t and not c.kind.startswith(("store.", "backend."))]
    echoes = [c.t for c in run.of(second, key) if c.kind == "send" and c.peer == first and c.numel == nbytes]
    trips = []
    for j, (a, b) in enumerate(zip(timed, timed[1:])):
        if (a.kind, a.peer, a.numel, b.kind, b.peer, b.numel) == ("send", second, nbytes, "recv", second, nbytes):
            start = timed[j - 1].t if j > 0 else before
            end = timed[j + 2].t if j + 2 < len(timed) else after
            trips.append([a.t, b.t, start, end])
    if len(echoes) == len(trips) and run.results[second][key][3] == host:
        for trip, echo in zip(trips, echoes):
            trip[1] = max(trip[1], echo)
    return [(arrived - sent, end - start) for sent, arrived, start, end in trips]


def judge_ping_pong(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(3):
        if size < 2:
            return Verdict([f"ping_pong needs a world of at least 2 ranks, not {size}"])
        run = grading.world(f"{HERE}:probe_ping_pong", size)
        for key, nbytes, iters, group in _ping_cases(size):
            members = _members(size, group)
            for r in members:
                where = f"ping_pong, world of {size}, rank {r}, case {key}"
                outcome = run.results[r][key][0]
                if outcome_problem(where, outcome, verdict):
                    continue
                problem = _ping_problem(run, r, members, key, nbytes, iters, outcome.value)
                verdict.add(problem and f"{where}: {problem}")
        refused(f"ping_pong, world of {size}, rank 0, case group of one", run.results[0]["group of one"], verdict)
        if verdict.not_written or verdict.problems:
            break
    return verdict


def _ping_problem(run: Run, r: int, members: list[int], key: str, nbytes: int, iters: int, times) -> str | None:
    calls = run.of(r, key)
    problem = messages_only(None, 0, 0, calls)
    if problem:
        return problem
    messages = [(c.kind, c.peer, c.numel, c.dtype) for c in calls if c.kind in ("send", "recv")]
    first, second = members[0], members[1]
    if r not in (first, second):
        if messages:
            return f"made {len(messages)} messages; only the group's first two ranks ping-pong"
        return None if times == [] else f"returned {times!r}; every rank but the group's first returns []"
    peer = second if r == first else first
    one_way = [("send", peer, nbytes, "uint8"), ("recv", peer, nbytes, "uint8")]
    expected = (one_way if r == first else one_way[::-1]) * iters
    if messages != expected:
        shown = messages[:4] + [("...",)] if len(messages) > 4 else messages
        return (f"made {len(messages)} messages {shown}; expected {iters} round trips of one uint8 message "
                f"of {nbytes} bytes each way with rank {peer}, {'sending' if r == first else 'receiving'} first")
    if r != first:
        return None if times == [] else f"returned {times!r}; every rank but the group's first returns []"
    if not isinstance(times, list) or len(times) != iters or not all(isinstance(t, float) for t in times):
        return f"returned {times!r}; expected a list of {iters} round-trip times (floats, seconds)"
    for j, (t, (shortest, longest)) in enumerate(zip(times, round_trips(run, key, first, second, nbytes))):
        if not (t > 0 and shortest - SLACK <= t <= longest + SLACK):
            return (f"round trip {j} is {t!r} s, but its messages took between {shortest:.3g} and "
                    f"{longest:.3g} s: time each round trip, in seconds")
    return None


# ---- task 4: measure_alpha_beta --------------------------------------------------------------

def _sweep_cases(p: int) -> list[tuple]:
    """(key, group): the world (every rank gets rank 0's numbers), and a group of two whose
    first rank is global rank 1."""
    return [("world", None)] + ([("group (1, 2)", (1, 2))] if p >= 3 else [])


def probe_measure(probe: Probe) -> dict:
    import torch.distributed as dist

    fn = probe.student("measure_alpha_beta")
    cases = _sweep_cases(probe.size)
    groups = {c[1]: dist.new_group(list(c[1])) for c in cases if c[1] is not None}
    out = {}
    for key, group in cases:
        if group is None or probe.rank in group:
            outcome, before, after, host = _timed(probe, key, fn, list(SIZES), SWEEP_ITERS,
                                                  **({} if group is None else {"group": groups[group]}))
            if not (outcome.error or outcome.not_written):
                outcome.value = _plain(outcome.value)
            out[key] = (outcome, before, after, host)
    return out


def _plain(result):
    """(alpha, beta, table) from what the function returned, or a description of it."""
    try:
        link, table = result
        return float(link.alpha), float(link.beta), [dict(row) for row in table]
    except Exception:  # noqa: BLE001 - judged as a wrong result
        return f"returned {type(result).__name__}, expected (link, table)"


def judge_measure(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(3):
        if size < 2:
            return Verdict([f"measure_alpha_beta needs a world of at least 2 ranks, not {size}"])
        run = grading.world(f"{HERE}:probe_measure", size)
        for key, group in _sweep_cases(size):
            members = _members(size, group)
            for r in members:
                where = f"measure_alpha_beta, world of {size}, rank {r}, case {key}"
                outcome = run.results[r][key][0]
                if outcome_problem(where, outcome, verdict):
                    continue
                problem = _sweep_problem(run, r, members, key, outcome.value)
                verdict.add(problem and f"{where}: {problem}")
        if verdict.not_written or verdict.problems:
            break
    return verdict


def _sweep_problem(run: Run, r: int, members: list[int], key: str, got) -> str | None:
    if isinstance(got, str):
        return got
    alpha, beta, table = got
    sizes = [row.get("nbytes") for row in table]
    if sizes != SIZES:
        return f"table sizes {sizes}, expected one row per size asked for, in order: {SIZES}"
    first, second = members[0], members[1]
    if r != first:
        theirs = run.results[first][key][0].value
        return None if got == theirs else \
            f"holds {got!r}, not group rank 0's {theirs!r}: every rank gets rank 0's numbers"
    one_way = [row.get("one_way") for row in table]
    for row in table:
        if not (isinstance(row.get("one_way"), float) and row["one_way"] > 0):
            return f"row {row}: one_way must be a positive number of seconds"
        if not math.isclose(row.get("round_trip", -1.0), 2 * row["one_way"], rel_tol=1e-12):
            return f"row {row}: round_trip must be twice one_way"
    fit = cost.fit_alpha_beta(SIZES, one_way)
    if not (math.isclose(alpha, fit.alpha, rel_tol=1e-9) and math.isclose(beta, fit.beta, rel_tol=1e-9)):
        return (f"link (α = {alpha!r}, β = {beta!r}) is not the least-squares fit of its table "
                f"(α = {fit.alpha!r}, β = {fit.beta!r})")
    for nbytes, t in zip(SIZES, one_way):
        trips = round_trips(run, key, first, second, nbytes)
        echoed = sum(c.kind == "send" and c.peer == first and c.numel == nbytes for c in run.of(second, key))
        if len(trips) < SWEEP_ITERS or echoed < SWEEP_ITERS:
            return (f"ping-ponged {len(trips)} times with {nbytes} bytes (rank {second} sent {echoed} back); "
                    f"expected at least iters = {SWEEP_ITERS}")
        timed = trips[-SWEEP_ITERS:]             # any warm-up comes first
        low = statistics.median(shortest for shortest, _ in timed) / 2
        high = statistics.median(longest for _, longest in timed) / 2
        if not low - SLACK <= t <= high + SLACK:
            return (f"one_way for {nbytes} bytes is {t!r} s, but half the median of its last {SWEEP_ITERS} "
                    f"round trips lies between {low:.3g} and {high:.3g} s (by the times its messages "
                    "reached the process group)")
    return None
