"""Lesson 1's graded tasks: the token ring, the exchange, ping-pong and the α–β fit.

Every token and every exchanged tensor is drawn from the ranks' secrets, and every
message is read from the tap: its peer, its size, and whether it carried the sender's
data. Which kind of call made it (a blocking ``dist.send`` or an immediate
``dist.isend``) only the course's trace tells; it is read from there.

The two timed tasks are judged on consistency, never on speed, in :mod:`.lesson01_timing`.
"""

from __future__ import annotations

import torch

from ...verify import SENTINEL
from . import P2P, GradedTask
from .allreduce import messages_only
from .lesson01_messages import (
    _describe,
    _draw,
    _laid_out,
    _members,
    _messages,
    _traced_call,
    holds,
    refused,
)
from .lesson01_timing import judge_measure, judge_ping_pong
from .world import Grading, Outcome, Probe, Verdict, outcome_problem, same, seed_of

HERE = __name__


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


TASKS = [
    GradedTask(1, 1, "pass_token with blocking send/recv", 2, _judge_pass_token, ("pass_token",), routes=P2P),
    GradedTask(1, 2, "exchange with isend/irecv", 3, _judge_exchange, ("exchange",), routes=P2P),
    GradedTask(1, 3, "ping_pong round trips", 2, judge_ping_pong, ("ping_pong",), routes=P2P),
    GradedTask(1, 4, "measure_alpha_beta", 3, judge_measure, ("measure_alpha_beta",), routes=P2P | {"broadcast"}),
]
