"""What the launcher keeps of each rank besides its result: where it is, what it wrote to
stderr, and its tie to the launcher's life.

* the **status board** -- shared memory each rank writes "where am I waiting" into
  (:mod:`collectives.core.trace` writes through a rank's :class:`Slot`), read by the
  watchdog when a world overruns and by the error of a rank that died;
* **stderr** -- each rank's file descriptor 2 goes to a file of its own, so C++ messages
  and fatal-error dumps are kept, shown when the rank fails and passed on when it works;
* **dying with the launcher** -- a rank must not outlive the process that started it.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time

import torch

SLOT_BYTES = 200
STDERR_TAIL_LINES = 20      # lines of a dead rank's stderr that its RankError shows


class StatusBoard:
    """Shared memory the ranks write "where am I waiting" into, for the watchdog to read."""

    def __init__(self, ctx, world_size: int):
        self.text = ctx.Array(ctypes.c_char, world_size * SLOT_BYTES, lock=False)
        self.since = ctx.Array(ctypes.c_double, world_size, lock=False)
        self.done = ctx.Array(ctypes.c_byte, world_size, lock=False)
        # what each rank is doing in its caller's words (trace.context: function and case)
        self.context = ctx.Array(ctypes.c_char, world_size * SLOT_BYTES, lock=False)
        # the last course collective each rank entered ("ring_all_reduce"; trace.note_call)
        self.collective = ctx.Array(ctypes.c_char, world_size * SLOT_BYTES, lock=False)

    def slot(self, rank: int) -> "Slot":
        return Slot(self, rank)

    def read(self, rank: int) -> tuple[str, float]:
        return _text(self.text, rank), self.since[rank]

    def read_context(self, rank: int) -> str:
        return _text(self.context, rank)

    def read_collective(self, rank: int) -> str:
        return _text(self.collective, rank)


def _text(array, rank: int) -> str:
    raw = bytes(array[rank * SLOT_BYTES:(rank + 1) * SLOT_BYTES])
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def _put(array, rank: int, text: str) -> None:
    data = text.encode()[: SLOT_BYTES - 1] + b"\0"
    start = rank * SLOT_BYTES
    array[start:start + len(data)] = data


class Slot:
    """One rank's view of the board: :mod:`collectives.core.trace` writes through it."""

    def __init__(self, board: StatusBoard, rank: int):
        self.board, self.rank = board, rank

    def set(self, text: str) -> None:
        _put(self.board.text, self.rank, text)
        self.board.since[self.rank] = time.time()

    def set_context(self, text: str) -> None:
        _put(self.board.context, self.rank, text)

    def set_collective(self, name: str) -> None:
        _put(self.board.collective, self.rank, name)


LAUNCHER_ENV = "COLLECTIVES_LAUNCHER"   # "<pid>:<1 if the launching thread is the main thread>"


def launcher_tag() -> str:
    """What a rank needs to know to die with its launcher, written in the launcher."""
    return f"{os.getpid()}:{int(threading.current_thread() is threading.main_thread())}"


def die_with_parent(tag: str | None = None) -> None:
    """End this rank when the process that launched it goes away.

    Linux's ``PR_SET_PDEATHSIG`` delivers SIGKILL when the *thread* that forked the child
    exits, not the process: right for a world launched from a process's main thread, and
    a silent kill of every rank for one launched from a thread that finishes first. So a
    rank forked from another thread watches its parent process instead (a daemon thread
    that looks every half second whether it has been handed to another parent)."""
    parent, from_main = (int(x) for x in tag.split(":")) if tag else (os.getppid(), 1)
    if from_main:
        try:  # Linux: deliver SIGKILL to this child when the parent goes away
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:  # pragma: no cover - not Linux
            pass
    if os.getppid() != parent:   # the launcher died before the line above
        os._exit(1)
    if not from_main:
        def watch():
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended in this cgroup (v2), or None."""
    try:
        with open("/sys/fs/cgroup/memory.events") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def why_killed(oom_before: int | None) -> str:
    """For a rank ended by SIGKILL: who can have sent it, from what this machine can tell."""
    after = oom_kills()
    if oom_before is not None and after is not None and after > oom_before:
        return (f"; the kernel's out-of-memory killer ended {after - oom_before} process(es) in this "
                "cgroup meanwhile: the machine ran out of memory")
    available = ""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = f", {int(info['MemAvailable'].split()[0]) >> 10} MiB of memory free now"
    except (OSError, KeyError, ValueError):
        pass
    return ("; not sent by this launcher, which stops ranks only after a world ends or at its time "
            "limit, and says so: another process sent it, or the kernel's out-of-memory killer"
            f"{available}")


def capture_stderr(path: str) -> None:
    """Point file descriptor 2 at ``path``: C++ logging (gloo, NCCL), Python's writes and a
    fatal-error dump all land there. ``sys.stderr`` and faulthandler are re-aimed at it:
    under pytest both point elsewhere (a capture file, a copy of the terminal's stderr)."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)


def read_tail(path: str, max_bytes: int = 1 << 16) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
_CPP_LEVELS = {"INFO": 0, "WARNING": 1, "ERROR": 2, "FATAL": 3}


def set_cpp_log_level(level: str) -> None:
    """What ``TORCH_CPP_LOG_LEVEL=level`` does, in a process that imported torch already.

    torch reads the variable once, at import, into c10's ``FLAGS_caffe2_log_level``; a
    forked rank sets that flag itself. An unknown level, or a libc10 without the flag,
    changes nothing.
    """
    value = _CPP_LEVELS.get(level.upper(), int(level) if level.isdigit() else None)
    if value is None:
        return
    try:
        lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
        ctypes.c_int.in_dll(ctypes.CDLL(lib), "FLAGS_caffe2_log_level").value = value
    except (OSError, ValueError):
        pass


STACK_FRAMES_SHOWN = 6      # innermost frames kept of each stack in a fatal-error dump


def stderr_tail(path: str) -> str:
    """The last lines of a rank's stderr. Python's fatal-error dump is trimmed to the
    innermost frames of each stack (it lists them first; the rest is the launcher, pytest,
    a notebook's kernel) and loses its list of loaded extension modules."""
    lines, frames = [], None
    for line in read_tail(path).splitlines():
        if not line.strip() or line.startswith("Extension modules:"):
            continue
        if line.startswith(("Thread 0x", "Current thread 0x", "Stack (most recent call first)")):
            frames = 0
        elif frames is not None and line.startswith("  File "):
            frames += 1
            if frames == STACK_FRAMES_SHOWN + 1:
                lines.append("  ...")
            if frames > STACK_FRAMES_SHOWN:
                continue
        else:
            frames = None
        lines.append(line)
    return "\n".join(lines[-STDERR_TAIL_LINES:])


def where(board, rank: int) -> str:
    """", in ring_all_reduce, waiting on irecv from rank 0": from the trace."""
    parts = []
    context = board.read_collective(rank) or board.read_context(rank)
    if context:
        parts.append(f"in {context}")
    text, _ = board.read(rank)
    if text.startswith("in "):
        text = text[3:]
    if text and text not in ("running", "finished"):
        parts.append(text if text.startswith(("waiting", "starting")) else f"inside {text}")
    return ", " + ", ".join(parts) if parts else ""
