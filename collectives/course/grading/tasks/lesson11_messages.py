"""Lesson 11's judges of messages: the pairwise rounds and Bruck's, in order, finished one
before the next, and what each message carried (the tap's fingerprint of its content, against
the block the algorithm says it carries: a zero-filled decoy of the right size does not pass)."""

from __future__ import annotations

import torch

from .tap import fingerprint

COUNTED = "counted float32, 3 rows of 5 per block"
COUNTED_ROWS, COUNTED_WIDTH = 3, 5
LATE = 0.15          # seconds the last rank waits before the counted case of task 1


def pairwise_pattern(case, p: int, rank: int, calls) -> str | None:
    from ....alltoall.flat import pairwise_schedule
    if case[0] != COUNTED or p == 1:
        return None
    msgs = [c for c in calls if c.kind in ("send", "recv") and c.numel]
    if len(msgs) != 2 * (p - 1):
        return f"made {len(msgs)} sends and receives, expected 2(p − 1) = {2 * (p - 1)}"
    block = COUNTED_ROWS * COUNTED_WIDTH
    for k, (to, frm) in enumerate(pairwise_schedule(rank, p), start=1):
        got = {(c.kind, c.peer) for c in msgs[2 * (k - 1): 2 * k]}
        if got != {("send", to), ("recv", frm)}:
            return (f"round {k} {sorted(got)}, expected a send to {to} and a receive from {frm} "
                    "(one partner each way per round, rounds in order)")
    if any(c.numel != block for c in msgs):
        return f"messages of {sorted({c.numel for c in msgs})} elements, expected one block ({block})"
    return None


def bruck_pattern(case, p: int, rank: int, calls) -> str | None:
    if case[0] != COUNTED or p == 1:
        return None
    sends = [c for c in calls if c.kind == "send" and c.numel]
    rounds = (p - 1).bit_length()
    expected = [((rank + (1 << k)) % p, sum(1 for i in range(p) if i >> k & 1) * COUNTED_ROWS * COUNTED_WIDTH)
                for k in range(rounds)]
    got = [(c.peer, c.numel) for c in sends]
    if got != expected:
        return (f"sent (rank, elements) {got}, expected {expected}: round k sends the blocks whose bit k "
                "is set to rank + 2^k, packed in one message")
    return None


def posted_early(run, p: int, rank: int) -> str | None:
    """Rank p − 1 started the counted case late: a rank that posts a round after the one in
    which it receives from p − 1 before that block was even sent did not finish the round."""
    from ....alltoall.flat import pairwise_schedule
    late = p - 1
    if p < 3 or rank == late:
        return None
    schedule = pairwise_schedule(rank, p)
    k_late = next(k for k, (_, frm) in enumerate(schedule, start=1) if frm == late)
    theirs = [c for c in run.of(late, COUNTED) if c.kind == "send" and c.peer == rank and c.numel]
    mine = [c for c in run.of(rank, COUNTED) if c.kind == "send" and c.numel]
    if not theirs or len(mine) < len(schedule):
        return None                                     # the pattern's own check says what is missing
    for k in range(k_late + 1, len(schedule) + 1):
        if mine[k - 1].t < theirs[0].t:
            early = 1e3 * (theirs[0].t - mine[k - 1].t)
            return (f"posted round {k} (a send to rank {schedule[k - 1][0]}) {early:.0f} ms before rank {late}"
                    f", which started {LATE:g} s late, sent its block of round {k_late}: "
                    f"round {k_late} was not finished (both messages waited for) before the next was posted")
    return None


def _expected_sends(name: str, inputs: list[torch.Tensor], p: int) -> list[list[torch.Tensor]]:
    """What each rank's sends carry, in order: the pairwise exchange's one block per round,
    or Bruck's packed slots, found by running Bruck's rounds on every rank's input."""
    from ....alltoall.flat import pairwise_schedule
    blocks = [list(x.reshape(p, -1)) for x in inputs]
    if name == "pairwise_all_to_all":
        return [[blocks[r][to] for to, _ in pairwise_schedule(r, p)] for r in range(p)]
    slots = [[blocks[r][(r + i) % p] for i in range(p)] for r in range(p)]
    sent: list[list[torch.Tensor]] = [[] for _ in range(p)]
    d = 1
    while d < p:
        moving = [i for i in range(p) if i & d]
        packed = [torch.cat([slots[r][i] for i in moving]) for r in range(p)]
        for r in range(p):
            sent[r].append(packed[r])
            for i, piece in zip(moving, packed[(r - d) % p].split(blocks[0][0].numel())):
                slots[r][i] = piece
        d <<= 1
    return sent


def carried(name: str, inputs: list[torch.Tensor], p: int, rank: int, calls) -> str | None:
    """Each send of the counted case against the content the design says it carries."""
    if p == 1:
        return None
    sends = [c for c in calls if c.kind == "send" and c.numel]
    for k, (call, want) in enumerate(zip(sends, _expected_sends(name, inputs, p)[rank]), start=1):
        expected = fingerprint(want)
        if abs(call.fingerprint - expected) > 1e-6 * max(1.0, abs(expected)):
            what = "the blocks of its round" if name.startswith("bruck") else "its round's input block"
            return (f"message {k} (to rank {call.peer}) did not carry {what}: messages carry the data, "
                    "nothing else does")
    return None
