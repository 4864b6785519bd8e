"""``.venv/bin/python -m collectives cluster``: one real ``torchrun`` per machine of a simulated cluster.

::

    .venv/bin/python -m collectives cluster --machines 2 --ranks-per-machine 2 --link 1gbit -- \\
        lessons/04_ring/exercise.py

makes a :class:`~collectives.core.cluster.Cluster` and starts, inside machine N's network
namespace::

    .venv/bin/torchrun --nnodes M --nproc-per-node D --node-rank N \\
             --master-addr 198.18.0.1 --master-port 29500  CMD...

which is exactly what one types on M real machines (static rendezvous: machine 0's agent
hosts the store; every worker gets ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``,
``LOCAL_WORLD_SIZE``... from its torchrun). ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` name the machine's cluster link, so rank traffic leaves on it.
``--rdzv c10d`` uses the c10d rendezvous instead (``--rdzv-backend c10d --rdzv-endpoint
ADDR:PORT --rdzv-id ID`` and ``--local-addr`` set to each machine's own address: without
it, machine 0 advertises its host name as the store's address, and the host name resolves
to nothing the other machines can reach). With either rendezvous, machines 1.. enter
torchrun once machine 0's agent listens on the port: an agent that finds it closed tries
again a second later, then later and later (seconds lost for nothing).

Each machine's output comes back prefixed with ``[machine N]``; the exit status is the
first failing machine's (0 when all pass). The cluster and every process in it are
removed on every way out.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

from collectives.core.cluster import Cluster, ClusterUnavailable


def torchrun_argv(cluster: Cluster, machine: int, command: list[str], port: int,
                  rdzv: str = "static", run_id: str = "collectives") -> list[str]:
    """The torchrun command line machine ``machine`` runs (``command``: script and its arguments)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(cluster.n_machines),
            "--nproc-per-node", str(cluster.ranks_per_machine)]
    if rdzv == "static":
        argv += ["--node-rank", str(machine), "--master-addr", cluster.master_addr,
                 "--master-port", str(port)]
    elif rdzv == "c10d":
        # the agents elect the store host themselves; --local-addr is what it advertises
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.master_addr}:{port}",
                 "--rdzv-id", run_id, "--local-addr", cluster.address(machine),
                 "--rdzv-conf", f"is_host={'true' if machine == 0 else 'false'}"]
    else:
        raise ValueError(f"rdzv must be 'static' or 'c10d', got {rdzv!r}")
    return argv + command


def _listening(pid: int, port: int) -> bool:
    """Whether a socket in process ``pid``'s network namespace listens on ``port``."""
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        return True
        except (OSError, StopIteration):
            pass
    return False


# Run by machines 1.. in place of `torchrun ARGS`: import torchrun (the slow part) while
# machine 0 starts, wait until machine 0's agent listens (read from its /proc/PID/net/tcp,
# which shows machine 0's namespace), then run torchrun's main with ARGS.
_AFTER_STORE = """
import sys, time
from torch.distributed.run import main
from collectives.course.cli.cluster import _listening
pid, port = int(sys.argv[1]), int(sys.argv[2])
deadline = time.monotonic() + 120
while not _listening(pid, port) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.argv = ["torchrun"] + sys.argv[3:]
main()
"""


# c10d looks up a name for every peer's address for its log; 198.18.x.x has none, and the
# warning it prints for each connection says nothing about the run.
_NOISE = "The hostname of the client socket cannot be retrieved"


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        if _NOISE not in line:
            out.write(f"{prefix}{line}")
            out.flush()
    stream.close()


