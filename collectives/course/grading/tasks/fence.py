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

Sends and receives do not go through gloo: they travel through the grading process itself
(:mod:`collectives.core.relay`), which writes down every message from the bytes that crossed,
where no rank can reach. The rank's own record of its sends is held against that list
(:func:`relay_problems`): a send recorded but never carried -- a record forged, even with the
probe's signed sender found on the stack -- or a message carried but not recorded fails the
task. Data moved any other way (files, a gloo backend of the rank's own built from the store)
carries no message the judge counts.

On GPUs (``GPU_BACKEND``, the runner's ``--backend nccl``) the fence is the same group:
sends and receives of GPU tensors travel through the grading process too, through host
memory (:mod:`collectives.core.relay` says in which stream order), so the evidence is the
same as on CPU; the collectives a task allows run on GPU tensors through an NCCL backend the
group keeps, on CPU tensors through its gloo backend. A world may have more ranks than the
machine has GPUs (ranks share them; messages do not need NCCL): there a collective on GPU
tensors runs on gloo, on host copies written back before the call returns.

Each call is recorded (a :class:`~collectives.course.grading.tasks.tap.Call`, stamped with a
clock taken when this module was imported, before any student's code) on the rank's signed
stream, then either handed to the relay or the gloo backend, or refused: the task's :data:`ROUTES` say
which calls its world offers (``P2P``: sends and receives, what ``batch_isend_irecv`` and
the course's helpers are built from). Whatever the rank does to the routes in its own
memory, the judge holds every recorded call against the task's routes
(:func:`outside_routes`), so a call the task does not allow scores 0 whether it was
refused or not.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ....core import relay

BACKEND = "graded"
GPU_BACKEND = f"cpu:{BACKEND},cuda:{BACKEND}"
"""A graded world on GPUs: the same fenced group for both devices (the ``cuda:`` in it is
what makes ``ops.rank_device()`` answer the rank's GPU)."""
P2P = frozenset({"send", "recv", "recv_anysource"})
"""The routes of a task built from messages: sends and receives (``dist.send``, ``isend``,
``batch_isend_irecv``, the course's helpers), nothing else."""
ANY = None
"""Every route (the library's collectives included): each call is still recorded."""

_Backend = torch._C._distributed_c10d.Backend
_Gloo = torch._C._distributed_c10d.ProcessGroupGloo
_Nccl = getattr(torch._C._distributed_c10d, "ProcessGroupNCCL", None)
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
        self._store, self._timeout = store, timeout
        self._nccl = None                 # made for the first collective on GPU tensors
        self._made_nccl = 0
        self._seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
        self._channel: tuple | None = None
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
        if name in ("send", "recv", "recv_anysource") and relay.available():
            return self._relayed(name, args, kwargs, sink)
        if sink is not None:
            sink(record_call(_kind(name), self, args, _clock(), name in ("send", "recv")))
        routes = _state["routes"]
        if routes is not None and _kind(name) not in routes:
            raise RuntimeError(f"{name} is not offered in this world: this task is built from "
                               f"{', '.join(sorted(routes))} alone")
        original = _ORIGINAL.get(_SAME_AS.get(name, name))
        if original is None:
            raise RuntimeError(f"{name} is not offered in a graded world")
        on_gpu = any(t.is_cuda for t in _flat(args))
        if on_gpu and _Nccl is not None and torch.cuda.device_count() >= dist.get_world_size():
            self._made_nccl += 1
            return original(self._gpu_backend(), *args, **kwargs)
        self._made += 1
        if on_gpu:                      # ranks share GPUs: NCCL cannot run here
            return _staged(original, self._gloo, args, kwargs)
        return original(self._gloo, *args, **kwargs)

    def _gpu_backend(self):
        """The NCCL backend under this group, made the first time a collective gets GPU tensors."""
        if self._nccl is None:
            options = _Nccl.Options()
            options._timeout = self._timeout
            self._nccl = _Nccl(dist.PrefixStore("nccl", self._store), self.rank(), self.size(), options)
        return self._nccl

    def _relayed(self, name: str, args: tuple, kwargs: dict, sink):
        """A send or receive through the launcher (:mod:`collectives.core.relay`), which writes
        down every message itself: the judge holds the rank's record of its sends against it."""
        from .tap import record_call
        given = dict(zip(("tensors", "tag") if name == "recv_anysource" else ("tensors", "peer", "tag"), args))
        tensors, peer, tag = given.get("tensors"), given.get("peer"), given.get("tag", kwargs.get("tag", 0))
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1 or not isinstance(tensors[0], torch.Tensor):
            raise ValueError(f"{name} takes a list of one tensor")
        tensor = tensors[0]
        if tensor.layout != torch.strided or not tensor.is_contiguous() or tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name}: the tensor must be a dense, contiguous CPU or GPU tensor")
        ranks = self._ranks()
        if name != "recv_anysource" and not (type(peer) is int and 0 <= peer < len(ranks)):
            raise ValueError(f"{name}: no rank {peer!r} in a group of {len(ranks)}")
        if name == "send":
            with _SENDING:          # recorded and carried in one order, whatever threads send
                if sink is not None:
                    sink(record_call("send", self, args, _clock(), True))
                return relay.send(tensor, ranks[peer], int(tag), self._channel, self._seconds)
        if sink is not None:
            sink(record_call("recv", self, args, _clock(), name == "recv"))
        return relay.recv(tensor, None if name == "recv_anysource" else ranks[peer], int(tag), self._channel,
                          self._seconds, ranks.index)

    def _ranks(self) -> list[int]:
        """The group's global ranks; its channel on the relay: those ranks and how many groups
        of the same ranks this rank made before it (every member makes them in one order)."""
        if self._channel is None:
            made: dict[tuple, int] = {}
            for group in _GROUPS[:_GROUPS.index(self) + 1]:       # in the order this rank made them
                ranks = tuple(dist.get_process_group_ranks(group))
                group._channel = (ranks, made.get(ranks, 0))
                made[ranks] = made.get(ranks, 0) + 1
        return list(self._channel[0])

    def audit(self) -> None:
        """Record the operations the gloo backend ran that this group did not hand it (gloo
        counts every operation it runs): code that reached round the fence."""
        count = _ORIGINAL["_get_sequence_number_for_group"]
        ran = count(self._gloo)
        ran_nccl = count(self._nccl) if self._nccl is not None else 0
        extra = max(0, ran - self._made) + max(0, ran_nccl - self._made_nccl)    # each backend on its own
        if extra > 0 and _state["sink"] is not None:
            from .tap import Call
            _state["sink"](Call("backend.operations behind the process group", None, extra, "", 0.0,
                                0.0, (), "", _clock()))
        self._made, self._made_nccl = ran, ran_nccl


def _flat(args: tuple) -> list[torch.Tensor]:
    """The tensors among a call's arguments (in lists, and lists of lists)."""
    out: list[torch.Tensor] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            out.append(arg)
        elif isinstance(arg, (list, tuple)):
            out += _flat(tuple(arg))
    return out


def _staged(original, gloo, args: tuple, kwargs: dict) -> dist.Work:
    """A collective on GPU tensors run by gloo on host copies of them (a world whose ranks
    share GPUs), waited on here; the copies of its outputs (every method's first argument,
    the in-place ones' too) are written back into their GPU tensors before the call returns,
    so the work it returns is complete. Only the outputs: an input may overlap an output (a
    reduce-scatter in place), and its old values would overwrite the result."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def host(arg, output: bool):
        if isinstance(arg, torch.Tensor) and arg.is_cuda:
            copy = arg.detach().cpu()
            if output:
                pairs.append((arg, copy))
            return copy
        return type(arg)(host(a, output) for a in arg) if isinstance(arg, (list, tuple)) else arg

    work = original(gloo, *(host(a, i == 0) for i, a in enumerate(args)), **kwargs)
    work.wait()
    back = {id(copy): gpu for gpu, copy in pairs}
    for gpu, copy in pairs:
        gpu.copy_(copy)
    try:
        value = work.get_future().value()
    except RuntimeError:           # a work without a future: what it returns has no value either
        value = []
    return _Done([back.get(id(t), t) for t in value] if isinstance(value, list) else value)


class _Done(dist.Work):
    """A finished collective's work (:func:`_staged`)."""

    def __init__(self, value):
        super().__init__()
        self._value = value

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self._value)
        return future


_GROUPS: list[FencedGroup] = []
_SENDING = threading.Lock()


def audit() -> None:
    """:meth:`FencedGroup.audit` on every group of this rank (at the end of each case)."""
    for group in _GROUPS:
        group.audit()


def relay_problems(stream: list[Any], carried: list[tuple], rank: int) -> list[str]:
    """A rank's record of its sends held against the messages the launching process carried
    for it (``launch.World.relayed``: destination, dtype, numel, fingerprint, in order): a
    send recorded but never carried was forged on the record; a message carried but never
    recorded went round the process group."""
    from .tap import Call
    sent = [c for c in stream if isinstance(c, Call) and c.kind == "send"]
    for i, (c, m) in enumerate(itertools.zip_longest(sent, carried)):
        if c is None:
            return [f"rank {rank}: message {i + 1} it sent (to rank {m[0]}, {m[2]} × {m[1]}) is missing from "
                    "its record: it went round the process group"]
        if m is None:
            return [f"rank {rank}: send {i + 1} of its record (to rank {c.peer}) never crossed: "
                    "the record is not evidence"]
        if (c.peer, c.dtype, c.numel) != tuple(m[:3]) or m[3] is None or not _same_print(c.fingerprint, *m[3]):
            return [f"rank {rank}: send {i + 1} of its record (to rank {c.peer}, {c.numel} × {c.dtype}) is not "
                    f"what crossed (to rank {m[0]}, {m[2]} × {m[1]}, other contents): the record is not evidence"]
    return []


def _same_print(recorded, crossed: float, scale: float) -> bool:
    """The fingerprint a rank recorded against the one the relay computed (the same function,
    summed in another process: equal to rounding at the message's own scale)."""
    if type(recorded) not in (float, int):
        return False
    if recorded == crossed or (recorded != recorded and crossed != crossed):
        return True
    return math.isfinite(recorded) and math.isfinite(crossed) and abs(recorded - crossed) <= 1e-9 * max(1.0, scale)


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
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
