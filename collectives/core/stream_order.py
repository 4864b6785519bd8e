"""Checking on CPU the order a GPU would impose: stand-in streams and events that keep count.

:func:`checking` (re-exported by :mod:`collectives.core.streams`, where lessons use it) makes
the CPU stand-ins behave like a GPU's queues: each stream a clock, events carrying them,
every tensor read and write attributed to the stream it was issued on, and every
communication on a stream of its own (as NCCL runs it), which waits for the issuing stream
and is joined by waiting on its work. Work that touches memory another stream touched with
no event or wait ordering the two, and a wait on an event never recorded, are reported.
Without :func:`checking`, :class:`NullStream` and :class:`NullEvent` do nothing: on CPU every
operation already ran when it returns.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


class NullStream:
    """A CPU stand-in for ``torch.cuda.Stream``: work is already done when issued."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class NullEvent:
    """A CPU stand-in for ``torch.cuda.Event``."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True



class OrderingError(AssertionError):
    """Work on one stream touched memory another stream used, with nothing ordering the two."""


class CheckedStream(NullStream):
    """A CPU stand-in stream that keeps a vector clock: ``clock[s]`` is the last step of
    stream ``s`` known to have happened before what this stream issues next."""

    def __init__(self, checker: "Checker", name: str):
        self.checker, self.name = checker, name
        self.id = next(checker.ids)
        self.clock: dict[int, int] = {self.id: 0}

    def tick(self) -> int:
        self.clock[self.id] += 1
        return self.clock[self.id]

    def join(self, clock: dict[int, int]) -> None:
        for sid, t in clock.items():
            if self.clock.get(sid, 0) < t:
                self.clock[sid] = t

    def wait_stream(self, other) -> None:
        if isinstance(other, CheckedStream):
            self.join(other.clock)

    def wait_event(self, event) -> None:
        if isinstance(event, CheckedEvent):
            if event.clock is None:
                self.checker.report(f"{self.name} waits on event {event.name}, which was never "
                                    "recorded: the wait orders nothing")
            else:
                self.join(event.clock)

    def record_event(self, event=None):
        event = event or CheckedEvent(self.checker, None)
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"CheckedStream({self.name!r})"


class CheckedEvent(NullEvent):
    """A CPU stand-in event: holds the clock of the stream it was last recorded on."""

    def __init__(self, checker: "Checker", name: str | None):
        self.checker = checker
        self.name = name or f"#{next(checker.ids)}"
        self.clock: dict[int, int] | None = None

    def record(self, stream=None) -> None:
        stream = stream if isinstance(stream, CheckedStream) else self.checker.current
        self.clock = dict(stream.clock)

    def wait(self, stream=None) -> None:
        (stream if isinstance(stream, CheckedStream) else self.checker.current).wait_event(self)


@dataclass
class _Access:
    stream: CheckedStream
    tick: int
    write: bool
    start: int                      # bytes, in the storage
    end: int
    what: str


class _CheckedWork:
    """A collective's Work: ``wait()`` makes the current stream wait for the collective."""

    def __init__(self, work, stream: CheckedStream, checker: "Checker"):
        self._work, self._stream, self._checker = work, stream, checker

    def wait(self, *args, **kwargs):
        self._checker.current.join(self._stream.clock)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _verb(what: str, write: bool, past: bool) -> str:
    if what == "all_reduce":
        return "reduced" if past else "reduces"
    if what in ("reduce_scatter_tensor", "all_gather_into_tensor") and write:
        return "wrote the result into" if past else "writes its result into"
    if what in ("irecv", "recv") or (what.startswith("batch") and write):
        return "received into" if past else "receives into"
    if what in ("isend", "send") or (what.startswith("batch") and not write):
        return "sent from" if past else "sends from"
    if write:
        return "wrote" if past else "writes"
    return "read" if past else "reads"


class _Verbs:
    def __init__(self, past: bool):
        self.past = past

    def __getitem__(self, key) -> str:
        return _verb(*key, self.past)


_VERB, _PAST = _Verbs(False), _Verbs(True)


