"""``bench-symmetric --backend nccl``: lesson 12's GPU all-reduces against NCCL and torch's own.

One process per GPU (spawned by :func:`collectives.core.launch.run`), NVLink multicast off
in every one of them (:func:`collectives.symmetric.gpu.no_multicast`, before CUDA starts).
The contenders, each an all-reduce of the same tensor, each on a buffer of its own (no two
share a signal pad):

* ``nccl``: NCCL's ``all_reduce`` in place, called directly (``distributed_c10d.all_reduce``:
  not through the course's trace, which wraps the public ``dist.all_reduce``);
* ``nccl_symmetric``: the same call on a buffer registered with NCCL as a symmetric window,
  where NCCL runs its own symmetric-memory kernels -- where this torch exposes the
  registration (:func:`nccl_window`; else it is listed under ``skipped``, with why);
* ``symm_one_shot``, ``symm_two_shot``: ``torch.ops.symm_mem.one_shot_all_reduce`` and
  ``two_shot_all_reduce_`` (loads from peers' buffers; not the multicast (multimem) variants);
* ``triton_one_shot``, ``triton_two_shot``, ``triton_two_shot_store``: the lesson's kernels
  (:mod:`collectives.symmetric.triton_allreduce`), where Triton is installed;
* ``torch_one_shot``, ``torch_two_shot``: the lesson's plain-torch versions.

The run follows the course's rule for GPU comparisons (``docs/benchmarks.md``):

* **launched the same way**: ``launch="eager"`` issues every contender from Python;
  ``launch="graph"`` captures every contender, NCCL included, in a CUDA graph per size and
  replays it. A run is one or the other, never a mix;
* **the same work**: ``inputs="copied"`` (the default) times, for every contender, an
  all-reduce of one ordinary tensor in place -- a contender that works in symmetric memory
  copies the tensor in and the result back out, inside the timed call, as a caller must;
  ``inputs="resident"`` gives every contender its input already where it reads it, NCCL's
  in its tensor, and times the all-reduce alone;
* **untraced**: NCCL is called directly, and no contender goes through the trace;
* **CUDA events** around runs issued back to back (:func:`collectives.core.timing.measure_back_to_back`),
  the slowest rank's; the median, and the spread (lowest, highest), of :data:`ROUNDS`
  batches, the rounds interleaving the contenders -- each round times every one once, in
  turn -- so that a drift of the machine's pace falls on all of them alike.

The timing loop, the graph replays and NCCL's window are the pieces every GPU benchmark of
the course shares (:mod:`collectives.course.benchmarks.gpu_timing`).

Every contender is checked against NCCL bit for bit on integer-valued data first (sizes that
do not divide by p included), as the in-place all-reduce of an ordinary tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ...core import launch, timing
from ...symmetric import gpu
from .gpu_timing import (  # noqa: F401
    INPUTS,
    LAUNCHES,
    RULE,
    Replayed,
    check_launch,
    fields,
    nccl_window,
    rank_env,
    rounds,
    said,
    summary,
)

GPU_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M,1G"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
CHECK_SIZES = (1, 1001, 4099, (1 << 20) + 3)
ROUNDS = 5          # batches per contender and size, interleaved across the contenders


def _copied(buffer: torch.Tensor, src: torch.Tensor, kernel, out_is_src: bool):
    """``run(n)``: ``src[:n]`` into ``buffer``, ``kernel(n)``, and (unless the kernel writes
    ``src`` itself) the result back from ``buffer``: an in-place all-reduce of ``src``."""
    def run(n: int):
        buffer[:n].copy_(src[:n])
        kernel(n)
        if not out_is_src:
            src[:n].copy_(buffer[:n])
    return run


def contenders(capacity: int, dtype: torch.dtype, inputs: str = "copied") -> tuple[dict, list[str], torch.Tensor]:
    """name -> run(numel), each on a buffer of its own; what could not run here (and why);
    the ordinary tensor every contender all-reduces in place (``inputs="copied"``)."""
    if inputs not in INPUTS:
        raise ValueError(f"inputs must be one of {INPUTS}, got {inputs!r}")
    group, copied = dist.group.WORLD, inputs == "copied"
    src = torch.zeros(capacity, dtype=dtype, device="cuda")
    out = src if copied else torch.zeros(capacity, dtype=dtype, device="cuda")
    runs, skipped = {"nccl": lambda n: c10d.all_reduce(src[:n])}, []
    window, why = nccl_window(capacity, dtype, group)
    if window is None:
        skipped.append(why)
    else:
        nccl_in_window = lambda n: c10d.all_reduce(window[:n])                      # noqa: E731
        runs["nccl_symmetric"] = _copied(window, src, nccl_in_window, False) if copied else nccl_in_window
    torch_ops = gpu.symm_mem_ops()
    if torch_ops:
        theirs = gpu.SymmetricBuffer(capacity, dtype, group)
        theirs.buffer.zero_()
        if "one_shot_all_reduce" in torch_ops:
            op = torch_ops["one_shot_all_reduce"]
            one = lambda n: op(theirs.buffer[:n], "sum", theirs.group_name)                   # noqa: E731
            into_src = lambda n: src[:n].copy_(one(n))                                        # noqa: E731
            runs["symm_one_shot"] = _copied(theirs.buffer, src, into_src, True) if copied else one
        if "two_shot_all_reduce_" in torch_ops:
            op2 = torch_ops["two_shot_all_reduce_"]
            two = lambda n: op2(theirs.buffer[:n], "sum", theirs.group_name)                  # noqa: E731
            runs["symm_two_shot"] = _copied(theirs.buffer, src, two, False) if copied else two
    else:
        skipped.append("torch.ops.symm_mem (not in this torch)")
    if gpu.triton_available():
        from ...symmetric import triton_allreduce as ta
        lesson = gpu.SymmetricBuffer(capacity, dtype, group)
        lesson.buffer.zero_()
        kernels = {"triton_one_shot": (lambda n: ta.one_shot(lesson.handle, n, dtype, out), True),
                   "triton_two_shot": (lambda n: ta.two_shot(lesson.handle, n, dtype, gather="load"), False),
                   "triton_two_shot_store": (lambda n: ta.two_shot(lesson.handle, n, dtype, gather="store"), False)}
        for name, (kernel, writes_out) in kernels.items():
            runs[name] = _copied(lesson.buffer, src, kernel, writes_out) if copied else kernel
    else:
        skipped.append("the Triton kernels (Triton not installed)")
    plain = gpu.SymmetricBuffer(capacity, dtype, group)
    plain.buffer.zero_()
    mine = {"torch_one_shot": (lambda n: gpu.torch_one_shot(plain, n, out), True),
            "torch_two_shot": (lambda n: gpu.torch_two_shot(plain, n), False)}
    for name, (kernel, writes_out) in mine.items():
        runs[name] = _copied(plain.buffer, src, kernel, writes_out) if copied else kernel
    return runs, skipped, src


def check(runs: dict, src: torch.Tensor, dtype: torch.dtype) -> dict[str, object]:
    """Each contender (made with ``inputs="copied"``) against NCCL's all_reduce, bit for bit
    on small integers (exact in bf16): True, False, or the error it raised (the same on
    every rank: it depends on the size only)."""
    rank = dist.get_rank()
    ok: dict[str, object] = {}
    for name, run in runs.items():
        if name == "nccl":
            continue
        good: object = True
        for n in CHECK_SIZES:
            values = ((torch.arange(n, device="cuda") * (rank + 3)) % 7 + rank).to(dtype)
            expected = values.clone()
            c10d.all_reduce(expected)
            src[:n].copy_(values)
            torch.cuda.synchronize()
            c10d.barrier()
            try:
                run(n)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - reported: torch's ops refuse some sizes
                good = f"n={n}: raised {said(exc)}"
                break
            if not torch.equal(src[:n], expected):
                good = False
                break
        ok[name] = good
        torch.cuda.synchronize()
        c10d.barrier()
    return ok


EXERCISE = "lessons/12_symmetric/exercise.py:triton_one_shot"


def check_rank(dtypes: list[str], capacity: int = 1 << 22, exercise: bool = False) -> dict:
    """Only the checks (``tools/gpu_lesson12.py``): every contender against NCCL, per dtype;
    with ``exercise``, the exercise's optional Triton one-shot too (task 4), where written."""
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    checked, skipped = {}, []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        runs, skipped, src = contenders(capacity, dtype)
        if gpu.triton_available():      # the serial barrier too: its data-carrying barrier must order the block
            from ...symmetric import triton_allreduce as ta
            serial = gpu.SymmetricBuffer(capacity, dtype)
            for fences in ta.FENCES:
                runs[f"triton_one_shot_serial_{fences}"] = _copied(
                    serial.buffer, src, lambda n, f=fences: ta.one_shot(serial.handle, n, dtype, src, barrier="serial",
                                                                        fences=f), True)
                runs[f"triton_two_shot_serial_{fences}"] = _copied(
                    serial.buffer, src, lambda n, f=fences: ta.two_shot(serial.handle, n, dtype, gather="load",
                                                                        barrier="serial", fences=f), False)
        if exercise:
            from ..impl import resolve
            theirs = resolve(EXERCISE)
            mine = gpu.SymmetricBuffer(capacity, dtype)
            runs["exercise_triton_one_shot"] = _copied(mine.buffer, src, lambda n: theirs(mine.handle, n, dtype, src),
                                                       True)
        checked[dtype_name] = check(runs, src, dtype)
    return {"checked": checked, "skipped": skipped}


