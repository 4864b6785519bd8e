"""The process group of a graded world: it offers what the task allows, and records every call.

A graded world on CPU is started with the backend ``"graded"`` (registered here, in the
grading process, before its ranks are forked). Its process groups -- the default one and
every group ``dist.new_group`` makes -- are fenced groups (:class:`FencedGroup`): a Python
process group round a gloo backend of its own. Every route to a collective ends at one of its methods:

* the public functions (``dist.all_reduce``, ``dist.send``, ...) and the group's methods
  (``group.allreduce``, ``group.alltoall_base``, ...) are its methods;
* the functional collectives (``torch.ops._c10d_functional.*``, ``torch.distributed.
  _functional_collectives``), the ``torch.ops.c10d.*`` operators and C++ callers such as
  DDP's reducer call the group through its C++ side, which calls these methods back, or
  finds no backend under the group and fails;
* ``ProcessGroup``'s own methods, taken from anywhere, call these methods back too.

Each call is recorded (a :class:`~collectives.course.grading.tasks.tap.Call`, stamped with a
clock taken when this module was imported, before any student's code) on the rank's signed
stream, then either handed to the gloo backend or refused: the task's :data:`ROUTES` say
which calls its world offers (``P2P``: sends and receives, what ``batch_isend_irecv`` and
the course's helpers are built from). Whatever the rank does to the routes in its own
memory, the judge holds every recorded call against the task's routes
(:func:`outside_routes`), so a call the task does not allow scores 0 whether it was
refused or not.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

BACKEND = "graded"
P2P = frozenset({"send", "recv", "recv_anysource"})
"""The routes of a task built from messages: sends and receives (``dist.send``, ``isend``,
``batch_isend_irecv``, the course's helpers), nothing else."""
ANY = None
"""Every route (the library's collectives included): each call is still recorded."""

_Backend = torch._C._distributed_c10d.Backend
_Gloo = torch._C._distributed_c10d.ProcessGroupGloo
_ORIGINAL = {name: getattr(_Backend, name) for name in dir(_Backend)
             if not name.startswith("__") and callable(getattr(_Backend, name))}
_clock = time.perf_counter      # taken at import, before any student's code
_state: dict[str, Any] = {"sink": None, "routes": ANY}


def configure(sink: Callable[[Any], None] | None, routes: frozenset | None) -> None:
    """In a rank, before the student's code: where calls are recorded, and what is offered."""
    _state["sink"], _state["routes"] = sink, routes


def _kind(name: str) -> str:
    return "send" if name == "send" else "recv" if name in ("recv", "recv_anysource") else name


def outside_routes(kinds, routes: frozenset | None) -> list[str]:
    """The recorded kinds of call (``Call.kind``) a task with ``routes`` does not allow."""
    if routes is None:
        return []
    return sorted({k for k in kinds if not k.startswith(("store.", "backend.")) and k not in routes
                   and k != "divide" and k != "hook"})


class FencedGroup(dist.ProcessGroup):
    """A graded world's process group (see the module doc)."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = _Gloo(store, rank, size, timeout)
        self._made = 0                    # operations this group handed to its gloo backend
        _GROUPS.append(self)

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        """A fenced group has no backend under it for the functional collectives to find by
        its name: asking for the name is how they start, so the error names them."""
        routes = _state["routes"]
        offered = (f"this task is built from {', '.join(sorted(routes))} alone" if routes is not None
                   else "call the torch.distributed functions instead")
        raise RuntimeError("functional collectives (torch.ops._c10d_functional, torch.distributed."
                           f"_functional_collectives) are not offered in a graded world: {offered}")

    def _call(self, name: str, args: tuple, kwargs: dict):
        from .tap import record_call
        sink = _state["sink"]
        self.audit()
        if sink is not None:
            sink(record_call(_kind(name), self, args, _clock(), name in ("send", "recv")))
        routes = _state["routes"]
        if routes is not None and _kind(name) not in routes:
            raise RuntimeError(f"{name} is not offered in this world: this task is built from "
                               f"{', '.join(sorted(routes))} alone")
        original = _ORIGINAL.get(_SAME_AS.get(name, name))
        if original is None:
            raise RuntimeError(f"{name} is not offered in a graded world")
        self._made += 1
        return original(self._gloo, *args, **kwargs)

    def audit(self) -> None:
        """Record the operations the gloo backend ran that this group did not hand it (gloo
        counts every operation it runs): code that reached round the fence."""
        ran = _ORIGINAL["_get_sequence_number_for_group"](self._gloo)
        if ran > self._made and _state["sink"] is not None:
            from .tap import Call
            _state["sink"](Call("backend.operations behind the process group", None, ran - self._made, "", 0.0,
                                0.0, (), "", _clock()))
        self._made = ran


_GROUPS: list[FencedGroup] = []


def audit() -> None:
    """:meth:`FencedGroup.audit` on every group of this rank (at the end of each case)."""
    for group in _GROUPS:
        group.audit()


_SAME_AS = {"all_to_all_single": "alltoall_base", "all_gather_single": "_allgather_base",
            "reduce_scatter_single": "_reduce_scatter_base"}
"""The group's methods the backend names otherwise (same arguments)."""


def _method(name: str):
    def method(self, *args, **kwargs):
        return self._call(name, args, kwargs)
    method.__name__ = name
    return method


OPERATIONS = ("send", "recv", "recv_anysource", "allreduce", "allreduce_coalesced", "broadcast", "reduce",
              "allgather", "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced",
              "all_gather_single", "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base",
              "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
              "alltoall", "alltoall_base", "all_to_all_single", "gather", "scatter", "barrier",
              "monitored_barrier")
for _name in OPERATIONS:
    setattr(FencedGroup, _name, _method(_name))


def _create(store, rank, size, timeout):
    return FencedGroup(store, rank, size, timeout)


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