class Checker:
    """What :func:`checking` yields: the streams' clocks, the memory each touched, and
    ``violations``, one line each."""

    _HISTORY = 64                   # accesses kept per storage

    def __init__(self):
        self.ids = itertools.count(1)
        self.violations: list[str] = []
        self.caller = CheckedStream(self, "the caller's stream")
        self._stack: list[CheckedStream] = [self.caller]
        self._names = itertools.count(1)
        self._collectives = itertools.count(1)
        self._memory: dict[int, list[_Access]] = {}
        self._passing = 0               # > 0 inside a communication: its inner calls pass through

    @property
    def current(self) -> CheckedStream:
        return self._stack[-1]

    def new_stream(self, name: str | None) -> CheckedStream:
        return CheckedStream(self, name or f"side stream {next(self._names)}")

    @contextlib.contextmanager
    def using(self, stream: CheckedStream):
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def report(self, line: str) -> None:
        if line not in self.violations:
            self.violations.append(line)

    def touch(self, tensor: torch.Tensor, write: bool, what: str, stream=None) -> None:
        """Note that ``stream`` (the current one) reads or writes ``tensor``'s memory now."""
        if (not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu"
                or tensor.layout != torch.strided or tensor.numel() == 0):
            return
        stream = stream or self.current
        size = tensor.element_size()
        start = tensor.storage_offset() * size
        extent = 1 + sum((n - 1) * abs(st) for n, st in zip(tensor.shape, tensor.stride()))
        end = start + extent * size
        key = tensor.untyped_storage().data_ptr()
        history = self._memory.setdefault(key, [])
        for before in history:
            if (before.stream is not stream and (write or before.write)
                    and before.start < end and start < before.end
                    and stream.clock.get(before.stream.id, 0) < before.tick):
                self.report(f"{what} on {stream.name} {_VERB[what, write]} memory that "
                            f"{before.what} on {before.stream.name} "
                            f"{_PAST[before.what, before.write]}, without waiting for it "
                            f"(record an event on {before.stream.name} after it, and wait on it)")
        history.append(_Access(stream, stream.tick(), write, start, end, what))
        if len(history) > self._HISTORY:
            del history[0]

    def communicate(self, what: str, original, args, kwargs, reads=(), writes=(), async_op=True):
        """A communication runs on a stream of its own, which waits for the issuing stream
        (NCCL's: it waits for the caller's current stream when issued); it reads ``reads`` and
        writes ``writes`` there. Waiting on its Work joins it back; a blocking call joins at once."""
        issuer = self.current
        stream = CheckedStream(self, f"the stream of {what} #{next(self._collectives)} "
                                     f"(issued on {issuer.name})")
        stream.join(issuer.clock)
        for t in reads:
            self.touch(t, False, what, stream)
        for t in writes:
            self.touch(t, True, what, stream)
        self._passing += 1            # inside it (a batch calls isend, ...): not counted again
        try:
            result = original(*args, **kwargs)
        finally:
            self._passing -= 1
        if not async_op:
            issuer.join(stream.clock)
            return result
        if isinstance(result, list):
            return [_CheckedWork(w, stream, self) for w in result]
        return None if result is None else _CheckedWork(result, stream, self)

    def all_reduce(self, original, tensor, *args, **kwargs):
        """``dist.all_reduce`` on a stream of its own (:meth:`communicate`)."""
        async_op = kwargs.get("async_op", len(args) >= 3 and args[2])
        return self.communicate("all_reduce", original, (tensor, *args), kwargs, writes=[tensor],
                                async_op=bool(async_op))

    def wrap(self, name: str, original):
        """The stand-in for ``dist.<name>`` inside :func:`checking`: who reads and who writes."""
        def stand_in(*args, **kwargs):
            if self._passing:
                return original(*args, **kwargs)
            if name in ("isend", "irecv", "send", "recv"):
                tensor = args[0] if args else kwargs["tensor"]
                reading = name in ("isend", "send")
                return self.communicate(name, original, args, kwargs, reads=[tensor] if reading else [],
                                        writes=[] if reading else [tensor], async_op=name[0] == "i")
            if name == "batch_isend_irecv":
                ops = args[0] if args else kwargs["p2p_op_list"]
                reads = [op.tensor for op in ops if op.op in _SENDING]
                writes = [op.tensor for op in ops if op.op not in _SENDING]
                return self.communicate(f"batch of {len(ops)} messages", original, args, kwargs, reads, writes)
            bound = _signature(original).bind_partial(*args, **kwargs).arguments
            if name == "reduce_scatter_tensor":
                reads, writes = [bound["input"]], [bound["output"]]
            else:                                       # all_gather_into_tensor
                reads, writes = [bound["input_tensor"]], [bound["output_tensor"]]
            return self.communicate(name, original, args, kwargs, reads, writes,
                                    async_op=bool(bound.get("async_op")))
        stand_in.__name__ = name
        return stand_in


