"""Run a function on N local ranks and get each rank's result back.

::

    from collectives import launch

    def hello():                      # a module-level function (or one defined in a notebook)
        t = torch.tensor([dist.get_rank()])
        dist.all_reduce(t)
        return t.item()

    launch.run(hello, world_size=4)   # -> [6, 6, 6, 6]

The same call works from pytest, a notebook cell and the command line. Each rank is a
process with an initialized default process group (gloo on CPU; NCCL with one GPU per
rank when ``backend="nccl"``), ``torch.distributed`` traced (:mod:`collectives.core.trace`)
and the usual launcher variables set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``; ``MASTER_PORT`` on a simulated cluster).

What it promises:

* **fast start** -- on CPU the ranks are forked (about 0.1 s for 4 ranks instead of
  3.5-5.5 s for spawned ones); NCCL ranks are spawned, as CUDA requires.
* **no port, no stall** -- the ranks meet through a file store of this world's own: no
  port to clash with another world's, and no TCP connection for c10d to look a host name
  up for (it asked the DNS resolver about 127.0.0.1, and a world in eight waited out the
  resolver's 5 s timeout). A simulated cluster's ranks meet through a TCP store on
  machine 0, on a port the kernel picks.
* **errors name the rank** -- when a rank raises, :class:`RankError` reaches the caller
  with that rank's traceback, and the other ranks are killed at once: nobody sits in a
  cleanup barrier waiting for a peer that will never come. A rank that dies without a
  traceback (gloo aborting on a message of the wrong size, a segfault) is reported with
  the last lines it wrote to stderr and the collective it was in.
* **quiet ranks** -- each rank's stderr (C++ included: the file descriptor is redirected)
  goes to a file of its own. A world that succeeds copies it to the caller's
  ``sys.stderr``, where pytest and notebooks catch it; a world that fails puts its tail
  in the error instead, so an expected crash prints nothing.
* **back to back** -- a rank that is done stays up until the launcher has every result
  and ends the world: a rank that exited at once would close its connections while a
  slower peer was still completing gloo's handshake with it, and that peer failed with
  "Connection closed by peer": worlds started back to back failed now and then.
* **check mode** -- ``check=True`` (or ``COLLECTIVES_CHECK=1``) makes every course
  algorithm compare its arguments across ranks before it communicates
  (:func:`collectives.core.ops.check_all_reduce_args`).
* **no hangs** -- a watchdog ends a world that overruns ``timeout`` and raises
  :class:`WorldTimeout` saying where each rank was waiting ("rank 1 waiting in recv from
  rank 0"), read from the trace.
* **a flight recorder** -- with ``flight_recorder=DIR`` every rank records its last calls
  (:mod:`collectives.core.flight_recorder`) and, however the world ends, dumps them to
  ``DIR`` before it is stopped: ``.venv/bin/python -m collectives diagnose DIR`` names the culprit.
* **nothing left behind** -- every child is killed and reaped on every way out, and a
  child dies with its parent.

With ``machines=M`` (or ``cluster=`` a running :class:`~collectives.core.cluster.Cluster`)
the ranks are spread machine-major over M simulated machines joined by a shaped link: each
rank enters its machine's network namespace before it opens a socket, gets
``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as torchrun would give them and
``GLOO_SOCKET_IFNAME`` naming its link, and rank 0 hosts the store on machine 0's address.
The same promises hold (needs root and iproute2). Its ranks log C++ messages from ERROR up
(``TORCH_CPP_LOG_LEVEL=ERROR``, unless the environment or ``env=`` names another level):
c10d warns once per connection that 198.18.x.x has no host name, which says nothing.

What each rank's process does, from its start to its end, is :mod:`collectives.core.worker`.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from . import channels, flight_dumps, rankio
from . import cluster as _cluster
from . import flight_recorder as _recorder
from . import relay as _relay
from .ops import on_gpus
from .worker import _worker

__all__ = ["run", "run_world", "World", "RankError", "WorldTimeout", "auto_backend"]



class RankError(RuntimeError):
    """A rank raised (or died). ``rank`` is the first rank that failed, ``remote_traceback`` its traceback."""

    def __init__(self, rank: int, summary: str, remote_traceback: str, others: dict[int, str],
                 stderr_tail: str = ""):
        self.rank = rank
        self.summary = summary
        self.remote_traceback = remote_traceback
        self.others = others
        self.stderr_tail = stderr_tail
        lines = [f"rank {rank} failed: {summary}", "", f"--- traceback of rank {rank} ---",
                 remote_traceback.rstrip()]
        if stderr_tail:
            lines += ["", f"--- last lines rank {rank} wrote to stderr ---", stderr_tail.rstrip()]
        if others:
            lines += ["", "other ranks, by the time the world was stopped:"]
            lines += [f"  rank {r}: {s}" for r, s in sorted(others.items())]
        super().__init__("\n".join(lines))


class WorldTimeout(TimeoutError):
    """The world overran its time limit. ``waiting[rank]`` says where each rank was;
    ``context[rank]`` what it was doing, as set by :func:`collectives.core.trace.context`
    ("ring_all_reduce, case n=1001 float32 SUM"), for the ranks that had set one."""

    def __init__(self, seconds: float, waiting: dict[int, str], context: dict[int, str] | None = None):
        self.seconds = seconds
        self.waiting = waiting
        self.context = dict(context or {})
        lines = [f"the world did not finish within {seconds:g} s; it was stopped"
                 + (f" in {self.where}" if self.where else "") + ". Where each rank was:"]
        lines += [f"  rank {r} {w}" for r, w in sorted(waiting.items())]
        super().__init__("\n".join(lines))

    @property
    def where(self) -> str:
        """What the stuck ranks were doing (the context most of them had set), or ""."""
        stuck = [self.context[r] for r, w in self.waiting.items() if self.context.get(r) and w != "finished"]
        return max(set(stuck), key=stuck.count) if stuck else ""


def auto_backend(world_size: int) -> str:
    """What the command line picks: ``"nccl"`` when there is a GPU for every rank, else
    ``"gloo"``. :func:`run` itself defaults to gloo, so tests and notebooks stay on CPU."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


