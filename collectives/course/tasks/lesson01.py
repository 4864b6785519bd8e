"""Lesson 1's graded tasks: the token ring, the exchange, ping-pong and the α–β fit.

Every token and every exchanged tensor is drawn from the ranks' secrets, and every
message is read from the tap: its peer, its size, and whether it carried the sender's
data. Which kind of call made it (a blocking ``dist.send`` or an immediate
``dist.isend``) only the course's trace tells; it is read from there.

The two timed tasks are judged on consistency, never on speed: a returned round trip
must lie between the tap's times of the two messages it timed and those of the calls
around them -- so it is in seconds, and it was measured, not made up -- and the α–β fit
is recomputed here from the returned table.
"""

from __future__ import annotations

import math
import socket
import statistics
import time

import torch

from ...core import cost, trace
from ..verify import SENTINEL
from . import GradedTask
from .allreduce import messages_only
from .tap import Call, fingerprint
from .world import Grading, Outcome, Probe, Run, Verdict, outcome_problem, same, seed_of

HERE = __name__
PING_BYTES, PING_ITERS = 1000, 5          # the world's ping-pong
GROUP_BYTES, GROUP_ITERS = 24, 3          # ... and a pair's inside a group
SIZES = [8, 4 << 10, 256 << 10]           # measure_alpha_beta's sweep: distinct sizes
SWEEP_ITERS = 3
SLACK = 1e-6                              # seconds: float rounding of the clock's readings


# ---- inputs, drawn from secrets ---------------------------------------------------------

