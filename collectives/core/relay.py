"""Messages carried by the launching process: a transport whose every message the launcher sees.

A world started with ``launch.run_world(..., relay=digest)`` gives each rank one pipe to the
launching process, and the launcher runs a :class:`Hub`: a reader thread per rank takes each
message the rank sends, writes down who sent it, to whom, its dtype, its size and
``digest(tensor)`` of what it carried, and hands it to a writer thread of the destination.
The ranks' process groups send and receive through :func:`send` and :func:`recv` (the
grader's fenced group does, :mod:`collectives.course.grading.tasks.fence`), so what the
launcher wrote down is a record no rank can edit: it was made in another process, from the
bytes that crossed.

The semantics are gloo's, which the lessons teach:

* a receive is matched to the oldest message of its sender (or of any sender) with its tag,
  on its group, in the order the sender sent them; its data lands in the tensor as soon as
  both are there, without the receiver waiting on it;
* a send completes once a receive has taken its message: a blocking ``dist.send`` that no
  peer receives waits, as under gloo, and two ranks that both send first deadlock;
* a message of another size or dtype than the receive expects fails both sides, naming them.

A GPU tensor crosses through host memory: a send copies it out in the order of the caller's
current stream (what NCCL's send would carry), a receive copies the message in on a stream of
the transport's own, after the work the caller had queued when it posted the receive, and its
work completes only once the copy has landed.

Frames are ``header length | JSON header | payload`` (JSON: the launcher reads what a rank
wrote, and a pickle would run code there); the header says ``"m"`` (a message:
destination, tag, group, id, dtype, shape) or ``"a"`` (the receipt of message ``id``).
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

_LEN = struct.Struct("<I")


def _frame(head: dict, payload: bytes = b"") -> bytes:
    data = json.dumps(head).encode()
    return _LEN.pack(len(data)) + data + payload


def _unframe(frame: bytes) -> tuple[dict, memoryview]:
    (n,) = _LEN.unpack_from(frame)
    head = json.loads(bytes(frame[_LEN.size:_LEN.size + n]))
    if not isinstance(head, dict):
        raise ValueError("a frame without a header")
    return head, memoryview(frame)[_LEN.size + n:]


def _hashable(value):
    """A group as JSON brings it back (lists) as the tuple it was sent as."""
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def _int(head: dict, name: str) -> int:
    value = head.get(name)
    if type(value) is not int:
        raise ValueError(f"{name} is {value!r}, not an integer")
    return value


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no dtype {name!r}")
    return dtype


def as_tensor(payload, dtype: str, shape) -> torch.Tensor:
    """The tensor a message carried (a copy of its bytes)."""
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else \
        torch.empty(0, dtype=torch.uint8)
    return flat.view(_dtype(dtype)).reshape(tuple(shape))


# ---- the launching process's half ------------------------------------------------------

class Hub:
    """The launcher's side: one pipe per rank, a reader and a writer thread per rank.

    ``log[r]`` lists, in order, every message rank ``r`` sent: ``(destination, dtype,
    numel, digest)``; ``problems`` what could not be carried (a malformed frame)."""

    def __init__(self, ctx, size: int, digest: Callable[[torch.Tensor], Any]):
        self.ctx = ctx
        self.ends: list = []          # this process's end of each rank's pipe (the rank's: closed
                                      # here once the rank is started, before the next is)
        self.digest = digest
        self.size = size
        self.log: list[list[tuple]] = [[] for _ in range(size)]
        self.problems: list[str] = []
        self._out = [queue.SimpleQueue() for _ in range(size)]
        self._threads: list[threading.Thread] = []
        self._closed = False

    def end_for(self, rank: int) -> tuple:
        """Rank ``rank``'s end of a new pipe, made just before the rank is started (so no
        rank started earlier holds it), and this process's ends of the earlier ranks' pipes,
        which a forked rank inherits and closes first thing (so it cannot speak as the hub;
        a spawned rank holds only what it is given)."""
        mine, theirs = self.ctx.Pipe(duplex=True)
        inherited = list(self.ends) if self.ctx.get_start_method() == "fork" else []
        self.ends.append(mine)
        return theirs, inherited

    def start(self) -> None:
        """After every rank was started (no thread of ours is forked)."""
        for rank in range(self.size):
            for target in (self._reader, self._writer):
                t = threading.Thread(target=target, args=(rank,), daemon=True,
                                     name=f"collectives-relay-{target.__name__[1:]}-{rank}")
                t.start()
                self._threads.append(t)

    def _reader(self, rank: int) -> None:
        conn = self.ends[rank]
        while True:
            try:
                frame = conn.recv_bytes()
            except (EOFError, OSError):
                return
            try:        # what goes on is rebuilt here from the fields it needs, nothing else
                head, payload = _unframe(frame)
                to = _int(head, "dst" if head.get("k") == "m" else "to")
                if not 0 <= to < self.size:
                    raise ValueError(f"no rank {to!r}")
                if head.get("k") == "m":
                    shape, error = head.get("shape"), None
                    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
                        raise ValueError(f"a shape {shape!r}")
                    tensor = as_tensor(payload, str(head.get("dtype")), shape)
                    try:
                        digest = self.digest(tensor)
                    except Exception as exc:  # noqa: BLE001 - the message still crosses; the log says why
                        digest, error = None, exc
                    self.log[rank].append((to, head["dtype"], tensor.numel(), digest))
                    frame = _frame(dict(k="m", src=rank, dst=to, tag=_int(head, "tag"), g=head.get("g"),
                                        id=_int(head, "id"), dtype=head["dtype"], shape=shape), bytes(payload))
                    if error is not None:
                        self._problem(f"rank {rank}: a message could not be written down ({error})")
                elif head.get("k") == "a":
                    said = head.get("error")
                    frame = _frame(dict(k="a", to=to, id=_int(head, "id"), error=None if said is None else str(said)))
                else:
                    raise ValueError(f"a frame of kind {head.get('k')!r}")
                self._out[to].put(frame)
            except Exception as exc:  # noqa: BLE001 - whatever a rank wrote is its problem, not ours
                self._problem(f"rank {rank}: wrote a frame the relay cannot read ({exc})")

    def _problem(self, text: str) -> None:
        if len(self.problems) < 5:          # the first few say it; a flood would bury the verdict
            self.problems.append(text)

    def _writer(self, rank: int) -> None:
        while (frame := self._out[rank].get()) is not None:
            try:
                self.ends[rank].send_bytes(frame)
            except OSError:
                pass                        # the rank has ended: what was for it is dropped

    def close(self, wait: float = 10.0) -> None:
        """After the ranks have ended: read what their pipes still hold, then stop (once)."""
        if self._closed:
            return
        self._closed = True
        readers = self._threads[0::2]
        for t in readers:
            t.join(wait)
        for q in self._out:
            q.put(None)
        for end in self.ends:
            end.close()
        for t in self._threads[1::2]:
            t.join(1.0)


# ---- a rank's half ---------------------------------------------------------------------

_conn = None
_transport: "_Transport | None" = None
_made = threading.Lock()


def _install(ends) -> None:
    """In a new rank: keep its end of the relay and close the ones it inherited
    (:meth:`Hub.end_for`; None: the world has no relay)."""
    global _conn, _transport
    conn, inherited = ends if ends is not None else (None, ())
    for other in inherited:
        other.close()
    _conn, _transport = conn, None


os.register_at_fork(after_in_child=lambda: _install(None))


def available() -> bool:
    """Whether this rank's messages go through the launcher."""
    return _conn is not None


