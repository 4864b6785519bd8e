"""The network primitives a simulated cluster is made of: iproute2 and ``tc``, from Python.

A :class:`~collectives.core.cluster.Cluster` decides what to build; this module builds it,
one ``ip`` or ``tc`` command at a time, and knows how to find and remove it again::

    add_namespace("collectives-123-1-m0")                       # ip netns add, lo up
    add_veth("collectives-123-1-m0", "eth0", "collectives-123-1-m1", "eth0")
    up("collectives-123-1-m0", "eth0", "198.18.0.1")            # address /24, link up
    shape("collectives-123-1-m0", "eth0", "1gbit", "256kb", "100ms")   # tc qdisc ... tbf
    enter_namespace("/run/netns/collectives-123-1-m0")          # in a fresh child process

Every namespace is named ``collectives-<owner pid>-<n>-<role>`` (:data:`PREFIX`): that is how
:func:`our_namespaces` tells the project's namespaces from any other, and how
:func:`clean_leftovers` tells a dead owner's (a crashed run, a ``kill -9``) from a live one's.
Only addresses of :data:`SUBNET` are ever used, and only on interfaces inside namespaces
made here. Everything needs root and iproute2; :func:`unavailable_reason` says which is
missing. Only the standard library is imported: no torch.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import time

__all__ = ["PREFIX", "SUBNET", "ClusterUnavailable", "unavailable_reason", "require",
           "our_namespaces", "clean_leftovers", "remove_namespaces", "enter_namespace",
           "add_namespace", "add_veth", "add_bridge", "attach", "up", "shape", "rate_bytes_per_second", "wait_until_up",
           "exec_in", "die_with_parent"]

PREFIX = "collectives"
"""Every namespace a cluster makes is called ``collectives-<owner pid>-<n>-<role>``."""
SUBNET = "198.18.0.0/15"
"""The only addresses a cluster uses (RFC 2544's benchmarking range)."""

_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-(\w+)$")
_CLONE_NEWNET = 0x40000000


# -- can a cluster be made here? -------------------------------------------------------------

class ClusterUnavailable(RuntimeError):
    """A simulated cluster cannot be made here; the message says what is missing."""


def unavailable_reason() -> str | None:
    """Why no cluster can be made on this host (missing root or iproute2), or ``None``."""
    missing = []
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        uid = os.geteuid() if hasattr(os, "geteuid") else "?"
        missing.append(f"root (network namespaces and tc need it; running as uid {uid})")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}") \
                and not os.path.exists(f"/sbin/{tool}"):
            missing.append(f"the `{tool}` command from iproute2 (apt-get install iproute2)")
    if not os.path.exists("/proc/self/ns/net"):
        missing.append("Linux network namespaces (/proc/self/ns/net)")
    elif not missing:
        lacking = [name for name, bit in (("CAP_NET_ADMIN", 12), ("CAP_SYS_ADMIN", 21))
                   if not _capabilities() >> bit & 1]
        if lacking:
            missing.append(" and ".join(lacking) + " (root in a container started without them: "
                           "docker run --privileged, or --cap-add NET_ADMIN --cap-add SYS_ADMIN)")
    if not missing:
        return None
    return "the simulated cluster needs " + " and ".join(missing)


