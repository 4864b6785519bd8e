"""Zero-copy point-to-point on NCCL: communicate from memory registered with NCCL.

NCCL moves a ``send``/``recv`` between GPUs through staging buffers of its own unless the
user's buffer is registered with the communicator; then the transfer goes straight into
the peer's tensor: for a hand-written ring on NVLink, one copy less per step
(``tools/gpu_ring_check.py`` measures both against NCCL's own ``all_reduce``).

Usage::

    from collectives import nccl_memory
    x = nccl_memory.empty(n, dtype=torch.float32)   # from the registered pool under NCCL
    ...                                              # allocate everything you will send
    nccl_memory.register()                           # register the pool's segments, once
    ring_all_reduce(x)                               # zero-copy transfers

On CPU (gloo), or when the backend offers no NCCL allocator, :func:`empty` is
``torch.empty`` and :func:`register` does nothing, so the same code runs everywhere.

**Both ends registered, or neither.** A transfer from a registered buffer into an ordinary
one (or the other way) hung NCCL 2.28 on 4 H200s: every rank waiting on the GPU, for
good. So every algorithm of the course takes the buffers it receives into from
:func:`scratch` (the pool), never from ``torch.empty``; warmed up before :func:`register`,
they are registered with everything else. (Found when the benchmark's sweep hung as soon
as halving-doubling, whose landing buffer was still ordinary memory, met registered
tensors; after the change all seven algorithms ran there clean.) The library's other
temporaries -- the contiguous copy of a view (``ops.work_buffer``), the reduce-scatter's
working copy, ``exchange``'s landing buffer -- come from :func:`temporary`, which takes
them from the pool once :func:`register` has run. The same holds for your tensors: once
:func:`register` has run, hand the algorithms tensors from :func:`empty` only, or
ordinary ones in a process that never registers.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_pool = None
_backend = None
_registered = False


def _nccl_backend(device: torch.device):
    if not (dist.is_initialized() and dist.get_backend() == "nccl"):
        return None
    group = dist.distributed_c10d._get_default_group()
    backend = group._get_backend(device)
    return backend if hasattr(backend, "mem_allocator") else None


def pool(device: torch.device | None = None):
    """This process's NCCL-backed ``torch.cuda.MemPool``, or None off NCCL."""
    global _pool, _backend
    if _pool is None:
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        backend = _nccl_backend(device) if device is not None else None
        if backend is None:
            return None
        _backend = backend
        _pool = torch.cuda.MemPool(backend.mem_allocator)
    return _pool


def allocating():
    """Context manager: CUDA tensors created inside come from the registered pool."""
    p = pool()
    return torch.cuda.use_mem_pool(p) if p is not None else contextlib.nullcontext()


def empty(*shape, dtype=torch.float32, device=None) -> torch.Tensor:
    """``torch.empty`` from the registered pool under NCCL (call :func:`register` before use)."""
    device = device or (torch.device("cuda", torch.cuda.current_device())
                        if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu"))
    if torch.device(device).type != "cuda":
        return torch.empty(*shape, dtype=dtype, device=device)
    with allocating():
        return torch.empty(*shape, dtype=dtype, device=device)


def register() -> None:
    """Register every segment of the pool with NCCL -- once per process.

    Call it when everything you will communicate is allocated and a warm-up call has run
    (so landing buffers exist too); it synchronizes the device first. Memory allocated
    from the pool afterwards works, through NCCL's staging buffers, until freed.

    Registration is once and for all: NCCL ranks keep mappings of the registered buffers
    of their peers, so deregistering and registering again mid-run left peers writing
    through stale mappings -- an illegal memory access on 2 H200s, a wrong ring result on
    4. Allocate the largest buffer first and work on views of it (as ``python -m
    collectives bench`` does), and keep registered memory alive until the end.
    """
    global _registered
    if _pool is None:
        return
    if _registered:
        raise RuntimeError("nccl_memory.register(): the pool is already registered; registering "
                           "again is unsafe while peers hold mappings of it. Allocate everything "
                           "first (views of one large buffer) and register once.")
    torch.cuda.synchronize()
    _backend.register_mem_pool(_pool)
    _registered = True


def registered() -> bool:
    """Whether :func:`register` has run in this process."""
    return _registered


def pool_allocates(device) -> bool:
    """Whether a temporary on ``device`` must come from the pool: once :func:`register` has
    run, on a GPU. Ordinary memory could then meet registered memory in a transfer, and
    such a transfer never completes (NCCL 2.28, measured both ways on 2 H200s)."""
    return _registered and torch.device(device).type == "cuda"


def temporary(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A flat temporary of ``numel`` elements for the library's own copies (a contiguous copy
    of a view, a landing buffer, a reduce-scatter's working copy): ``torch.empty``, or, once
    :func:`register` has run, memory from the registered pool (:func:`pool_allocates`), so
    that no transfer mixes registered and ordinary memory."""
    device = torch.device(device)
    if pool_allocates(device) and _pool is not None:
        with torch.cuda.use_mem_pool(_pool):
            return torch.empty(numel, dtype=dtype, device=device)
    return torch.empty(numel, dtype=dtype, device=device)


def contiguous_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements in a new flat :func:`temporary` (its data: detached)."""
    flat = temporary(tensor.numel(), tensor.dtype, tensor.device)
    flat.copy_(tensor.detach().reshape(-1))
    return flat


def scratch_key(dtype: torch.dtype, device, group=None) -> tuple:
    """What a :func:`scratch` buffer is shared by: one dtype on one device, *and* one process
    group on one stream. Two groups (a hierarchical all-reduce's inner and outer ones) or two
    streams may run at the same time; sharing a landing buffer between them would let one's
    arrivals overwrite the other's."""
    device = torch.device(device)
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    return (dtype, device, group, stream)


_scratch: dict[tuple, torch.Tensor] = {}


def scratch_parts(count: int, numel: int, dtype: torch.dtype, device: torch.device,
                  group=None) -> list[torch.Tensor]:
    """``count`` landing buffers of ``numel`` elements each, side by side in :func:`scratch`."""
    whole = scratch(count * numel, dtype, device, group)
    return [whole[i * numel: (i + 1) * numel] for i in range(count)]


def scratch(numel: int, dtype: torch.dtype, device: torch.device, group=None) -> torch.Tensor:
    """A landing buffer of ``numel`` elements for received chunks (one per :func:`scratch_key`:
    callers that need several at once take :func:`scratch_parts`).

    Under NCCL it is cached per (dtype, device, group, stream) and comes from the pool,
    grown when a larger one is asked for. It is *not* registered here: registering (or
    re-registering) while earlier asynchronous transfers may still be in flight is unsafe.
    Warm up once, then call :func:`register` -- from then on the arrivals are zero-copy.
    Elsewhere it is a fresh ``torch.empty``.
    """
    device = torch.device(device)
    if device.type != "cuda" or pool(device) is None:
        return torch.empty(numel, dtype=dtype, device=device)
    key = scratch_key(dtype, device, group)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < numel:
        with allocating():
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
        _scratch[key] = buf
    return buf[:numel]
