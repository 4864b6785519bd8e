"""The flight recorder: every rank's last N communication calls, kept where a crash cannot take them.

After torch's Flight Recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``),
whose entry fields it follows. Each rank keeps a ring of its last ``buffer_size`` calls,
fed by :func:`collectives.core.trace.add_listener` (so a student's ``dist.isend`` is
recorded without a change to their code), in a file mapped into memory that outlives the
process (:mod:`~collectives.core.flight_ring`: its layout, and reading it back).

* **what a call costs** -- a call made from a site seen before (a training loop's
  all-reduce) reuses its encoded description: one dictionary look-up, a few integers
  packed into the slot, and two more when it starts and completes.
* **states** (torch's names): ``scheduled`` -- posted and not yet waited on (an ``isend``
  before its ``wait()``); ``started`` -- the rank is waiting in it; ``completed``. A call
  that raised stays started and carries its ``error``.
* **sequence numbers**, per process group, as torch counts them: ``collective_seq_id``
  counts the group's collectives, ``p2p_seq_id`` its point-to-point calls; each entry
  carries both (the one of the other kind as it stood).
* **dumps** (one JSON file per rank, ``DIR/rank<r>.json``) on request (:func:`dump`), on a
  signal (``kill -USR1 <pid>``: a thread of the recorder waits for it, so a rank stuck in
  a C++ wait still answers), when a call has been in flight for ``dump_after`` seconds
  (``COLLECTIVES_DUMP_ON_TIMEOUT``), and from the launcher: ``launch.run(...,
  flight_recorder=DIR)`` asks every live rank for a dump when the world ends -- overrun,
  failed or finished -- before it kills them, recovers the rings of the ranks that died,
  and writes what it saw of each rank to ``DIR/world.json``
  (:mod:`~collectives.core.flight_dumps`).
* **what Python never sees** -- DDP's reducer and torch's internals call the process group
  from C++: torch's own Flight Recorder (``TORCH_FR_BUFFER_SIZE``, on gloo as on NCCL, which
  :func:`start` turns on) records them, and every dump merges its entries into ours
  (:mod:`~collectives.core.flight_torch`). A call awaited through its future
  (``work.get_future().wait()``, ``.then()``, a DDP hook) completes when the future does.
* **how a rank ends** -- a dump is also written when the rank's code raises (with the
  exception, :func:`note_exception`) and when it exits (``atexit``): under ``torchrun``, where
  no launcher asks, a rank that finished is not mistaken for one that died.

On NCCL, the calls of one ``batch_isend_irecv`` are waited on through the batch's handles,
not their own: they stay ``scheduled``.

``.venv/bin/python -m collectives diagnose DIR`` reads them (:mod:`collectives.debugging`).
"""

from __future__ import annotations

import atexit
import json
import mmap
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import flight_ring as fr
from . import flight_torch, trace
from .flight_ring import SLOT_BYTES, STATES, VERSION, read_ring

__all__ = ["FlightRecorder", "start", "start_from_env", "active", "dump", "stop", "read_ring", "note_exception",
           "ENV_DIR", "ENV_BUFFER", "ENV_DUMP_AFTER", "DUMP_SIGNAL", "SLOT_BYTES", "STATES", "VERSION"]

ENV_DIR = "COLLECTIVES_FLIGHT_RECORDER"        # the dump directory; launch.run(flight_recorder=DIR) sets it
ENV_BUFFER = "COLLECTIVES_TRACE_BUFFER_SIZE"   # after TORCH_NCCL_TRACE_BUFFER_SIZE
ENV_DUMP_AFTER = "COLLECTIVES_DUMP_ON_TIMEOUT"  # seconds a call may be in flight before the rank dumps
DUMP_SIGNAL = signal.SIGUSR1
DEFAULT_BUFFER = 2000

