"""Launching lesson 12's Triton kernels without paying Triton's dispatch on every call.

``kernel[grid](*args)`` goes through Triton's JIT dispatch on every call: it binds the
arguments, works out how each one specialises the kernel (an integer equal to 1 or a
multiple of 16, a pointer aligned to 16 bytes), looks the compiled kernel up, then launches
it. At small sizes that Python costs the host longer than the one-shot kernel runs (the
record ``docs/data/gpu/lesson12-shapes-2x-h200.json``, from ``tools/gpu_probe.py triton``):
the launch, not NVLink, would set the pace.

:class:`Launcher` pays for the dispatch once per *shape* -- the grid and every property the
specialisation depends on -- and keeps the compiled kernel it returns; later calls of the
same shape hand the arguments straight to the compiled kernel's launcher. That launcher
(``compiled.run`` with its ``function`` and ``packed_metadata``) is Triton's own, not a
public API: if this Triton's compiled kernels take their arguments differently (the call
raises before anything is launched) the launcher goes back to the JIT for good, and while
a launch hook is installed (a profiler), each launch goes through the JIT, which calls it.
``counts`` says how many launches went each way and ``why`` the last reason for the JIT;
``bench-symmetric --backend nccl`` records both with the host's time per call.

Two details keep the direct path direct (``tools/gpu_probe.py launch`` times a launch piece
by piece; its record is ``docs/data/gpu/launch-probe-2x-h200.json``): Triton 3.4 and later
keep an empty chain of launch hooks where earlier versions kept None, and an empty chain is
no hook; and the stream is read from torch's C++, as Triton's own dispatch does, because
``torch.cuda.current_stream()`` builds a Python object that costs about as much as the
launch (the public call is the fallback). The callers (:mod:`.triton_allreduce`) also work
out each call's launch arguments once. vLLM's and TensorRT-LLM's custom all-reduces avoid
the question another way: they run inside CUDA graphs, where a replay issues every kernel
at once.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["Launcher", "int_shape"]


def int_shape(value: int) -> tuple[bool, bool, bool]:
    """How an integer argument specialises a Triton kernel: equal to 1, a multiple of 16,
    and whether it fits in 32 bits (else the kernel takes a 64-bit integer)."""
    return value == 1, value % 16 == 0, -(1 << 31) <= value < (1 << 31)


def _hook_set(hook) -> bool:
    """Whether a launch hook would run: Triton 3.4 and later keep an empty ``HookChain``
    where earlier versions kept None, so an empty chain is no hook."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


@functools.lru_cache(maxsize=1)
def _runtime():
    """Triton's runtime knobs (where launch hooks are kept), looked up once; None without them."""
    try:
        import triton
    except ImportError:
        return None
    return getattr(getattr(triton, "knobs", None), "runtime", None)


def _hooks_installed() -> bool:
    runtime = _runtime()
    return runtime is not None and (_hook_set(getattr(runtime, "launch_enter_hook", None))
                                    or _hook_set(getattr(runtime, "launch_exit_hook", None)))


def _current_stream() -> int:
    """The current CUDA stream's handle, as Triton's own dispatch reads it: straight from
    torch's C++ (``torch.cuda.current_stream()`` builds a Python stream object first, which
    costs the host about as much as the launch itself: ``tools/gpu_probe.py launch``)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)      # torch's own getter, not public API
    device = getattr(torch._C, "_cuda_getDevice", None)
    if raw is None or device is None:
        return torch.cuda.current_stream().cuda_stream                 # the public route
    return raw(device())


class Launcher:
    """One ``@triton.jit`` kernel, launched through the JIT once per shape and directly after.

    ``launch(grid, key, args, constexprs, warps)``: ``args`` the kernel's runtime arguments
    and ``constexprs`` its compile-time ones, both in the order of its signature (runtime
    first, as the lesson's kernels are written); ``key`` everything the compiled kernel
    depends on besides the grid (dtype, constexprs, :func:`int_shape` of each integer,
    pointers' alignment). Two calls with the same grid and key run the same machine code.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}
        self.direct = True               # False once the direct path has failed: JIT only
        self.counts = {"direct": 0, "jit": 0}   # launches each way: a run's record says which ran
        self.why: str | None = None      # why a launch went through the JIT after all (the last reason)

    def launch(self, grid: tuple[int], key: tuple, args: tuple, constexprs: dict, warps: int,
               shape=None) -> None:
        """``shape``: a cheaper key the caller vouches for (it determines grid, key and warps)."""
        shape = (grid, key, warps) if shape is None else shape
        compiled = self.compiled.get(shape) if self.direct else None
        if compiled is not None and _hooks_installed():
            self.why, compiled = "a launch hook is installed (a profiler): the JIT calls it", None
        if compiled is not None:
            try:         # Triton's own launcher, not a public API: any refusal falls back to the JIT below
                compiled.run(grid[0], 1, 1, _current_stream(), compiled.function,
                             compiled.packed_metadata, None, None, None, *args, *constexprs.values())
                self.counts["direct"] += 1
                return
            except (TypeError, AttributeError, ValueError) as exc:
                self.why = f"the compiled kernel refused its arguments: {type(exc).__name__}: {exc}"
                self.direct = False      # raised while parsing the arguments: nothing was launched
                self.compiled.clear()
        compiled = self.kernel[grid](*args, **constexprs, num_warps=warps)
        self.counts["jit"] += 1
        if self.direct and compiled is not None and hasattr(compiled, "run"):
            self.compiled[shape] = compiled
