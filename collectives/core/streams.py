"""Streams and events that are real on CUDA and do nothing on CPU.

GPU lessons overlap copies and communication on side streams ordered by events. Writing
that through this module keeps one code path that runs -- and is tested -- everywhere:
on CPU every operation already ran when it returns, so waiting is a no-op.

A forgotten wait is then invisible on CPU. :func:`checking` makes the stand-ins keep
count, the way a GPU would order the work: each stream a clock, events carrying them,
every tensor read and write attributed to the stream it was issued on, and every
communication -- ``dist.all_reduce``, ``reduce_scatter_tensor``, ``all_gather_into_tensor``,
``isend``, ``irecv``, a ``batch_isend_irecv`` -- on a stream of its own (as NCCL runs it),
which waits for the issuing stream and is joined by waiting on its work. Work that reads or
writes memory another stream touched, without an event or wait ordering the two, and a
stream waiting on an event that was never recorded, are reported -- on CPU.

::

    side = streams.new_stream(device)
    done = streams.new_event(device)
    with streams.use(side):
        side.wait_stream(streams.current_stream(device))   # inputs are ready
        fused.copy_(...)
        done.record(side)
    streams.current_stream(device).wait_event(done)           # caller waits for the copy
"""

from __future__ import annotations

import contextlib

import torch

from . import stream_order
from .stream_order import (  # noqa: F401  (the checker's names: part of this module's interface too)
    CheckedEvent,
    CheckedStream,
    Checker,
    NullEvent,
    NullStream,
    OrderingError,
    _CheckedWork,
    _Watch,
    active_checker,
    checking,
)

_NULL_STREAM = NullStream()


def is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def new_stream(device=None, priority: int = 0, name: str | None = None):
    """A new side stream on ``device`` (a :class:`NullStream` on CPU; ``name`` names it in
    :func:`checking`'s reports)."""
    if is_cuda(device):
        return torch.cuda.Stream(device=device, priority=priority)
    checker = stream_order.active_checker()
    if checker is not None:
        return checker.new_stream(name)
    return NullStream()


def current_stream(device=None):
    """The stream work is issued on now (a :class:`NullStream` on CPU)."""
    if is_cuda(device):
        return torch.cuda.current_stream(device)
    checker = stream_order.active_checker()
    if checker is not None:
        return checker.current
    return _NULL_STREAM


def new_event(device=None, timing: bool = False, name: str | None = None):
    if is_cuda(device):
        return torch.cuda.Event(enable_timing=timing)
    checker = stream_order.active_checker()
    if checker is not None:
        return CheckedEvent(checker, name)
    return NullEvent()


def use(stream):
    """Context manager: issue work on ``stream`` inside the block (nothing on CPU)."""
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    if isinstance(stream, CheckedStream):
        return stream.checker.using(stream)
    return contextlib.nullcontext()


def record_stream(tensor: torch.Tensor, stream) -> None:
    """Tell the CUDA caching allocator ``tensor`` is in use on ``stream`` (no-op on CPU)."""
    if isinstance(stream, torch.cuda.Stream) and tensor.is_cuda:
        tensor.record_stream(stream)
