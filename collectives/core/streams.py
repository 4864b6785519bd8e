"""Streams and events that are real on CUDA and do nothing on CPU.

GPU lessons overlap copies and communication on side streams ordered by events. Writing
that through this module keeps one code path that runs -- and is tested -- everywhere:
on CPU every operation already ran when it returns, so waiting is a no-op.

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


_NULL_STREAM = NullStream()


def is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def new_stream(device=None, priority: int = 0):
    """A new side stream on ``device`` (a :class:`NullStream` on CPU)."""
    if is_cuda(device):
        return torch.cuda.Stream(device=device, priority=priority)
    return NullStream()


def current_stream(device=None):
    """The stream work is issued on now (a :class:`NullStream` on CPU)."""
    if is_cuda(device):
        return torch.cuda.current_stream(device)
    return _NULL_STREAM


def new_event(device=None, timing: bool = False):
    if is_cuda(device):
        return torch.cuda.Event(enable_timing=timing)
    return NullEvent()


def use(stream):
    """Context manager: issue work on ``stream`` inside the block (nothing on CPU)."""
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()


def record_stream(tensor: torch.Tensor, stream) -> None:
    """Tell the CUDA caching allocator ``tensor`` is in use on ``stream`` (no-op on CPU)."""
    if isinstance(stream, torch.cuda.Stream) and tensor.is_cuda:
        tensor.record_stream(stream)
