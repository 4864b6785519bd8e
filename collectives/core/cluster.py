"""A cluster of several "machines" on one Linux host: two tiers of links, for real.

::

    from collectives import launch
    from collectives.core.cluster import Cluster

    with Cluster(machines=2, ranks_per_machine=2, link="1gbit") as cluster:
        launch.run(fn, world_size=4, cluster=cluster)     # ranks 0, 1 on machine 0; 2, 3 on 1

    launch.run(fn, world_size=4, machines=2, link="1gbit")  # the same, the cluster made for the run

Each machine is a network namespace (``ip netns``) with its own loopback: ranks on one
machine talk through it, unshaped -- the fast tier. Machines are joined by a veth pair
(two machines) or through a bridge in a namespace of its own (more than two, a switch),
and every cross-machine link is shaped with a token bucket (``tc qdisc ... tbf``), both
ways -- the slow tier::

      machine 0 (netns)                      machine 1 (netns)
    ┌──────────────────┐   eth0 ── eth0    ┌──────────────────┐
    │ rank 0   rank 1  │ ◄───────────────► │ rank 2   rank 3  │
    │    └── lo ──┘    │   tbf 1gbit each  │    └── lo ──┘    │
    └──────────────────┘   way            └──────────────────┘
        198.18.0.1                             198.18.0.2

With ``rails=True`` every local rank gets a link of its own (``rail0``, ``rail1``, ...,
subnet 198.18.j.0/24 for rail j), as in clusters with one NIC per GPU: local rank j's
traffic leaves its machine on rail j.

Addresses come from 198.18.0.0/15, the range set aside for network benchmarks, and exist
only on interfaces inside namespaces the cluster made. Namespace names carry a fixed
prefix and the owner's process id (``collectives-<pid>-<n>-m0``): a cluster whose owner
died (a crashed run) is removed before a new one starts; another live run's cluster is
never touched. Everything a cluster made -- namespaces, links, queues, and any process
still inside them -- is removed on exit, after an exception, on Ctrl-C, on SIGTERM and at
interpreter exit. Making one needs root and iproute2 (``ip``, ``tc``); without them
:class:`ClusterUnavailable` says which is missing.

This module is the cluster: its shape, where each rank goes and what it is told, and
its removal on every way out. The ``ip`` and ``tc`` commands it is made of are in
:mod:`~collectives.core.netns`; the names used from there (``ClusterUnavailable``,
``require``, ``clean_leftovers``, ...) can be imported from here too.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field

from . import netns
from .netns import (
    PREFIX,
    SUBNET,
    ClusterUnavailable,
    clean_leftovers,
    enter_namespace,
    our_namespaces,
    require,
    unavailable_reason,
)

__all__ = ["Cluster", "Machine", "ClusterUnavailable", "unavailable_reason", "require",
           "clean_leftovers", "our_namespaces", "enter_namespace", "PREFIX", "SUBNET"]

_LIVE: list["Cluster"] = []          # clusters this process owns and has not torn down
_LOCK = threading.Lock()
_counter = 0


@dataclass
class Machine:
    """One simulated machine: its namespace and its addresses, one per link."""

    index: int
    namespace: str
    addresses: list[str] = field(default_factory=list)   # addresses[j]: on link j

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.namespace}"

    @property
    def address(self) -> str:
        """The machine's address on its first link (where rank 0 hosts the store)."""
        return self.addresses[0]


