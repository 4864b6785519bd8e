"""Lesson 10: where ZeRO-3's communication runs -- a thread of its own on CPU, a CUDA stream
on GPUs, or inline -- and how a GPU's allocator learns when the memory it made is free again.
"""

from __future__ import annotations

import concurrent.futures

from collectives.core import live_bytes, streams


class SideStream:
    """Where the communication runs: a thread of its own on CPU (``overlap``), a CUDA
    stream on GPUs, or inline. ``submit(fn)`` returns something with ``.result()``.

    On a GPU the tensors ``fn`` makes (a gathered layer, a reduced shard) belong to the side
    stream's memory, and the issuing stream reads them. ``release`` says how the allocator
    learns when their memory may be reused:

    * ``"record_stream"``: ``result()`` marks them as used by the issuing stream; a tensor the
      host frees stays allocated until the GPU has passed that use -- when the host runs
      ahead, several gathered layers at once;
    * ``"stream_order"`` (as FSDP2): nothing is marked. Every ``submit`` first makes the side
      stream wait for the issuing stream, and only the side stream allocates from that memory,
      so whatever the side stream makes after a free runs after every read issued before it:
      the memory is reusable as soon as the host frees it.
    """

    def __init__(self, device, overlap: bool, release: str = "record_stream"):
        self.device, self.overlap, self.release = device, overlap, release
        self.cuda = streams.is_cuda(device)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "fsdp-comm") if overlap and not self.cuda else None
        self.stream = streams.new_stream(device, name="fsdp-comm") if overlap and self.cuda else None

    def submit(self, fn, keep=()):
        """Run ``fn`` here; ``keep``: tensors of the issuing stream it reads (on a GPU the
        allocator is told they are in use on the side stream until it is done)."""
        if self.pool is not None:
            return self.pool.submit(live_bytes.carry(fn))     # a running meter sees the thread's tensors
        if self.stream is None:
            return _Done(fn(), None, None)
        for t in keep:
            streams.record_stream(t, self.stream)
        self.stream.wait_stream(streams.current_stream(self.device))
        with streams.use(self.stream):
            value = fn()
        done = streams.new_event(self.device)
        done.record(self.stream)
        return _Done(value, done, self)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class _Done:
    def __init__(self, value, event, side):
        self.value, self.event, self.side = value, event, side

    def result(self):
        if self.event is not None:
            streams.current_stream(self.side.device).wait_event(self.event)
            if self.side.release == "record_stream":
                for t in self.value if isinstance(self.value, list) else []:
                    streams.record_stream(t, streams.current_stream(self.side.device))
        return self.value
