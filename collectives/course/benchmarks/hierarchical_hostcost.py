"""``.venv/bin/python -m collectives bench-hier host-cost``: lesson 7's host work per bucket and per slice.

::

    .venv/bin/python -m collectives bench-hier host-cost            # layouts (2, 2), (1, 4), (4, 1); 4 gloo ranks
    .venv/bin/python -m collectives bench-hier host-cost --quick    # (2, 2) only, fewer rounds

On a GPU the host only *issues* the stages: NCCL and the streams do the work, so every
microsecond of Python per bucket or per slice is time the GPUs may wait for. This suite
measures that Python on a CPU, where it is the same code: tiny tensors (communication is
cheap), 4 local gloo ranks, and the time spent *inside* torch.distributed's calls (posting
a message, a collective, ``wait()``) taken out by a clock around each of them
(:func:`c10d_clock`). What is left is the course's own host work:

* **per bucket**: ``HierarchicalAllReducer.all_reduce`` on buckets of one slice each, with
  ``progress="streams"`` and ``inside="collectives"`` -- the GPU's path (on a CPU the stand-in
  streams run each stage as it is issued, so all of it is on the caller's thread and can be
  clocked); and with messages inside (gloo's default);
* **per slice**: one bucket cut into many slices, the same reducer; and the blocking
  ``hierarchical_all_reduce`` with many slices;
* **calls**: Python function calls per bucket and per slice (``cProfile``'s count: the same
  on every run, whatever the machine's load), and torch.distributed calls;
* **threads**: the CPU's own path (a lane per stage is a thread): the caller's time to hand
  a bucket over, and the wall time per bucket (thread hand-offs included).

Times are the median over ``--iters`` rounds of the slowest rank. The record (``bench-hier-host-cost.json``)
carries microseconds per bucket and per slice beside the machine, versions and commit;
``tools/gpu_hierarchical.py`` records the same host time on GPUs beside NCCL's.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import threading
import time
from time import perf_counter, thread_time

import torch
import torch.distributed as dist

from ...core import launch, timing, trace

CLOCKED = ("isend", "irecv", "batch_isend_irecv", "reduce_scatter_tensor", "all_gather_into_tensor",
           "all_to_all_single", "all_reduce", "barrier")


class _Clock:
    """Seconds spent inside torch.distributed's calls (and their ``wait()``), by thread: wall
    time and this thread's CPU time."""

    def __init__(self):
        self.seconds: dict[int, list[float]] = {}
        self.calls = 0

    def add(self, wall: float, cpu: float) -> None:
        spent = self.seconds.setdefault(threading.get_ident(), [0.0, 0.0])
        spent[0] += wall
        spent[1] += cpu

    def mine(self) -> list[float]:
        return self.seconds.get(threading.get_ident(), [0.0, 0.0])

    def reset(self) -> None:
        self.seconds.clear()
        self.calls = 0


class _ClockedWork:
    def __init__(self, work, clock: _Clock):
        self._work, self._clock = work, clock

    def wait(self, *args, **kwargs):
        t0, c0 = perf_counter(), thread_time()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._clock.add(perf_counter() - t0, thread_time() - c0)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _clocked(original, clock: _Clock):
    """``original`` clocked from entry to return, the wrapping of its handles included: what
    the clock itself costs is counted as torch.distributed's, not as the course's."""
    def wrapper(*args, **kwargs):
        t0, c0 = perf_counter(), thread_time()
        try:
            clock.calls += 1
            out = original(*args, **kwargs)
            if isinstance(out, list):
                return [_ClockedWork(w, clock) for w in out]
            return out if out is None or isinstance(out, torch.Tensor) else _ClockedWork(out, clock)
        finally:
            clock.add(perf_counter() - t0, thread_time() - c0)
    return wrapper


@contextlib.contextmanager
def c10d_clock():
    """Clock every call of :data:`CLOCKED` (and its ``wait()``) made inside the block."""
    c10d = dist.distributed_c10d
    clock = _Clock()
    saved = [(module, name, getattr(module, name)) for name in CLOCKED for module in (dist, c10d)
             if hasattr(module, name)]
    wrapped = {}
    for module, name, original in saved:
        if id(original) not in wrapped:
            wrapped[id(original)] = _clocked(original, clock)
        setattr(module, name, wrapped[id(original)])
    try:
        yield clock
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


