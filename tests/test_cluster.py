"""The simulated cluster: machines as network namespaces, a shaped link between them.

One 2 × 2 cluster serves most checks (making one takes a few hundredths of a second, but a
world on it starts like any forked world: about 0.1 s). Tests that need root and iproute2
skip with the reason where those are missing; CI runs as root, so there they run.
"""

import ipaddress
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from collectives import cost, launch
from collectives.core import cluster as cl
from collectives.core import netns
from collectives.core.cluster import Cluster

from . import workers

REASON = cl.unavailable_reason()
needs_cluster = pytest.mark.skipif(REASON is not None, reason=REASON or "")
BENCHMARK_NET = ipaddress.ip_network(cl.SUBNET)


def _ip(*argv):
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=True).stdout


def _root_state():
    """What the host's own namespace shows: its links and queues (a cluster must add none)."""
    links = sorted(line.split(":")[1].strip() for line in _ip("-o", "link").splitlines())
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    return links, sorted(line.split(" refcnt")[0] for line in qdiscs.splitlines())


@pytest.fixture(scope="module")
def cluster():
    before = _root_state()
    with Cluster(machines=2, ranks_per_machine=2, link="1gbit") as made:
        assert _root_state() == before, "the cluster put links or queues in the host's namespace"
        yield made
    assert not set(made.namespaces) & set(cl.our_namespaces())


# -- functions the ranks run -----------------------------------------------------------------

def where_am_i():
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "GLOO_SOCKET_IFNAME")
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    return {k: os.environ.get(k) for k in keys} | {
        "netns": os.readlink("/proc/self/ns/net"), "sum": t.item(), "rank": dist.get_rank()}


def ring_matches_all_reduce():
    from collectives import verify
    from collectives.ring import ring_all_reduce
    report = verify.check_all_reduce(ring_all_reduce)
    return report.ok, report.summary(limit=3)


def everyone_receives_first():
    """Every rank waits for its right neighbour, which waits for its own: nobody sends."""
    rank, p = dist.get_rank(), dist.get_world_size()
    dist.recv(torch.zeros(1), src=(rank + 1) % p)


# -- without root or iproute2 --------------------------------------------------------------

def test_a_missing_requirement_is_named(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    monkeypatch.setattr(netns.os.path, "exists", lambda path: path == "/proc/self/ns/net")
    reason = cl.unavailable_reason()
    assert "root" in reason and "uid 1000" in reason
    assert "`ip`" in reason and "`tc`" in reason and "iproute2" in reason
    with pytest.raises(cl.ClusterUnavailable, match="needs root"):
        Cluster(2).start()


def test_bad_shapes_are_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="at least 2 machines"):
        Cluster(machines=1)
    with pytest.raises(ValueError, match="ranks_per_machine"):
        Cluster(machines=2, ranks_per_machine=0)


# -- ranks on the cluster ----------------------------------------------------------------

