"""The grader's record of every message a rank makes, taken where ``torch.distributed``
hands it to the process group.

:mod:`collectives.core.trace` wraps the public functions (``dist.isend``, ...), which is
what students and lessons read; code can step round it (``trace.paused()``, or calling
``group.allreduce`` itself). The tap wraps the methods underneath, on the classes:

* ``ProcessGroup``'s sends, receives and collectives -- every public function ends there;
* ``Backend``'s -- the object ``group._get_backend(device)`` returns, one level lower;
* ``Store``'s -- the rendezvous store, a channel between ranks that carries no message.

It is installed in a graded rank before the student's module is imported and never
switched off. Each call is written at once to the rank's stream to the grading process
(the signed sender of :func:`collectives.core.channels.recorder`), so what was recorded
cannot be edited or withdrawn afterwards, and what the rank writes there by other means is
read as forged. In the grader's own worlds the process group is the fence
(:mod:`~collectives.course.grading.tasks.fence`), which records the group's calls itself;
the tap then sees the gloo backend under it and the store.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

_PG = dist.ProcessGroup
_BACKEND = torch._C._distributed_c10d.Backend
_STORE = dist.Store

SENDS = ("send",)
RECVS = ("recv", "recv_anysource")
COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single",
    "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
    "all_to_all_single", "gather", "scatter", "barrier", "monitored_barrier",
)
STORE_METHODS = ("set", "get", "add", "compare_set", "wait", "check", "multi_get", "multi_set",
                 "append", "delete_key", "queue_push", "queue_pop", "list_keys")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_clock = time.perf_counter      # taken at import, before any student's code


class Call(NamedTuple):
    """One call that reached a process group (or its backend, or the store)."""

    kind: str                 # "send", "recv", a collective ("allreduce"...), "backend.<m>", "store.<m>"
    peer: int | None          # global rank of a send's or receive's peer
    numel: int                # elements in the call's tensors (its first argument)
    dtype: str
    weight: float             # sum of |x| of what a send carried (0 for everything else)
    fingerprint: float        # an order-sensitive sum of what a send carried
    ranks: tuple[int, ...]    # the group's global ranks (() when unknown)
    caller: str = ""          # store calls: the file that made the call
    t: float = 0.0            # process-group calls: time.perf_counter() when the call reached it


def fingerprint(values: torch.Tensor) -> float:
    """The same for the same elements in the same order (and rarely otherwise)."""
    v = values.detach().reshape(-1).to("cpu", torch.float64)
    if not v.numel():
        return 0.0
    return float((torch.nan_to_num(v) * torch.arange(1, v.numel() + 1, dtype=torch.float64).sin_()).sum())


def digest(values: torch.Tensor) -> tuple[float, float]:
    """What the relay writes down of a message (``launch.run_world(relay=digest)``): its
    :func:`fingerprint`, and the sum of its finite magnitudes, the scale the fingerprint is
    compared at."""
    v = values.detach().reshape(-1).to("cpu", torch.float64)
    return fingerprint(v), float(v.nan_to_num(0.0, 0.0, 0.0).abs().sum())


def _tensors(arg) -> list[torch.Tensor]:
    items = arg if isinstance(arg, (list, tuple)) else [arg]
    out = []
    for item in items:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            out += [t for t in item if isinstance(t, torch.Tensor)]
    return out


def _group_ranks(pg) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - a group this rank cannot map (a backend, say)
        return ()


class Tap:
    """Wraps the methods once per process; every call goes to ``sink`` (see the module doc)."""

    def __init__(self, sink: Callable[[Any], None]):
        self.sink = sink
        self.wrapped: dict[tuple[type, str], Any] = {}

    def install(self) -> "Tap":
        for name in SENDS + RECVS + COLLECTIVES:
            self._wrap(_PG, name, self._pg_call)
            self._wrap(_BACKEND, name, self._backend_call)
        for name in STORE_METHODS:
            self._wrap(_STORE, name, self._store_call)
        return self

    def intact(self) -> bool:
        """False when something replaced the wrapped methods after :meth:`install`."""
        return all(getattr(cls, name, None) is w for (cls, name), w in self.wrapped.items())

    def _wrap(self, cls, name, record) -> None:
        original = getattr(cls, name, None)
        if original is None:
            return

        def wrapper(obj, *args, **kwargs):
            record(name, obj, args)
            return original(obj, *args, **kwargs)

        wrapper.__name__ = name
        setattr(cls, name, wrapper)
        self.wrapped[(cls, name)] = wrapper

    def _pg_call(self, name, pg, args) -> None:
        kind = "send" if name in SENDS else "recv" if name in RECVS else name
        self.sink(record_call(kind, pg, args, _clock(), name in ("send", "recv")))

    def _backend_call(self, name, backend, args) -> None:
        flat = _tensors(args[0]) if args else []
        self.sink(Call(f"backend.{name}", None, sum(t.numel() for t in flat), "", 0.0, 0.0, ()))

    def _store_call(self, name, store, args) -> None:
        caller = sys._getframe(2).f_code.co_filename
        if caller.startswith(_TORCH_DIR):
            return                     # torch's own bookkeeping (new_group, init)
        self.sink(Call(f"store.{name}", None, 0, "", 0.0, 0.0, (), caller))


def record_call(kind: str, pg, args: tuple, at: float, has_peer: bool) -> Call:
    """The record of one call that reached process group ``pg`` (``kind``: "send", "recv" or
    the collective's name) with ``args``, at time ``at``: its size and dtype, its peer's
    global rank (``has_peer``: ``args[1]`` is the peer's rank in the group), and for a send
    what it carried (weight and fingerprint)."""
    flat = _tensors(args[0]) if args else []
    numel = sum(t.numel() for t in flat)
    dtype = str(flat[0].dtype).replace("torch.", "") if flat else ""
    ranks = _group_ranks(pg)
    peer, weight, print_ = None, 0.0, 0.0
    if has_peer:
        local = args[1] if len(args) > 1 else None
        peer = ranks[local] if ranks and isinstance(local, int) and 0 <= local < len(ranks) else local
    if kind == "send" and flat:
        weight = float(sum(t.detach().to("cpu", torch.float64).abs().nan_to_num().sum() for t in flat))
        print_ = sum(fingerprint(t) for t in flat)
    return Call(kind, peer, numel, dtype, weight, print_, ranks, "", at)


_installed: Tap | None = None


def install(sink: Callable[[Any], None]) -> Tap:
    """The rank's tap, installed once (a second call only changes where calls go)."""
    global _installed
    if _installed is None:
        _installed = Tap(sink).install()
    else:
        _installed.sink = sink
    return _installed