class World:
    """What :func:`run_world` returns: each rank's result, secret and stream, rank 0 first."""

    def __init__(self, results: list[Any], secrets: list[int] | None, streams: list[list[Any]] | None,
                 complete: list[bool] | None, keys: list[bytes] | None = None,
                 relayed: list[list[tuple]] | None = None, relay_problems: list[str] | None = None):
        self.results = results
        self.secrets = secrets      # the number each rank read with channels.secret()
        self.streams = streams      # what each rank's stream carried, in order (channels.opened reads it)
        self.complete = complete    # whether every object a rank counted as sent arrived
        self.keys = keys            # the key each rank's stream was signed with
        self.relayed = relayed      # per rank, every message it sent through the relay (relay.Hub.log)
        self.relay_problems = relay_problems or []


def run(fn: Callable[..., Any], world_size: int = 4, args: tuple = (), kwargs: dict | None = None,
        **options) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results, rank 0 first.

    The options are :func:`run_world`'s.
    """
    return run_world(fn, world_size, args, kwargs, **options).results


def run_world(fn: Callable[..., Any], world_size: int = 4, args: tuple = (), kwargs: dict | None = None,
              *, backend: str | None = None, timeout: float = 120.0, start_method: str | None = None,
              local_world_size: int | None = None, threads: int | None = 1,
              env: dict[str, str] | None = None, init_timeout: float = 30.0,
              check: bool | None = None, machines: int | None = None, link: str = "1gbit",
              burst: str = "256kb", rails: bool = False,
              cluster: "_cluster.Cluster | None" = None, secrets: bool = False,
              stream: bool = False, flight_recorder: str | os.PathLike | None = None,
              relay: Callable[[torch.Tensor], Any] | None = None) -> World:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return a :class:`World`.

    Args:
        fn: a module-level function (with fork, a function defined in a notebook works too).
        world_size: number of ranks.
        backend: ``"gloo"`` (default), ``"nccl"`` (one GPU per rank, spawned ranks), or both,
            ``"cpu:gloo,cuda:nccl"``: GPU tensors through NCCL, CPU tensors through gloo.
        timeout: seconds before the watchdog stops the world and raises :class:`WorldTimeout`.
        start_method: ``"fork"`` (default for gloo) or ``"spawn"`` (default for NCCL).
        local_world_size: ranks per simulated machine (``LOCAL_WORLD_SIZE``); default all.
        threads: intra-op threads per rank (1: ranks share few cores); ``None`` leaves torch's default.
        env: extra environment variables for the ranks.
        init_timeout: seconds the ranks may take to find each other before failing.
        check: compare every course collective's arguments across ranks before it runs
            (``COLLECTIVES_CHECK=1`` in the ranks); ``None`` leaves the environment's choice.
        machines: spread the ranks over this many simulated machines
            (:class:`~collectives.core.cluster.Cluster`, made for this call and removed
            after it): machine-major, ``world_size // machines`` ranks on each, every rank
            in its machine's network namespace with ``GLOO_SOCKET_IFNAME`` set to its link.
        link, burst, rails: the cluster's link rate, token-bucket depth and one link per
            local rank (see :class:`~collectives.core.cluster.Cluster`).
        cluster: a running cluster to place the ranks on instead (one cluster, many
            worlds); ``machines``, ``link``, ``burst`` and ``rails`` are then its own.
        secrets: give each rank a random number of its own, drawn after every rank was
            forked (:func:`collectives.core.channels.secret`); ``World.secrets`` holds them.
        stream: let each rank send objects as it goes (:func:`collectives.core.channels.recorder`);
            ``World.streams`` holds them, in order, signed (:func:`collectives.core.channels.opened`
            reads them with ``World.keys``).
        relay: carry the ranks' messages through this process (:mod:`collectives.core.relay`)
            and write each down with ``relay(tensor)`` of what it carried; ``World.relayed``
            holds them. Only a process group that sends through the relay uses it (the
            grader's fenced group).
        flight_recorder: a directory: every rank records its calls there and dumps them
            (``rank<r>.json``) as the world ends, however it ends, with ``world.json``
            (default ``COLLECTIVES_FLIGHT_RECORDER``; see :mod:`collectives.core.flight_recorder`).

    Raises:
        RankError: a rank raised or died; the message names it and carries its traceback.
        WorldTimeout: the world overran ``timeout``; the message says where each rank waited.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    backend = backend or "gloo"
    gpus = on_gpus(backend)
    # NCCL needs a GPU per rank; a backend of GPUs without NCCL (the grader's: its messages go
    # through the relay) lets ranks share them, rank r on GPU r mod count
    needed = world_size if "nccl" in backend else 1
    if gpus and torch.cuda.device_count() < needed:
        raise RuntimeError(f"backend={backend!r} needs {needed} GPUs, found {torch.cuda.device_count()}")
    if start_method is None:
        start_method = "spawn" if gpus else "fork"
    if cluster is None and machines is not None:
        if machines < 2 or world_size % machines:
            raise ValueError(f"world_size {world_size} does not split over {machines} machines "
                             "(at least 2, each with the same number of ranks)")
        with _cluster.Cluster(machines, world_size // machines, link=link, burst=burst,
                              rails=rails) as made:
            return run_world(fn, world_size, args, kwargs, backend=backend, timeout=timeout,
                             start_method=start_method, local_world_size=local_world_size,
                             threads=threads, env=env, init_timeout=init_timeout, check=check,
                             cluster=made, secrets=secrets, stream=stream,
                             flight_recorder=flight_recorder, relay=relay)
    placements = [None] * world_size
    if cluster is not None:
        if world_size % cluster.n_machines:
            raise ValueError(f"world_size {world_size} does not split over {cluster.n_machines} "
                             "machines: give each machine the same number of ranks")
        if local_world_size not in (None, world_size // cluster.n_machines):
            raise ValueError(f"local_world_size is {world_size // cluster.n_machines} on this cluster")
        local_world_size = world_size // cluster.n_machines
        placements = [(cluster.machines[rank // local_world_size].netns_path,
                       cluster.rank_env(rank, world_size)) for rank in range(world_size)]
    ctx = mp.get_context(start_method)
    board = rankio.StatusBoard(ctx, world_size)
    # The store's port is picked by the kernel (rank 0 publishes it here), so two worlds
    # -- two test runs, a notebook and a test -- never fight over 29500.
    port_box = ctx.Value(ctypes.c_int, 0, lock=False)
    # gloo's own timeout stays behind the watchdog's: a rank stuck in a message is reported
    # by the watchdog, with where it waited, instead of returning a gloo timeout error.
    pg_timeout = timeout + max(5.0, timeout / 2)
    env = dict(env or {})
    if check is not None:
        env["COLLECTIVES_CHECK"] = "1" if check else "0"
    env[rankio.LAUNCHER_ENV] = rankio.launcher_tag()
    oom_before = rankio.oom_kills()
    recorder_dir = flight_recorder or env.get(_recorder.ENV_DIR) or os.environ.get(_recorder.ENV_DIR)
    if recorder_dir:
        env[_recorder.ENV_DIR] = recorder_dir = str(flight_dumps.prepare(recorder_dir).resolve())
        env[flight_dumps.RUN_ENV] = run_id = os.urandom(6).hex()    # in every dump and world.json
    stderr_dir = tempfile.mkdtemp(prefix="collectives-world-")
    stderr_paths = [os.path.join(stderr_dir, f"rank{rank}.stderr") for rank in range(world_size)]
    procs, conns, secret_ends, streams = [], {}, [], {}
    hub = _relay.Hub(ctx, world_size, relay) if relay is not None else None
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            secret_in, secret_out = ctx.Pipe(duplex=False) if secrets else (None, None)
            stream_in, stream_out = ctx.Pipe(duplex=False) if stream else (None, None)
            relay_end = hub.end_for(rank) if hub else None
            p = ctx.Process(target=_worker, name=f"rank{rank}", daemon=True,
                            args=(rank, world_size, local_world_size or world_size, fn, args,
                                  kwargs, backend, port_box, child_end, board, pg_timeout,
                                  min(init_timeout, timeout), threads, env, placements[rank],
                                  stderr_paths[rank], os.path.join(stderr_dir, "store"),
                                  secret_in, stream_out, relay_end))
            p.start()
            for end in (child_end, secret_in, stream_out, relay_end and relay_end[0]):
                if end is not None:
                    end.close()
            procs.append(p)
            conns[parent_end] = rank
            secret_ends.append(secret_out)
            if stream_in is not None:
                streams[stream_in] = rank
        if hub is not None:
            hub.start()
        drawn = None
        if secrets:
            # Drawn only now, after every rank was forked: no rank's memory ever held another's.
            drawn = [channels.draw() for _ in range(world_size)]
            for end, value in zip(secret_ends, drawn):
                end.send_bytes(value)
                end.close()
        received: list[list[Any]] = [[] for _ in range(world_size)]
        try:
            results, counts = _collect(procs, conns, board, timeout, stderr_paths, streams, received, oom_before,
                                       sealed=secrets)
        except (WorldTimeout, RankError) as exc:
            if recorder_dir:        # every live rank dumps its calls before it is stopped
                flight_dumps.dump_world(recorder_dir, procs, lambda r: board.read(r)[0], exc, run_id)
            raise
        if recorder_dir:
            flight_dumps.dump_world(recorder_dir, procs, lambda r: board.read(r)[0], None, run_id)
        _end(procs)
        if hub is not None:
            hub.close()
        for path in stderr_paths:    # a world that worked: its ranks' stderr, where it belongs
            text = rankio.read_tail(path)
            if text:
                sys.stderr.write(text)
        return World(results, [channels.secret_of(v) for v in drawn] if drawn else None,
                     received if stream else None,
                     [len(got) == n for got, n in zip(received, counts)] if stream else None,
                     [channels.key_of(v) for v in drawn] if drawn else None,
                     hub.log if hub else None, hub.problems if hub else None)
    finally:
        _end(procs)
        if hub is not None:
            hub.close(wait=0.5)
        for c in list(conns) + list(streams) + [e for e in secret_ends if e is not None]:
            c.close()
        shutil.rmtree(stderr_dir, ignore_errors=True)


def _end(procs) -> None:
    """Kill and reap every rank (they wait to be ended; see ``_worker``)."""
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join(timeout=10)


def _signal_name(number: int) -> str:
    try:
        return f"signal {number}, {signal.Signals(number).name}"
    except ValueError:
        return f"signal {number}"


def _collect(procs, conns, board, timeout, stderr_paths, streams=None, received=None, oom_before=None,
             sealed: bool = False):
    """Every rank's result (and the count of objects it sent on its stream), reading the
    streams as they come; raises :class:`RankError` or :class:`WorldTimeout`."""
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    counts = [0] * world_size
    errors: dict[int, tuple[str, str, float]] = {}
    deadline = time.monotonic() + timeout
    pending = dict(conns)
    open_streams = dict(streams or {})
    by_rank = {rank: conn for conn, rank in open_streams.items()}
    while pending:
        left = deadline - time.monotonic()
        if errors:
            # Give the other ranks a moment to report their own failures, then stop them.
            left = min(left, 0.3)
        waiting_on = list(pending) + list(open_streams)
        ready = mp.connection.wait(waiting_on, timeout=max(left, 0)) if left > 0 else []
        for conn in [c for c in ready if c in open_streams]:
            # a rank's stream: read it as it comes (a full pipe would stop the rank)
            if not channels.drain(conn, received[open_streams[conn]]):
                del open_streams[conn]
        ready = [c for c in ready if c in pending]
        if not ready and not errors and time.monotonic() < deadline:
            continue                          # only a stream had something
        if not ready:
            if errors:
                break
            waiting, context = {}, {}
            for rank in range(world_size):
                context[rank] = board.read_context(rank)
            for rank in pending.values():
                text, since = board.read(rank)
                held = f" (for {time.time() - since:.1f} s)" if since else ""
                if text.startswith("in "):
                    text = "waiting " + text          # "waiting in recv from rank 0"
                waiting[rank] = (text or "running (not in a traced call)") + held
                if context[rank]:
                    waiting[rank] += f", in {context[rank]}"
            for rank in range(world_size):
                # only a rank whose function returned is "finished"
                waiting.setdefault(rank, "finished" if board.done[rank] else "stopped without a result")
            raise WorldTimeout(timeout, waiting, context)
        for conn in ready:
            rank = pending.pop(conn)
            try:
                # a graded world's result is read as data: no class of the rank's own is rebuilt here
                status, value, tb, counts[rank] = (channels.sealed_loads if sealed else pickle.loads)(conn.recv_bytes())
                if rank in by_rank and by_rank[rank] in open_streams:
                    # everything it sent before its result is in the pipe already
                    channels.drain(by_rank[rank], received[rank])
            except (pickle.UnpicklingError, ValueError, TypeError) as exc:   # not data, or not a result
                errors[rank] = (f"its result could not be read as data: {exc}", "", time.monotonic())
                continue
            except (EOFError, OSError):
                procs[rank].join(timeout=1)
                code = procs[rank].exitcode
                how = f"killed by {_signal_name(-code)}" if code and code < 0 else f"exit code {code}"
                if code == -signal.SIGKILL:
                    how += rankio.why_killed(oom_before)
                errors[rank] = (f"the process died without a result ({how}){rankio.where(board, rank)}",
                                "", time.monotonic())
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = (value, tb, time.monotonic())
    if errors:
        # The first rank to fail, preferring a cause to its echoes: when a rank dies, its
        # peers fail with gloo's "Connection closed by peer ... remote worker crashing".
        first = min(errors, key=lambda r: ("remote worker" in errors[r][0], errors[r][2], r))
        others = {r: e[0] for r, e in errors.items() if r != first}
        for rank in pending.values():
            text, _ = board.read(rank)
            others.setdefault(rank, f"stopped while {text or 'running'}")
        tail = ""
        if not errors[first][1]:   # no traceback: what it wrote to stderr is all there is
            procs[first].join(timeout=1)
            tail = rankio.stderr_tail(stderr_paths[first])
            if "collective mismatch" in tail or "doesn't match expected size" in tail:
                errors[first] = (errors[first][0] + "; the ranks' messages did not match: "
                                 "compare the arguments with launch.run(..., check=True)",) + errors[first][1:]
        raise RankError(first, errors[first][0], errors[first][1] or "(no traceback)", others, tail)
    return results, counts
