"""Lesson 12 on GPUs, as Triton kernels: one-shot and two-shot all-reduce over NVLink loads.

Each rank's buffer lives in torch's symmetric memory, so a kernel on rank r can load from
rank q's buffer through a plain pointer (``handle.buffer_ptrs_dev``: the p buffers'
addresses, peers' mapped over NVLink). No copy engine, no NCCL call, no multicast::

    one-shot, program b (of at most MAX_BLOCKS), elements in its blocks of BLOCK:
        barrier b                 every rank's input is in its buffer
        for each of its blocks:   acc = x_0 + x_1 + ... + x_{p-1}    (loads from p buffers, rank order)
                                  store acc into out (this rank's own tensor)
        barrier b                 nobody reads our buffer any more: the caller may refill it

    two-shot: chunk r of the buffer is rank r's (⌈n/p⌉ elements each)
        barrier b
        reduce: for each block of chunk r: acc = Σ_q x_q (rank order), store into OUR buffer, in place
        barrier b                 every chunk is reduced, in its owner's buffer
        gather: for each block of every other chunk j: copy from rank j's buffer into ours
        barrier b                 nobody reads our buffer any more

    two-shot, the gather by stores (``gather="store"``, the default; as torch's in-place two-shot):
        barrier b
        for each block of chunk r: acc = Σ_q x_q; store acc into EVERY rank's buffer
        barrier b                 every sum has landed in every buffer
      No barrier in the middle: block k of chunk r is read and written by one program of
      rank r alone, which reads it from every buffer before it writes it anywhere. And a
      store over NVLink is posted -- nothing waits for it to come back -- where a load is a
      round trip.

Each program runs through its blocks with a stride of the grid (a persistent grid of at
most :data:`MAX_BLOCKS` programs, so the barrier's words stay within the signal pad), each
load is BLOCK contiguous elements (Triton vectorises them to 16-byte loads). The sum is
taken in float32 for 16-bit types and in rank order on every rank: the same bits everywhere.

After the structure of symm-mem-recipes' one-shot all-reduce kernel (a blockwise barrier
on the signal pads, loads from every peer's buffer, one kernel per algorithm) and of
vLLM's and TensorRT-LLM's custom all-reduce two-shot; written for this course. Import
this module only where Triton and CUDA are: :func:`collectives.symmetric.gpu.triton_available`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import triton_errors
from .triton_barrier import RESERVED, blockwise_barrier
from .triton_errors import SPIN_LIMIT
from .triton_launch import Launcher, int_shape

__all__ = ["one_shot", "two_shot", "errors_of", "BLOCK_BYTES", "MAX_BLOCKS", "WARPS", "GATHERS", "BARRIERS",
           "FENCES", "SPIN_LIMIT"]

# The launch shape: the best of six measured on 2x NVIDIA H200 (tools/gpu_probe.py triton; the
# record docs/data/gpu/lesson12-shapes-2x-h200.json). A block is so many bytes, not elements, so
# that every dtype gets as many programs for the same bytes (the record
# docs/data/gpu/figures/lesson12-4x-h200-block-elements.json compares the two).
BLOCK_BYTES = 16384   # bytes per load of one program: 8192 elements of bf16, 4096 of fp32
MAX_BLOCKS = 128      # programs at most: (128 + 2) · p words of the signal pad (p ≤ 8: about 4 KiB)
WARPS = 16            # warps per program: 512 threads, 32 bytes each per load


@triton.jit
def _peer(buffer_ptrs, peer, ELEMENT: tl.constexpr):
    """Rank ``peer``'s buffer, as a pointer to ELEMENT (``buffer_ptrs``: the address, an
    integer, of the device array of the p buffers' addresses)."""
    base = tl.load(buffer_ptrs.to(tl.pointer_type(tl.uint64)) + peer).to(tl.pointer_type(ELEMENT))
    # A pointer read from memory tells the compiler nothing of its alignment, and unaligned it
    # moves one element per instruction. Symmetric buffers start at least 16-byte aligned:
    # saying so lets it load and store 16 bytes at a time (tools/gpu_probe.py barrier counts them).
    return tl.multiple_of(base, 16)


