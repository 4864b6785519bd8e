"""bench-alltoall host: what one call of each all-to-all costs the host, beside its messages.

On a GPU the host posts and the GPU waits for it: a call whose host work takes 200 µs
cannot take less, however few bytes it moves. This suite measures that host work on tiny
tensors (one element per block by default), for every algorithm and for
``dist.all_to_all_single``:

* ``host_seconds`` -- CPU time of the calling thread per call (``time.thread_time``),
  the median of ``--repeats`` batches of ``--calls`` calls back to back; waiting for a
  peer sleeps and is not counted (on GPUs the GPU's work is asynchronous: this is the
  time the host takes to issue the call);
* ``floor_seconds`` -- the same for the call's messages alone: this rank's trace of one
  call, replayed (buffers made once, one ``batch_isend_irecv`` per labelled round, each
  round waited before the next). No algorithm can post its messages for less, and
  ``own_seconds`` = host − floor (the median of the batches' differences; a batch of
  the call and one of its floor run in turn) is what the algorithm adds: checks,
  cutting, copies, lists;
* ``untraced_floor_seconds`` -- the floor again through torch's own ``isend``/``irecv``,
  past the course's trace: floor − untraced floor is what the trace's wrappers (the
  watchdog's "rank 1 waiting in irecv from rank 0") cost;
* ``wall_seconds`` -- wall time per call back to back (on a GPU, how fast the host issues
  calls; on CPU, waiting for the peers included);
* ``python_calls`` -- Python function calls per call (``cProfile``), by whose code:
  the lesson's, the course's core (the trace's wrappers), torch's, and C built-ins.

``alone`` repeats ``host_seconds`` in a world of one rank, where a call sends nothing: all
the host does there is the call's own work. Every number is the maximum over ranks.
``--before RECORD`` puts an earlier host record beside this one and writes the ratios
(before / now).
"""

from __future__ import annotations

import cProfile
import functools
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ...core import launch, ops, trace

FLAT = {"linear": "linear_all_to_all", "pairwise": "pairwise_all_to_all", "bruck": "bruck_all_to_all"}


def library_all_to_all(output, input, group=None, **_):
    dist.all_to_all_single(output, input, group=group)


def _algorithms(names, layout=None) -> dict:
    import collectives.alltoall as a2a
    table = {"dist.all_to_all_single": library_all_to_all}
    table.update({k: getattr(a2a, v) for k, v in FLAT.items()})
    if layout is not None:
        table["hierarchical"] = functools.partial(a2a.hierarchical_all_to_all, layout=layout)
    return {k: table[k] for k in names}


NAMES = ("dist.all_to_all_single", "linear", "pairwise", "bruck", "hierarchical")


def _owner(filename: str) -> str:
    if filename.startswith("~") or filename.startswith("<"):
        return "builtin"
    if "collectives/alltoall" in filename:
        return "lesson"
    if "collectives/" in filename:
        return "core"
    return "torch" if "torch" in filename else "other"


