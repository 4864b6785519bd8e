"""Lesson 7's judges read where each byte went: the tiers of a rank's recorded calls.

A rank sits at ``(d, m)`` of a layout ``(D, M)`` -- local rank ``d = r mod D`` of machine
``m = r // D``. Every call the tap recorded (:class:`~collectives.course.grading.tasks.tap.Call`)
names its process group's ranks (and a message its peer), so the judge tells, without
trusting anything a rank computed:

* *inside*: a message to a rank of the same machine, or a collective whose ranks all share
  this machine;
* *across*: a message to another machine, or a collective whose ranks are each on a
  different machine; *off the rail* when that is not this rank's rail (local rank ``d``
  of every machine);
* *mixed*: a collective over several ranks of several machines -- a flat all-reduce; a
  hierarchy has none.

Bytes are counted as the textbook algorithm sends them (what
:func:`collectives.hierarchical.layout.bytes_put_on_the_wire` counts from the course's
trace, here from the process group's own arguments): a message its size; a collective
over g ranks (g − 1)/g of its whole extent, twice that for an all-reduce.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ....core.ops import ReduceOp
from ... import verify
from ...verify import Case
from .tap import Call

PRIME = 1009
PATTERN_N = 960      # divisible by every D·M judged here (2, 4, 6): the byte counts are exact
SLICE_N = 240        # pipelined: PATTERN_N / SLICE_N = 4 slices, a stage of each in flight
PRETEND = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)], 4: [(2, 2), (1, 4), (4, 1)],
           6: [(3, 2), (2, 3)], 8: [(2, 4), (4, 2)]}
# the kinds of a collective whose stages are reduce-scatter, all-to-all and all-gather
REDUCING = ("allreduce", "allreduce_coalesced", "reduce")
ONE_TO_ALL = ("broadcast",)


def machines_in_environment(p: int) -> int | None:
    """D from the launcher's environment when it says the world spans machines, else None."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", p) or p)
    return local if 0 < local < p and p % local == 0 else None


def layouts_for(p: int) -> list[tuple[int, int] | None]:
    """The layouts a world of ``p`` ranks is judged on: the environment's (``None``: the
    function reads it itself, as under torchrun on several machines), or pretended ones."""
    if machines_in_environment(p):
        return [None]
    return PRETEND.get(p) or [(p, 1), (1, p)]


def shape(layout, p: int) -> tuple[int, int]:
    if layout is None:
        D = machines_in_environment(p) or p
        return D, p // D
    return tuple(layout)


def layout_name(layout, p: int) -> str:
    D, M = shape(layout, p)
    return f"layout ({D}, {M})" + (" from the environment" if layout is None else "")


def size_cases(D: int, M: int, light: bool = False) -> list[Case]:
    """The sizes around D·M (the padding slot), integer-valued, every op once, a view
    (``light``: the sizes that cross the padding slot, MAX and AVG)."""
    dm = D * M
    if light:
        return [Case(max(dm - 1, 1)), Case(dm + 1), Case(PRIME, torch.int64, ReduceOp.MAX),
                Case(dm + 1, torch.float64, ReduceOp.AVG)]
    cases = [Case(n) for n in sorted({0, 1, max(dm - 1, 1), dm, dm + 1, PRIME})]
    cases += [Case(PRIME, torch.int64, op) for op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)]
    cases += [Case(dm + 1, torch.float64, ReduceOp.AVG), Case(PRIME, layout="strided")]
    return cases


def harness(D: int, M: int) -> list[Case]:
    """The harness's quick covering set (every dtype, every op, views), on the whole group."""
    return [c for c in verify.default_cases(D * M, quick=True, large=False) if c.group is None]


def unique(cases: list[Case]) -> list[Case]:
    return list({c.name: c for c in cases}.values())


def element_size(dtype: str) -> int:
    try:
        return torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    except (AttributeError, TypeError):
        return 4


@dataclass
class Tiers:
    """Bytes one rank sent, by tier, and what the judge reads beside them."""

    inside: float = 0.0
    across: float = 0.0
    mixed: float = 0.0
    off_rail: float = 0.0
    mixed_kinds: set = field(default_factory=set)
    mixed_by_kind: dict = field(default_factory=dict)       # kind -> bytes of flat collectives
    kinds: set = field(default_factory=set)                 # every collective's kind
    sequence: list = field(default_factory=list)            # "I"/"A" per send or collective, in order
    across_peers: dict = field(default_factory=dict)        # peer -> messages sent to it across
    across_sends: list = field(default_factory=list)