def gpu_rank(sizes: list[int], dtypes: list[str], iters: int, launch_mode: str = "eager",
             inputs: str = "copied") -> dict:
    check_launch(launch_mode)
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    runs, spreads, checked, skipped, host = {}, {}, {}, [], {}
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        size = torch.empty(0, dtype=dtype).element_size()
        checking, found, src = contenders(max(max(sizes) // size, max(CHECK_SIZES)), dtype)
        skipped += [why for why in found if why not in skipped]     # every dtype's, each once
        checked[dtype_name] = check(checking, src, dtype)
        del checking
        timed, _, _ = contenders(max(sizes) // size, dtype, inputs)
        if launch_mode == "eager":
            host[dtype_name] = {name: timing.measure_issue(lambda run=run: run(sizes[0] // size), barrier=True)
                                for name, run in timed.items()}
        else:
            timed = {name: Replayed(run) for name, run in timed.items()}
        times = {name: [] for name in timed}
        spread = {name: [] for name in timed}
        for nbytes in sizes:
            n = nbytes // size
            batch = max(3, iters if nbytes <= 1 << 20 else iters // 10 if nbytes <= 64 << 20 else 3)
            samples = rounds({name: (lambda run=run: run(n)) for name, run in timed.items()}, iters=batch,
                             skipped=skipped, where=f" ({dtype_name}): raised at {nbytes} bytes", count=ROUNDS,
                             device=torch.device("cuda"))
            for name in [name for name in timed if name not in samples]:   # raised: dropped whole
                del timed[name], times[name], spread[name]
            for name in timed:
                middle, lowest_highest = summary(samples[name])
                times[name].append(middle)
                spread[name].append(lowest_highest)
        runs[dtype_name], spreads[dtype_name] = times, spread
        del timed, src
        torch.cuda.empty_cache()
    return {"runs": runs, "spread": spreads, "checked": checked, "skipped": skipped, "host": host,
            "launcher": _launcher_counts()}


def _launcher_counts() -> dict:
    """How the lesson's Triton kernels were launched (:mod:`collectives.symmetric.triton_launch`):
    straight to the compiled kernel, or through Triton's JIT dispatch."""
    if not gpu.triton_available():
        return {}
    from ...symmetric import triton_allreduce
    return {name: dict(launcher.counts, why_jit=launcher.why)
            for name, launcher in (("one_shot", triton_allreduce._ONE_SHOT), ("two_shot", triton_allreduce._TWO_SHOT),
                                   ("two_shot_store", triton_allreduce._TWO_SHOT_STORE))}


def run_gpu(args) -> dict:
    world = args.world or torch.cuda.device_count()
    if world < 2:
        raise SystemExit("bench-symmetric --backend nccl needs at least 2 GPUs")
    sizes = timing.parse_sizes(args.sizes or GPU_SIZES)
    dtypes = [d for d in args.dtypes.split(",") if d]
    launch_mode, inputs = getattr(args, "launch", "eager"), getattr(args, "inputs", "copied")
    results = launch.run(gpu_rank, world, args=(sizes, dtypes, args.iters, launch_mode, inputs), backend="nccl",
                         timeout=args.timeout, env=rank_env(launch_mode))
    first = results[0]
    return {"backend": "nccl", "world": world, "sizes": sizes, "runs": first["runs"], "spread": first["spread"],
            "checked": first["checked"], "iters": args.iters, "host": first["host"], "launcher": first["launcher"],
            **fields(launch_mode, inputs, first["skipped"])}
