"""A per-rank record of every message and collective call.

Inside a world started by :mod:`collectives.core.launch`, the point-to-point functions
(``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``) and the collectives
(``all_reduce``, ``broadcast``, ...) of ``torch.distributed`` are wrapped, so code that
calls ``dist.isend(...)`` -- a student's exercise included -- is recorded without doing
anything. Each record says what happened (kind), with whom (peer, as a global rank),
how much (elements, bytes), in which order (seq) and when (t0 when posted, t1 when it
completed: for ``isend``/``irecv``, when its ``wait()`` returned).

Tests assert patterns on it::

    with trace.recording() as t:
        ring_all_reduce(x)
    assert {e.peer for e in t.sends()} == {(rank + 1) % p}

and the same wrappers tell the launcher's watchdog where a rank is waiting
("rank 1 waiting in recv from rank 0"), and every listener (:func:`add_listener`: the
flight recorder, :mod:`collectives.core.flight_recorder`) of every call, recording or not.

The records themselves (:class:`Event`, :class:`Trace`, :func:`step_table`) live in
:mod:`collectives.core.trace_events`; this module makes them and re-exports them.

While ``torch.profiler`` (or ``torch.autograd.profiler.emit_nvtx``) is running, every
:func:`label` and every wrapped call is also a named range in its trace (``record_function``;
NVTX ranges under ``emit_nvtx``); with no profiler running this costs one check per call.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .trace_events import (  # noqa: F401  (RECVS, step_table: part of this module's interface too)
    _COLLECTIVE_ARGS,
    COLLECTIVES,
    POINT_TO_POINT,
    RECVS,
    SENDS,
    Event,
    Trace,
    _describe,
    _global_peer,
    _group_ranks,
    _size,
    step_table,
)

# ---------------------------------------------------------------------------------
# Per-process state. One process is one rank, so module globals are per rank.

_rank: int = -1
_clock = time.perf_counter    # taken at import: code that patches time.perf_counter later moves no stamp
_status = None           # the launcher's shared status slot for this rank, or None
_recorders: list[Trace] = []   # open recording() blocks; every event goes to each
_paused = 0
_nested = 0      # >0 while inside a traced call: its internal calls pass straight through
_seq = 0
_label = ""
_originals: dict[tuple[Any, str], Any] = {}
_listeners: list = []    # add_listener: told of every call, recording or not
# Whether torch's profiler (or emit_nvtx) runs now, about 0.15 µs a call; and a named range
# in its trace (record_function: NVTX under emit_nvtx).
_profiler_enabled = torch._C._autograd._profiler_enabled
_range = torch.autograd.profiler.record_function


def installed() -> bool:
    return bool(_originals)


def _set_status(text: str) -> None:
    if _status is not None:
        _status.set(text)


_noted = None


def note_call(what: str) -> None:
    """Tell the launcher which course collective this rank entered last ("ring_all_reduce"),
    so a rank that dies inside it is reported by name. Nothing is recorded.
    :func:`collectives.core.ops.check_all_reduce_args` calls it on every call, so a repeat
    of the last name (the same string object: a call site's literal) costs one comparison."""
    global _noted
    if what is _noted or _status is None or not hasattr(_status, "set_collective"):
        return
    _noted = what
    _status.set_collective(what)


def _record(kind, peer, tensors, group, tag=0) -> Event | None:
    global _seq
    if _paused or not _recorders:
        return None
    numel, nbytes, dtype = _size(tensors)
    event = Event(_seq, kind, _rank, peer, numel, nbytes, dtype, _clock(),
                  None, _group_ranks(group), tag or 0, _label)
    _seq += 1
    for rec in _recorders:
        rec.events.append(event)
    return event


def add_listener(listener) -> Any:
    """Tell ``listener(kind, peer, tensors, group)`` of every traced call as it is made,
    recorded or not, paused or not (the flight recorder). It may return ``end(stage,
    error=None)``, which is then told ``"started"`` when the rank starts waiting on the
    call (a blocking call at once, an ``isend`` at ``wait()``), ``"completed"`` when it
    returns, or ``"failed"`` with the exception that ended it. A listener must be fast and
    must not raise. Returns a function that removes the listener.

    A listener with ``wants_arguments = True`` is also given, for a collective, the call's
    arguments by name (``arguments={"op": ReduceOp.MAX, "tensor_list": [...], ...}``)."""
    _listeners.append(listener)
    return lambda: listener in _listeners and _listeners.remove(listener)


def _notify(kind, peer, tensors, group, arguments=None) -> list | None:
    """The listeners' ``end`` callbacks for a call being made (None: nobody listens)."""
    ends = [end for listener in _listeners
            if (end := (listener(kind, peer, tensors, group, arguments=arguments)
                        if arguments is not None and getattr(listener, "wants_arguments", False)
                        else listener(kind, peer, tensors, group))) is not None]
    return ends or None


def _tell(ends, stage: str, error: BaseException | None = None) -> None:
    for end in ends:
        end(stage, error)


class TracedWork:
    """Wraps a ``Work`` handle so that ``wait()`` completes the event and tells the watchdog."""

    def __init__(self, work, event: Event | None, what: str, ends: list | None = None):
        self._work = work
        self._event = event
        self._what = what
        self._ends = ends

    def wait(self, *args, **kwargs):
        _set_status(f"waiting on {self._what}")
        ends, self._ends = self._ends, None      # listeners hear of the first wait only
        if ends:
            _tell(ends, "started")
        try:
            if _profiler_enabled():
                with _range(f"wait: {self._what}"):
                    result = self._work.wait(*args, **kwargs)
            else:
                result = self._work.wait(*args, **kwargs)
        except BaseException as exc:
            if ends:
                _tell(ends, "failed", exc)
            raise
        finally:
            _set_status("")
        if ends:
            _tell(ends, "completed")
        if self._event is not None and self._event.t1 is None:
            self._event.t1 = _clock()
        return result

    def get_future(self):
        """The work's future; the listeners hear ``"started"`` now (the rank waits through the
        future: a DDP communication hook hands it to the reducer) and ``"completed"`` or
        ``"failed"`` when it is done, whoever waits on it (``.wait()``, ``.then()``, DDP's C++).
        With listeners, the future returned is the work's chained with that news: whoever
        waits on it waits until they have heard."""
        future = self._work.get_future()
        ends, self._ends = self._ends, None
        if not ends:
            return future
        _tell(ends, "started")

        def done(fut):
            try:
                value = fut.value()
            except BaseException as exc:
                _tell(ends, "failed", exc)
                raise
            _tell(ends, "completed")
            return value
        return future.then(done)

    def __getattr__(self, name):  # is_completed, exception, result, ...
        return getattr(self._work, name)


def _call(original, ends, blocking: bool, *args, _named: str = "", **kwargs):
    """``original(*args, **kwargs)``, telling the listeners' ``ends`` how it went; while
    torch's profiler runs, a range named ``_named`` (the call, as the watchdog names it)."""
    if _named and _profiler_enabled():
        with _range(_named):
            return _call(original, ends, blocking, *args, **kwargs)
    if not ends:
        return original(*args, **kwargs)
    if blocking:
        _tell(ends, "started")
    try:
        result = original(*args, **kwargs)
    except BaseException as exc:
        _tell(ends, "failed", exc)
        raise
    if blocking:
        _tell(ends, "completed")
    return result


def _wrap_p2p(kind: str, original):
    is_send = kind in SENDS
    blocking = kind in ("send", "recv")

    @functools.wraps(original)
    def wrapper(tensor, *args, **kwargs):
        global _nested
        if _nested:
            return original(tensor, *args, **kwargs)
        names = ("dst", "group", "tag") if is_send else ("src", "group", "tag")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        group = bound.get("group")
        peer = _global_peer(group, bound.get(names[0]),
                            bound.get("group_dst" if is_send else "group_src"))
        event = _record(kind, peer, tensor, group, bound.get("tag", 0))
        ends = _notify(kind, peer, tensor, group) if _listeners else None
        what = _describe(kind, peer)
        if blocking:
            _set_status(f"in {what}")
            _nested += 1
            try:
                result = _call(original, ends, True, tensor, *args, _named=what, **kwargs)
            finally:
                _nested -= 1
                _set_status("")
            if event is not None:
                event.t1 = _clock()
            return result
        work = _call(original, ends, False, tensor, *args, _named=what, **kwargs)
        return None if work is None else TracedWork(work, event, what, ends)

    wrapper.__collectives_traced__ = True
    return wrapper


def _wrap_collective(kind: str, original):
    signature = inspect.signature(original)
    tensor_arg, root_arg, group_root_arg = _COLLECTIVE_ARGS[kind]

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        global _nested
        if _nested:
            return original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        event, ends, what = None, None, kind
        if _listeners or (_recorders and not _paused):
            group = bound.get("group")
            root = None
            if root_arg is not None:
                root = _global_peer(group, bound.get(root_arg), bound.get(group_root_arg))
            tensors = bound.get(tensor_arg) if tensor_arg else []
            tensors = tensors if tensors is not None else []
            event = _record(kind, root, tensors, group)
            ends = _notify(kind, root, tensors, group, bound) if _listeners else None
            what = _describe(kind, root)
        if bound.get("async_op"):
            work = _call(original, ends, False, *args, _named=what, **kwargs)
            return None if work is None else TracedWork(work, event, what, ends)
        _set_status(f"in {what}")
        _nested += 1
        try:
            result = _call(original, ends, True, *args, _named=what, **kwargs)
        finally:
            _nested -= 1
            _set_status("")
        if event is not None:
            event.t1 = _clock()
        return result

    wrapper.__collectives_traced__ = True
    return wrapper


def install(rank: int, status=None) -> None:
    """Wrap ``torch.distributed``'s communication functions in this process (idempotent).

    ``isend``/``irecv`` are also replaced inside ``distributed_c10d``, so that
    ``dist.P2POp(dist.isend, ...)`` and ``batch_isend_irecv`` see the traced versions.
    Collectives are replaced only in the public namespace: the internal calls that
    ``all_gather_object`` and friends make are not counted twice.
    """
    global _rank, _status, _noted
    _rank, _status, _noted = rank, status, None
    if _originals:
        return
    for kind in POINT_TO_POINT:
        original = getattr(c10d, kind)
        wrapped = _wrap_p2p(kind, original)
        targets = [dist] + ([c10d] if kind in ("isend", "irecv") else [])
        for module in targets:
            _originals[(module, kind)] = getattr(module, kind)
            setattr(module, kind, wrapped)
    for kind in COLLECTIVES:
        _originals[(dist, kind)] = getattr(dist, kind)
        setattr(dist, kind, _wrap_collective(kind, getattr(dist, kind)))


def uninstall() -> None:
    for (module, name), original in _originals.items():
        setattr(module, name, original)
    _originals.clear()


@contextlib.contextmanager
def recording() -> Iterator[Trace]:
    """Record every event of this rank made inside the block into a fresh :class:`Trace`."""
    rank = dist.get_rank() if dist.is_initialized() else _rank
    if not _originals:
        install(rank, _status)
    rec = Trace(rank)
    _recorders.append(rec)
    try:
        yield rec
    finally:
        _recorders.remove(rec)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Calls made inside the block are not recorded (a reference computation, say)."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


def active() -> bool:
    """True inside an unpaused :func:`recording`: calls made now are being recorded.

    Work replayed from a CUDA graph makes no calls, so code that can replay asks this
    first and issues the calls for real while someone is watching.
    """
    return bool(_recorders) and not _paused


_context = ""


@contextlib.contextmanager
def context(text: str) -> Iterator[None]:
    """Tell the launcher's watchdog what this rank is doing ("ring_all_reduce (case n=1001
    float32 SUM)"): a world that hangs inside the block is reported with it. Not recorded.
    The innermost block wins; :func:`current_context` reads it back (after a gloo timeout,
    say)."""
    global _context
    before, _context = _context, text
    slot = getattr(_status, "set_context", None)
    if slot is not None:
        slot(text)
    try:
        yield
    except BaseException:
        # keep the innermost context for whoever catches the exception
        raise
    else:
        _context = before
        if slot is not None:
            slot(before)


def current_context() -> str:
    """The text of the innermost :func:`context` block this rank is in (or last failed in)."""
    return _context


_NO_LABEL = contextlib.nullcontext()


def label(text: str):
    """Tag the events made inside the block (e.g. "reduce-scatter step 2"); under a running
    ``torch.profiler``, the block is also a range of that name in its trace.

    Costs nothing when no :func:`recording` is open and no profiler runs (one check): the
    hot loops of the algorithms call it at every step, timed runs included.
    """
    if active():
        return _labelled(text, _profiler_enabled())
    return _range(text) if _profiler_enabled() else _NO_LABEL


@contextlib.contextmanager
def _labelled(text: str, profiled: bool = False) -> Iterator[None]:
    global _label
    before, _label = _label, text
    try:
        if profiled:
            with _range(text):
                yield
        else:
            yield
    finally:
        _label = before
