"""``bench-symmetric --backend nccl``: lesson 12's GPU all-reduces against NCCL and torch's own.

One process per GPU (spawned by :func:`collectives.core.launch.run`), NVLink multicast off
in every one of them (:func:`collectives.symmetric.gpu.no_multicast`, before CUDA starts).
Per dtype, each algorithm has a buffer of the largest size of its own -- a plain tensor
for NCCL, symmetric memory for the others, one allocation each, so no two of them share a
signal pad -- and the data is already where the algorithm reads it (the caller of a
symmetric-memory all-reduce writes its tensor into the buffer; that copy is not timed):

* ``nccl``: ``dist.all_reduce`` in place;
* ``symm_one_shot``, ``symm_two_shot``: ``torch.ops.symm_mem.one_shot_all_reduce`` and
  ``two_shot_all_reduce_`` (loads from peers' buffers; not the multicast (multimem) variants);
* ``triton_one_shot``, ``triton_two_shot``, ``triton_two_shot_store``: the lesson's kernels
  (:mod:`collectives.symmetric.triton_allreduce`; the last gathers by stores), where
  Triton is installed;
* ``torch_one_shot``, ``torch_two_shot``: the lesson's plain-torch versions
  (:mod:`collectives.symmetric.gpu`).

Every algorithm is checked against NCCL bit for bit on integer-valued data first (sizes
that do not divide by p included). Times: CUDA events around runs issued back to back
(:func:`collectives.core.timing.measure_back_to_back`), the slowest rank's, the median of
:data:`ROUNDS` batches. The rounds interleave the algorithms -- each round times every one
once, in turn -- so that a drift of the machine's pace (a shared host, a clock) falls on all
of them alike, not on whichever was timed then: at ten microseconds a call, drift is as large
as the differences measured.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from ...core import launch, timing
from ...symmetric import gpu

GPU_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M,1G"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
CHECK_SIZES = (1, 1001, 4099, (1 << 20) + 3)
ROUNDS = 5          # batches per algorithm and size, interleaved across the algorithms


class Replayed:
    """``run(n)`` captured in a CUDA graph once per ``n`` (:func:`~collectives.core.timing.capture_graph`)
    and replayed: the kernel's own time, with no launch from Python (as vLLM runs its custom
    all-reduce). The warm run before the capture changes ``buffer``'s first ``n`` elements;
    they are put back as they were."""

    def __init__(self, run, buffer: torch.Tensor):
        self.run, self.buffer, self.graphs = run, buffer, {}

    def __call__(self, n: int):
        graph = self.graphs.get(n)
        if graph is None:
            saved = self.buffer[:n].clone()
            graph = self.graphs[n] = timing.capture_graph(lambda: self.run(n), device=self.buffer.device)
            self.buffer[:n].copy_(saved)         # the warm run changed it; the capture did not run
        graph.replay()


def _algorithms(capacity: int, dtype: torch.dtype) -> tuple[dict, list[str], dict, torch.Tensor]:
    """name -> run(numel), each on a buffer of its own; what could not run here; each
    algorithm's buffer (where its input goes); the one-shots' output."""
    group = dist.group.WORLD
    plain = torch.zeros(capacity, dtype=dtype, device="cuda")
    algos = {"nccl": lambda n: dist.all_reduce(plain[:n])}
    skipped = []
    torch_ops = gpu.symm_mem_ops()
    if torch_ops:
        theirs = gpu.SymmetricBuffer(capacity, dtype, group)
        theirs.buffer.zero_()
        if "one_shot_all_reduce" in torch_ops:
            algos["symm_one_shot"] = lambda n: torch_ops["one_shot_all_reduce"](theirs.buffer[:n], "sum",
                                                                              theirs.group_name)
        if "two_shot_all_reduce_" in torch_ops:
            algos["symm_two_shot"] = lambda n: torch_ops["two_shot_all_reduce_"](theirs.buffer[:n], "sum",
                                                                               theirs.group_name)
    else:
        skipped.append("torch.ops.symm_mem (not in this torch)")
    out = torch.zeros(capacity, dtype=dtype, device="cuda")
    if gpu.triton_available():
        from ...symmetric import triton_allreduce
        lesson = gpu.SymmetricBuffer(capacity, dtype, group)
        lesson.buffer.zero_()
        algos["triton_one_shot"] = lambda n: triton_allreduce.one_shot(lesson.handle, n, dtype, out)
        algos["triton_two_shot"] = lambda n: triton_allreduce.two_shot(lesson.handle, n, dtype, gather="load")
        algos["triton_two_shot_store"] = lambda n: triton_allreduce.two_shot(lesson.handle, n, dtype, gather="store")
        algos["graph_triton_one_shot"] = Replayed(algos["triton_one_shot"], lesson.buffer)
        algos["graph_triton_two_shot"] = Replayed(algos["triton_two_shot"], lesson.buffer)
    else:
        skipped.append("the Triton kernels (Triton not installed)")
    plain_torch = gpu.SymmetricBuffer(capacity, dtype, group)
    plain_torch.buffer.zero_()
    algos["torch_one_shot"] = lambda n: gpu.torch_one_shot(plain_torch, n, out)
    algos["torch_two_shot"] = lambda n: gpu.torch_two_shot(plain_torch, n)
    buffers = {"nccl": plain, "symm_one_shot": theirs.buffer if torch_ops else None,
               "symm_two_shot": theirs.buffer if torch_ops else None,
               "triton_one_shot": lesson.buffer if "triton_one_shot" in algos else None,
               "triton_two_shot": lesson.buffer if "triton_two_shot" in algos else None,
               "triton_two_shot_store": lesson.buffer if "triton_two_shot" in algos else None,
               "graph_triton_one_shot": lesson.buffer if "triton_one_shot" in algos else None,
               "graph_triton_two_shot": lesson.buffer if "triton_two_shot" in algos else None,
               "torch_one_shot": plain_torch.buffer, "torch_two_shot": plain_torch.buffer}
    return algos, skipped, buffers, out


def _check(algos: dict, buffers: dict, out: torch.Tensor, dtype: torch.dtype) -> dict[str, object]:
    """Each algorithm against NCCL's all_reduce, bit for bit, on small integers (exact in bf16):
    True, False, or the error it raised (the same on every rank: it depends on the size only)."""
    rank = dist.get_rank()
    ok: dict[str, object] = {}
    for name, run in algos.items():
        if name == "nccl":
            continue
        good: object = True
        for n in CHECK_SIZES:
            values = ((torch.arange(n, device="cuda") * (rank + 3)) % 7 + rank).to(dtype)
            expected = values.clone()
            dist.all_reduce(expected)
            buffers[name][:n].copy_(values)
            torch.cuda.synchronize()
            dist.barrier()
            try:
                result = run(n)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - reported: torch's ops refuse some sizes
                good = f"n={n}: raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                break
            got = result if name == "symm_one_shot" else out[:n] if name.endswith("one_shot") else buffers[name][:n]
            if not torch.equal(got[:n], expected):
                good = False
                break
        ok[name] = good
        buffers[name].zero_()
        torch.cuda.synchronize()
        dist.barrier()
    return ok


EXERCISE = "lessons/12_symmetric/exercise.py:triton_one_shot"


def check_rank(dtypes: list[str], capacity: int = 1 << 22, exercise: bool = False) -> dict:
    """Only the checks (``tools/gpu_lesson12.py``): every algorithm against NCCL, per dtype;
    with ``exercise``, the exercise's optional Triton one-shot too (task 4), where written."""
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    checked, skipped = {}, []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        algos, skipped, buffers, out = _algorithms(capacity, dtype)
        if exercise:
            from ..impl import resolve
            theirs = resolve(EXERCISE)
            mine = gpu.SymmetricBuffer(capacity, dtype)
            algos["exercise_triton_one_shot"] = lambda n: theirs(mine.handle, n, dtype, out)
            buffers["exercise_triton_one_shot"] = mine.buffer
        checked[dtype_name] = _check(algos, buffers, out, dtype)
    return {"checked": checked, "skipped": skipped}


