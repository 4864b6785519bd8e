"""What the trace records: the :class:`Event` of one call and a rank's :class:`Trace` of them.

Plain data, with no state of its own: an :class:`Event` says what a call was (kind), with
whom (peer, a global rank), how much (elements, bytes), in which order (seq) and when (t0,
t1); a :class:`Trace` is a rank's ordered list of them with the questions tests ask
(``sends()``, ``bytes_sent()``, ...), and :func:`step_table` lines every rank's sends up
into steps. Beside them, how a call's arguments become an event's fields -- its peer as a
global rank, its size, its name ("recv from rank 0").

The events are made by the wrappers of :mod:`collectives.core.trace`, which re-exports every
public name here (``trace.Event``, ``trace.Trace``, ``trace.step_table``, ...).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

POINT_TO_POINT = ("send", "recv", "isend", "irecv")
COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier",
)
SENDS = ("send", "isend")
RECVS = ("recv", "irecv")


@dataclass
class Event:
    """One message or collective call, seen from the rank that made it."""

    seq: int                 # order of the call on this rank, from 0
    kind: str                # "isend", "recv", "all_reduce", ...
    rank: int                # the rank that made the call (global)
    peer: int | None         # the other end of a message (global rank); root of a rooted collective
    numel: int               # elements in the tensor(s) of the call
    nbytes: int              # bytes in the tensor(s) of the call
    dtype: str
    t0: float                # perf_counter when the call was made
    t1: float | None = None  # when it completed (wait() returned); None while in flight
    group: tuple[int, ...] | None = None  # global ranks of the group; None for the world
    tag: int = 0
    label: str = ""          # free text set by trace.label(...) around the call

    @property
    def is_send(self) -> bool:
        return self.kind in SENDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECVS

    @property
    def seconds(self) -> float | None:
        return None if self.t1 is None else self.t1 - self.t0


@dataclass
class Trace:
    """An ordered list of :class:`Event` with the questions tests ask of it."""

    rank: int = -1
    events: list[Event] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def of_kind(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e.kind in kinds]

    def sends(self) -> list[Event]:
        """Messages this rank sent (``send`` and ``isend``), in order."""
        return [e for e in self.events if e.is_send]

    def recvs(self) -> list[Event]:
        """Messages this rank received (``recv`` and ``irecv``), in order."""
        return [e for e in self.events if e.is_recv]

    def collectives(self) -> list[Event]:
        return [e for e in self.events if e.kind in COLLECTIVES]

    def bytes_sent(self) -> int:
        return sum(e.nbytes for e in self.sends())

    def bytes_received(self) -> int:
        return sum(e.nbytes for e in self.recvs())

    def peers_sent_to(self) -> set[int]:
        return {e.peer for e in self.sends()}

    def to_dicts(self) -> list[dict[str, Any]]:
        """Plain dicts: cheap to pickle back to the launcher, a notebook or a plot."""
        return [asdict(e) for e in self.events]

    @classmethod
    def from_dicts(cls, rank: int, rows: list[dict[str, Any]]) -> "Trace":
        return cls(rank, [Event(**r) for r in rows])


def _group_ranks(group) -> tuple[int, ...] | None:
    if group is None or group is c10d.GroupMember.WORLD:
        return None
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # pragma: no cover - a group this rank is not part of
        return None


def _global_peer(group, peer: int | None, group_peer: int | None) -> int | None:
    if peer is not None:
        return peer
    if group_peer is None:
        return None
    if group is None or group is c10d.GroupMember.WORLD:
        return group_peer
    return dist.get_global_rank(group, group_peer)


def _size(tensors) -> tuple[int, int, str]:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    flat = [t for t in tensors if isinstance(t, torch.Tensor)]
    numel = sum(t.numel() for t in flat)
    nbytes = sum(t.numel() * t.element_size() for t in flat)
    dtype = str(flat[0].dtype).replace("torch.", "") if flat else ""
    return numel, nbytes, dtype


def _describe(kind: str, peer: int | None) -> str:
    if kind in SENDS:
        return f"{kind} to rank {peer}"
    if kind in RECVS:
        return f"{kind} from rank {peer}"
    return kind if peer is None else f"{kind} (root rank {peer})"


# For each collective: the argument whose tensor(s) this rank contributes, and the
# arguments that name a root (global rank, then group rank), if it has one.
_COLLECTIVE_ARGS = {
    "all_reduce": ("tensor", None, None),
    "broadcast": ("tensor", "src", "group_src"),
    "reduce": ("tensor", "dst", "group_dst"),
    "all_gather": ("tensor", None, None),
    "all_gather_into_tensor": ("input_tensor", None, None),
    "gather": ("tensor", "dst", "group_dst"),
    "scatter": ("tensor", "src", "group_src"),
    "reduce_scatter": ("input_list", None, None),
    "reduce_scatter_tensor": ("input", None, None),
    "all_to_all": ("input_tensor_list", None, None),
    "all_to_all_single": ("input", None, None),
    "barrier": (None, None, None),
}


def step_table(traces: list[Trace]) -> list[list[tuple[int, int, int]]]:
    """Group every rank's sends into steps: step k holds each rank's k-th send.

    Returns ``steps[k] = [(src, dst, numel), ...]`` -- the input a step diagram needs.
    """
    per_rank = [t.sends() for t in traces]
    n_steps = max((len(s) for s in per_rank), default=0)
    return [[(e.rank, e.peer, e.numel) for s in per_rank if k < len(s) for e in [s[k]]]
            for k in range(n_steps)]