class _Done:
    """A handle of a call that did nothing: already complete."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


STUBBED = ("isend", "irecv", "batch_isend_irecv", "reduce_scatter_tensor", "all_gather_into_tensor",
           "all_to_all_single")


@contextlib.contextmanager
def c10d_stubbed():
    """Inside the block :data:`STUBBED` do nothing and return completed handles: what is left
    of a call is the course's own host work alone (the values are wrong: only for timing)."""
    c10d = dist.distributed_c10d
    done = _Done()

    def nothing(*args, **kwargs):
        return done

    def batch(ops):
        return [done for _ in ops]
    saved = [(module, name, getattr(module, name)) for name in STUBBED for module in (dist, c10d)
             if hasattr(module, name)]
    for module, name, _ in saved:
        setattr(module, name, batch if name == "batch_isend_irecv" else nothing)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _issue_cost(fn, per: int, rounds: int, clock=time.thread_time) -> tuple[list[float], float]:
    """With torch.distributed's calls stubbed out: CPU seconds per unit of ``fn()``, one value
    per round of ``rounds`` calls (nine rounds); and the Python calls per unit (the same on
    every run, whatever else the machine is doing)."""
    out = []
    with c10d_stubbed():
        fn()
        for _ in range(9):
            c0 = clock()
            for _ in range(rounds):
                fn()
            out.append((clock() - c0) / (rounds * per))
        calls = _python_calls(fn) / per
    return out, calls