def gpu_rank(sizes: list[int], dtypes: list[str], iters: int) -> dict:
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    runs, checked, skipped, host = {}, {}, [], {}
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        size = torch.empty(0, dtype=dtype).element_size()
        algos, skipped, buffers, out = _algorithms(max(sizes) // size, dtype)
        checked[dtype_name] = _check(algos, buffers, out, dtype)
        times = {name: [] for name in algos}
        for nbytes in sizes:
            n = nbytes // size
            batch = max(3, iters if nbytes <= 1 << 20 else iters // 10 if nbytes <= 64 << 20 else 3)
            samples: dict[str, list[float]] = {name: [] for name in algos}
            for _ in range(ROUNDS):
                for name, run in list(algos.items()):
                    try:
                        samples[name].append(timing.measure_back_to_back(lambda: run(n), iters=batch,
                                                                         device=torch.device("cuda")))
                    except RuntimeError as exc:   # the same on every rank (it depends on the size): dropped whole
                        skipped.append(f"{name} ({dtype_name}): raised at {nbytes} bytes: {str(exc).splitlines()[0]}")
                        del algos[name], times[name], samples[name]
            for name in algos:
                times[name].append(statistics.median(samples[name]))
        runs[dtype_name] = times
        host[dtype_name] = {name: timing.measure_issue(lambda run=run: run(sizes[0] // size), barrier=True)
                            for name, run in algos.items() if not name.startswith("graph_")}
        del algos, buffers, out
        torch.cuda.empty_cache()
    return {"runs": runs, "checked": checked, "skipped": skipped, "host": host, "launcher": _launcher_counts()}


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
    results = launch.run(gpu_rank, world, args=(sizes, dtypes, args.iters), backend="nccl", timeout=args.timeout,
                         env=dict(gpu.NO_MULTICAST))
    first = results[0]
    return {"backend": "nccl", "world": world, "sizes": sizes, "runs": first["runs"], "checked": first["checked"],
            "skipped": first["skipped"], "iters": args.iters, "host": first["host"], "launcher": first["launcher"]}