def run_on_cluster(command: list[str], machines: int = 2, ranks_per_machine: int = 2,
                   link: str = "1gbit", burst: str = "256kb", port: int = 29500,
                   rdzv: str = "static", timeout: float = 600.0, env: dict[str, str] | None = None,
                   out=None) -> int:
    """Make a cluster, run ``.venv/bin/torchrun ... command`` on every machine, return the exit status."""
    out = out or sys.stdout
    if not command:
        raise ValueError("no command: give the script and its arguments after --")
    with Cluster(machines=machines, ranks_per_machine=ranks_per_machine, link=link,
                 burst=burst) as cluster:
        child_env = dict(os.environ, **(env or {}))
        child_env.update(GLOO_SOCKET_IFNAME=cluster.interface(0),
                         NCCL_SOCKET_IFNAME=cluster.interface(0),
                         PYTHONUNBUFFERED="1")
        # the command finds the course's package from the directory it was started in
        child_env["PYTHONPATH"] = os.pathsep.join(
            [os.getcwd()] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        out.write(f"{cluster}: machine 0 at {cluster.master_addr}, "
                  f"{cluster.size} ranks ({rdzv} rendezvous)\n")
        procs, pumps = [], []
        for machine in range(machines):
            argv = torchrun_argv(cluster, machine, command, port, rdzv)
            out.write(f"machine {machine}: torchrun {' '.join(argv[3:])}\n")
            if machine > 0:
                # torchrun's own entry point, entered once machine 0's store listens (static:
                # the master's store; c10d: the rendezvous store machine 0 hosts, is_host=true):
                # an agent that finds the port closed backs off, a second, then longer
                argv = [sys.executable, "-c", _AFTER_STORE, str(procs[0].pid), str(port)] + argv[3:]
            proc = cluster.popen(machine, argv, env=child_env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1)
            procs.append(proc)
            pump = threading.Thread(target=_pump, args=(proc.stdout, f"[machine {machine}] ", out),
                                    daemon=True)
            pump.start()
            pumps.append(pump)
        deadline = time.monotonic() + timeout
        codes: list[int | None] = [None] * machines
        failed_at = None
        while any(c is None for c in codes):
            for i, proc in enumerate(procs):
                if codes[i] is None:
                    codes[i] = proc.poll()
                    if codes[i] not in (None, 0) and failed_at is None:
                        failed_at = time.monotonic()
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now - failed_at > 30):
                why = "timed out" if now > deadline else "another machine failed"
                out.write(f"stopping the machines still running ({why})\n")
                break                      # the cluster's close() kills what is left
            time.sleep(0.05)
        for pump in pumps:
            pump.join(timeout=1)
    failures = [c for c in codes if c != 0]
    return (failures[0] if failures[0] is not None else 124) if failures else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(
        prog=".venv/bin/python -m collectives cluster",
        description="run CMD under one torchrun per machine of a simulated cluster "
                    "(network namespaces joined by a shaped link; needs root and iproute2)",
        usage="%(prog)s [options] -- CMD [ARGS...]")
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--ranks-per-machine", type=int, default=2)
    parser.add_argument("--link", default="1gbit", help="rate of the link between machines (tc units)")
    parser.add_argument("--burst", default="256kb", help="token-bucket depth (tc units)")
    parser.add_argument("--port", type=int, default=29500, help="the store's port on machine 0")
    parser.add_argument("--rdzv", choices=("static", "c10d"), default="static",
                        help="torchrun's rendezvous: static (--node-rank) or c10d (--local-addr)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--reference", action="store_true",
                        help="exercises check the reference solution (COLLECTIVES_EXERCISE_IMPL=reference)")
    args = parser.parse_args(argv)
    if not command:
        parser.error("give the command after --, e.g. -- lessons/04_ring/exercise.py")
    env = {"COLLECTIVES_EXERCISE_IMPL": "reference"} if args.reference else None
    try:
        return run_on_cluster(command, args.machines, args.ranks_per_machine, args.link, args.burst,
                              args.port, args.rdzv, args.timeout, env)
    except ClusterUnavailable as exc:
        print(f".venv/bin/python -m collectives cluster: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:      # the cluster's __exit__ has removed everything by now
        print("interrupted: the cluster and every process in it were removed", file=sys.stderr)
        return 130
