"""Pipeline schedules as data: for every rank, the list of steps it runs, in order.

A step is ``Step(kind, mb, chunk)``: ``F`` (forward), ``B`` (backward; the input
gradient alone when the same rank also lists a ``W`` for that micro-batch and chunk) or
``W`` (the weight gradient) of micro-batch ``mb`` on model chunk ``chunk``. With ``p``
ranks and ``v`` chunks per rank there are ``C = p·v`` chunks; chunk ``c`` lives on rank
``c mod p`` (rank r holds r, r + p, r + 2p, ...), so activations go round the ranks v
times. One runner (:mod:`.runner`) executes every schedule; the simulator
(:mod:`.simulate`) checks it cannot deadlock before it runs.

Picture, p = 4, m = 4, each step one unit of time (numbers are micro-batches)::

    GPipe        rank 0  F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
                 rank 3  .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .
    1F1B         rank 0  F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3      at most p − r in flight
                 rank 3  .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  .
    ZB-H1        rank 0  F0 F1 F2 F3 .  .  .  B0 W0 B1 W1 B2 W2 B3 W3   B the input gradient alone,
                 rank 3  .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3   W's in the gaps

Bubble (idle share of each rank's time, equal step times; t = F + B):

    GPipe, 1F1B       (p − 1)/(m + p − 1)               1F1B holds p − r micro-batches, not m
    interleaved       (p − 1)/(v·m + p − 1)             each chunk is 1/v of the work
    ZB-H1             (p − 1)(F + B − W)/(m(F + B + W) + (p − 1)(F + B − W))
"""

from __future__ import annotations

from typing import NamedTuple

KINDS = ("F", "B", "W")


class Step(NamedTuple):
    kind: str       # "F", "B" or "W"
    mb: int         # micro-batch
    chunk: int      # model chunk (virtual stage); rank = chunk mod p

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f"@{self.chunk}" if self.chunk else "")


Schedule = list  # list[list[Step]]: one list per rank (a name for the annotations below)


def _check(p: int, m: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"a schedule needs p ≥ 1 ranks, m ≥ 1 micro-batches and v ≥ 1 chunks per rank "
                         f"(got p={p}, m={m}, v={v})")


def gpipe(p: int, m: int) -> Schedule:
    """Every forward, then every backward, micro-batches in order (GPipe, Huang et al.)."""
    _check(p, m)
    return [[Step("F", i, r) for i in range(m)] + [Step("B", i, r) for i in range(m)] for r in range(p)]


def one_f_one_b_order(p: int, m: int, rank: int) -> list[tuple[str, int]]:
    """Rank ``rank``'s 1F1B order as ``(kind, mb)``: p − 1 − rank forwards to fill the
    pipe, then one forward and one backward in turn, then the backwards left."""
    warmup = min(p - 1 - rank, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush's 1F1B (Narayanan et al.): GPipe's bubble, at most p − r micro-batches
    held on rank r instead of m."""
    _check(p, m)
    return [[Step(k, i, r) for k, i in one_f_one_b_order(p, m, r)] for r in range(p)]


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B: v chunks per rank, micro-batches taken p at a time
    through each chunk in turn; the bubble shrinks v times for v times the messages."""
    _check(p, m, v)
    if v > 1 and m % p:
        raise ValueError(f"the interleaved schedule takes micro-batches p at a time: m = {m} is not a "
                         f"multiple of p = {p}")
    total = m * v

    def step(kind: str, k: int, r: int) -> Step:
        group, within = divmod(k, p * v)
        local = within // p if kind == "F" else v - 1 - within // p
        return Step(kind, group * p + within % p, local * p + r)

    out = []
    for r in range(p):
        warmup = total if m == p else min(total, (p - r - 1) * 2 + (v - 1) * p)
        order = [step("F", k, r) for k in range(warmup)]
        for i in range(total - warmup):
            order += [step("F", warmup + i, r), step("B", i, r)]
        out.append(order + [step("B", i, r) for i in range(total - warmup, total)])
    return out


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al.): 1F1B's forwards, the backward split into B (input gradient) and
    W (weight gradient), each W put where the rank would otherwise wait.

    Built by playing the pipeline with F = B = W = one unit: at every unit each rank runs
    the first of -- W, when more than p − 1 W's are owed; B, when its gradient is there; F,
    when its activation is there and fewer than p − r micro-batches await their B (1F1B's
    limit); an owed W -- or waits. The bubble falls from 1F1B's 3(p − 1) units to p − 1.
    """
    _check(p, m)
    done: dict[tuple[str, int, int], int] = {}
    nf, nb = [0] * p, [0] * p
    owed: list[list[int]] = [[] for _ in range(p)]
    orders: list[list[tuple[str, int]]] = [[] for _ in range(p)]
    t = 0
    while any(len(o) < 3 * m for o in orders):
        chosen = []
        for r in range(p):
            grad_from = ("F", nb[r], r) if r == p - 1 else ("B", nb[r], r + 1)
            if len(owed[r]) > p - 1:
                chosen.append((r, "W", owed[r][0]))
            elif nb[r] < nf[r] and done.get(grad_from, t + 1) <= t:
                chosen.append((r, "B", nb[r]))
            elif nf[r] < m and nf[r] - nb[r] < p - r and (r == 0 or done.get(("F", nf[r], r - 1), t + 1) <= t):
                chosen.append((r, "F", nf[r]))
            elif owed[r]:
                chosen.append((r, "W", owed[r][0]))
        for r, kind, mb in chosen:
            orders[r].append((kind, mb))
            done[(kind, mb, r)] = t + 1
            if kind == "F":
                nf[r] += 1
            elif kind == "B":
                nb[r] += 1
                owed[r].append(mb)
            else:
                owed[r].pop(0)
        t += 1
    return [[Step(k, i, r) for k, i in order] for r, order in enumerate(orders)]


def zb_h1_order(p: int, m: int, rank: int) -> list[tuple[str, int]]:
    """Rank ``rank``'s ZB-H1 order as ``(kind, mb)``."""
    return [(s.kind, s.mb) for s in zb_h1(p, m)[rank]]


def schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """A schedule by name: ``gpipe``, ``1f1b``, ``interleaved`` (v chunks per rank), ``zb-h1``."""
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    if name == "zb-h1":
        return zb_h1(p, m)
    raise ValueError(f"no schedule {name!r}; schedules are {', '.join(NAMES)}")


NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def from_orders(orders: list[list[tuple[str, int]]]) -> Schedule:
    """A one-chunk-per-rank schedule from each rank's ``(kind, mb)`` order."""
    return [[Step(str(k), int(i), r) for k, i in order] for r, order in enumerate(orders)]


def chunks_of(rank: int, p: int, v: int) -> list[int]:
    return [rank + k * p for k in range(v)]