def _capabilities() -> int:
    """This process's effective capabilities (a bit mask; all ones when unreadable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return -1


def require() -> None:
    """Raise :class:`ClusterUnavailable` naming what is missing, if anything."""
    reason = unavailable_reason()
    if reason:
        raise ClusterUnavailable(reason)


def _tool(name: str) -> str:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}")
                                       if os.path.exists(p)), name)


def _sh(*argv: str, check: bool = True) -> str:
    argv = (_tool(argv[0]),) + argv[1:]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


# -- making: namespaces, links, addresses, queues --------------------------------------------

def add_namespace(name: str) -> str:
    """``ip netns add name`` and its loopback up; returns ``name``."""
    _sh("ip", "netns", "add", name)
    _sh("ip", "-n", name, "link", "set", "lo", "up")
    return name


def add_veth(namespace: str, dev: str, peer_namespace: str, peer: str) -> None:
    """A veth pair: ``dev`` in ``namespace`` wired to ``peer`` in ``peer_namespace``."""
    _sh("ip", "-n", namespace, "link", "add", dev, "type", "veth",
        "peer", "name", peer, "netns", peer_namespace)


def add_bridge(namespace: str, bridge: str) -> None:
    """A bridge (a switch) ``bridge`` in ``namespace``, up."""
    _sh("ip", "-n", namespace, "link", "add", bridge, "type", "bridge")
    _sh("ip", "-n", namespace, "link", "set", bridge, "up")


def attach(namespace: str, port: str, bridge: str) -> None:
    """Plug interface ``port`` into ``bridge`` (both in ``namespace``)."""
    _sh("ip", "-n", namespace, "link", "set", port, "master", bridge)


def up(namespace: str, dev: str, address: str | None = None) -> None:
    """Give ``dev`` the address ``address``/24 (if any) and bring it up."""
    if address:
        _sh("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", dev)
    _sh("ip", "-n", namespace, "link", "set", dev, "up")


def shape(namespace: str, dev: str, rate: str, burst: str, latency: str) -> None:
    """A token bucket on ``dev``'s way out: ``tc qdisc add ... root tbf rate burst latency``."""
    _sh("tc", "-n", namespace, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
        "burst", burst, "latency", latency)


_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 1 << 10, "mibit": 1 << 20, "gibit": 1 << 30, "tibit": 1 << 40,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


def rate_bytes_per_second(rate: str) -> float:
    """What a ``tc`` rate means, in bytes per second: ``"1gbit"`` -> 125e6.

    tc's units are decimal (``gbit`` = 10^9 bits/s), ``*bps`` are bytes per second, ``*ibit``
    binary; a bare number is bits per second. The α–β models take β = 1 / this."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]*)\s*", rate.lower())
    if not match or match.group(2) not in {"", *_RATE_UNITS}:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 1gbit, 200mbit, 125mbps)")
    return float(match.group(1)) * _RATE_UNITS.get(match.group(2), 1) / 8


def wait_until_up(links: list[tuple[str, str]], timeout: float = 5.0) -> None:
    """Wait until every (namespace, dev) of ``links`` reports UP.

    The kernel switches a new link's queue on a moment after its carrier comes up (up to a
    second); a connection tried before then loses its first packets.
    """
    deadline = time.monotonic() + timeout
    for namespace, dev in links:
        while True:
            state = _sh("ip", "-n", namespace, "-br", "link", "show", "dev", dev).split()
            if len(state) > 1 and state[1] == "UP":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{dev} in {namespace} did not come up: {' '.join(state)}")
            time.sleep(0.01)


def exec_in(namespace: str, *argv: str) -> str:
    """Run a short command inside ``namespace`` (``ip netns exec``); its output."""
    return _sh("ip", "netns", "exec", namespace, *argv)


# -- entering ----------------------------------------------------------------------------------

def enter_namespace(path: str) -> None:
    """Move the calling thread (and the threads it starts later) into the network
    namespace at ``path`` (``/run/netns/NAME``). Call it in a fresh child process,
    before any socket is opened: before ``init_process_group``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "setns"):                               # Python 3.12+
            os.setns(fd, _CLONE_NEWNET)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL the calling process when its parent dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - not Linux
        pass


# -- finding and removing ----------------------------------------------------------------------

def our_namespaces() -> list[str]:
    """Every namespace on this host named by a cluster (any owner's), by ``ip netns list``."""
    if shutil.which("ip") is None and not os.path.exists("/usr/sbin/ip"):
        return []
    out = _sh("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if _NAME.match(n)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pids_in(namespace: str) -> list[int]:
    out = _sh("ip", "netns", "pids", namespace, check=False)
    return [int(x) for x in out.split() if x.isdigit()]


def remove_namespaces(names: list[str]) -> None:
    """Kill every process inside ``names`` (not this one), then delete the namespaces
    (which deletes the links and queues inside them)."""
    me = os.getpid()
    for _ in range(3):
        pids = [pid for name in names for pid in _pids_in(name) if pid != me]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    for name in names:
        _sh("ip", "netns", "delete", name, check=False)


def clean_leftovers() -> list[str]:
    """Remove the namespaces of clusters whose owner process is gone; return their names.

    A live owner's cluster (another test run, a notebook) is left alone.
    """
    dead = [n for n in our_namespaces() if not _pid_alive(int(_NAME.match(n).group(1)))]
    if dead:
        remove_namespaces(dead)
    return dead