class Cluster:
    """``machines`` network namespaces joined by shaped links; a context manager.

    Args:
        machines: how many machines (namespaces), at least 2.
        ranks_per_machine: ranks each machine will host (the number of rails with
            ``rails=True``; otherwise only the default for :meth:`size`).
        link: the rate of every cross-machine link, in ``tc`` units (``"1gbit"``,
            ``"200mbit"``), each way.
        burst: the token bucket's depth (``tc``'s ``burst``): bytes that may leave at
            line speed after a pause.
        latency: the longest a packet may wait in the bucket's queue (``tc``'s ``latency``),
            which sizes the queue: rate × latency. With 10 ms (250 KB at 200 Mbit/s) a
            single flow of 2 MiB messages already lost packets and TCP backed off, so
            measurements jumped from run to run; 100 ms holds a few MiB at any rate here.
        rails: one link per local rank instead of one per machine.

    The cluster is made on ``__enter__`` (or :meth:`start`) and removed on ``__exit__``
    (or :meth:`close`), and at the latest when this process exits.
    """

    def __init__(self, machines: int = 2, ranks_per_machine: int = 1, link: str = "1gbit",
                 burst: str = "256kb", latency: str = "100ms", rails: bool = False):
        if machines < 2:
            raise ValueError(f"a cluster needs at least 2 machines, got {machines}")
        if machines > 250:
            raise ValueError(f"at most 250 machines (one /24 per link), got {machines}")
        if ranks_per_machine < 1:
            raise ValueError(f"ranks_per_machine must be at least 1, got {ranks_per_machine}")
        if rails and ranks_per_machine > 200:
            raise ValueError("at most 200 rails")
        self.n_machines = machines
        self.ranks_per_machine = ranks_per_machine
        self.link, self.burst, self.latency, self.rails = link, burst, latency, rails
        self.machines: list[Machine] = []
        self.switch: str | None = None      # the bridge's namespace, with more than 2 machines
        self.owner = os.getpid()
        self._made: list[str] = []
        self._active = False

    # -- what the launcher asks ------------------------------------------------------
    @property
    def size(self) -> int:
        """machines × ranks_per_machine: the world this cluster was made for."""
        return self.n_machines * self.ranks_per_machine

    @property
    def links(self) -> int:
        """Links per machine: one, or one per local rank with rails."""
        return self.ranks_per_machine if self.rails else 1

    def interface(self, local_rank: int = 0) -> str:
        """The interface a rank binds to (``GLOO_SOCKET_IFNAME``) inside its machine."""
        if not self.rails:
            return "eth0"
        if local_rank >= self.links:
            raise ValueError(f"local rank {local_rank} has no rail: the cluster has {self.links}")
        return f"rail{local_rank}"

    def address(self, machine: int, local_rank: int = 0) -> str:
        """The address of ``machine`` on the link local rank ``local_rank`` uses."""
        self._check_active()
        return self.machines[machine].addresses[local_rank if self.rails else 0]

    @property
    def master_addr(self) -> str:
        """Where rank 0 (machine 0, local rank 0) hosts the rendezvous store."""
        return self.address(0, 0)

    def placement(self, rank: int, local_world_size: int) -> tuple[int, int]:
        """(machine, local rank) of global ``rank``: machine-major, as torchrun numbers them."""
        return rank // local_world_size, rank % local_world_size

    def rank_env(self, rank: int, world_size: int) -> dict[str, str]:
        """The variables torchrun would give ``rank`` of a world of ``world_size`` on
        this cluster, and the socket interface gloo and NCCL should bind to."""
        if world_size % self.n_machines:
            raise ValueError(f"world_size {world_size} is not a multiple of {self.n_machines} machines")
        local = world_size // self.n_machines
        machine, local_rank = self.placement(rank, local)
        ifname = self.interface(local_rank)
        return dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                    LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(machine), NODE_RANK=str(machine),
                    GROUP_WORLD_SIZE=str(self.n_machines), MASTER_ADDR=self.master_addr,
                    GLOO_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname)

    def popen(self, machine: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``machine``'s namespace; it dies with this process."""
        self._check_active()
        path = self.machines[machine].netns_path

        def inside():
            enter_namespace(path)
            netns.die_with_parent()
        return subprocess.Popen(argv, preexec_fn=inside, **kwargs)

    def run_in(self, machine: int, *argv: str) -> str:
        """Run a short command (``ip addr``, ``tc -s qdisc``) in ``machine``; its output."""
        self._check_active()
        return netns.exec_in(self.machines[machine].namespace, *argv)

    def set_link(self, machine: int, up: bool) -> None:
        """Take ``machine``'s links down (``ip link set eth0 down`` in its namespace: a cable
        pulled; its ranks can no longer reach another machine) or bring them back up."""
        self._check_active()
        namespace = self.machines[machine].namespace
        devs = [self.interface(j) for j in range(self.links)]
        for dev in devs:
            netns._sh("ip", "-n", namespace, "link", "set", dev, "up" if up else "down")
        if up:
            netns.wait_until_up([(namespace, dev) for dev in devs])

    # -- making and removing -----------------------------------------------------------
    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Cluster":
        """Make the namespaces, links and queues (first removing dead owners' leftovers)."""
        global _counter
        if self._active:
            raise RuntimeError("this cluster is already running")
        require()
        clean_leftovers()
        with _LOCK:
            _counter += 1
            serial = _counter
            _LIVE.append(self)
        _install_handlers()
        self.owner = os.getpid()
        self._active = True
        try:
            self._build(f"{PREFIX}-{self.owner}-{serial}")
        except BaseException:
            self.close()
            raise
        return self

    def _ns(self, name: str) -> str:
        self._made.append(netns.add_namespace(name))
        return name

    def _shape(self, namespace: str, dev: str) -> None:
        netns.shape(namespace, dev, self.link, self.burst, self.latency)

    def _build(self, base: str) -> None:
        self.machines = [Machine(i, self._ns(f"{base}-m{i}")) for i in range(self.n_machines)]
        names = ["eth0"] if not self.rails else [f"rail{j}" for j in range(self.links)]
        if self.n_machines > 2:
            self.switch = self._ns(f"{base}-sw")
        for j, dev in enumerate(names):
            if self.switch:
                netns.add_bridge(self.switch, f"br{j}")
            for m in self.machines:
                address = f"198.18.{j}.{m.index + 1}"
                m.addresses.append(address)
                if self.switch:            # machine's dev <-> port m<i>r<j> on the bridge
                    port = f"m{m.index}r{j}"
                    netns.add_veth(m.namespace, dev, self.switch, port)
                    netns.attach(self.switch, port, f"br{j}")
                    netns.up(self.switch, port)
                    self._shape(self.switch, port)          # the switch port toward machine m
                elif m.index == 0:         # two machines: one veth pair per link
                    netns.add_veth(m.namespace, dev, self.machines[1].namespace, dev)
                netns.up(m.namespace, dev, address)
                self._shape(m.namespace, dev)               # machine m's way out
        netns.wait_until_up([(m.namespace, dev) for m in self.machines for dev in names])

    def close(self) -> None:
        """Remove everything this cluster made: processes inside, links, namespaces."""
        if os.getpid() != self.owner:     # a forked child never tears down its parent's cluster
            return
        with _LOCK:
            if self in _LIVE:
                _LIVE.remove(self)
        if self._made:
            netns.remove_namespaces(list(self._made))
        self._made = []
        self._active = False

    def _check_active(self) -> None:
        if not self._active:
            raise RuntimeError("the cluster is not running: use it inside `with Cluster(...)`")

    @property
    def namespaces(self) -> list[str]:
        """The namespaces this cluster made (machines, then the switch)."""
        return list(self._made)

    def __repr__(self) -> str:
        state = "running" if self._active else "stopped"
        return (f"Cluster(machines={self.n_machines}, ranks_per_machine={self.ranks_per_machine}, "
                f"link={self.link!r}, rails={self.rails}) [{state}]")


# -- every way out ------------------------------------------------------------------------
_handlers_installed = False
_previous: dict[int, object] = {}


def _close_all() -> None:
    for cluster in list(_LIVE):
        try:
            cluster.close()
        except Exception:  # noqa: BLE001 - at exit, remove what can be removed
            pass


def _on_signal(signum, frame):
    if any(c.owner == os.getpid() for c in _LIVE):
        _close_all()
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        return previous(signum, frame)
    if previous == signal.SIG_IGN:
        return None
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return None


def _install_handlers() -> None:
    """atexit, and SIGTERM/SIGHUP handlers that remove the clusters before dying (Ctrl-C
    needs none: KeyboardInterrupt runs ``__exit__``). Only from the main thread, and
    only over a default handler."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        current = signal.getsignal(signum)
        if current in (signal.SIG_DFL, None):
            _previous[signum] = current or signal.SIG_DFL
            signal.signal(signum, _on_signal)