_HEAD, _ID = fr.HEAD, fr.ID
_INSIDE = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
_P2P = frozenset(trace.POINT_TO_POINT)
_IN_PLACE = ("all_reduce", "broadcast", "reduce", "send", "recv", "isend", "irecv")
class FlightRecorder:
    """One rank's ring of calls, in ``directory/rank<rank>.ring``; dumps to ``rank<rank>.json``."""

    wants_arguments = True      # the trace hands over a collective's arguments (its reduce op, its output)

    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int,
                 buffer_size: int = DEFAULT_BUFFER, dump_after: float | None = None):
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1, got {buffer_size}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size, self.buffer_size = rank, world_size, buffer_size
        self.dump_after = dump_after
        self.ring_path = self.directory / f"rank{rank}.ring"
        self.dump_path = self.directory / f"rank{rank}.json"
        with open(self.ring_path, "w+b") as f:
            f.truncate(SLOT_BYTES * (buffer_size + 1))
            self._ring = mmap.mmap(f.fileno(), 0)
        fr.create(self._ring, buffer_size, rank, world_size)
        self.recorded = 0                    # calls seen; the next record_id
        self.exception: str | None = None    # what the rank's code raised (note_exception)
        self.merge_torch = True              # merge torch's Flight Recorder into every dump
        self._seq: dict = {}                 # group (and its name) -> [collectives, point-to-point] so far
        self._groups: dict = {}              # group object -> (name, description, ranks, backend)
        self._sites: dict = {}               # (op, group, peer, sizes, dtype, details, code id, line) -> (code, text)
        self._inside: dict = {}              # code id -> (code, is it torch's or collectives.core's?)
        self._waiting: dict[int, int] = {}   # record_id -> started ns, of the calls a rank waits in
        self._timed_out: set[int] = set()
        self._remove = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._restore: tuple | None = None    # the signal mask and handler before serve()
        self._lock = threading.Lock()

    # -- recording: the trace listener ---------------------------------------------------
    def __call__(self, kind, peer, tensors, group, arguments=None):
        counts = self._seq.get(group)
        if counts is None:
            counts = self._seq[group] = self._counts(group)
        counts[kind in _P2P] += 1
        shapes, dtype = fr.shapes_of(tensors)
        details = fr.call_details(kind, arguments) if arguments is not None else ()
        code, line = self._caller()
        # code objects hash their whole contents, every time: they are keyed by id (and checked)
        key = (kind, group, peer, shapes, dtype, details, id(code), line)
        site = self._sites.get(key)
        text = site[1] if site is not None and site[0] is code else self._describe(key, code, group)
        record_id = self.recorded
        self.recorded += 1
        offset = SLOT_BYTES * (record_id % self.buffer_size + 1)
        ring = self._ring
        ring[offset + _HEAD.size:offset + _HEAD.size + len(text)] = text
        _HEAD.pack_into(ring, offset, record_id, counts[0], counts[1], time.time_ns(), 0, 0,
                        fr.SCHEDULED, 0, len(text))

        def end(stage, error=None):
            if _ID.unpack_from(ring, offset)[0] != record_id:
                return                         # the ring came round: the slot holds a newer call
            if stage == "started":
                now = time.time_ns()
                _ID.pack_into(ring, offset + fr.STARTED_AT, now)
                ring[offset + fr.STATE_AT] = fr.STARTED
                self._waiting[record_id] = now
            elif stage == "completed":
                ring[offset + fr.STATE_AT] = fr.COMPLETED
                _ID.pack_into(ring, offset + fr.COMPLETED_AT, time.time_ns())
                self._waiting.pop(record_id, None)
            else:                              # failed: stays started, with the error
                self._fail(offset, record_id, error)
        return end

    def _counts(self, group) -> list[int]:
        """The group's [collectives, point-to-point] counters; one pair per group name."""
        name = self._group(group)[0]
        return self._seq.setdefault(name, [0, 0])

    def _group(self, group):
        info = self._groups.get(group)
        if info is None:
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            ranks = tuple(dist.get_process_group_ranks(pg))
            info = (str(getattr(pg, "group_name", "0")), str(getattr(pg, "group_desc", "undefined")),
                    ranks, dist.get_backend(pg))
            self._groups[group] = info
        return info

    def _caller(self):
        """The first frame outside torch and collectives.core: the line that made the call."""
        frame = sys._getframe(2)
        inside = self._inside
        while frame is not None:
            code = frame.f_code
            known = inside.get(id(code))
            if known is None or known[0] is not code:
                known = inside[id(code)] = (code, code.co_filename.startswith(_INSIDE))
            if not known[1]:
                return code, frame.f_lineno
            frame = frame.f_back
        return None, 0

    def _describe(self, key, code, group) -> bytes:
        kind, _, peer, shapes, dtype, details, _, line = key
        name, desc, ranks, backend = self._group(group)
        profiling = f"{backend}:{kind}"
        if kind in trace.SENDS:
            profiling += f" {self.rank}->{peer}"
        elif kind in trace.RECVS:
            profiling += f" {self.rank}<-{peer}"
        sizes = [list(s) for s in shapes]
        dtypes = [fr.dtype_name(dtype)] * len(sizes) if dtype else []
        reduce_op, out_shapes, out_dtype, splits = details or (None, (), None, None)
        if kind in _IN_PLACE:
            out_sizes, out_dtypes = sizes, dtypes
        elif out_shapes:
            out_sizes = [list(s) for s in out_shapes]
            out_dtypes = [fr.dtype_name(out_dtype)] * len(out_sizes) if out_dtype else []
        else:
            out_sizes = out_dtypes = None
        frames = [] if code is None else [{"name": code.co_name, "filename": code.co_filename, "line": line}]
        what = {"profiling_name": profiling, "process_group": [name, desc], "pg_ranks": list(ranks),
                "is_p2p": kind in trace.POINT_TO_POINT, "peer": peer,
                "input_sizes": sizes, "input_dtypes": dtypes, "output_sizes": out_sizes, "output_dtypes": out_dtypes,
                "frames": frames}
        if reduce_op is not None:
            what["reduce_op"] = reduce_op
        if splits is not None:
            what["split_sizes"] = [list(splits[0]), list(splits[1])]
        text = json.dumps(what, separators=(",", ":")).encode()
        if len(text) > SLOT_BYTES - _HEAD.size:     # a long list of tensors: keep the first sizes
            if len(shapes) <= 1 and len(out_shapes) <= 1:
                frames[:] = [dict(f, filename=os.path.basename(f["filename"])) for f in frames]
                what["frames"] = frames
                return json.dumps(what, separators=(",", ":")).encode()[:SLOT_BYTES - _HEAD.size]
            shorter = (reduce_op, out_shapes[:4], out_dtype, None) if details else ()
            return self._describe((kind, group, peer, shapes[:4], dtype, shorter, key[6], line), code, group)
        if len(self._sites) > 4096:
            self._sites.clear()
        self._sites[key] = (code, text)
        return text

    def _fail(self, offset: int, record_id: int, error) -> None:
        head = list(_HEAD.unpack_from(self._ring, offset))
        text = bytes(self._ring[offset + _HEAD.size:offset + _HEAD.size + head[-1]])
        message = (f"{type(error).__name__}: {error}" if error is not None else "failed").splitlines()[0]
        room = SLOT_BYTES - _HEAD.size - len(text)
        extra = json.dumps({"error": message}, separators=(",", ":")).encode()
        while len(extra) > room and len(message) > 20:       # keep as much of the message as fits
            message = message[:len(message) - (len(extra) - room) - 4] + "..."
            extra = json.dumps({"error": message}, separators=(",", ":")).encode()
        text = (text[:-1] + b"," + extra[1:]) if len(extra) <= room else text
        self._ring[offset + _HEAD.size:offset + _HEAD.size + len(text)] = text
        head[6], head[7], head[8] = fr.STARTED, 1, len(text)
        _HEAD.pack_into(self._ring, offset, *head)
        self._waiting.pop(record_id, None)

    # -- reading and dumping ---------------------------------------------------------------
    def entries(self) -> list[dict]:
        """The calls in the ring, oldest first, as torch's Flight Recorder names their fields."""
        return fr.ring_entries(self._ring, self.buffer_size)

    def dump(self, reason: str = "request", request_id: int | None = None) -> Path:
        """Write ``rank<r>.json`` (atomically: a reader never sees half a file); its path.
        ``request_id``: the launcher's request this dump answers."""
        with self._lock:
            data = {"request_id": request_id}
            data.update(fr.dump_header(self.rank, self.world_size, os.getpid(), reason, self.buffer_size,
                                       self.recorded))
            data["exception"] = self.exception
            entries, added = self.entries(), 0
            try:                        # the extras: a dump is written even when they fail
                data["network"] = fr.network()
                if self.merge_torch:
                    entries, added = flight_torch.merge(entries, flight_torch.torch_entries(),
                                                        self.recorded > self.buffer_size)
            except Exception as exc:  # noqa: BLE001 - said in the dump instead
                data["extras_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            data["torch_entries"] = added
            data["entries"] = entries
            data["pg_config"] = fr.pg_config(entries)
            tmp = self.dump_path.with_suffix(f".tmp{threading.get_ident()}")
            tmp.write_text(json.dumps(data, indent=1, default=str))   # an odd value of torch's: as text
            os.replace(tmp, self.dump_path)
            return self.dump_path

    # -- the thread that answers signals and timeouts --------------------------------------
    def serve(self) -> None:
        """Start the thread that dumps on :data:`DUMP_SIGNAL` and on ``dump_after``. Call it from
        the main thread, before ``init_process_group``: the signal is blocked in this thread and
        every thread started after it (gloo's), so only the recorder's thread receives it."""
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {DUMP_SIGNAL})
        handler = None
        if threading.current_thread() is threading.main_thread():
            # a thread that existed before (started it late) may still get the signal: answer it there
            handler = signal.signal(DUMP_SIGNAL, lambda *_: self.dump(*_request(self.directory)))
        self._restore = (mask, handler)
        self._thread = threading.Thread(target=self._serve, name="flight-recorder", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # A thread torch started before serve() (its intra-op pool) may take the signal instead,
        # and the main thread may be asleep: the launcher's request file is also looked at.
        period = min(0.1, self.dump_after / 4) if self.dump_after else 0.1
        answered = None
        while not self._stopping:
            got = signal.sigtimedwait({DUMP_SIGNAL}, period)
            if self._stopping:
                return
            reason, request_id = _request(self.directory)
            if got is not None or (request_id is not None and request_id != answered):
                answered = request_id
                self.dump(reason, request_id)
            elif self.dump_after:
                limit = time.time_ns() - int(self.dump_after * 1e9)
                overdue = {r for r, t in list(self._waiting.items()) if t < limit} - self._timed_out
                if overdue:
                    self._timed_out |= overdue
                    self.dump("timeout")

    def close(self) -> None:
        """Stop listening and the thread; the ring file stays (it is the record)."""
        global _active
        if self._remove:
            self._remove()
            self._remove = None
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            signal.pthread_kill(self._thread.ident, DUMP_SIGNAL)
            self._thread.join(timeout=5)
        if self._restore is not None and threading.current_thread() is threading.main_thread():
            mask, handler = self._restore
            if handler is not None:
                signal.signal(DUMP_SIGNAL, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            self._restore = None
        if _active is self:
            _active = None
        self._ring.close()


def _request(directory: Path) -> tuple[str, int | None]:
    """The reason and id of the launcher's request (a signal from anyone else: "signal")."""
    try:
        request = json.loads((directory / "request.json").read_text())
        return request["reason"], request["id"]
    except (OSError, ValueError, KeyError):
        return "signal", None


# -- this process's recorder ---------------------------------------------------------------
_active: FlightRecorder | None = None


def start(directory: str | os.PathLike, rank: int | None = None, world_size: int | None = None,
          buffer_size: int | None = None, dump_after: float | None = None) -> FlightRecorder:
    """Record this rank's calls into ``directory`` and answer dump requests (one per process).

    Installs the call wrappers (:func:`collectives.core.trace.install`) where nothing did
    (``torchrun``), turns torch's own Flight Recorder on when no process group exists yet
    (call it before ``init_process_group`` to record DDP's calls), and dumps when the
    process exits or its code raises.

    ``rank``/``world_size`` default to the environment's (``RANK``, ``WORLD_SIZE``);
    ``buffer_size`` to ``COLLECTIVES_TRACE_BUFFER_SIZE`` or 2000; ``dump_after`` (seconds a
    call may stay in flight before the rank dumps by itself) to ``COLLECTIVES_DUMP_ON_TIMEOUT``.
    """
    global _active
    if _active is not None:
        _active.close()
    rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    buffer_size = buffer_size or int(os.environ.get(ENV_BUFFER, DEFAULT_BUFFER))
    if dump_after is None and os.environ.get(ENV_DUMP_AFTER):
        dump_after = float(os.environ[ENV_DUMP_AFTER])
    if not dist.is_initialized():
        flight_torch.enable(buffer_size)     # torch reads it as each process group is made
    recorder = FlightRecorder(directory, rank, world_size, buffer_size, dump_after)
    recorder._remove = trace.add_listener(recorder)
    if not trace.installed():               # under torchrun nothing else wraps torch.distributed
        trace.install(rank)
    recorder.serve()
    _active = recorder
    global _hooked
    if not _hooked:
        _hooked = True
        atexit.register(_at_exit)
        previous = sys.excepthook

        def excepthook(kind, value, tb):
            note_exception(value)
            previous(kind, value, tb)
        sys.excepthook = excepthook
    return recorder


def start_from_env(rank: int, world_size: int) -> FlightRecorder | None:
    """:func:`start` into ``COLLECTIVES_FLIGHT_RECORDER`` when it is set (what the launcher does)."""
    directory = os.environ.get(ENV_DIR)
    return start(directory, rank, world_size) if directory else None


_hooked = False


def note_exception(exc: BaseException) -> None:
    """The rank's code raised ``exc``: remember it (every later dump quotes it) and dump now."""
    if _active is None:
        return
    _active.exception = (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__).splitlines()[0][:500]
    try:
        _active.dump(f"exception: {_active.exception}")
    except Exception:  # noqa: BLE001 - a dump that fails must not hide the exception
        pass


def _at_exit() -> None:
    if _active is not None and not _active._stopping:
        try:
            _active.dump("exit" if _active.exception is None else f"exception: {_active.exception}")
        except Exception:  # noqa: BLE001 - the interpreter is going away
            pass


def active() -> FlightRecorder | None:
    return _active


def dump(reason: str = "request") -> Path | None:
    """Dump this rank's recorder now (None when none is running)."""
    return _active.dump(reason) if _active is not None else None


def stop() -> None:
    if _active is not None:
        _active.close()