def _draw(seed: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).round().div(4).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def _laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` as handed over: itself, or (for ``transposed``) the transpose of a 2-D draw."""
    return values.t() if layout == "transposed" else values


def _members(p: int, group) -> list[int]:
    return list(group) if group is not None else list(range(p))


_WEIGHTS: dict[int, torch.Tensor] = {}


def fingerprint_of(values: torch.Tensor) -> float:
    """:func:`~collectives.course.tasks.tap.fingerprint`, its weights computed once per length
    (the judge takes the fingerprints of many tensors of a few lengths)."""
    v = values.detach().reshape(-1).to("cpu", torch.float64)
    n = v.numel()
    if n < 4096:
        return fingerprint(v)
    if n not in _WEIGHTS:
        _WEIGHTS[n] = torch.arange(1, n + 1, dtype=torch.float64).sin_()
    return float((torch.nan_to_num(v) * _WEIGHTS[n]).sum())


def holds(call: Call, values: torch.Tensor) -> bool:
    """The message holds ``values``, element for element (by the tap's fingerprint)."""
    return (call.numel == values.numel()
            and abs(call.fingerprint - fingerprint_of(values)) <= 1e-9 * (1 + call.weight))


def _messages(calls: list[Call]) -> tuple[list[Call], list[Call]]:
    return [c for c in calls if c.kind == "send"], [c for c in calls if c.kind == "recv"]


def _describe(calls: list[Call]) -> str:
    return "[" + ", ".join(f"{c.kind} {'to' if c.kind == 'send' else 'from'} {c.peer} ({c.numel})"
                           for c in calls) + "]" if calls else "nothing"


def _traced_call(probe: Probe, key: str, fn, *args, **kwargs):
    """``probe.call``, with the kinds of the messages the course's trace saw (send or isend)."""
    with trace.recording() as t:
        outcome = probe.call(key, fn, *args, **kwargs)
    return outcome, [(e.kind, e.peer) for e in t if e.is_send or e.is_recv]


# ---- task 1: pass_token -------------------------------------------------------------------

def _token_cases(p: int) -> list[tuple]:
    """(key, drawn shape, dtype, layout, group): tokens of several dtypes and shapes round the
    world, a ring of another size inside it (odd where the world is even), every rank alone."""
    cases = [("int64 [2]", (2,), torch.int64, "contiguous", None),
             ("float32 [4, 3]", (4, 3), torch.float32, "contiguous", None),
             ("bfloat16 [7]", (7,), torch.bfloat16, "contiguous", None),
             ("float64 [3, 2] transposed", (2, 3), torch.float64, "transposed", None),
             ("float32 0-d", (), torch.float32, "contiguous", None)]
    if p >= 3:
        group = tuple(range(p - 1)) if p % 2 == 0 else tuple(range(1, p))
        cases.append((f"float64 [3], group {group}", (3,), torch.float64, "contiguous", group))
    cases.append(("int32 [2], alone", (2,), torch.int32, "contiguous", "alone"))
    return cases


def _token(secret: int, case: tuple) -> torch.Tensor:
    key, shape, dtype, layout, _ = case
    return _laid_out(_draw(seed_of(secret, "token " + key), shape, dtype), layout)


def probe_pass_token(probe: Probe) -> dict:
    import torch.distributed as dist

    fn = probe.student("pass_token")
    cases = _token_cases(probe.size)
    groups = {c[4]: dist.new_group(list(c[4])) for c in cases if isinstance(c[4], tuple)}
    alone = [dist.new_group([r]) for r in range(probe.size)]
    out = {}
    for case in cases:
        key, group = case[0], case[4]
        if isinstance(group, tuple) and probe.rank not in group:
            continue
        token = _token(probe.secret, case)
        extra = {} if group is None else {"group": alone[probe.rank] if group == "alone" else groups[group]}
        outcome, kinds = _traced_call(probe, key, fn, token, **extra)
        got, outcome.value = outcome.value, None
        out[key] = (outcome, got.detach().clone() if isinstance(got, torch.Tensor) else got, kinds)
    return out


def _judge_pass_token(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(4):
        run = grading.world(f"{HERE}:probe_pass_token", size)
        for problem in run.problems():
            verdict.add(problem)
        for case in _token_cases(size):
            key, group = case[0], case[4]
            members = [None] if group == "alone" else _members(size, group)
            for r in (range(size) if group == "alone" else members):
                where = f"pass_token, world of {size}, rank {r}, case {key}"
                outcome, got, kinds = run.results[r][key]
                if outcome_problem(where, outcome, verdict):
                    continue
                mine = _token(run.secrets[r], case)
                if group == "alone" or len(members) == 1:
                    right = left = None
                    expected = mine
                else:
                    i = members.index(r)
                    right, left = members[(i + 1) % len(members)], members[(i - 1) % len(members)]
                    expected = _token(run.secrets[left], case)
                problem = same(expected, got)
                if problem is not None:
                    problem = f"returned the wrong token: {problem}"
                verdict.add(problem and f"{where}: {problem}")
                if problem is None:
                    problem = _token_messages(run.of(r, key), kinds, mine, right, left)
                    verdict.add(problem and f"{where}: {problem}")
        if verdict.not_written or verdict.problems:
            break
    return verdict


def _token_messages(calls, kinds, token, right, left) -> str | None:
    """One blocking send of the token to the right, one blocking receive from the left."""
    problem = messages_only(None, 0, 0, calls)
    if problem:
        return problem
    sends, recvs = _messages(calls)
    if right is None:
        return f"made {_describe(sends + recvs)} in a group of one: return a copy, send nothing" \
            if sends or recvs else None
    n = token.numel()
    if [(c.peer, c.numel) for c in sends] != [(right, n)] or [(c.peer, c.numel) for c in recvs] != [(left, n)]:
        return (f"made {_describe(sends + recvs)}; expected one message of {n} elements to rank {right} "
                f"and one from rank {left}")
    if not holds(sends[0], token):
        return "the message it sent did not hold its token"
    if sorted(kinds) != sorted([("recv", left), ("send", right)]):
        return (f"expected a blocking dist.send to rank {right} and a blocking dist.recv from rank {left}; "
                f"the course's trace saw {kinds or 'none'}")
    return None


# ---- task 2: exchange ----------------------------------------------------------------------

def _exchange_cases(p: int) -> list[tuple]:
    """(key, drawn shape, dtype, send layout, receive layout, direction, group)."""
    cases = [(f"ring right {str(dtype)[6:]}", (5,), dtype, "contiguous", "contiguous", "right", None)
             for dtype in (torch.int64, torch.float16, torch.bfloat16, torch.float32)]
    cases.append(("ring left int32", (3,), torch.int32, "contiguous", "contiguous", "left", None))
    if p % 2 == 0:
        cases.append(("pairs float64", (2,), torch.float64, "contiguous", "contiguous", "pair", None))
    cases += [("transposed send, strided receive", (2, 3), torch.float32, "transposed", "strided", "right", None),
              ("empty", (0,), torch.float32, "contiguous", "contiguous", "right", None)]
    if p >= 3:
        group = tuple(range(1, p))
        cases.append((f"ring right in group {group}", (1,), torch.int64, "contiguous", "contiguous", "right", group))
    cases.append(("with itself", (2,), torch.float32, "contiguous", "contiguous", "self", None))
    return cases


def _peers(rank: int, p: int, direction: str, group) -> tuple[int, int]:
    """(send_to, recv_from), global ranks."""
    if direction == "self":
        return rank, rank
    if direction == "pair":
        return rank ^ 1, rank ^ 1
    members = _members(p, group)
    i = members.index(rank)
    right, left = members[(i + 1) % len(members)], members[(i - 1) % len(members)]
    return (right, left) if direction == "right" else (left, right)


def _sent(secret: int, case: tuple) -> torch.Tensor:
    key, shape, dtype, layout = case[:4]
    return _laid_out(_draw(seed_of(secret, "exchange " + key), shape, dtype), layout)


def _landing(like: torch.Tensor, layout: str):
    """(receive tensor, the buffer it lives in or None): -1 everywhere, or a strided view of
    sentinels."""
    if layout == "strided":
        base = torch.full((2 * like.numel(),), SENTINEL, dtype=like.dtype)
        return base[::2].view(like.shape), base
    return torch.full(like.shape, -1, dtype=like.dtype), None


def probe_exchange(probe: Probe) -> dict:
    import torch.distributed as dist

    fn = probe.student("exchange")
    rank, p = probe.rank, probe.size
    cases = _exchange_cases(p)
    groups = {c[6]: dist.new_group(list(c[6])) for c in cases if c[6] is not None}
    out = {}
    for case in cases:
        key, _, _, _, recv_layout, direction, group = case
        if group is not None and rank not in group:
            continue
        send = _sent(probe.secret, case)
        original = send.clone()
        recv, base = _landing(send, recv_layout)
        send_to, recv_from = _peers(rank, p, direction, group)
        extra = {} if group is None else {"group": groups[group]}
        outcome, kinds = _traced_call(probe, key, fn, send, recv, send_to, recv_from, **extra)
        gaps_ok = base is None or not bool((base[1::2] != SENTINEL).any())
        out[key] = (outcome, recv.clone(), gaps_ok, torch.equal(send, original), kinds)
    # bad input, last: a call that posted a message before refusing leaves no later case out of step
    left = (rank - 1) % p
    out["expanded receive"] = probe.call("expanded receive", fn, torch.ones(4), torch.zeros(1).expand(4),
                                         (rank + 1) % p, left)
    if p > 1:
        try:        # not refused, gloo's send to its own rank fails, as the probe takes for a broken world
            out["half with itself"] = probe.call("half with itself", fn, torch.ones(2), torch.zeros(2), rank, left)
        except RuntimeError as exc:
            out["half with itself"] = Outcome(None, f"raised RuntimeError: {str(exc).splitlines()[0][:160]}")
    return out


def _judge_exchange(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(4):
        run = grading.world(f"{HERE}:probe_exchange", size)
        for problem in run.problems():
            verdict.add(problem)
        for case in _exchange_cases(size):
            key, group, direction = case[0], case[6], case[5]
            for r in _members(size, group):
                where = f"exchange, world of {size}, rank {r}, case {key}"
                outcome, got, gaps_ok, untouched, kinds = run.results[r][key]
                if outcome_problem(where, outcome, verdict):
                    continue
                send_to, recv_from = _peers(r, size, direction, group)
                problem = same(_sent(run.secrets[recv_from], case), got)
                if problem is None and not gaps_ok:
                    problem = "wrote between the elements of the strided recv_tensor"
                if problem is None and not untouched:
                    problem = "changed send_tensor"
                if problem is None:
                    problem = _exchange_messages(run.of(r, key), kinds, _sent(run.secrets[r], case),
                                                 r, send_to, recv_from)
                verdict.add(problem and f"{where}: {problem}")
        for r in range(size):
            for key in ("half with itself", "expanded receive"):
                if key in run.results[r]:
                    refused(f"exchange, world of {size}, rank {r}, case {key}", run.results[r][key], verdict)
        if verdict.not_written or verdict.problems:
            break
    return verdict


def refused(where: str, outcome, verdict: Verdict) -> None:
    """Bad input must be refused with ValueError."""
    if outcome.not_written:
        verdict.not_written = verdict.not_written or outcome.not_written
    elif not outcome.error.startswith("raised ValueError"):
        verdict.add(f"{where}: expected ValueError, got {outcome.error or 'no error'}")


def _exchange_messages(calls, kinds, sent, rank, send_to, recv_from) -> str | None:
    """The receive posted first, then the send; immediates; the send holds ``send_tensor``."""
    problem = messages_only(None, 0, 0, calls)
    if problem:
        return problem
    messages = [c for c in calls if c.kind in ("send", "recv")]
    if send_to == rank:
        return f"made {_describe(messages)} exchanging with itself: copy, send nothing" if messages else None
    n = sent.numel()
    expected = [("recv", recv_from, n), ("send", send_to, n)]
    if [(c.kind, c.peer, c.numel) for c in messages] != expected:
        return (f"made {_describe(messages)}; expected a receive of {n} elements from rank {recv_from} "
                f"posted before a send of {n} to rank {send_to}")
    if not holds(messages[1], sent):
        return "the message it sent did not hold send_tensor"
    if kinds != [("irecv", recv_from), ("isend", send_to)]:
        return (f"expected dist.irecv from rank {recv_from}, then dist.isend to rank {send_to}; "
                f"the course's trace saw {kinds or 'none'}")
    return None


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


def _judge_ping_pong(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(3):
        if size < 2:
            return Verdict([f"ping_pong needs a world of at least 2 ranks, not {size}"])
        run = grading.world(f"{HERE}:probe_ping_pong", size)
        for problem in run.problems():
            verdict.add(problem)
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


def _judge_measure(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(3):
        if size < 2:
            return Verdict([f"measure_alpha_beta needs a world of at least 2 ranks, not {size}"])
        run = grading.world(f"{HERE}:probe_measure", size)
        for problem in run.problems():
            verdict.add(problem)
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


TASKS = [
    GradedTask(1, 1, "pass_token with blocking send/recv", 2, _judge_pass_token, ("pass_token",)),
    GradedTask(1, 2, "exchange with isend/irecv", 3, _judge_exchange, ("exchange",)),
    GradedTask(1, 3, "ping_pong round trips", 2, _judge_ping_pong, ("ping_pong",)),
    GradedTask(1, 4, "measure_alpha_beta", 3, _judge_measure, ("measure_alpha_beta",)),
]