def tiers_of(calls: list[Call], rank: int, D: int, M: int) -> Tiers:
    """Where ``rank``'s ``calls`` sent their bytes (see the module doc)."""
    out = Tiers()
    m, d = rank // D, rank % D
    rail = {d + D * k for k in range(M)}
    for c in calls:
        if c.kind in ("recv", "divide") or c.kind.startswith(("store.", "backend.")):
            continue
        nbytes = float(c.numel * element_size(c.dtype))
        if c.kind == "send":
            if c.peer is None:
                continue
            if c.peer // D == m:
                out.inside += nbytes
                out.sequence.append("I")
            else:
                out.across += nbytes
                out.sequence.append("A")
                out.across_peers[c.peer] = out.across_peers.get(c.peer, 0) + 1
                out.across_sends.append(c)
                if c.peer not in rail:
                    out.off_rail += nbytes
            continue
        members = c.ranks or tuple(range(D * M))
        g = len(members)
        if g <= 1 or c.kind in ("barrier", "monitored_barrier"):
            continue
        out.kinds.add(c.kind)
        if c.kind in ("allreduce", "allreduce_coalesced"):
            sent = 2 * (g - 1) / g * nbytes
        elif c.kind in ("_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced",
                        "reduce_scatter_single", "reduce_scatter_single_coalesced"):
            sent = (g - 1) * nbytes            # the first argument is this rank's part
        elif c.kind in ("reduce", "broadcast", "gather", "scatter"):
            sent = nbytes                      # which rank is the root is not recorded
        else:
            sent = (g - 1) / g * nbytes        # all-gather, all-to-all: the whole extent
        machines = {r // D for r in members}
        if len(machines) == 1:
            out.inside += sent
            out.sequence.append("I")
        elif len(machines) == len(members):
            out.across += sent
            out.sequence.append("A")
            if not set(members) <= rail:
                out.off_rail += sent
        else:
            out.mixed += sent
            out.mixed_kinds.add(c.kind)
            out.mixed_by_kind[c.kind] = out.mixed_by_kind.get(c.kind, 0.0) + sent
    return out


def close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-6 * max(want, 1.0)


def flat_problem(t: Tiers) -> str | None:
    if t.mixed:
        return (f"called {', '.join(sorted(t.mixed_kinds))} on a group of ranks of several machines "
                f"({t.mixed:.0f} bytes): a flat collective, not a hierarchy")
    if t.off_rail:
        return f"sent {t.off_rail:.0f} bytes across machines off its rail (local rank d of every machine)"
    return None


def fairring_problem(t: Tiers, nbytes: int, D: int, M: int) -> str | None:
    """Each rank sends 2(M − 1)/M·n/D across, on its rail, and 2(D − 1)/D·n inside."""
    problem = flat_problem(t)
    if problem:
        return problem
    across, inside = 2 * (M - 1) / M * nbytes / D, 2 * (D - 1) / D * nbytes
    if not close(t.across, across):
        return f"sent {t.across:.0f} bytes across machines, expected 2(M-1)/M·n/D = {across:.0f}"
    if not close(t.inside, inside):
        return f"sent {t.inside:.0f} bytes inside its machine, expected 2(D-1)/D·n = {inside:.0f}"
    return None


def staged_problem(t: Tiers, rank: int, D: int, M: int) -> str | None:
    """Fairring's stages, not an all-reduce: no reducing collective (the add is the rank's
    own), and the collect and diffuse reach every other machine of the rail."""
    reducing = sorted(t.kinds & set(REDUCING + ONE_TO_ALL))
    if reducing:
        return (f"called {', '.join(reducing)} on the process group: the five stages are a reduce-scatter, "
                "an all-to-all on the rail, this rank's own add, and all-gathers")
    if t.across_peers:
        d, m = rank % D, rank // D
        rail = sorted(d + D * k for k in range(M) if k != m)
        if sorted(t.across_peers) != rail:
            return (f"sent across machines to ranks {sorted(t.across_peers)}; the collect and the diffuse "
                    f"exchange with every other rank of its rail, {rail}")
        if len(set(t.across_peers.values())) != 1:
            return f"sent {dict(sorted(t.across_peers.items()))} messages across to its rail's ranks: uneven"
    return None


def order_problem(t: Tiers, D: int, M: int) -> str | None:
    """One slice's stages in order: inside, then across, then inside again."""
    text = "".join(t.sequence)
    runs = [ch for i, ch in enumerate(text) if i == 0 or text[i - 1] != ch]
    want = (["I"] if D > 1 else []) + (["A"] if M > 1 else []) + (["I"] if D > 1 else [])
    if D > 1 and M == 1:
        want = ["I"]
    if runs != want:
        return (f"its stages ran {'-'.join('inside' if r == 'I' else 'across' for r in runs) or 'nowhere'}; "
                "one slice runs reduce-scatter inside, collect and diffuse across, all-gather inside")
    return None
