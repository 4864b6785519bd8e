"""A world's flight recorders as it ends: every live rank dumps, the rings of the dead are read back.

What ``launch.run(fn, flight_recorder=DIR)`` does after its watchdog fires, a rank fails or
every rank returns -- and before it kills the ranks::

    launcher                                   each live rank's recorder thread
    write DIR/request.json {reason, id}
    kill -USR1 <every live rank>   ─────────►  sigtimedwait returns: dump rank<r>.json,
    wait until each rank<r>.json                 "request_id": id on its first line
      answers request id (or 5 s)
    rank died?  read DIR/rank<r>.ring (its ring, mapped into memory, outlives it)
    write DIR/world.json: the run's id, how each rank ended (returned, raised, exited,
      killed by a signal, hung), where it waited, the failure

The recorder itself is :mod:`collectives.core.flight_recorder`.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from .flight_recorder import DUMP_SIGNAL, read_ring
from .flight_ring import RUN_ENV

__all__ = ["prepare", "request_dumps", "dump_world", "how_it_ended", "DUMP_GRACE", "RUN_ENV"]

DUMP_GRACE = 5.0          # seconds the launcher waits for the ranks' dumps (they take milliseconds)


def prepare(directory: str | os.PathLike) -> Path:
    """Make ``directory`` and remove a previous world's dumps from it."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("rank*.json"), *path.glob("rank*.ring"), *path.glob("rank*.tmp*"),
                path / "world.json", path / "request.json"]:
        old.unlink(missing_ok=True)
    return path


def request_dumps(directory: Path, pids: dict[int, int], reason: str, grace: float | None = None) -> set[int]:
    """Signal every rank of ``pids`` to dump; wait up to ``grace`` seconds; the ranks that did."""
    request_id = time.time_ns()
    (directory / "request.json").write_text(json.dumps({"reason": reason, "id": request_id}))
    for pid in pids.values():
        try:
            os.kill(pid, DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    deadline, done = time.monotonic() + (DUMP_GRACE if grace is None else grace), set()
    while True:
        done = {r for r in pids if _answered(directory / f"rank{r}.json", request_id)}
        if len(done) == len(pids) or time.monotonic() > deadline:
            return done
        time.sleep(0.005)


def _answered(path: Path, request_id: int) -> bool:
    """Does the dump at ``path`` answer request ``request_id``? (Its first line says.)"""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    return f'"request_id": {request_id},'.encode() in head


def _exit_text(code: int | None) -> str | None:
    if code is None:
        return None
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def how_it_ended(code: int | None, status: str, exception: str | None, timed_out: bool) -> str:
    """One rank's end, in words: ``returned``, ``raised ValueError: ...``, ``exited with code 1``,
    ``killed by SIGKILL``, ``hung (in all_reduce ...)`` or ``stopped (running ...)``."""
    if code is not None:
        return "exited" if code == 0 else _exit_text(code).replace("exit code", "exited with code")
    if exception:
        return f"raised {exception}"
    if status == "finished":
        return "returned"
    return f"hung ({status or 'no status'})" if timed_out else f"stopped by the launcher ({status or 'no status'})"


def dump_world(directory: str | os.PathLike, procs, where, failure: BaseException | None,
               run_id: str = "") -> None:
    """What ``launch.run(..., flight_recorder=DIR)`` does as a world ends, before it kills the
    ranks: every live rank dumps, the rings of the others are recovered, and ``world.json``
    records how each rank ended. ``where(rank)`` is the launcher's "where is it waiting"."""
    directory = Path(directory)
    reason = ("timeout" if isinstance(failure, TimeoutError) else "failure" if failure else "exit")
    alive = {rank: p.pid for rank, p in enumerate(procs) if p.exitcode is None}
    dumped = request_dumps(directory, alive, reason)
    ranks = {}
    for rank, p in enumerate(procs):
        code = p.exitcode
        status = where(rank)
        exception = None
        if rank in dumped:
            try:
                exception = json.loads((directory / f"rank{rank}.json").read_text()).get("exception")
            except (OSError, ValueError):
                pass
        ranks[rank] = {"pid": p.pid, "alive": code is None, "exit": _exit_text(code), "where": status,
                       "dumped": rank in dumped, "exception": exception,
                       "end": how_it_ended(code, status, exception, reason == "timeout")}
        ring = directory / f"rank{rank}.ring"
        if rank not in dumped and ring.exists():
            # dead: what its ring holds is all there is; alive but slow to answer: its ring is current
            how = (f"recovered from its ring: {ranks[rank]['end']}" if code is not None
                   else f"{reason} (read from its ring: it did not answer within {DUMP_GRACE:g} s)")
            try:
                data = read_ring(ring, reason=how)
            except ValueError:
                continue
            data["run_id"] = data.get("run_id") or run_id
            (directory / f"rank{rank}.json").write_text(json.dumps(data, indent=1))
    record = {"run_id": run_id, "world_size": len(procs), "reason": reason, "ranks": ranks,
              "failure": str(failure).splitlines()[0] if failure else None,
              "failed_rank": getattr(failure, "rank", None),
              "stderr_tail": getattr(failure, "stderr_tail", "")}
    (directory / "world.json").write_text(json.dumps(record, indent=1))
    if failure is not None and failure.args:
        failure.args = (f"{failure.args[0]}\nflight recorder dumps in {directory}: "
                        f".venv/bin/python -m collectives diagnose {directory}",) + failure.args[1:]
