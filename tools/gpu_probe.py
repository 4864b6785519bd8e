"""Why the course's GPU collectives miss NCCL's pace: five measurements, one record each.

    python3 tools/gpu_probe.py host   --world 2 --json host.json     # host time of one call
    python3 tools/gpu_probe.py graph  --world 2 --json graph.json    # the ring from a CUDA graph
    python3 tools/gpu_probe.py triton --world 2 --json triton.json   # lesson 12's kernels' shape
    python3 tools/gpu_probe.py launch --world 2 --json launch.json   # where a kernel's launch goes
    python3 tools/gpu_probe.py barrier --world 4 --json barrier.json # lesson 12's two barriers

``host``: the host time to issue one call (synchronise, then perf_counter around the call)
of a CUDA kernel, ``dist.all_reduce``, a ``batch_isend_irecv`` pair, the course's ring and
lesson 11's linear all-to-all, through the course's trace and (``*_untraced_s``) without it;
then the ring's and the all-to-all's GPU times beside NCCL's, both issued from Python. Run it
under other torch settings (``TORCH_FR_BUFFER_SIZE=0``, ...): the record keeps the environment.

``graph``: the course's ring captured in a CUDA graph and replayed, exact against NCCL on
integer data first (stage by stage: a replay that never ends is named), the host time of a
replay; the same for the linear all-to-all. NCCL's registration of captured buffers is off
(``NCCL_GRAPH_REGISTER=0`` unless set otherwise: with it on, a replayed ring went wrong and
then hung; :func:`collectives.core.timing.graph_env`).

``triton``: lesson 12's one-shot and both two-shots at several shapes (elements per load,
programs, warps), beside torch's ``symm_mem`` ops and NCCL, and each one's host launch time.

``launch``: the host's time for one call of lesson 12's two-shot taken apart -- the whole
call, the launcher given ready arguments, Triton's compiled launcher alone, the handle's
pointer properties, the current stream -- and a cProfile of 300 calls, the costliest first.

``barrier``: lesson 12's kernels with each of their barriers (one thread meeting every peer
in turn, or one thread per peer), every barrier ordered or only those that hand over data,
exact against NCCL first.

Every time set against NCCL's follows the rule for fair GPU comparisons (``docs/benchmarks.md``,
:mod:`collectives.course.benchmarks.gpu_timing`): the ranks run without the course's trace,
NCCL is called directly, and each time is the median (and spread) of interleaved rounds of
runs back to back between CUDA events, every contender in turn. ``graph``, ``triton`` and
``barrier`` time every contender twice, all issued from Python (``b2b_s``, ``*_eager_s``),
then all replayed from CUDA graphs, NCCL's call included (``graph_s``, ``*_graph_s``); a
column is compared with the same column only (``*_speed_vs_nccl_eager`` / ``_replayed``).

No torchrun: one process per GPU (:func:`collectives.core.launch.run`). Multicast stays off.
A world that overruns (80 s for ``host``, ``graph`` and ``launch``, 150 s for ``barrier``, 400 s
for ``triton``) ends with the place each rank waited: give an outer ``timeout`` more than
that, or the report is lost.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

os.environ.update({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"})
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from collectives import launch, ops, timing, trace  # noqa: E402
from collectives.course.benchmarks import gpu_timing as rule  # noqa: E402
from collectives.course.site import claims  # noqa: E402

KNOBS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
         "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_AVOID_RECORD_STREAMS", "TORCH_NCCL_DESYNC_DEBUG",
         "TORCH_NCCL_ENABLE_TIMING", "TORCH_NCCL_BLOCKING_WAIT", "CUDA_LAUNCH_BLOCKING", "NCCL_DEBUG")


def _host(fn, device, reps=30) -> float:
    return timing.measure_issue(fn, iters=reps, device=device)


def _graph(fn, device, warm=3):
    """fn captured once in a CUDA graph after ``warm`` runs; the graph."""
    return timing.capture_graph(fn, warm=warm, device=device)


def host_rank(a2a_bytes: int, ring_bytes: int) -> dict:
    from collectives.alltoall import linear_all_to_all
    from collectives.ring import ring_all_reduce

    device = ops.rank_device()
    rank, p = dist.get_rank(), dist.get_world_size()
    peer = (rank + 1) % p
    tiny = torch.ones(1, device=device)
    land = torch.empty(1, device=device)

    def pair():
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, land, (rank - 1) % p),
                                         dist.P2POp(dist.isend, tiny, peer)]):
            w.wait()

    def unbatched():      # one NCCL call each, ranks 0 and 1: one sends first, the other receives first
        works = ([dist.isend(tiny, 1), dist.irecv(land, 1)] if rank == 0 else
                 [dist.irecv(land, 0), dist.isend(tiny, 0)] if rank == 1 else [])
        for w in works:
            w.wait()

    out = {"env": {k: os.environ[k] for k in KNOBS if k in os.environ}}
    ev = torch.cuda.Event()
    out["host_kernel_s"] = _host(lambda: tiny.add_(0), device)
    out["host_event_record_s"] = _host(lambda: ev.record(), device)
    out["host_all_reduce_4B_s"] = _host(lambda: dist.all_reduce(tiny), device)
    out["host_p2p_pair_4B_s"] = _host(pair, device)
    out["host_p2p_unbatched_4B_s"] = _host(unbatched, device) if p > 1 else None     # ranks 0 and 1
    with trace.paused():
        out["host_p2p_pair_4B_untraced_s"] = _host(pair, device)
        out["host_all_reduce_4B_untraced_s"] = _host(lambda: dist.all_reduce(tiny), device)
    small = torch.ones(256, device=device)
    out["host_ring_1KiB_s"] = _host(lambda: ring_all_reduce(small), device)
    n = a2a_bytes // 4 // p * p
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    out["host_linear_a2a_s"] = _host(lambda: linear_all_to_all(dst, src), device)
    out["host_nccl_a2a_s"] = _host(lambda: dist.all_to_all_single(dst, src), device)
    # From here the rule for fair GPU comparisons: nothing traced, NCCL called directly, CUDA
    # events over interleaved rounds, every contender issued from Python.
    rule.untrace_rank()
    skipped: list[str] = []
    out["host_linear_a2a_untraced_s"] = _host(lambda: linear_all_to_all(dst, src), device)
    out["host_nccl_a2a_untraced_s"] = _host(lambda: rule.nccl_all_to_all_single(dst, src), device)
    big = torch.zeros(ring_bytes // 4, device=device)       # zeros: summed in place they stay zeros
    for runs in ({"ring": lambda: ring_all_reduce(big), "nccl": lambda: rule.nccl_all_reduce(big)},
                 {"linear_a2a": lambda: linear_all_to_all(dst, src),
                  "nccl_a2a": lambda: rule.nccl_all_to_all_single(dst, src)}):
        for name, times in rule.rounds(runs, iters=10, skipped=skipped, device=device).items():
            out[f"gpu_{name}_s"], out[f"gpu_{name}_spread"] = rule.summary(times)
    big.resize_(0)
    out["rule"] = rule.fields("eager", "copied", skipped)
    return out


def graph_rank(sizes: list[int], a2a_bytes: int) -> dict:
    from collectives.alltoall import linear_all_to_all
    from collectives.ring import ring_all_reduce

    device = ops.rank_device()
    rank, p = dist.get_rank(), dist.get_world_size()
    stacks = os.environ.get("GPU_PROBE_STACKS")      # a folder: each rank's Python stack there if it stalls
    if stacks:
        import faulthandler
        faulthandler.dump_traceback_later(40, repeat=True, file=open(f"{stacks}/rank{rank}.txt", "w"))
    out: dict = {"stages": []}

    def stage(what: str) -> None:                   # kept in the record, and on disk as it happens
        out["stages"].append(what)
        if stacks:
            with open(f"{stacks}/stages{rank}.txt", "a") as f:
                print(what, flush=True, file=f)
    rule.untrace_rank()                             # the rule: nothing traced, NCCL called directly
    a, b = torch.ones(1 << 18, device=device) * (rank + 1), torch.zeros(1 << 18, device=device)
    peer = (rank + 1) % p

    def pair():                                     # the smallest case: one batched isend+irecv
        ops.sendrecv(a, peer, b, (rank - 1) % p)[0].wait()
    try:
        stage("pair: capturing")
        g_pair = _graph(pair, device)
        stage("pair: captured")
        b.zero_()
        g_pair.replay()
        torch.cuda.synchronize(device)
        out["pair_exact"] = bool(torch.all(b == ((rank - 1) % p) + 1))
        stage("pair: replayed")
    except Exception as exc:  # noqa: BLE001
        out["pair_error"] = rule.said(exc)
    rows = []
    for nbytes in sizes:
        n = nbytes // 4
        x = torch.empty(n, device=device)
        row, replays, skipped = {"bytes": nbytes}, {}, []
        stage(f"ring {nbytes}: capturing")
        try:
            g_ring = _graph(lambda: ring_all_reduce(x), device)
            values = torch.randint(-8, 9, (n,), device=device).float() * (rank + 1)
            expected = values.clone()
            rule.nccl_all_reduce(expected)
            x.copy_(values)
            g_ring.replay()
            torch.cuda.synchronize(device)
            row["exact"] = bool(torch.equal(x, expected))
            stage(f"ring {nbytes}: replayed once, exact {row['exact']}")
            for k in range(3):                   # one by one first: a replay that never ends is named
                g_ring.replay()
                torch.cuda.synchronize(device)
                stage(f"ring {nbytes}: replay {k + 2} done")
            replays["ring"] = g_ring.replay
            row["host_ring_graph_s"] = _host(g_ring.replay, device)
        except Exception as exc:  # noqa: BLE001 - a probe reports what failed
            row["ring_graph_error"] = rule.said(exc)
        try:
            replays["nccl"] = _graph(lambda: rule.nccl_all_reduce(x), device).replay
        except Exception as exc:  # noqa: BLE001
            row["nccl_graph_error"] = rule.said(exc)
        x.zero_()                                   # zeros: summed in place they stay zeros
        timed = rule.both_launches({"nccl": lambda: rule.nccl_all_reduce(x), "ring": lambda: ring_all_reduce(x)},
                                   replays, iters=10, skipped=skipped, device=device)
        row.update(rule.columns(timed, ("nccl", "ring")), skipped=skipped)
        rows.append(row)
        stage(json.dumps(row))
        x.resize_(0)
        torch.cuda.empty_cache()
    out["rows"] = rows
    stage("all-to-all: capturing")
    n = a2a_bytes // 4 // p * p
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    expected = torch.empty_like(dst)
    rule.nccl_all_to_all_single(expected, src)
    try:
        g = _graph(lambda: linear_all_to_all(dst, src), device)
        dst.zero_()
        g.replay()
        torch.cuda.synchronize(device)
        stage("all-to-all: replayed once")
        exact = bool(torch.equal(dst, expected))
        g_nccl = _graph(lambda: rule.nccl_all_to_all_single(dst, src), device)
        skipped = []
        timed = rule.both_launches({"nccl": lambda: rule.nccl_all_to_all_single(dst, src),
                                    "linear": lambda: linear_all_to_all(dst, src)},
                                   {"nccl": g_nccl.replay, "linear": g.replay}, iters=10, skipped=skipped,
                                   device=device)
        out["a2a"] = {"bytes": a2a_bytes, "exact": exact, **rule.columns(timed, ("nccl", "linear")), "skipped": skipped}
    except Exception as exc:  # noqa: BLE001
        out["a2a_error"] = rule.said(exc)
    out["rule"] = rule.fields(rule.BOTH, "copied", [])
    return out


SHAPES = [(4096, 64, 8), (4096, 128, 8), (8192, 128, 16), (2048, 128, 4), (4096, 256, 8), (1024, 32, 4)]


def triton_rank(sizes: list[int], shapes=None, algos=("one_shot", "two_shot", "two_shot_store"),
                dtype_name: str = "bfloat16") -> dict:
    from collectives.symmetric import gpu, triton_allreduce

    device = ops.rank_device()
    p = dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    size = torch.empty(0, dtype=dtype).element_size()
    cap = max(sizes) // size
    buf = gpu.SymmetricBuffer(cap, dtype)
    out = torch.empty(cap, dtype=dtype, device=device)
    theirs = gpu.symm_mem_ops()
    words = triton_allreduce._pad_words()
    rule.untrace_rank()                   # the rule: nothing traced, NCCL called directly
    rows = []
    for nbytes in sizes:
        n = nbytes // size
        buf.buffer[:n].zero_()            # zeros: summed in place they stay zeros
        base, runs = {"bytes": nbytes}, {}
        flat = buf.buffer[:n]
        runs["nccl"] = lambda flat=flat: rule.nccl_all_reduce(flat)
        for name, op in theirs.items():
            if name == "one_shot_all_reduce" and nbytes > (16 << 20):
                continue
            runs[name] = lambda op=op, n=n: op(buf.buffer[:n], "sum", buf.group_name)
        for block, programs, warps in shapes or SHAPES:
            if programs * p > words:
                continue
            for algo in algos:
                if algo == "one_shot" and nbytes > (16 << 20):
                    continue
                kw = dict(block=block, programs=programs, warps=warps)
                def fn(kw=kw, algo=algo, n=n):
                    if algo == "one_shot":
                        return triton_allreduce.one_shot(buf.handle, n, dtype, out, **kw)
                    gather = "store" if algo == "two_shot_store" else "load"
                    return triton_allreduce.two_shot(buf.handle, n, dtype, gather=gather, **kw)
                runs[f"{algo} b{block} g{programs} w{warps}"] = fn
        host = {}
        for key, fn in runs.items():
            try:
                host[key] = _host(fn, device, reps=20)
            except Exception as exc:  # noqa: BLE001 - a probe reports what failed
                why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                base.update({f"{key}_error": why} if key in theirs or key == "nccl" else {key: {"error": why}})
        skipped: list[str] = []
        timed = rule.both_launches({k: f for k, f in runs.items() if k in host}, iters=20, skipped=skipped,
                                   device=device)
        for key in host:
            cell = dict(timed.get(key, {}), host_s=host[key])
            if key == "nccl" or key in theirs:       # the flat names the earlier records used
                base.update({f"{key}_{k}": v for k, v in cell.items()})
            else:
                base[key] = cell
        base["skipped"] = skipped
        rows.append(base)
    return {"rows": rows, "pad_words": words, "world": p,
            "rule": rule.fields(rule.BOTH, "resident", [f"{r['bytes']}: {s}" for r in rows for s in r["skipped"]])}


def barrier_rank(sizes: list[int]) -> dict:
    """Lesson 12's kernels with each barrier (:data:`triton_allreduce.BARRIERS`), every barrier
    ordered, and with the parallel barrier ordered only where it hands over data
    (:data:`triton_allreduce.FENCES`): exact against NCCL on integer-valued bf16 first, then
    timed back to back and from a CUDA graph."""
    from collectives.symmetric import gpu, triton_allreduce

    device = ops.rank_device()
    rank, dtype = dist.get_rank(), torch.bfloat16
    cap = max(sizes) // 2
    buf = gpu.SymmetricBuffer(cap, dtype)
    out = torch.empty(cap, dtype=dtype, device=device)
    two_shot = gpu.symm_mem_ops().get("two_shot_all_reduce_")
    rule.untrace_rank()                   # the rule: nothing traced, NCCL called directly
    rows = []
    for nbytes in sizes:
        n = nbytes // 2
        row = {"bytes": nbytes}
        values = (torch.randint(-4, 5, (n,), device=device) * (rank + 1)).to(dtype)
        expected = values.clone()
        rule.nccl_all_reduce(expected)
        flat = buf.buffer[:n]
        runs = {"nccl": lambda: rule.nccl_all_reduce(flat)}
        if two_shot is not None:
            runs["symm_two_shot"] = lambda: two_shot(flat, "sum", buf.group_name)
        for barrier, fences in (("serial", "all"), ("parallel", "all"), ("parallel", "needed")):
            for algo in ("one_shot", "two_shot", "two_shot_store"):
                if algo == "one_shot" and nbytes > (16 << 20):
                    continue

                def fn(algo=algo, barrier=barrier, fences=fences):
                    if algo == "one_shot":
                        return triton_allreduce.one_shot(buf.handle, n, dtype, out, barrier=barrier, fences=fences)
                    gather = "store" if algo == "two_shot_store" else "load"
                    return triton_allreduce.two_shot(buf.handle, n, dtype, gather=gather, barrier=barrier,
                                                     fences=fences)
                key = f"{algo} {barrier}" + (" fences needed" if fences == "needed" else "")
                try:                             # exact against NCCL first, then timed with the others
                    flat.copy_(values)
                    dist.barrier()
                    fn()
                    torch.cuda.synchronize(device)
                    got = out[:n] if algo == "one_shot" else flat
                    row[key] = {"exact": bool(torch.equal(got, expected))}
                    runs[key] = fn
                except Exception as exc:  # noqa: BLE001 - a probe reports what failed
                    row[key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
        flat.zero_()                             # zeros: summed in place they stay zeros
        skipped: list[str] = []
        timed = rule.both_launches(runs, iters=20, skipped=skipped, device=device)
        for key in runs:
            if key in ("nccl", "symm_two_shot"):     # the flat names the earlier records used
                row.update({f"{key}_{k}": v for k, v in timed.get(key, {}).items()})
            else:
                row[key].update(timed.get(key, {}))
        row["skipped"] = skipped
        rows.append(row)
    launchers = {"one_shot": triton_allreduce._ONE_SHOT, "two_shot": triton_allreduce._TWO_SHOT,
                 "two_shot_store": triton_allreduce._TWO_SHOT_STORE}
    return {"rows": rows, "world": dist.get_world_size(),
            "ptx": {name: ptx_widths(launcher) for name, launcher in launchers.items()},
            "rule": rule.fields(rule.BOTH, "resident", [f"{r['bytes']}: {s}" for r in rows for s in r["skipped"]])}


def ptx_widths(launcher) -> dict:
    """How wide each compiled kernel's global loads and stores are: the count of every PTX form
    (``ld.global.v4.b32`` moves 16 bytes, ``st.global.b16`` two), per kernel compiled."""
    import collections
    import re

    found = {}
    for key, compiled in launcher.compiled.items():
        ptx = getattr(compiled, "asm", {}).get("ptx", "")
        forms = collections.Counter(m.group(0) for m in re.finditer(r"\b(?:ld|st)\.global(?:\.[a-z0-9]+)*", ptx))
        name = " ".join(str(part) for part in key if not isinstance(part, tuple)    # pointers left out
                        and not (isinstance(part, int) and part > 1 << 32))
        found[name] = dict(forms)
    return found


def launch_rank(numel: int) -> dict:
    import cProfile
    import io
    import pstats

    from collectives.symmetric import gpu, triton_allreduce

    device = ops.rank_device()
    dtype = torch.bfloat16
    buf = gpu.SymmetricBuffer(numel, dtype)
    buf.buffer.zero_()
    h = buf.handle
    two = triton_allreduce._TWO_SHOT
    for _ in range(5):
        triton_allreduce.two_shot(h, numel, dtype, gather="load")
    torch.cuda.synchronize(device)
    plan_key = next((k for k in triton_allreduce._PLANS if k[0] == "two"), None)
    compiled = two.compiled.get(plan_key)
    out = {"numel": numel, "dtype": str(dtype), "counts": dict(two.counts), "why_jit": two.why}
    out["host_two_shot_s"] = _host(lambda: triton_allreduce.two_shot(h, numel, dtype, gather="load"), device, reps=50)
    out["host_current_stream_s"] = _host(lambda: torch.cuda.current_stream().cuda_stream, device, reps=50)
    out["host_buffer_ptrs_dev_s"] = _host(lambda: (h.buffer_ptrs_dev, h.signal_pad_ptrs_dev), device, reps=50)
    out["host_hooks_check_s"] = _host(triton_launch_hooks, device, reps=50)
    out["host_error_check_s"] = _host(triton_allreduce.errors_of(h).check, device, reps=50)   # the per-call read
    if compiled is not None:
        (grid, key, args, consts, warps), _errors = triton_allreduce._PLANS[plan_key]
        stream = torch.cuda.current_stream().cuda_stream
        out["host_launcher_s"] = _host(lambda: two.launch(grid, key, args, consts, warps, shape=plan_key),
                                       device, reps=50)
        out["host_compiled_run_s"] = _host(
            lambda: compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata,
                                 None, None, None, *args, *consts.values()), device, reps=50)
        out["compiled_type"] = f"{type(compiled.run).__module__}.{type(compiled.run).__qualname__}"
    prof = cProfile.Profile()
    torch.cuda.synchronize(device)
    prof.enable()
    for _ in range(300):
        triton_allreduce.two_shot(h, numel, dtype, gather="load")
    prof.disable()
    torch.cuda.synchronize(device)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    out["profile"] = text.getvalue().splitlines()[-30:]
    return out


def triton_launch_hooks():
    from collectives.symmetric import triton_launch
    return triton_launch._hooks_installed()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["host", "graph", "triton", "launch", "barrier"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--label", default="", help="a name for this run's settings")
    ap.add_argument("--shapes", default="", help="triton: BLOCKxPROGRAMSxWARPS,... (default: six shapes)")
    ap.add_argument("--algos", default="", help="triton: one_shot,two_shot,two_shot_store (default: all three)")
    ap.add_argument("--dtype", default="bfloat16", help="triton: the element type (default bfloat16)")
    args = ap.parse_args()
    if args.what == "host":
        res = launch.run(host_rank, args.world, args=(64 << 20, 256 << 20), backend="nccl", timeout=80)
    elif args.what == "graph":
        res = launch.run(graph_rank, args.world, args=([1 << 20, 16 << 20, 256 << 20], 64 << 20),
                         backend="nccl", timeout=80, env=rule.rank_env("graph"))
    elif args.what == "barrier":        # captures its contenders too: the rule's graph settings
        res = launch.run(barrier_rank, args.world, args=([4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20],),
                         backend="nccl", timeout=150, env=rule.rank_env("graph"))
    elif args.what == "launch":
        res = launch.run(launch_rank, args.world, args=(8192,), backend="nccl", timeout=80)
    else:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else None
        algos = tuple(args.algos.split(",")) if args.algos else ("one_shot", "two_shot", "two_shot_store")
        res = launch.run(triton_rank, args.world, args=([64 << 10, 1 << 20, 16 << 20, 256 << 20], shapes, algos,
                                                         args.dtype), backend="nccl", timeout=400,
                         env=rule.rank_env("graph"))
    record = dict(claims.environment(backend="nccl", commit=claims.commit(), gpus=args.world),
                  what=args.what, label=args.label,
                  device=f"{args.world}× {torch.cuda.get_device_name(0)}, NVLink",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python3 tools/gpu_probe.py " + " ".join(sys.argv[1:]), rank0=res[0],
                  ranks=res if args.what == "host" else None)
    print(json.dumps(record["rank0"], indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
