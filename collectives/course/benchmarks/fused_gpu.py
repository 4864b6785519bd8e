"""``bench-fused --backend nccl``: lesson 5's fused all-reducer on GPUs, under the course's rule.

Many tensors of one size (the page's case: 1000 float32 tensors of 16 KiB, ``--numel 4096``)
all-reduced in one world, one process per GPU, every way the lesson discusses, each against
the floor -- one NCCL all-reduce of a buffer that already holds the same bytes:

* ``separate calls``   -- one NCCL all-reduce per tensor;
* ``flat all_reduce``  -- one NCCL all-reduce of the flat buffer (the baseline);
* ``flat all_reduce, NCCL window`` -- the same on a buffer NCCL registered as a symmetric
  window on every rank, where NCCL runs its own symmetric kernels (where this torch
  offers the registration; else under ``skipped``, with why);
* ``flat + 2 copies``  -- the flat call between a contiguous copy in and one back: the
  floor of copying around one call;
* ``cat + copy_ loop`` -- ``torch.cat``, the flat call, a Python loop of ``copy_`` back;
* ``fused``            -- :class:`~collectives.fused.FastFusedAllReducer` with one buffer
  for everything; ``fused, double buffer`` and ``fused, one buffer`` with buffers of
  ``--split`` bytes; ``fused, bound`` after ``bind()`` (the tensors live in the buffer).

The run follows the course's rule for GPU comparisons (``docs/benchmarks.md``;
:mod:`collectives.course.benchmarks.gpu_timing`):

* **launched the same way**: ``launch="eager"`` issues every case from Python, the reducer
  with ``graphs=False``; ``launch="graph"`` replays every case from a CUDA graph -- NCCL's
  calls and the copies captured by the benchmark, the reducer replaying the graph it records
  of a known list itself (``graphs=True``, as a training loop calls it: its check that the
  list is the one seen before is timed with it). Each row names how it was launched;
* **untraced**: NCCL is called directly, and the rank runs without the course's trace, so
  the reducer's own calls are NCCL's too;
* **the work counted**: each row names its ``inputs`` -- ``copied``: the caller's 1000
  tensors are all-reduced in place, any gathering into a buffer and back timed with it;
  ``resident``: the bytes already lie where the all-reduce reads them (the flat buffer, the
  window, the bound tensors). The ratio to the flat all-reduce sets the first against the
  second on purpose: it is the cost of fusing over the floor; ``vs_copy_floor`` sets copied
  against copied, and ``fused, bound`` against the flat call is resident against resident;
* **CUDA events**, runs issued back to back, the slowest rank's; the median and spread of
  ``rounds`` rounds, each round timing every case once, in turn.

Every case is first checked against NCCL on integer-valued data, as launched (a replay
included): one call after warm-up must leave the sum of every rank's values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...core import timing
from ...fused import FastFusedAllReducer
from .. import verify
from . import gpu_timing as rule

FUSED = ("fused", "fused, double buffer", "fused, one buffer", "fused, bound")
SEPARATE = "separate calls"
WINDOW = "flat all_reduce, NCCL window"
WARM = 3            # calls before the check: the reducer records its graph on a known list's second


EXERCISE_CASE = "fused (exercise)"


def exercise_case(tensors: list[torch.Tensor]) -> tuple[tuple | None, dict]:
    """The exercise's ``fused_all_reduce`` as a case, checked once on integer-valued copies of
    ``tensors``; or, when it cannot run, the row that says why. (The CPU path's too.)"""
    from ..impl import resolve
    from .allreduce import exercise_target

    target = exercise_target("collectives.fused:fused_all_reduce")
    ints = [torch.randint(-4, 5, t.shape, generator=torch.Generator().manual_seed(dist.get_rank() + i),
                          dtype=t.dtype).to(t.device) for i, t in enumerate(tensors)]
    expected = [verify.reference_all_reduce(t) for t in ints]
    try:
        fn = resolve(target)
        fn(ints)
    except NotImplementedError as exc:
        return None, dict(case=EXERCISE_CASE, detail=target, missing=f"not written yet ({exc})")
    except AttributeError as exc:
        return None, dict(case=EXERCISE_CASE, detail=target, missing=str(exc))
    wrong = torch.tensor([sum(int((a != b).sum()) for a, b in zip(ints, expected))], device=tensors[0].device)
    dist.all_reduce(wrong)
    return (EXERCISE_CASE, target, lambda ts, flat: (lambda: fn(ts))), dict(wrong=int(wrong.item()))


def _cases(tensors: list[torch.Tensor], flat: torch.Tensor, split_bytes: int, launch: str) -> tuple[dict, list[str]]:
    """name -> (run, the tensors it all-reduces in place, detail, inputs); what could not run, and why."""
    total = flat.numel() * flat.element_size()
    flushes = -(-total // split_bytes)
    graphs = launch == "graph"
    cases: dict[str, tuple] = {}
    skipped: list[str] = []

    def separate():
        for t in tensors:
            rule.nccl_all_reduce(t)
    cases[SEPARATE] = (separate, tensors, f"{len(tensors)} all_reduce calls", "copied")
    cases["flat all_reduce"] = (lambda: rule.nccl_all_reduce(flat), [flat], "one call, bytes already flat", "resident")
    window, why = rule.nccl_window(flat.numel(), flat.dtype, dist.group.WORLD)
    if window is None:
        skipped.append(f"{WINDOW}: {why}")
    else:
        cases[WINDOW] = (lambda: rule.nccl_all_reduce(window), [window],
                         "one call on a registered symmetric window (NCCL's symmetric kernels)", "resident")
    source = flat.clone()

    def copies():
        flat.copy_(source)
        rule.nccl_all_reduce(flat)
        source.copy_(flat)
    cases["flat + 2 copies"] = (copies, [source], "one contiguous copy in, the flat call, one back", "copied")

    def cat_loop():
        joined = torch.cat(tensors)
        rule.nccl_all_reduce(joined)
        for t, piece in zip(tensors, joined.split([t.numel() for t in tensors])):
            t.copy_(piece)
    cases["cat + copy_ loop"] = (cat_loop, tensors, "torch.cat, the flat call, Python copy_ loop", "copied")
    how = "each call replays the graph the reducer recorded" if graphs else "graphs=False, issued call by call"
    for name, buffer_bytes, double, bind, detail in (
            ("fused", total, True, False, "one buffer, 1 flush"),
            ("fused, double buffer", split_bytes, True, False,
             f"{timing.human_bytes(split_bytes)} buffers, {flushes} flushes"),
            ("fused, one buffer", split_bytes, False, False,
             f"{timing.human_bytes(split_bytes)} buffer, {flushes} flushes (SINGA order)"),
            ("fused, bound", total, True, True, "bind(): tensors live in the buffer, no copies")):
        reducer = FastFusedAllReducer(threshold_bytes=total + 1, buffer_bytes=buffer_bytes, device=flat.device,
                                      double_buffer=double, graphs=graphs)
        mine = reducer.bind([t.clone() for t in tensors]) if bind else tensors   # bound: tensors of its own
        cases[name] = ((lambda r=reducer, ts=mine: (r.all_reduce(ts), r.wait())), list(mine),
                       f"{detail}; {how}", "resident" if bind else "copied")
    return cases, skipped


def check(runs: dict, cases: dict) -> dict[str, object]:
    """Each case, as launched and warmed up, against NCCL: one call on integer-valued data
    must leave in every tensor the sum of every rank's values (exact in float32). True,
    False, or the error it raised; every tensor is left zero (zeros summed stay zeros)."""
    rank, ok = dist.get_rank(), {}
    for name, run in runs.items():
        tensors = cases[name][1]
        try:
            for _ in range(WARM):
                run()
            values = [(torch.arange(t.numel(), device=t.device).view(t.shape) % 9 - 4).to(t.dtype) * (rank + 1 + i % 3)
                      for i, t in enumerate(tensors)]
            expected = [v.clone() for v in values]
            for e in expected:
                rule.nccl_all_reduce(e)
            for t, v in zip(tensors, values):
                t.copy_(v)
            _synchronize(tensors)
            dist.barrier()
            run()
            _synchronize(tensors)
            ok[name] = all(torch.equal(t, e) for t, e in zip(tensors, expected))
        except Exception as exc:  # noqa: BLE001 - reported in the record, the case then dropped
            ok[name] = f"raised {rule.said(exc)}"
        for t in tensors:
            t.zero_()
        _synchronize(tensors)
        dist.barrier()
    return ok


def _synchronize(tensors: list[torch.Tensor]) -> None:
    if tensors and tensors[0].is_cuda:
        torch.cuda.synchronize(tensors[0].device)


def bench_gpu(count: int, numel: int, split_bytes: int, iters: int, separate_iters: int, rounds: int = rule.ROUNDS,
              launch: str = "eager", impl: str = "reference") -> dict:
    """Runs on every rank, one GPU each: :func:`measure` on that GPU."""
    rule.check_launch(launch)
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return measure(count, numel, split_bytes, iters, separate_iters, rounds, launch, impl,
                   torch.device("cuda", torch.cuda.current_device()))


def measure(count: int, numel: int, split_bytes: int, iters: int, separate_iters: int, rounds: int, launch: str,
            impl: str, device: torch.device) -> dict:
    """On every rank: check, then time every case in interleaved rounds. Returns the rows
    (times are the slowest rank's), the checks and the rule's fields. (On a CPU, with
    ``launch="eager"``, the same code runs under gloo: how the tests see it work.)"""
    rule.check_launch(launch)
    tensors = [torch.zeros(numel, device=device) for _ in range(count)]
    flat = torch.zeros(count * numel, device=device)
    exercise_row, exercise = None, None
    if impl == "exercise":            # checked on integer data before the trace comes off
        exercise_row, exercise = exercise_case(tensors)
    rule.untrace_rank()
    cases, skipped = _cases(tensors, flat, split_bytes, launch)
    if exercise_row is not None:
        name, detail, setup = exercise_row
        cases[name] = (setup(tensors, flat), tensors, detail, "copied")
    runs = rule.launched({name: c[0] for name, c in cases.items()}, launch, own_graphs=FUSED)
    checked = check(runs, cases)
    for name, good in checked.items():
        if good is not True:
            skipped.append(f"{name}: {'wrong against NCCL' if good is False else good}")
            del runs[name]
    samples = rule.rounds(runs, iters={name: separate_iters if name == SEPARATE else iters for name in runs},
                          skipped=skipped, count=rounds, device=device)
    rows = []
    for name, (_, _, detail, inputs) in cases.items():
        if name not in samples:
            continue
        middle, spread = rule.summary(samples[name])
        launched = ("eager" if launch == "eager" else "replayed: the reducer's own CUDA graph" if name in FUSED
                    else "replayed: captured by the benchmark")
        rows.append(dict(case=name, detail=detail, inputs=inputs, launched=launched, seconds=middle, best=spread[0],
                         spread=spread, times=samples[name], iters=separate_iters if name == SEPARATE else iters,
                         cpu_per_rank=None, checked=checked[name]))
    flat_s = next((r["seconds"] for r in rows if r["case"] == "flat all_reduce"), None)
    floor_s = next((r["seconds"] for r in rows if r["case"] == "flat + 2 copies"), None)
    for r in rows:
        r["vs_flat"] = r["seconds"] / flat_s if flat_s else float("nan")
        if r["inputs"] == "copied" and floor_s:
            r["vs_copy_floor"] = r["seconds"] / floor_s
    if exercise is not None and "missing" in exercise:
        rows.append(exercise)
    return {"rows": rows, "rule": rule.fields(launch, {name: c[3] for name, c in cases.items()}, skipped),
            "checked": checked}