@needs_cluster
def test_ranks_are_placed_machine_major_with_torchruns_variables(cluster):
    seen = launch.run(where_am_i, 4, cluster=cluster)
    assert [s["sum"] for s in seen] == [6] * 4
    for rank, s in enumerate(seen):
        assert s["rank"] == rank and s["WORLD_SIZE"] == "4"
        assert (s["GROUP_RANK"], s["LOCAL_RANK"], s["LOCAL_WORLD_SIZE"]) == (str(rank // 2), str(rank % 2), "2")
        assert s["GLOO_SOCKET_IFNAME"] == "eth0"
        assert ipaddress.ip_address(s["MASTER_ADDR"]) in BENCHMARK_NET
    # ranks of one machine share its namespace; the two machines have different ones,
    # and neither is the host's
    host = os.readlink("/proc/self/ns/net")
    assert seen[0]["netns"] == seen[1]["netns"] != seen[2]["netns"] == seen[3]["netns"]
    assert host not in {s["netns"] for s in seen}


@needs_cluster
def test_every_address_is_in_the_benchmarking_range(cluster):
    for m in range(cluster.n_machines):
        out = cluster.run_in(m, "ip", "-o", "-4", "addr")
        addresses = [line.split()[3].split("/")[0] for line in out.splitlines()]
        assert addresses and all(ipaddress.ip_address(a) in BENCHMARK_NET or a == "127.0.0.1"
                                 for a in addresses), addresses
        assert "tbf" in cluster.run_in(m, "tc", "qdisc", "show", "dev", "eth0")
        assert "tbf" not in cluster.run_in(m, "tc", "qdisc", "show", "dev", "lo")


@needs_cluster
def test_the_ring_matches_all_reduce_across_machines(cluster):
    for ok, summary in launch.run(ring_matches_all_reduce, 4, cluster=cluster):
        assert ok, summary


@needs_cluster
def test_cluster_ranks_print_no_warning_per_connection_but_the_level_can_be_raised(cluster, capfd):
    """c10d warns on every connection that 198.18.x.x has no host name: the ranks of a
    cluster log C++ messages from ERROR up, unless TORCH_CPP_LOG_LEVEL says otherwise."""
    noise = "hostname of the client socket cannot be retrieved"
    capfd.readouterr()
    assert launch.run(workers.sum_of_ranks, 4, cluster=cluster) == [6] * 4
    assert noise not in capfd.readouterr().err
    assert launch.run(workers.sum_of_ranks, 4, cluster=cluster,
                      env={"TORCH_CPP_LOG_LEVEL": "WARNING"}) == [6] * 4
    assert noise in capfd.readouterr().err


@needs_cluster
def test_a_raising_rank_inside_a_cluster_is_named(cluster):
    start = time.monotonic()
    with pytest.raises(launch.RankError) as info:
        launch.run(workers.rank_two_raises_others_wait, 4, cluster=cluster, timeout=30)
    assert info.value.rank == 2
    assert "rank two cannot go on" in str(info.value) and "Traceback" in info.value.remote_traceback
    assert time.monotonic() - start < 10


@needs_cluster
def test_the_watchdog_stops_a_stuck_cluster_world(cluster):
    with pytest.raises(launch.WorldTimeout) as info:
        launch.run(everyone_receives_first, 4, cluster=cluster, timeout=3)
    for rank in range(4):
        assert f"rank {rank} waiting in recv from rank {(rank + 1) % 4}" in str(info.value)


# -- nothing left behind -------------------------------------------------------------------

def _owned_by(pid):
    """The namespaces of clusters made by process ``pid`` (others' runs may have their own)."""
    return [name for name in cl.our_namespaces() if name.startswith(f"{cl.PREFIX}-{pid}-")]


def _children_alive(pids):
    return [pid for pid in pids if os.path.exists(f"/proc/{pid}") and
            open(f"/proc/{pid}/stat").read().split()[2] != "Z"]


@needs_cluster
def test_a_run_with_machines_leaves_nothing_behind():
    before_ns, before_root = set(_owned_by(os.getpid())), _root_state()
    pids = launch.run(workers.sleepy_children_pids, 4, machines=2, link="1gbit")
    assert set(_owned_by(os.getpid())) == before_ns
    assert _root_state() == before_root
    assert not _children_alive(pids)


@needs_cluster
def test_an_exception_inside_the_cluster_removes_it_and_its_processes():
    with pytest.raises(ZeroDivisionError):
        with Cluster(machines=3, ranks_per_machine=2, rails=True) as made:
            names = made.namespaces
            assert len(names) == 4 and made.switch in names        # 3 machines and a switch
            # through the bridge, each local rank on its own rail
            seen = launch.run(where_am_i, 6, cluster=made)
            assert [s["sum"] for s in seen] == [15] * 6
            assert [s["GLOO_SOCKET_IFNAME"] for s in seen] == ["rail0", "rail1"] * 3
            sleeper = made.popen(2, ["sleep", "60"])
            1 / 0
    assert not set(names) & set(cl.our_namespaces())
    assert sleeper.wait(timeout=5) == -signal.SIGKILL


OWNER = textwrap.dedent("""
    import importlib, os, sys, time, types
    # cluster.py and netns.py from their folder: they need only the standard library, so
    # no torch to import (collectives/__init__.py would import it)
    package = sys.modules["core"] = types.ModuleType("core")
    package.__path__ = [os.path.dirname(sys.argv[1])]
    cluster = importlib.import_module("core.cluster")
    with cluster.Cluster(machines=2) as c:
        c.popen(1, ["sleep", "60"])
        print(" ".join(c.namespaces), flush=True)
        time.sleep(60)
""")


def _owner():
    proc = subprocess.Popen([sys.executable, "-c", OWNER, cl.__file__], stdout=subprocess.PIPE, text=True)
    names = proc.stdout.readline().split()
    assert len(names) == 2 and set(names) <= set(cl.our_namespaces())
    return proc, names


@needs_cluster
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_remove_the_owners_cluster(how):
    proc, names = _owner()
    proc.send_signal(how)
    proc.wait(timeout=10)
    assert not set(names) & set(cl.our_namespaces())


@needs_cluster
def test_a_dead_owners_leftovers_are_cleaned_and_a_live_cluster_is_not(cluster):
    proc, names = _owner()
    proc.kill()                    # SIGKILL: no handler runs, the namespaces stay behind
    proc.wait(timeout=10)
    assert set(names) <= set(cl.our_namespaces())
    removed = cl.clean_leftovers()
    assert set(names) <= set(removed)
    assert not set(names) & set(cl.our_namespaces())
    assert set(cluster.namespaces) <= set(cl.our_namespaces())       # ours is alive: untouched
    assert launch.run(workers.sum_of_ranks, 4, cluster=cluster) == [6] * 4


# -- torchrun across machines, for real ------------------------------------------------------

@needs_cluster
def test_every_exercise_reference_passes_under_one_torchrun_per_machine():
    """``python -m collectives cluster`` starts a real torchrun in each of 2 namespaces
    (static rendezvous through machine 0's address); in that one world of 2 × 2 ranks,
    dist.all_reduce agrees and every lesson's graded task passes against the reference, judged
    in that world by the grader's own judges."""
    from collectives.course.catalog import LESSONS, ROOT
    from collectives.course.grading.tasks import tasks_of

    expected = {(item.number, task.number): task.title for item in LESSONS for task in tasks_of(item.number)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "collectives", "cluster", "--machines", "2", "--ranks-per-machine", "2",
         "--link", "10gbit", "--reference", "--", "-m", "collectives.course.grading.runner", "--all"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert not _owned_by(proc.pid)            # its cluster is gone with it
    assert proc.returncode == 0, out[-4000:] + err[-2000:]
    assert "FAIL" not in out, out[-4000:]
    agree = set(re.findall(r"\[machine (\d)\] \[rank (\d)\] dist.all_reduce agrees across 4 ranks "
                           r"\(GROUP_RANK=(\d), LOCAL_RANK=(\d)\): PASS", out))
    # ranks machine-major: rank r on machine r // 2 as local rank r % 2, in that machine's torchrun
    assert agree == {(str(r // 2), str(r), str(r // 2), str(r % 2)) for r in range(4)}, out[-4000:]
    passed = set(re.findall(r"\[machine 0\] \[lesson (\d+)\] task (\d+) (.*?): PASS", out))
    missing = {(str(lesson), str(number), title) for (lesson, number), title in expected.items()} - passed
    assert not missing, sorted(missing)[:10]
    assert f"rank 0: {len(expected) + 1} of {len(expected) + 1} checks pass" in out


C10D_SCRIPT = textwrap.dedent("""
    import os
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} on machine {os.environ['GROUP_RANK']}: "
          f"sum {t.item()}")
    dist.destroy_process_group()
""")


@needs_cluster
def test_the_c10d_rendezvous_numbers_the_machines_and_the_world_reduces(tmp_path):
    """``--rdzv c10d``: no --node-rank; machine 0's agent hosts the rendezvous store on its
    address (is_host, --local-addr) and the agents number themselves; one rank per machine."""
    from collectives.course.catalog import ROOT

    script = tmp_path / "reduce.py"
    script.write_text(C10D_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "collectives", "cluster", "--machines", "2", "--ranks-per-machine", "1",
         "--rdzv", "c10d", "--port", "29517", "--", str(script)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=180)
    assert not _owned_by(proc.pid)
    assert proc.returncode == 0, out[-4000:] + err[-2000:]
    assert "--rdzv-backend c10d" in out and "--node-rank" not in out
    seen = set(re.findall(r"\[machine (\d)\] rank (\d) of 2 on machine (\d): sum 3", out))
    # each machine one rank, numbered as its torchrun was (GROUP_RANK): one world of two
    assert {m for m, _, _ in seen} == {r for _, r, _ in seen} == {"0", "1"}, out[-4000:]
    assert all(rank == group for _, rank, group in seen) and len(seen) == 2, out[-4000:]


# -- the cost model per tier -----------------------------------------------------------------

def test_a_flat_ring_is_as_slow_as_its_slowest_link():
    fast, slow = cost.AlphaBeta(10e-6, 1e-9), cost.AlphaBeta(100e-6, 8e-9)
    n = 16 << 20
    two_by_two = cost.TwoTier(inside=fast, across=slow, machines=2, ranks_per_machine=2)
    # 2(p-1) = 6 steps, each a quarter of n across the slow link: 1.5 n in all
    assert cost.predict_flat("ring", n, two_by_two) == pytest.approx(6 * slow.alpha + 1.5 * n * slow.beta)
    # one machine: the ring of lesson 4 on the fast link; one rank per machine: on the slow one
    one_machine = cost.TwoTier(fast, slow, machines=1, ranks_per_machine=4)
    assert cost.predict_flat("ring", n, one_machine) == pytest.approx(cost.predict("ring", n, 4, fast))
    spread = cost.TwoTier(fast, slow, machines=4, ranks_per_machine=1)
    assert cost.predict_flat("ring", n, spread) == pytest.approx(cost.predict("ring", n, 4, slow))
    # a slow inside hop (say, a busy CPU) bounds the step just the same
    upside_down = cost.TwoTier(inside=slow, across=fast, machines=2, ranks_per_machine=2)
    assert cost.predict_flat("ring", n, upside_down) == pytest.approx(cost.predict_flat("ring", n, two_by_two))


@needs_cluster
def test_the_tier_aware_model_predicts_a_flat_all_reduce_on_the_cluster():
    """Ping-pong across a 200 Mbit/s link fits its rate; the flat ring predicted on the
    slowest link lands within 20 % of a measured 4 MiB dist.all_reduce on 2 × 2 ranks.
    (A slow link keeps the CPU's share small: the ranks share two cores.)"""
    from collectives.course.benchmarks import cluster as cluster_bench

    with Cluster(machines=2, ranks_per_machine=2, link="200mbit") as slow:
        # fastest round trips and fastest all-reduce: the runs the other ranks' and the
        # host's other processes disturbed least (the ranks share two cores)
        tiers = cluster_bench.measure_two_tier(slow, across_sizes=[512 << 10, 1 << 20, 2 << 20],
                                               iters=5, best=True)
        assert 0.8 < tiers.across.bandwidth / 25e6 < 1.2, tiers.across      # 200 Mbit/s = 25 MB/s
        predicted = cost.predict_flat("ring", 4 << 20, tiers)
        measured = cluster_bench.measure_flat(slow, 4 << 20, "dist", iters=3, best=True)
    assert abs(measured - predicted) < 0.2 * measured, (predicted, measured, tiers)


def test_a_world_that_does_not_split_over_the_machines_is_refused():
    with pytest.raises(ValueError, match="does not split over 2 machines"):
        launch.run(workers.sum_of_ranks, 3, machines=2)
