"""``.venv/bin/python -m collectives bench-cluster``: the two tiers measured, and the flat ring predicted.

::

    .venv/bin/python -m collectives bench-cluster --machines 2 --ranks-per-machine 2 --link 1gbit --sizes 4M,16M

1. fits α and β *inside* a machine (lesson 1's ping-pong between two ranks on one machine,
   over loopback) and γ (the add);
2. fits α and β *across* the shaped link (the same ping-pong, one rank on each machine);
   messages well above the token bucket's burst, so that the fit sees the link's rate;
3. predicts the flat all-reduce with :func:`collectives.core.cost.predict_flat` -- the ring on
   its slowest link -- and measures ``dist.all_reduce`` and lesson 4's ring on all
   ``machines × ranks_per_machine`` ranks placed machine-major.

Needs root and iproute2, as every simulated cluster does.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.distributed as dist

from ...core import cost, launch, timing
from ...core.cluster import Cluster, ClusterUnavailable

ACROSS_SIZES = [1 << 20, 2 << 20, 4 << 20]   # bytes: well above the default 256 KiB burst
INSIDE_SIZES = [8, 64 << 10, 1 << 20, 4 << 20]


def _fit(sizes: list[int], iters: int, with_gamma: bool, best: bool = False) -> cost.AlphaBeta:
    from ... import p2p

    if best:
        # lesson 1's ping-pong, each size's fastest round trip (the one other work on the
        # host disturbed least) instead of the median
        p2p.ping_pong(sizes[0], iters=1)
        one_way = [min(p2p.ping_pong(n, iters) or [0.0]) / 2 for n in sizes]
        shared = torch.tensor(one_way, dtype=torch.float64)
        dist.broadcast(shared, 0)
        link = cost.fit_alpha_beta(sizes, shared.tolist())
    else:
        link, _ = p2p.measure_alpha_beta(sizes, iters)
    if with_gamma:
        link = cost.AlphaBeta(link.alpha, link.beta, cost.measure_gamma(4 << 20))
    return link


def measure_two_tier(cluster: Cluster, across_sizes: list[int] | None = None,
                     inside_sizes: list[int] | None = None, iters: int = 3,
                     ranks_per_machine: int | None = None, best: bool = False) -> cost.TwoTier:
    """Fit both tiers of ``cluster`` with ping-pong: across (one rank on each machine, the
    first two machines) and inside (two ranks on one machine, over loopback). ``best``:
    fit each size's fastest round trip rather than the median."""
    across = launch.run(_fit, cluster.n_machines,
                        args=(across_sizes or ACROSS_SIZES, iters, False, best),
                        cluster=cluster, timeout=120)[0]
    # Loopback inside a namespace is the host's loopback, unshaped: a local world measures it.
    inside = launch.run(_fit, 2, args=(inside_sizes or INSIDE_SIZES, max(iters, 5), True, best),
                        timeout=120)[0]
    return cost.TwoTier(inside, across, cluster.n_machines,
                        ranks_per_machine or cluster.ranks_per_machine)


def _time_all_reduce(nbytes: int, which: str, iters: int) -> list[float]:
    x = torch.ones(max(nbytes // 4, 1))
    if which == "ring":
        from ...ring import ring_all_reduce

        call = lambda: ring_all_reduce(x)          # noqa: E731
    else:
        call = lambda: dist.all_reduce(x)          # noqa: E731
    return timing.measure(call, warmup=1, iters=iters)


def measure_flat(cluster: Cluster, nbytes: int, which: str = "dist", iters: int = 3,
                 world_size: int | None = None, best: bool = False) -> float:
    """Median seconds of a flat all-reduce of ``nbytes`` (``"dist"``: ``dist.all_reduce``;
    ``"ring"``: lesson 4's ring) on every rank of ``cluster`` (max over ranks per run);
    ``best``: the fastest run instead, the one other work on the host disturbed least."""
    times = launch.run(_time_all_reduce, world_size or cluster.size, args=(nbytes, which, iters),
                       cluster=cluster, timeout=300)[0]
    return min(times) if best else timing.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives bench-cluster",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--ranks-per-machine", type=int, default=2)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--burst", default="256kb")
    parser.add_argument("--sizes", default="4M,16M", help="all-reduce sizes in bytes (K/M/G suffixes)")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = timing.parse_sizes(args.sizes)
    try:
        with Cluster(args.machines, args.ranks_per_machine, link=args.link, burst=args.burst) as cluster:
            tiers = measure_two_tier(cluster, iters=5)
            print(f"{cluster}, torch {torch.__version__}, "
                  f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
            for name, link in (("inside", tiers.inside), ("across", tiers.across)):
                print(f"  {name:6}: α = {link.alpha * 1e6:8.1f} µs, 1/β = {link.bandwidth / 1e9:6.3f} GB/s"
                      + (f", γ = {link.gamma * 1e9:.2f} ns/B" if link.gamma else ""))
            print(f"\n{'size':>8} {'predicted':>10} {'dist.all_reduce':>16} {'ratio':>6} "
                  f"{'lesson 4 ring':>14} {'ratio':>6}")
            for nbytes in sizes:
                predicted = cost.predict_flat("ring", nbytes, tiers)
                row = f"{timing.human_bytes(nbytes):>8} {timing.human_seconds(predicted):>10}"
                for which, width in (("dist", 16), ("ring", 14)):
                    measured = measure_flat(cluster, nbytes, which, args.iters)
                    row += f" {timing.human_seconds(measured):>{width}} {measured / predicted:6.2f}"
                print(row, flush=True)
    except ClusterUnavailable as exc:
        print(f".venv/bin/python -m collectives bench-cluster: {exc}", file=sys.stderr)
        return 2
    return 0