def _per_call(fns: list, calls: int, repeats: int, sync) -> list[list[tuple[float, float]]]:
    """For each of ``fns``: ``repeats`` (thread CPU seconds, wall seconds) per call, each a
    batch of ``calls`` calls back to back; the functions take turns batch by batch, so a
    busy moment of a shared machine falls on all of them alike."""
    out: list[list[tuple[float, float]]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            sync()
            dist.barrier()
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            out[i].append(((time.thread_time() - c0) / calls, (time.perf_counter() - t0) / calls))
    sync()
    return out


def _replay(events, device, untraced: bool = False):
    """The messages of one recorded call, buffers made once, posted round by round: one
    ``batch_isend_irecv`` per round. ``untraced``: through torch's own ``isend``/``irecv``,
    past the course's trace (what its wrappers cost is the difference); on GPUs inside
    torch's coalescing block, as ``batch_isend_irecv`` does."""
    rounds: list[list] = []
    last = object()
    for e in events:
        if e.label != last:
            rounds.append([])
            last = e.label
        op = dist.isend if e.kind == "isend" else dist.irecv
        dtype = getattr(torch, e.dtype) if e.dtype else torch.float32
        rounds[-1].append((op, torch.zeros(e.numel, dtype=dtype, device=device), e.peer))
    if not untraced:
        batches = [[dist.P2POp(op, buf, peer) for op, buf, peer in ops_] for ops_ in rounds]

        def run():
            for p2p in batches:
                for work in dist.batch_isend_irecv(p2p):
                    work.wait()
        return run
    bare = [[(getattr(op, "__wrapped__", op), buf, peer) for op, buf, peer in ops_] for ops_ in rounds]
    if device.type != "cuda":
        def run():
            for ops_ in bare:
                for work in [op(buf, peer) for op, buf, peer in ops_]:
                    work.wait()
        return run
    from torch.distributed.distributed_c10d import _coalescing_manager

    def run():
        for ops_ in bare:
            with _coalescing_manager(None, device, async_ops=True) as cm:
                for op, buf, peer in ops_:
                    op(buf, peer)
            cm.wait()
    return run


def _profile(fn, calls: int) -> dict:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    by: dict[str, float] = {}
    for (filename, _, _), (_, ncalls, *_rest) in pstats.Stats(prof).stats.items():
        by[_owner(filename)] = by.get(_owner(filename), 0) + ncalls / calls
    return {k: round(v, 1) for k, v in sorted(by.items())}


def _host_in_rank(names: list[str], calls: int, repeats: int, per_block: int) -> dict:
    p = dist.get_world_size()
    device = ops.rank_device()
    layout = (2, p // 2) if p % 2 == 0 and p > 2 else (1, 1) if p == 1 else (p, 1)
    fns = _algorithms(names, layout)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    x = torch.arange(p * per_block, dtype=torch.float32, device=device) + 1000 * dist.get_rank()
    expected = torch.empty_like(x)
    dist.all_to_all_single(expected, x)
    rows = []
    for name, alg in fns.items():
        out = torch.zeros_like(x)
        fn = lambda: alg(out, x)          # noqa: E731
        fn()
        verified = bool(torch.equal(out, expected))
        for _ in range(10):               # warm: connections, plans, allocator
            fn()
        with trace.recording() as t:
            fn()
        messages = [e for e in t if e.kind in ("isend", "irecv")]
        fns = [fn]
        if messages:                      # the library's messages are inside its C++: no floor to replay
            fns += [_replay(messages, device), _replay(messages, device, untraced=True)]
            for f in fns[1:]:
                f()
        runs = _per_call(fns, calls, repeats, sync)
        med = lambda i, k=0: statistics.median(r[k] for r in runs[i])    # noqa: E731
        host, wall = med(0), med(0, 1)
        floor = bare = own = None
        if messages:
            floor, bare = med(1), med(2)
            own = statistics.median(a[0] - b[0] for a, b in zip(runs[0], runs[1]))
        dist.barrier()
        profile = _profile(fn, max(10, calls // 4))
        sync()
        mine = dict(host=host, floor=floor, bare=bare, own=own, wall=wall)
        every = [None] * p
        dist.all_gather_object(every, mine)
        rows.append(dict(name=name, verified=verified, nbytes=x.numel() * 4,
                         messages=len([e for e in t if e.kind in ("isend", "send")]),
                         host_seconds=max(r["host"] for r in every),
                         floor_seconds=None if floor is None else max(r["floor"] for r in every),
                         own_seconds=None if floor is None else max(r["own"] for r in every),
                         own_per_rank=None if floor is None else [r["own"] for r in every],
                         untraced_floor_seconds=None if bare is None else max(r["bare"] for r in every),
                         wall_seconds=max(r["wall"] for r in every),
                         python_calls=profile, python_calls_total=round(sum(profile.values()), 1)))
    return {"rows": rows, "world_size": p, "layout": list(layout), "calls": calls, "repeats": repeats,
            "per_block": per_block}


def suite_host(args, argv) -> dict:
    """``bench-alltoall host``: every all-to-all's host cost per call on tiny tensors."""
    p = args.ranks
    names = [n for n in NAMES if n != "hierarchical" or (p % 2 == 0 and p > 2)]
    result = launch.run(_host_in_rank, p, args=(names, args.calls, args.repeats, 1), backend=args.backend,
                        timeout=600)[0]
    # alone: a world of one rank, no message at all -- all the host does is the call's own work
    result["alone"] = launch.run(_host_in_rank, 1, args=(list(NAMES), args.calls, args.repeats, 1),
                                 backend=args.backend, timeout=600)[0]["rows"]
    if args.before:
        before = json.loads(Path(args.before).read_text())
        result["before"] = {"meta": before.get("meta"), "rows": before.get("rows"), "alone": before.get("alone")}
        was = {r["name"]: r for r in before.get("rows", [])}
        result["ratios"] = {
            r["name"]: {k: was[r["name"]][f"{k}_seconds"] / r[f"{k}_seconds"] for k in ("host", "own", "wall")
                        if (r[f"{k}_seconds"] or 0) > 0 and (was[r["name"]].get(f"{k}_seconds") or 0) > 0}
            for r in result["rows"] if r["name"] in was}
        alone = {r["name"]: r["host_seconds"] for r in before.get("alone") or []}
        for r in result["alone"]:
            if r["name"] in alone and r["name"] in result["ratios"]:
                result["ratios"][r["name"]]["alone"] = alone[r["name"]] / r["host_seconds"]
    return result


def print_rows(result: dict) -> None:
    for row in result["rows"]:
        ratio = result.get("ratios", {}).get(row["name"], {})
        us = {k: "" if row[f"{k}_seconds"] is None else f"{row[f'{k}_seconds'] * 1e6:.1f} µs"
              for k in ("floor", "own", "untraced_floor")}
        print(f"{row['name']:<24} host {row['host_seconds'] * 1e6:8.1f} µs  floor {us['floor']:>10}"
              f"  own {us['own']:>10}  untraced floor {us['untraced_floor']:>10}"
              f"  wall {row['wall_seconds'] * 1e6:8.1f} µs  "
              f"py calls {row['python_calls_total']:6.1f}  verified={row['verified']}"
              + (f"  before/now: host {ratio.get('host', 0):.2f}x own {ratio.get('own', 0):.2f}x"
                 f" alone {ratio.get('alone', 0):.2f}x" if ratio else ""))
    for row in result.get("alone", []):
        print(f"{row['name']:<24} alone (1 rank, no messages): host {row['host_seconds'] * 1e6:8.1f} µs  "
              f"py calls {row['python_calls_total']:6.1f}")
