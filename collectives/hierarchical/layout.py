"""Where each rank sits: D ranks per machine, M machines, and a process group per stage.

A hierarchical all-reduce needs to know which ranks share a machine. Ranks are
*machine-major*, as torchrun numbers them: rank ``r`` of a group of ``D·M`` ranks is local
rank ``d = r mod D`` on machine ``m = r // D``::

    machine 0        machine 1        machine 2            "inside" groups: one per machine
    ┌──────────┐     ┌──────────┐     ┌──────────┐         (fast links: NVLink, shared memory)
    │ 0  1  2  │     │ 3  4  5  │     │ 6  7  8  │
    └─┼──┼──┼──┘     └─┼──┼──┼──┘     └─┼──┼──┼──┘         "rail" groups: one per local rank d,
      └──┼──┼──────────┴──┼──┼──────────┘  │  │            the ranks with the same d on every
         └──┼─────────────┴──┼─────────────┘  │            machine (slow links: the network;
            └────────────────┴────────────────┘            with one NIC per GPU, a link each)

The layout comes from the launcher's environment (``LOCAL_WORLD_SIZE`` and the world size,
as torchrun and :mod:`collectives.launch` set them) or is given as ``layout=(D, M)``, which
lets one machine pretend to be several.

Like Fairring, every *stage* gets process groups of its own: the reduce-scatter and the
all-gather inside the machine, the collect and the diffuse on the rail. A process group
runs its operations in order (one NCCL communicator serialises its kernels; a gloo group
has its own connections and threads), so stages issued on separate groups can run at
once. Groups are created once per layout and cached, and every rank creates them in the
same order -- ``dist.new_group`` is collective.
"""

from __future__ import annotations

import numbers
import os
import warnings
from dataclasses import dataclass

import torch.distributed as dist

from ..core import ops, trace

# torch 2.13 renames reduce_scatter_tensor and all_gather_into_tensor (reduce_scatter_single,
# all_gather_single) and warns at every call; the old names are the ones every torch the
# course supports has, the ones the trace records, and the plain way to write stages 1 and
# 5 of this lesson's exercise.
warnings.filterwarnings("ignore", message=r".*`torch\.distributed\.(reduce_scatter_tensor|"
                        r"all_gather_into_tensor)` is deprecated", category=FutureWarning)

STAGES = ("reduce-scatter", "collect", "add", "diffuse", "all-gather")


@dataclass(frozen=True)
class Layout:
    """``D`` ranks per machine on ``M`` machines, ranks machine-major."""

    D: int
    M: int

    @property
    def size(self) -> int:
        return self.D * self.M

    def machine(self, group_rank: int) -> int:
        return group_rank // self.D

    def local(self, group_rank: int) -> int:
        return group_rank % self.D