class Work(dist.Work):
    """A relayed send or receive: :meth:`wait` blocks until the peer's half is there."""

    def __init__(self, what: str, timeout: float):
        super().__init__()
        self._what = what
        self._timeout = timeout
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._source = -1
        self._ready = None          # a receive into a GPU tensor: what must run before it lands

    def _finish(self, error: BaseException | None = None, source: int = -1) -> None:
        self._error, self._source = error, source
        self._done.set()

    def wait(self, timeout=None) -> bool:
        if not self._done.wait(self._timeout):
            raise RuntimeError(f"{self._what} timed out after {self._timeout:g} s (the peer never came)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        return self._source


class _Transport:
    def __init__(self, conn, timeout: float):
        self.conn = conn
        self.timeout = timeout
        self.write = threading.Lock()
        self.cond = threading.Lock()
        self.mail: dict[tuple, deque] = {}       # (group, src, tag) -> messages not yet received
        self.posted: list[tuple[tuple, Work, torch.Tensor]] = []   # receives not yet matched, oldest first
        self.sends: dict[int, Work] = {}         # message id -> its send, until receipted
        self.next = 0
        threading.Thread(target=self._read, daemon=True, name="collectives-relay").start()

    def _put(self, frame: bytes) -> None:
        with self.write:
            self.conn.send_bytes(frame)

    def send(self, tensor: torch.Tensor, dst: int, tag: int, group: tuple) -> Work:
        payload = tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if tensor.numel() else b""
        work = Work(f"a send to rank {dst} (tag {tag})", self.timeout)
        with self.cond:
            mid, self.next = self.next, self.next + 1
            self.sends[mid] = work
        self._put(_frame(dict(k="m", dst=dst, tag=tag, g=group, id=mid,
                              dtype=str(tensor.dtype).replace("torch.", ""), shape=list(tensor.shape)), payload))
        return work

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int, group: tuple, local) -> Work:
        peer = "any rank" if src is None else f"rank {src}"
        work = Work(f"a receive from {peer} (tag {tag})", self.timeout)
        work._local = local
        if tensor.is_cuda:          # the message lands after what the caller queued before it
            work._ready = torch.cuda.Event()
            work._ready.record(torch.cuda.current_stream(tensor.device))
        with self.cond:
            message = self._take(group, src, tag)
            if message is None:
                self.posted.append(((group, src, tag), work, tensor))
                return work
        self._deliver(work, tensor, message)
        return work

    def _take(self, group, src, tag):
        if src is not None:
            box = self.mail.get((group, src, tag))
            return box.popleft() if box else None
        boxes = [(box[0][0], key) for key, box in self.mail.items() if key[0] == group and key[2] == tag and box]
        if not boxes:
            return None
        _, key = min(boxes)                      # the oldest arrival, from any sender
        return self.mail[key].popleft()

    def _read(self) -> None:
        arrivals = 0
        while True:
            try:
                head, payload = _unframe(self.conn.recv_bytes())
            except (EOFError, OSError):
                return
            try:
                arrivals = self._take_frame(head, payload, arrivals)
            except Exception as exc:  # noqa: BLE001 - every wait still pending ends with it, not a timeout
                self._fail_all(RuntimeError(f"the relay could not take a message: {exc}"))

    def _take_frame(self, head: dict, payload, arrivals: int) -> int:
        if head["k"] == "a":
            with self.cond:
                work = self.sends.pop(head["id"], None)
            if work is not None:
                work._finish(RuntimeError(head["error"]) if head.get("error") else None)
            return arrivals
        message = (arrivals, head["src"], head["id"], head["dtype"], head["shape"], payload)
        key = (_hashable(head["g"]), head["src"], head["tag"])
        with self.cond:
            for i, (want, work, tensor) in enumerate(self.posted):
                if want == key or (want[1] is None and (want[0], want[2]) == (key[0], key[2])):
                    del self.posted[i]
                    break
            else:
                self.mail.setdefault(key, deque()).append(message)
                return arrivals + 1
        self._deliver(work, tensor, message)
        return arrivals + 1

    def _fail_all(self, error: BaseException) -> None:
        with self.cond:
            pending = [work for _, work, _ in self.posted] + list(self.sends.values())
            self.posted.clear()
            self.sends.clear()
        for work in pending:
            work._finish(error)

    def _deliver(self, work: Work, tensor: torch.Tensor, message: tuple) -> None:
        _, src, mid, dtype, shape, payload = message
        numel = 1
        for n in shape:
            numel *= n
        error = None
        if dtype != str(tensor.dtype).replace("torch.", "") or numel != tensor.numel():
            error = (f"rank {src} sent {numel} elements of {dtype}; the receive on rank "
                     f"{dist.get_rank()} expects {tensor.numel()} of {str(tensor.dtype).replace('torch.', '')}")
        else:
            try:
                if tensor.is_cuda:
                    _land(tensor, as_tensor(payload, dtype, shape), work._ready)
                else:
                    tensor.view(-1).copy_(as_tensor(payload, dtype, shape).view(-1))
            except Exception as exc:  # noqa: BLE001 - both sides hear of it, as of a size mismatch
                error = f"the message from rank {src} could not land: {exc}"
        local = work._local(src) if callable(work._local) else src
        work._finish(RuntimeError(error) if error else None, local)
        self._put(_frame(dict(k="a", to=src, id=mid, error=error)))


_streams: dict[int, Any] = {}


def _land(tensor: torch.Tensor, message: torch.Tensor, ready) -> None:
    """Copy a message into a GPU tensor on the transport's stream, after ``ready``; return
    once it is there."""
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index)
    stream = _streams[index]
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        tensor.view(-1).copy_(message.view(-1))
    stream.synchronize()


def _get(timeout: float) -> _Transport:
    global _transport
    with _made:
        if _transport is None:
            if _conn is None:
                raise RuntimeError("this rank has no relay: the world was not started with one")
            _transport = _Transport(_conn, timeout)
        return _transport


def send(tensor: torch.Tensor, dst: int, tag: int, group: tuple, timeout: float) -> Work:
    """Send ``tensor`` (contiguous) to global rank ``dst`` through the launcher."""
    return _get(timeout).send(tensor, dst, tag, group)


def recv(tensor: torch.Tensor, src: int | None, tag: int, group: tuple, timeout: float,
         local: Callable[[int], int] | None = None) -> Work:
    """Receive into ``tensor`` (contiguous) from global rank ``src`` (None: any rank);
    ``local`` maps the sender's global rank to the one :meth:`Work._source_rank` gives."""
    return _get(timeout).recv(tensor, src, tag, group, local)
