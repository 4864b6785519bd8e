"""What a rank does, from its start to its end: the rank side of :mod:`collectives.core.launch`.

:func:`_worker` is the function each rank's process runs. In order, it

* **ties itself to the launcher** -- dies with it, sends its stderr (C++ included) to a file
  of its own and opens its private channels (:mod:`collectives.core.rankio`,
  :mod:`collectives.core.channels`);
* **finds its place** -- on a simulated cluster, enters its machine's network namespace
  before any socket exists; sets the launcher variables (``RANK``, ``LOCAL_RANK``, ...);
* **meets the other ranks** -- through a file store of this world's own on one machine, or a
  TCP store that rank 0 hosts on machine 0; then ``init_process_group`` and the trace
  (:func:`collectives.core.trace.install`), writing each stage to its status slot;
* **runs the function and sends the outcome back** -- its result, or its error with the
  traceback, pickled down its pipe to the launcher;
* **waits to be ended** -- it stays up until the launcher has every result and kills the
  world, so no peer still completing gloo's handshake with it sees its connections close.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
import traceback

import torch
import torch.distributed as dist

from . import channels, rankio, relay, trace
from . import cluster as _cluster
from . import flight_recorder as _recorder
from .ops import on_gpus


def _worker(rank, world_size, local_world_size, fn, args, kwargs, backend, port_box, conn,
            board, pg_timeout, init_timeout, threads, env, machine, stderr_path, store_path,
            secret_conn=None, stream_conn=None, relay_conn=None):
    rankio.die_with_parent(env.get(rankio.LAUNCHER_ENV))
    status = board.slot(rank)
    try:
        rankio.capture_stderr(stderr_path)
        channels._install(secret_conn, stream_conn)
        relay._install(relay_conn)
        store_addr = "127.0.0.1"
        if machine is not None:
            # A rank of a simulated cluster: move into its machine's network namespace
            # before any socket exists, so everything it opens lives there.
            netns_path, cluster_env = machine
            status.set("starting: entering its machine's network namespace")
            _cluster.enter_namespace(netns_path)
            os.environ.update(cluster_env)
            # c10d looks up a name for every peer's address, for its messages; 198.18.x.x has
            # none and each connection warns so. Real errors are still printed.
            rankio.set_cpp_log_level(env.get("TORCH_CPP_LOG_LEVEL")
                               or os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
            store_addr = cluster_env["MASTER_ADDR"]
        os.environ.update(env)
        if "TORCH_DISTRIBUTED_DEBUG" in env:    # torch read it at import, in the parent
            dist.set_debug_level_from_env()
        if threads:
            torch.set_num_threads(threads)
        _recorder.start_from_env(rank, world_size)     # before gloo's threads: see its serve()
        status.set("starting: joining the store")
        init = datetime.timedelta(seconds=init_timeout)
        if machine is None:
            # One machine: the ranks rendezvous through a file of this world's own. A TCP
            # store would do as well but for one thing: c10d looks up a host name for every
            # address it connects to or accepts, ::ffff:127.0.0.1 is not in /etc/hosts, and
            # the lookup goes to the DNS resolver -- which, offline or slow, answered after
            # its 5 s timeout one world in eight (docs/benchmarks-notes.md, "worlds back to back").
            store = dist.FileStore(store_path, world_size)
            store.set_timeout(init)
            rendezvous = dict(MASTER_ADDR=store_addr)
            os.environ.pop("MASTER_PORT", None)      # no port: an inherited one would mislead
        else:
            # Several machines: a TCP store on machine 0, as torchrun's static rendezvous.
            # Rank 0 hosts it on a port the kernel picks and publishes the port; the parent
            # runs no store thread, so nothing it holds is forked mid-operation.
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
            rendezvous = dict(MASTER_ADDR=store_addr, MASTER_PORT=str(port_box.value))
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_RANK=str(rank % local_world_size),
                          LOCAL_WORLD_SIZE=str(local_world_size),
                          GROUP_RANK=str(rank // local_world_size), **rendezvous)
        store.set_timeout(datetime.timedelta(seconds=pg_timeout))
        device_id = None
        if on_gpus(backend):
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if "nccl" in backend:       # NCCL connects eagerly to it; a Python process group has none
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
        payload = pickle.dumps(("ok", result, "", channels.sent()))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        _recorder.note_exception(exc)       # a dump that quotes it (when the recorder is on)
        summary = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        payload = pickle.dumps(("error", summary, traceback.format_exc(), channels.sent()))
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send_bytes(payload)
        conn.close()
        if world_size > 1:
            # Stay up until the launcher has every result and ends the world. Exiting now
            # would close this rank's connections while a slower peer may still be
            # completing gloo's handshake with it (it fails with "Connection closed by
            # peer"), and on a simulated cluster rank 0 hosts the store late ranks
            # rendezvous through.
            while True:
                time.sleep(3600)
    finally:
        # No destroy_process_group(): it can wait on peers. The parent reaps us.
        os._exit(0)