def check_layout(layout) -> tuple[int, int]:
    """``(D, M)`` from ``layout`` (a :class:`Layout` or two integers), or a ``TypeError``.

    Two integers, nothing else: ``(2.5, 1.6)`` has D·M = 4 on 4 ranks, but no rank can be
    2.5 ranks per machine -- truncated, it would be (2, 1), and the algorithms would build
    groups for one layout and index blocks for another. Every rank raises the same error
    before anything is sent."""
    if isinstance(layout, Layout):
        return layout.D, layout.M
    try:
        D, M = layout
    except (TypeError, ValueError):
        raise TypeError(f"layout must be (D, M), two integers: ranks per machine and machines; "
                        f"got {layout!r}") from None
    for name, value in (("D", D), ("M", M)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"layout (D, M) must be two integers, got {name}={value!r} "
                            f"({type(value).__name__}) in {tuple(layout)!r}")
    return int(D), int(M)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def resolve(layout=None, group=None) -> Layout:
    """The layout of ``group`` (the world by default): ``layout`` if given, else the environment.

    Raises ``TypeError`` when ``layout`` is not two integers (:func:`check_layout`),
    ``ValueError`` when it does not match the group's size, or when the environment's
    machines do not split the group evenly and machine-major.
    """
    p = dist.get_world_size(group)
    if layout is not None:
        D, M = check_layout(layout)
        if D < 1 or M < 1 or D * M != p:
            raise ValueError(f"layout (D={D}, M={M}) has {D * M} ranks, but the group has {p}: "
                             f"pass a layout with D·M = {p}, e.g. layout=({p}, 1)")
        return Layout(D, M)
    local_size = _env_int("LOCAL_WORLD_SIZE")
    world = dist.get_world_size()
    if local_size is None:
        return Layout(p, 1)                      # no launcher told us: one machine
    if world % local_size:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_size} does not divide the world size {world}: "
                         "machines of unequal size; pass layout=(D, M)")
    ranks = _ranks(group)
    machines = [r // local_size for r in ranks]   # world ranks are machine-major
    order = list(dict.fromkeys(machines))
    per_machine = [machines.count(m) for m in order]
    if len(set(per_machine)) != 1 or machines != sorted(machines, key=order.index):
        raise ValueError(f"the group's ranks {ranks} are spread unevenly over machines "
                         f"{machines}: pass layout=(D, M) explicitly")
    return Layout(per_machine[0], len(order))


def _ranks(group) -> list[int]:
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


@dataclass
class StageGroups:
    """The process groups one rank uses, one per stage (None where a stage is skipped)."""

    layout: Layout
    d: int                  # this rank's local index (its rail)
    m: int                  # this rank's machine
    ranks: list[int]        # global ranks of the whole group, machine-major
    reduce_scatter: object = None   # inside my machine
    collect: object = None          # on my rail
    diffuse: object = None          # on my rail
    all_gather: object = None       # inside my machine

    def machine_of(self, global_rank: int) -> int:
        return self.layout.machine(self.ranks.index(global_rank))

    def inside_ranks(self, m: int | None = None) -> list[int]:
        m = self.m if m is None else m
        D = self.layout.D
        return self.ranks[m * D:(m + 1) * D]

    def rail_ranks(self, d: int | None = None) -> list[int]:
        d = self.d if d is None else d
        return self.ranks[d::self.layout.D]


_cache: dict[tuple, StageGroups] = {}


def stage_groups(layout: Layout, group=None, *, ranks: list[int] | None = None,
                 name: str = "") -> StageGroups | None:
    """This rank's :class:`StageGroups` for ``layout`` over ``group``, created on first use.

    ``dist.new_group`` is collective over the *whole world*: every rank creates every
    group, in the same order -- the inside groups of the reduce-scatter (machine 0, 1, ...),
    the rail groups of the collect (rail 0, 1, ...), of the diffuse, then the inside groups
    of the all-gather. For the world that happens on the first call. A subgroup is called
    by its members only, so:

    * when one tier has a single rank (D = 1 or M = 1), the stages of the other tier run on
      the subgroup itself -- its members are exactly the stage's members;
    * otherwise every rank of the world must create the groups first, together:
      ``stage_groups(layout, ranks=[...])`` on every rank (non-members get ``None``).

    ``name`` asks for a set of groups of its own: the asynchronous all-reduce
    (:mod:`.inflight`) issues its stages from threads of its own, so it must not share a
    group with calls the caller makes meanwhile (one group's operations match in the
    order they are issued, and two threads would interleave them differently on each rank).
    """
    if ranks is None:
        ranks = _ranks(group)
        world = group is None or group is dist.GroupMember.WORLD
    else:
        world, group = True, None          # called by every rank of the world, to prepare
        ranks = list(ranks)
    default = dist.distributed_c10d._get_default_group()
    key = (id(default), tuple(ranks), layout.D, layout.M, name)
    if key in _cache:
        return _cache[key]
    me = ranks.index(dist.get_rank()) if dist.get_rank() in ranks else None
    D, M = layout.D, layout.M
    if not world and D > 1 and M > 1:
        raise ValueError(f"hierarchical all-reduce on the subgroup {ranks} with layout (D={D}, M={M}): "
                         "its stage groups must be created by every rank of the world first: "
                         f"call collectives.hierarchical.stage_groups(Layout({D}, {M}), ranks={ranks}) "
                         "on every rank")
    groups = None if me is None else StageGroups(layout, layout.local(me), layout.machine(me), ranks)
    plan = [("reduce_scatter", [ranks[m * D:(m + 1) * D] for m in range(M)], D > 1),
            ("collect", [ranks[d::D] for d in range(D)], M > 1),
            ("diffuse", [ranks[d::D] for d in range(D)], M > 1),
            ("all_gather", [ranks[m * D:(m + 1) * D] for m in range(M)], D > 1)]
    with trace.paused():
        for stage, member_lists, needed in plan:
            if not needed:
                continue
            for members in member_lists:
                pg = dist.new_group(members) if world else group   # a subgroup: one tier only
                if groups is not None and dist.get_rank() in members:
                    setattr(groups, stage, pg)
    if groups is not None:
        _cache[key] = groups
    return groups


# ---------------------------------------------------------------------------------------
# Bytes by tier, read from a trace: what the tests and the lab check the pattern with.

def bytes_put_on_the_wire(event, world_size: int) -> float:
    """Bytes this rank sends in ``event``, counted as the textbook algorithm sends them.

    A message: its size. A collective over g ranks whose whole extent is F bytes (what is
    reduce-scattered, all-gathered or exchanged all-to-all): (g − 1)/g·F -- the least any
    algorithm sends, and what a ring or a direct exchange sends. An all-reduce: twice that.
    A reduce: its tensor from every rank but the root; a broadcast: g − 1 copies from the root.
    """
    if event.is_send:
        return float(event.nbytes)
    if event.is_recv:
        return 0.0
    g = len(event.group) if event.group else world_size
    if g <= 1:
        return 0.0
    n = float(event.nbytes)
    kind = event.kind
    if kind in ("reduce_scatter_tensor", "all_to_all_single", "reduce_scatter", "all_to_all"):
        return (g - 1) / g * n
    if kind in ("all_gather_into_tensor", "all_gather"):
        return (g - 1) * n                     # the trace records this rank's part
    if kind == "all_reduce":
        return 2 * (g - 1) / g * n
    if kind == "reduce":
        return 0.0 if event.peer == event.rank else n
    if kind == "broadcast":
        return (g - 1) * n if event.peer == event.rank else 0.0
    return 0.0


def bytes_by_tier(events, machine_of, world_size: int) -> dict[str, float]:
    """``{"inside": ..., "across": ..., "mixed": ...}``: bytes one rank sent, by where they went.

    ``machine_of(global_rank)`` says which machine a rank is on. A message goes *inside*
    when its peer shares the sender's machine, *across* otherwise. A collective counts as
    inside when all its ranks share one machine, across when each is on a different one,
    and *mixed* otherwise (a flat collective over several ranks of several machines: its
    bytes cannot be told apart from the trace; a hierarchical algorithm has none).
    """
    out = {"inside": 0.0, "across": 0.0, "mixed": 0.0}
    for e in events:
        sent = bytes_put_on_the_wire(e, world_size)
        if not sent:
            continue
        if e.is_send:
            tier = "inside" if machine_of(e.peer) == machine_of(e.rank) else "across"
        else:
            members = e.group if e.group else tuple(range(world_size))
            machines = [machine_of(r) for r in members]
            if len(set(machines)) == 1:
                tier = "inside"
            elif len(set(machines)) == len(machines):
                tier = "across"
            else:
                tier = "mixed"
        out[tier] += sent
    return out


def tier_bytes(events, groups: StageGroups, world_size: int) -> dict[str, float]:
    """:func:`bytes_by_tier` for one rank of a hierarchical layout, plus ``"off_rail"``: bytes
    sent across machines to ranks that are not on this rank's rail (a hierarchical
    all-reduce sends none: its cross-machine stages run on the rail)."""
    out = bytes_by_tier(events, groups.machine_of, world_size)
    rail = set(groups.rail_ranks())
    out["off_rail"] = 0.0
    for e in events:
        sent = bytes_put_on_the_wire(e, world_size)
        if not sent:
            continue
        if e.is_send:
            off = groups.machine_of(e.peer) != groups.m and e.peer not in rail
        else:
            members = set(e.group) if e.group else set(range(world_size))
            machines = {groups.machine_of(r) for r in members}
            off = len(machines) > 1 and not members <= rail
        out["off_rail"] += sent if off else 0.0
    return out


# ---------------------------------------------------------------------------------------
# The checks every all-reduce of this lesson starts with.

def checked_layout(tensor, op, group, layout, what: str, **agree) -> Layout | None:
    """Check the arguments, resolve the layout, and in check mode compare them across ranks;
    return the :class:`Layout`, or None on a rank outside ``group`` (nothing to do).

    The local checks come first (:func:`collectives.core.ops.check_all_reduce_args`: a
    tensor, an op it supports; :func:`check_layout`), so every rank raises the same error
    before anything is sent. Then, in check mode, the ranks compare the call -- elements,
    dtype, op, group -- and what else must agree: the layout (ranks that read (2, 2) and
    (4, 1) would build different groups and wait for each other forever) and ``agree``
    (the slice size). The comparison goes through the store, after the layout is known.
    """
    if not ops.check_all_reduce_args(tensor, op, group, what=what, compare=False):
        return None
    shape = resolve(layout, group)
    if ops.check_mode():
        ops.check_all_reduce_args(tensor, op, group, what=what,
                                  agree={"layout": (shape.D, shape.M), **agree})
    return shape