def _python_calls(fn) -> int:
    """Python function calls (cProfile's count, primitive and recursive) made by ``fn()``."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    return pstats.Stats(prof).total_calls


def _host_seconds(fn, clock: _Clock, iters: int) -> tuple[list[float], list[float], list[float]]:
    """Per round: wall seconds; and outside torch.distributed's calls on this thread, wall
    seconds (time descheduled included) and CPU seconds (this thread's own work only)."""
    walls, hosts, cpus = [], [], []
    for _ in range(iters):
        dist.barrier()
        clock.reset()
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        inside = clock.mine()
        walls.append(wall)
        hosts.append(wall - inside[0])
        cpus.append(cpu - inside[1])
    return walls, hosts, cpus


def _rank(layouts: list[tuple[int, int]], buckets: int, numel: int, slices: int, iters: int) -> list[dict]:
    from collectives.hierarchical import HierarchicalAllReducer, hierarchical_all_reduce

    trace.uninstall()                     # a plain program: no per-call tracing
    torch.manual_seed(dist.get_rank())
    rows = []
    for layout in layouts:
        D, M = layout
        element = 4
        one_slice = max(numel * element, 8 * D * M) * 2          # every bucket one slice
        data = [torch.randint(-8, 9, (numel,)).float() for _ in range(buckets)]
        long = torch.randint(-8, 9, (numel * slices,)).float()
        per_slice = numel                                        # elements per slice of the long bucket
        reducers = {
            "bucket": HierarchicalAllReducer(layout=layout, progress="streams", slice_bytes=one_slice,
                                             memory_bytes=1 << 20, inside="collectives"),
            "bucket, messages": HierarchicalAllReducer(layout=layout, progress="streams", slice_bytes=one_slice,
                                                       memory_bytes=1 << 20),
            "slice": HierarchicalAllReducer(layout=layout, progress="streams", slice_bytes=per_slice * element,
                                            memory_bytes=1 << 22),
            "threads": HierarchicalAllReducer(layout=layout, progress="threads", slice_bytes=one_slice,
                                              memory_bytes=1 << 20),
        }

        def buckets_through(reducer):
            for h in [reducer.all_reduce(t) for t in data]:
                h.wait()

        def long_through(reducer):
            reducer.all_reduce(long).wait()

        def pipeline():
            hierarchical_all_reduce(long, layout=layout, slice_numel=per_slice)

        issue = []

        def threads():
            t0 = time.perf_counter()
            handles = [reducers["threads"].all_reduce(t) for t in data]
            issue.append(time.perf_counter() - t0)
            for h in handles:
                h.wait()

        cases = {"bucket": (lambda: buckets_through(reducers["bucket"]), buckets),
                 "bucket, messages": (lambda: buckets_through(reducers["bucket, messages"]), buckets),
                 "slice": (lambda: long_through(reducers["slice"]), slices),
                 "pipeline slice": (pipeline, slices)}
        # correct first: every path gives dist.all_reduce's values, bit for bit (integer-valued data)
        want = [t.clone() for t in data]
        for t in want:
            dist.all_reduce(t)
        verified = True
        for name in ("bucket", "bucket, messages", "threads"):
            got = [t.clone() for t in data]
            for h in [reducers[name].all_reduce(t) for t in got]:
                h.wait()
            verified = verified and all(torch.equal(a, b) for a, b in zip(got, want))
        for run, _ in cases.values():        # warm-up: groups, arena, plans, connections
            run()
            run()
        threads()
        data[:] = [torch.zeros_like(t) for t in data]     # zeros stay zeros, round after round
        long.zero_()
        with c10d_clock() as clock:
            for name, (run, per) in cases.items():
                walls, hosts, cpus = _host_seconds(run, clock, iters)
                clock.reset()
                calls = _python_calls(run)
                c10d_calls = clock.calls
                rows.append(dict(layout=layout, name=name, per=per, wall=[w / per for w in walls],
                                 host=[h / per for h in hosts], cpu=[c / per for c in cpus], python_calls=calls / per,
                                 c10d_calls=c10d_calls / per, verified=verified))
        for row, (run, per) in zip(rows[-len(cases):], cases.values()):
            row["issue"], row["issue_calls"] = _issue_cost(run, per, 10)
        issue.clear()
        walls = [timing.measure(threads, warmup=0, iters=1)[0] for _ in range(iters)]
        rows.append(dict(layout=layout, name="threads", per=buckets, wall=[w / buckets for w in walls],
                         host=[i / buckets for i in issue], cpu=[float("nan")], python_calls=float("nan"),
                         c10d_calls=float("nan"), verified=verified))
        rows[-1]["issue"], rows[-1]["issue_calls"] = _issue_cost(threads, buckets, 10, clock=time.process_time)
        for reducer in reducers.values():
            reducer.close()
    return rows


def run(layouts, buckets: int, numel: int, slices: int, iters: int) -> list[dict]:
    """The rows of every rank merged: per row, the slowest rank's median (seconds per unit)."""
    ranks = launch.run(_rank, 4, args=(layouts, buckets, numel, slices, iters), timeout=300)
    rows = []
    for i, row in enumerate(ranks[0]):
        mine = [r[i] for r in ranks]
        rows.append(dict(layout=list(row["layout"]), name=row["name"], per=row["per"],
                         wall_us=max(timing.median(r["wall"]) for r in mine) * 1e6,
                         host_us=max(timing.median(r["host"]) for r in mine) * 1e6,
                         cpu_us=max(timing.median(r["cpu"]) for r in mine) * 1e6,
                         issue_us=max(timing.median(r["issue"]) for r in mine) * 1e6,
                         issue_min_us=max(min(r["issue"]) for r in mine) * 1e6,
                         issue_calls=row["issue_calls"],
                         python_calls=row["python_calls"], c10d_calls=row["c10d_calls"],
                         verified=all(r["verified"] for r in mine)))
    return rows


LABELS = {"bucket": "in flight, per bucket (1 slice, streams, collectives: the GPU's path)",
          "bucket, messages": "in flight, per bucket (1 slice, streams, messages inside)",
          "slice": "in flight, per slice (streams)",
          "pipeline slice": "hierarchical_all_reduce, per slice",
          "threads": "in flight, threads, per bucket (all threads' CPU)"}


def suite(args, argv):
    from ..site.claims import commit

    layouts = [(2, 2)] if args.quick else [(2, 2), (1, 4), (4, 1)]
    buckets, numel, slices = 16, 64, 16
    iters = 3 if args.quick else max(args.iters, 5)
    rows = run(layouts, buckets, numel, slices, iters)
    for r in rows:
        print(f"layout {tuple(r['layout'])}  {LABELS[r['name']]:66s} issue {r['issue_us']:6.1f} us "
              f"(least {r['issue_min_us']:6.1f}, {r['issue_calls']:4.0f} calls)  "
              f"CPU {r['cpu_us']:6.1f} us  "
              f"host {r['host_us']:7.1f} us  "
              f"wall {r['wall_us']:7.1f} us  py calls {r['python_calls']:5.0f}  c10d calls {r['c10d_calls']:3.0f}")
    result = {"config": dict(layouts=layouts, buckets=buckets, numel=numel, slices=slices, iters=iters,
                             ranks=4, backend="gloo"),
              "commit": commit(), "labels": LABELS, "runs": [{"rows": rows}]}
    return result, _plot(rows)


def _plot(rows: list[dict]):
    import matplotlib.pyplot as plt

    layouts = sorted({tuple(r["layout"]) for r in rows})
    names = list(LABELS)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        got = {tuple(r["layout"]): r["issue_us"] for r in rows if r["name"] == name}
        ax.bar([x + i * width for x in range(len(layouts))], [got.get(k, float("nan")) for k in layouts],
               width, label=LABELS[name], color=f"C{i}")
    ax.set_xticks([x + width for x in range(len(layouts))], [f"layout {k}" for k in layouts])
    ax.set_ylabel("host CPU µs, torch.distributed stubbed")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