@triton.jit
def _sum_of_peers(buffer_ptrs, offsets, mask, ELEMENT: tl.constexpr, ACC: tl.constexpr, WORLD: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Σ over ranks 0 .. WORLD − 1 of their buffers at ``offsets``, accumulated in ACC."""
    acc = tl.zeros((BLOCK,), dtype=ACC)
    for peer in tl.static_range(WORLD):
        acc += tl.load(_peer(buffer_ptrs, peer, ELEMENT) + offsets, mask=mask).to(ACC)
    return acc


@triton.jit(do_not_specialize=["spin_limit"])
def _one_shot_kernel(buffer_ptrs, signal_pad_ptrs, out_ptr, numel, errors, spin_limit,
                     RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, ELEMENT: tl.constexpr,
                     ACC: tl.constexpr, PARALLEL: tl.constexpr, ORDER_ALL: tl.constexpr):
    program, programs = tl.program_id(0), tl.num_programs(0)
    gave_up = blockwise_barrier(signal_pad_ptrs, program, errors, spin_limit, RANK, WORLD, PARALLEL, ORDER_ALL, 10)
    if gave_up != 0:                                                                       # a peer never started
        return
    for start in range(program * BLOCK, numel, programs * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < numel
        acc = _sum_of_peers(buffer_ptrs, offsets, mask, ELEMENT, ACC, WORLD, BLOCK)
        tl.store(out_ptr + offsets, acc.to(ELEMENT), mask=mask)
    blockwise_barrier(signal_pad_ptrs, program, errors, spin_limit, RANK, WORLD, PARALLEL, ORDER_ALL, 11)


@triton.jit(do_not_specialize=["spin_limit"])
def _two_shot_kernel(buffer_ptrs, signal_pad_ptrs, numel, chunk, errors, spin_limit,
                     RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, ELEMENT: tl.constexpr,
                     ACC: tl.constexpr, PARALLEL: tl.constexpr, ORDER_ALL: tl.constexpr):
    program, programs = tl.program_id(0), tl.num_programs(0)
    own = _peer(buffer_ptrs, RANK, ELEMENT)
    gave_up = blockwise_barrier(signal_pad_ptrs, program, errors, spin_limit, RANK, WORLD, PARALLEL, ORDER_ALL, 20)
    if gave_up != 0:
        return
    lo = RANK * chunk
    for start in range(program * BLOCK, chunk, programs * BLOCK):        # reduce our chunk, in place
        offsets = lo + start + tl.arange(0, BLOCK)
        mask = (offsets < lo + chunk) & (offsets < numel)
        acc = _sum_of_peers(buffer_ptrs, offsets, mask, ELEMENT, ACC, WORLD, BLOCK)
        tl.store(own + offsets, acc.to(ELEMENT), mask=mask)
    gave_up = blockwise_barrier(signal_pad_ptrs, program, errors, spin_limit, RANK, WORLD, PARALLEL, True, 21)
    if gave_up != 0:                                                           # hands over what we wrote
        return
    for peer in tl.static_range(WORLD):                                  # gather the others' chunks
        if peer != RANK:
            theirs = _peer(buffer_ptrs, peer, ELEMENT)
            for start in range(program * BLOCK, chunk, programs * BLOCK):
                offsets = peer * chunk + start + tl.arange(0, BLOCK)
                mask = (offsets < (peer + 1) * chunk) & (offsets < numel)
                tl.store(own + offsets, tl.load(theirs + offsets, mask=mask), mask=mask)
    blockwise_barrier(signal_pad_ptrs, program, errors, spin_limit, RANK, WORLD, PARALLEL, ORDER_ALL, 22)


@triton.jit(do_not_specialize=["spin_limit"])
def _two_shot_store_kernel(buffer_ptrs, signal_pad_ptrs, numel, chunk, errors, spin_limit,
                           RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, ELEMENT: tl.constexpr,
                           ACC: tl.constexpr, PARALLEL: tl.constexpr, ORDER_ALL: tl.constexpr):
    program, programs = tl.program_id(0), tl.num_programs(0)
    gave_up = blockwise_barrier(signal_pad_ptrs, program, errors, spin_limit, RANK, WORLD, PARALLEL, ORDER_ALL, 30)
    if gave_up != 0:
        return
    lo = RANK * chunk
    for start in range(program * BLOCK, chunk, programs * BLOCK):
        offsets = lo + start + tl.arange(0, BLOCK)
        mask = (offsets < lo + chunk) & (offsets < numel)
        acc = _sum_of_peers(buffer_ptrs, offsets, mask, ELEMENT, ACC, WORLD, BLOCK).to(ELEMENT)
        for step in tl.static_range(WORLD):              # the sum into every rank's buffer, ours last
            peer = (RANK + 1 + step) % WORLD
            tl.store(_peer(buffer_ptrs, peer, ELEMENT) + offsets, acc, mask=mask)
    blockwise_barrier(signal_pad_ptrs, program, errors, spin_limit, RANK, WORLD, PARALLEL, True, 31)  # the sums


_ELEMENTS = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
             torch.int32: tl.int32, torch.int64: tl.int64}


def _types(dtype: torch.dtype) -> dict:
    """The element type, and the accumulator's: float32 for the 16-bit floats."""
    element = _ELEMENTS[dtype]
    return {"ELEMENT": element, "ACC": tl.float32 if dtype in (torch.bfloat16, torch.float16) else element}


_ONE_SHOT, _TWO_SHOT = Launcher(_one_shot_kernel), Launcher(_two_shot_kernel)
_TWO_SHOT_STORE = Launcher(_two_shot_store_kernel)
GATHERS = ("load", "store")
BARRIERS = ("serial", "parallel")     # one thread for every peer in turn, or one thread per peer
FENCES = ("needed", "all")            # order only the barriers that hand over data, or every one


def _check(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _check_limit(spin_limit: int) -> None:
    if not (isinstance(spin_limit, int) and 1 <= spin_limit < 1 << 62):
        raise ValueError(f"spin_limit must be a positive integer (tries of one handshake), got {spin_limit!r}")


def _block(block: int | None, dtype: torch.dtype) -> int:
    """Elements per load: ``block``, or :data:`BLOCK_BYTES` worth of ``dtype``."""
    return BLOCK_BYTES // dtype.itemsize if block is None else block


def _grid(work: int, block: int, programs: int, world: int) -> tuple[int]:
    if not (block > 0 and block & (block - 1) == 0):
        raise ValueError(f"block must be a power of two, got {block}")
    words = _pad_words()
    if programs < 1 or (programs + RESERVED) * world > words:
        raise ValueError(f"programs must be 1 .. {words // world - RESERVED} at world size {world} (the signal "
                         f"pad has {words} words: one per program and rank, after torch's barrier channels 0 and "
                         f"1), got {programs}")
    return (max(1, min(programs, triton.cdiv(work, block))),)


@functools.lru_cache(maxsize=None)
def _pad_words() -> int:
    from torch.distributed import _symmetric_memory as symm_mem

    return symm_mem.get_signal_pad_size() // 4 if hasattr(symm_mem, "get_signal_pad_size") else 2048


def _device() -> int:
    """The current CUDA device's index. ``torch._C._cuda_getDevice`` is torch's own C++ getter,
    called without building Python objects (this runs on every launch); where a torch lacks
    it, the public ``torch.cuda.current_device()``."""
    getter = getattr(torch._C, "_cuda_getDevice", None)
    return getter() if getter is not None else torch.cuda.current_device()


def refuse_alias(handle, out: torch.Tensor, numel: int, dtype: torch.dtype) -> None:
    """``out`` must not overlap this rank's own symmetric buffer: peers read that buffer
    while the kernel stores the sums into ``out``, so they would read sums, not inputs."""
    ptrs, size = getattr(handle, "buffer_ptrs", None), getattr(handle, "buffer_size", None)
    if ptrs is None or size is None:
        return                          # a handle that does not say where its buffer is
    own, start = int(ptrs[handle.rank]), out.data_ptr()
    if start < own + size and own < start + numel * dtype.itemsize:
        raise ValueError(f"one_shot on rank {handle.rank}: out overlaps this rank's own symmetric buffer, which "
                         "its peers read while the kernel writes out; pass a tensor outside symmetric memory")


def errors_of(handle) -> triton_errors.ErrorBuffer:
    """The error buffer the kernels on ``handle``'s signal pads write when they give up:
    :func:`.triton_errors.wait` waits for a call with a deadline while reading it."""
    return triton_errors.for_handle(handle, _device(), _pad_words())


_PLANS: dict = {}       # (pointers, rank, world, device, call) -> the launch's arguments, worked out once
MAX_PLANS = 4096


def _plan(key: tuple, make) -> tuple:
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = make()
    return plan


def one_shot(handle, numel: int, dtype: torch.dtype, out: torch.Tensor, *, block: int | None = None,
             programs: int = MAX_BLOCKS, warps: int = WARPS, barrier: str = "parallel",
             fences: str = "needed", spin_limit: int = SPIN_LIMIT) -> torch.Tensor:
    """``out[:numel]`` <- the sum over ranks of their symmetric buffers' first ``numel``
    elements (``handle``: ``symm_mem.rendezvous`` of a buffer of ``dtype``). One launch of at
    most ``programs`` programs of ``warps`` warps, each taking ``block`` elements at a time
    (default: :data:`BLOCK_BYTES` of them).
    ``barrier``: how a block meets its peers (:mod:`.triton_barrier`; :data:`BARRIERS`): one
    thread per peer unless asked (the serial handshake's round trips add up with p;
    ``tools/gpu_probe.py barrier`` times both). ``fences``: :data:`FENCES` --
    release and acquire only at the barriers that hand peers what this kernel wrote
    (``"needed"``), or at every barrier (``"all"``, to measure what they cost).
    A call's launch arguments are worked out once and looked up after (keyed by the handle's
    pointers, its rank and world size, and every argument, so nothing stale can match).
    ``out`` overlapping this rank's own symmetric buffer is refused (:func:`refuse_alias`).
    ``spin_limit``: the tries of one handshake before a barrier gives up on a peer
    (:mod:`.triton_errors`); every call first reads whether an earlier kernel gave up, and
    raises :class:`.triton_errors.SpinTimeout` naming the peer if one did."""
    _check("barrier", barrier, BARRIERS)
    _check("fences", fences, FENCES)
    ptrs = handle.buffer_ptrs_dev, handle.signal_pad_ptrs_dev
    key = ("one", ptrs, handle.rank, handle.world_size, _device(), numel, dtype, out.data_ptr(), block, programs,
           warps, barrier, fences, spin_limit)

    def make():     # no tensor kept here: a cached plan must not keep ``out`` alive
        refuse_alias(handle, out, numel, dtype)
        _check_limit(spin_limit)
        elements = _block(block, dtype)
        constexprs = dict(RANK=handle.rank, WORLD=handle.world_size, BLOCK=elements, **_types(dtype),
                          PARALLEL=barrier == "parallel", ORDER_ALL=fences == "all")
        shape = (dtype, tuple(constexprs.values()), int_shape(numel), out.data_ptr() % 16 == 0, out.device.index,
                 *ptrs)
        return _grid(numel, elements, programs, handle.world_size), shape, constexprs, errors_of(handle)
    grid, shape, constexprs, errors = _plan(key, make)
    errors.check()                     # a read of host memory: did an earlier kernel give up?
    _ONE_SHOT.launch(grid, shape, (*ptrs, out, numel, errors.address, spin_limit), constexprs, warps, shape=key)
    return out


def two_shot(handle, numel: int, dtype: torch.dtype, *, gather: str = "store", block: int | None = None,
             programs: int = MAX_BLOCKS, warps: int = WARPS, barrier: str = "parallel",
             fences: str = "needed", spin_limit: int = SPIN_LIMIT) -> None:
    """The first ``numel`` elements of this rank's symmetric buffer <- their sum over ranks,
    in place: a reduce-scatter by loads, then an all-gather -- by loads (``gather="load"``:
    every rank reads the others' reduced chunks; three barriers) or by stores
    (``"store"``, the default: every rank writes its reduced chunk into every rank's buffer;
    two barriers; a store over NVLink is posted, where a load is a round trip). One launch
    (``block``, ``programs``, ``warps``, ``barrier``, ``fences``, ``spin_limit``: as :func:`one_shot`)."""
    _check("gather", gather, GATHERS)
    _check("barrier", barrier, BARRIERS)
    _check("fences", fences, FENCES)
    ptrs = handle.buffer_ptrs_dev, handle.signal_pad_ptrs_dev
    key = ("two", ptrs, handle.rank, handle.world_size, _device(), numel, dtype, gather, block, programs, warps,
           barrier, fences, spin_limit)

    def make():
        _check_limit(spin_limit)
        chunk = triton.cdiv(numel, handle.world_size)
        elements = _block(block, dtype)
        constexprs = dict(RANK=handle.rank, WORLD=handle.world_size, BLOCK=elements, **_types(dtype),
                          PARALLEL=barrier == "parallel", ORDER_ALL=fences == "all")
        shape = (dtype, tuple(constexprs.values()), int_shape(numel), int_shape(chunk), *ptrs)
        errors = errors_of(handle)
        return (_grid(chunk, elements, programs, handle.world_size), shape,
                (*ptrs, numel, chunk, errors.address, spin_limit), constexprs, warps), errors
    launch, errors = _plan(key, make)
    errors.check()                     # a read of host memory: did an earlier kernel give up?
    (_TWO_SHOT if gather == "load" else _TWO_SHOT_STORE).launch(*launch, shape=key)
