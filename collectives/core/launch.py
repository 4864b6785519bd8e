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
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

What it promises:

* **fast start** -- on CPU the ranks are forked (about 0.1 s for 4 ranks instead of
  3.5-5.5 s for spawned ones); NCCL ranks are spawned, as CUDA requires.
* **a free port every time** -- the rendezvous store listens on a port the kernel picks.
* **errors name the rank** -- when a rank raises, :class:`RankError` reaches the caller
  with that rank's traceback, and the other ranks are killed at once: nobody sits in a
  cleanup barrier waiting for a peer that will never come.
* **no hangs** -- a watchdog ends a world that overruns ``timeout`` and raises
  :class:`WorldTimeout` saying where each rank was waiting ("rank 1 waiting in recv from
  rank 0"), read from the trace.
* **nothing left behind** -- every child is killed and reaped on every way out, and a
  child dies with its parent.

With ``machines=M`` (or ``cluster=`` a running :class:`~collectives.core.cluster.Cluster`)
the ranks are spread machine-major over M simulated machines joined by a shaped link: each
rank enters its machine's network namespace before it opens a socket, gets
``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as torchrun would give them and
``GLOO_SOCKET_IFNAME`` naming its link, and rank 0 hosts the store on machine 0's address.
The same promises hold (needs root and iproute2).
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import cluster as _cluster, trace

__all__ = ["run", "RankError", "WorldTimeout", "auto_backend"]

_SLOT_BYTES = 200


class RankError(RuntimeError):
    """A rank raised (or died). ``rank`` is the first rank that failed, ``remote_traceback`` its traceback."""

    def __init__(self, rank: int, summary: str, remote_traceback: str, others: dict[int, str]):
        self.rank = rank
        self.summary = summary
        self.remote_traceback = remote_traceback
        self.others = others
        lines = [f"rank {rank} failed: {summary}", "", f"--- traceback of rank {rank} ---",
                 remote_traceback.rstrip()]
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


class _StatusBoard:
    """Shared memory the ranks write "where am I waiting" into, for the watchdog to read."""

    def __init__(self, ctx, world_size: int):
        self.text = ctx.Array(ctypes.c_char, world_size * _SLOT_BYTES, lock=False)
        self.since = ctx.Array(ctypes.c_double, world_size, lock=False)
        self.done = ctx.Array(ctypes.c_byte, world_size, lock=False)
        self.context = ctx.Array(ctypes.c_char, world_size * _SLOT_BYTES, lock=False)

    def slot(self, rank: int) -> "_Slot":
        return _Slot(self, rank)

    def read(self, rank: int) -> tuple[str, float]:
        raw = bytes(self.text[rank * _SLOT_BYTES:(rank + 1) * _SLOT_BYTES])
        return raw.split(b"\0", 1)[0].decode(errors="replace"), self.since[rank]

    def read_context(self, rank: int) -> str:
        raw = bytes(self.context[rank * _SLOT_BYTES:(rank + 1) * _SLOT_BYTES])
        return raw.split(b"\0", 1)[0].decode(errors="replace")


class _Slot:
    def __init__(self, board: _StatusBoard, rank: int):
        self.board, self.rank = board, rank

    def set(self, text: str) -> None:
        data = text.encode()[: _SLOT_BYTES - 1] + b"\0"
        start = self.rank * _SLOT_BYTES
        self.board.text[start:start + len(data)] = data
        self.board.since[self.rank] = time.time()

    def set_context(self, text: str) -> None:
        """What the rank is doing, in the caller's words (which function, which case)."""
        data = text.encode()[: _SLOT_BYTES - 1] + b"\0"
        start = self.rank * _SLOT_BYTES
        self.board.context[start:start + len(data)] = data


def auto_backend(world_size: int) -> str:
    """What the command line picks: ``"nccl"`` when there is a GPU for every rank, else
    ``"gloo"``. :func:`run` itself defaults to gloo, so tests and notebooks stay on CPU."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def _die_with_parent() -> None:
    try:  # Linux: deliver SIGKILL to this child when the parent goes away
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - not Linux
        pass


def _worker(rank, world_size, local_world_size, fn, args, kwargs, backend, port_box, conn,
            board, pg_timeout, init_timeout, threads, env, machine):
    _die_with_parent()
    status = board.slot(rank)
    try:
        store_addr = "127.0.0.1"
        if machine is not None:
            # A rank of a simulated cluster: move into its machine's network namespace
            # before any socket exists, so everything it opens lives there.
            netns_path, cluster_env = machine
            status.set("starting: entering its machine's network namespace")
            _cluster.enter_namespace(netns_path)
            os.environ.update(cluster_env)
            store_addr = cluster_env["MASTER_ADDR"]
        os.environ.update(env)
        if threads:
            torch.set_num_threads(threads)
        status.set("starting: joining the store")
        # Rank 0 hosts the rendezvous store on a port the kernel picks and publishes it;
        # the parent runs no store thread, so nothing it holds is forked mid-operation.
        init = datetime.timedelta(seconds=init_timeout)
        if rank == 0:
            store = dist.TCPStore(store_addr, 0, world_size, is_master=True,
                                  wait_for_workers=False, timeout=init)
            port_box.value = store.port
        else:
            deadline = time.monotonic() + init_timeout
            while port_box.value == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 0 did not open the store within {init_timeout:g} s")
                time.sleep(0.002)
            store = dist.TCPStore(store_addr, port_box.value, world_size, is_master=False,
                                  timeout=init)
        port = port_box.value
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_RANK=str(rank % local_world_size),
                          LOCAL_WORLD_SIZE=str(local_world_size),
                          GROUP_RANK=str(rank // local_world_size),
                          MASTER_ADDR=store_addr, MASTER_PORT=str(port))
        store.set_timeout(datetime.timedelta(seconds=pg_timeout))
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device_id = torch.device("cuda", torch.cuda.current_device())
        status.set("starting: init_process_group")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout),
                                device_id=device_id)
        trace.install(rank, status)
        status.set("running")
        result = fn(*args, **(kwargs or {}))
        board.done[rank] = 1
        status.set("finished")
        payload = pickle.dumps(("ok", result, ""))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        summary = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        payload = pickle.dumps(("error", summary, traceback.format_exc()))
    try:
        conn.send_bytes(payload)
        conn.close()
        if rank == 0 and world_size > 1:
            # Rank 0 hosts the store: it stays up until the launcher has every result and
            # reaps the world, so late ranks can still rendezvous (subgroups, NCCL comms).
            while True:
                time.sleep(3600)
    finally:
        # No destroy_process_group(): it can wait on peers. The parent reaps us.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run(fn: Callable[..., Any], world_size: int = 4, args: tuple = (), kwargs: dict | None = None,
        *, backend: str | None = None, timeout: float = 120.0, start_method: str | None = None,
        local_world_size: int | None = None, threads: int | None = 1,
        env: dict[str, str] | None = None, init_timeout: float = 30.0,
        machines: int | None = None, link: str = "1gbit", burst: str = "256kb",
        rails: bool = False, cluster: "_cluster.Cluster | None" = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results, rank 0 first.

    Args:
        fn: a module-level function (with fork, a function defined in a notebook works too).
        world_size: number of ranks.
        backend: ``"gloo"`` (default) or ``"nccl"`` (one GPU per rank, spawned ranks).
        timeout: seconds before the watchdog stops the world and raises :class:`WorldTimeout`.
        start_method: ``"fork"`` (default for gloo) or ``"spawn"`` (default for NCCL).
        local_world_size: ranks per simulated machine (``LOCAL_WORLD_SIZE``); default all.
        threads: intra-op threads per rank (1: ranks share few cores); ``None`` leaves torch's default.
        env: extra environment variables for the ranks.
        init_timeout: seconds the ranks may take to find each other before failing.
        machines: spread the ranks over this many simulated machines
            (:class:`~collectives.core.cluster.Cluster`, made for this call and removed
            after it): machine-major, ``world_size // machines`` ranks on each, every rank
            in its machine's network namespace with ``GLOO_SOCKET_IFNAME`` set to its link.
        link, burst, rails: the cluster's link rate, token-bucket depth and one link per
            local rank (see :class:`~collectives.core.cluster.Cluster`).
        cluster: a running cluster to place the ranks on instead (one cluster, many
            worlds); ``machines``, ``link``, ``burst`` and ``rails`` are then its own.

    Raises:
        RankError: a rank raised or died; the message names it and carries its traceback.
        WorldTimeout: the world overran ``timeout``; the message says where each rank waited.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    backend = backend or "gloo"
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"backend='nccl' needs {world_size} GPUs, found {torch.cuda.device_count()}")
    if start_method is None:
        start_method = "spawn" if backend == "nccl" else "fork"
    if cluster is None and machines is not None:
        if machines < 2 or world_size % machines:
            raise ValueError(f"world_size {world_size} does not split over {machines} machines "
                             "(at least 2, each with the same number of ranks)")
        with _cluster.Cluster(machines, world_size // machines, link=link, burst=burst,
                              rails=rails) as made:
            return run(fn, world_size, args, kwargs, backend=backend, timeout=timeout,
                       start_method=start_method, local_world_size=local_world_size,
                       threads=threads, env=env, init_timeout=init_timeout, cluster=made)
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
    board = _StatusBoard(ctx, world_size)
    # The store's port is picked by the kernel (rank 0 publishes it here), so two worlds
    # -- two test runs, a notebook and a test -- never fight over 29500.
    port_box = ctx.Value(ctypes.c_int, 0, lock=False)
    # gloo's own timeout stays behind the watchdog's: a rank stuck in a message is reported
    # by the watchdog, with where it waited, instead of returning a gloo timeout error.
    pg_timeout = timeout + max(5.0, timeout / 2)
    procs, conns = [], {}
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, name=f"rank{rank}", daemon=True,
                            args=(rank, world_size, local_world_size or world_size, fn, args,
                                  kwargs, backend, port_box, child_end, board, pg_timeout,
                                  min(init_timeout, timeout), threads, dict(env or {}),
                                  placements[rank]))
            p.start()
            child_end.close()
            procs.append(p)
            conns[parent_end] = rank
        return _collect(procs, conns, board, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        for c in conns:
            c.close()


def _collect(procs, conns, board, timeout):
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    errors: dict[int, tuple[str, str, float]] = {}
    deadline = time.monotonic() + timeout
    pending = dict(conns)
    while pending:
        left = deadline - time.monotonic()
        if errors:
            # Give the other ranks a moment to report their own failures, then stop them.
            left = min(left, 0.3)
        ready = mp.connection.wait(list(pending), timeout=max(left, 0)) if left > 0 else []
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
                status, value, tb = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                procs[rank].join(timeout=1)
                code = procs[rank].exitcode
                how = f"killed by signal {-code}" if code and code < 0 else f"exit code {code}"
                errors[rank] = (f"the process died without a result ({how})", "", time.monotonic())
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = (value, tb, time.monotonic())
    if errors:
        first = min(errors, key=lambda r: (errors[r][2], r))
        others = {r: e[0] for r, e in errors.items() if r != first}
        for rank in pending.values():
            text, _ = board.read(rank)
            others.setdefault(rank, f"stopped while {text or 'running'}")
        raise RankError(first, errors[first][0], errors[first][1] or "(no traceback)", others)
    return results