class _Watch(TorchDispatchMode):
    """Attributes every tensor op's reads and writes to the stream it is issued on."""

    def __init__(self, checker: Checker):
        super().__init__()
        self.checker = checker

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False        # nothing here is compiled: not wrapping it spares importing dynamo (seconds)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        if func.namespace != "c10d" and not is_view:      # a view reads nothing
            what = func.overloadpacket.__name__
            for i, arg in enumerate(schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                write = arg.alias_info is not None and arg.alias_info.is_write
                for t in (value if isinstance(value, (list, tuple)) else (value,)):
                    if isinstance(t, torch.Tensor):
                        self.checker.touch(t, write, what)
        return func(*args, **kwargs)


_checker: Checker | None = None
_WRAPPED = [(dist, name) for name in ("all_reduce", "isend", "irecv", "send", "recv", "batch_isend_irecv",
                                       "reduce_scatter_tensor", "all_gather_into_tensor")]
_WRAPPED += [(dist.distributed_c10d, "isend"), (dist.distributed_c10d, "irecv")]
_SENDING: list = []                 # the isend and send stand-ins, while checking


def _signature(fn):
    import inspect
    return inspect.signature(fn)


def active_checker() -> Checker | None:
    """The :class:`Checker` of the :func:`checking` block this process is in, or None. Code
    that keeps streams between calls makes new ones when this changes: a stream made outside
    the block orders nothing the checker can see."""
    return _checker


@contextlib.contextmanager
def checking(raise_errors: bool = True):
    """Inside the block, CPU streams and events made by this module keep count (see the module
    docstring); yields the :class:`Checker`. Make the streams and events inside the block.
    At its end, raises :class:`OrderingError` listing every violation (``raise_errors``).

    The checks are those a GPU would need: a read of memory written on another stream, or a
    write of memory read or written there, must come after an event recorded there was
    waited on (or ``wait_stream``); each communication (``dist.all_reduce``,
    ``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``isend``, ``irecv``, ``send``,
    ``recv``, ``batch_isend_irecv``) runs on a stream of its own, joined by waiting on its
    Work; a wait on an event never recorded is reported too."""
    global _checker
    if _checker is not None:
        raise RuntimeError("streams.checking() does not nest")
    checker = _checker = Checker()
    c10d = dist.distributed_c10d
    saved = {(module, name): getattr(module, name) for module, name in _WRAPPED}
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        return checker.all_reduce(original, tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv", "reduce_scatter_tensor",
                 "all_gather_into_tensor"):
        stand_in = checker.wrap(name, getattr(dist, name))
        setattr(dist, name, stand_in)
        if name in ("isend", "irecv"):      # P2POp and batch_isend_irecv look them up there
            setattr(c10d, name, stand_in)
    _SENDING[:] = [dist.isend, dist.send]
    try:
        with _Watch(checker):
            yield checker
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
        _SENDING.clear()
        _checker = None
    if raise_errors and checker.violations:
        shown = checker.violations[:5]
        more = len(checker.violations) - len(shown)
        raise OrderingError("work not ordered between streams:\n  " + "\n  ".join(shown)
                            + (f"\n  ... and {more} more" if more else ""))
