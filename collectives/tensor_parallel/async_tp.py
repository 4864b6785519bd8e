"""Lesson 13: async TP -- the all-gather and the reduce-scatter cut into p pieces, each
piece's transfer hidden under the matmul of the piece before it.

Under sequence parallelism a column layer waits for an all-gather before its matmul, and a
row layer's reduce-scatter waits for its matmul: communication on the critical path, with
nothing else to hide it. But the matmul is row by row: rows from rank j need only rank j's
piece. So (after PyTorch's async TP, Wang et al.'s decomposition of collectives into p2p
steps overlapped with partial matmuls)::

    all-gather → matmul (x_j: rank j's rows, W: my columns)
      step 0:  send x_r right, receive x_{r-1}   ║  y_r     = x_r · W
      step s:  forward x_{r-s} right, receive   ║  y_{r-s}  = x_{r-s} · W
      last:                                         y_{r-p+1} = x_{r-p+1} · W

    matmul → reduce-scatter (x: every row, my input columns; W: my rows of the weight)
      step 0:  a = x_{r-1} · W; send a right            (chunk r-1's running sum starts here)
      step s:  compute x_{r-1-s} · W   ║  receive the running sum of chunk r-1-s from the left
               add them, send right                     (lesson 4's ring, one step at a time)
      last:    out = x_r · W + the running sum arriving for chunk r

The transfers go on a side thread on CPU (gloo's p2p from a ``ThreadPoolExecutor(1)``), so
each piece's message travels while this thread multiplies. The results are the same as
the sequential all-gather then matmul (exactly: nothing is added in a new order) and as
matmul then lesson 4's ring reduce-scatter (the same additions in the same order).

On GPUs (:func:`all_gather_matmul` with CUDA tensors) the all-gather reads the peers'
pieces from lesson 12's symmetric memory, each copy on a side stream while the main stream
multiplies the piece before it -- PyTorch's ``fused_all_gather_matmul`` does the same.
``timeline`` (a list) receives ``dict(what, chunk, start, end)`` for each transfer and
each matmul on CPU: the lab's figure of the overlap.
"""

from __future__ import annotations

import concurrent.futures
import time

import torch

from collectives.core import ops, streams

from .comm import TPGroup


def _note(timeline, what: str, chunk: int, t0: float) -> None:
    if timeline is not None:
        timeline.append(dict(what=what, chunk=chunk, start=t0, end=time.perf_counter()))


def _check(x: torch.Tensor, weight: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{what}: x and weight must be tensors")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"{what}: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply "
                         "(2-D x of (rows, k) and weight of (k, n))")


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, tp: TPGroup | None = None, *,
                      overlap: bool = True, timeline: list | None = None, matmul=torch.matmul) -> torch.Tensor:
    """``all_gather(x) @ weight``: ``x`` this rank's (m, k) rows, the result (p·m, n), rank
    j's rows at block j. ``overlap=False`` waits for each transfer before the matmul (the
    same messages, nothing hidden); ``matmul`` is the product used for each piece."""
    _check(x, weight, "all_gather_matmul")
    tp = tp or TPGroup()
    p, r = tp.size, tp.rank
    if x.is_cuda and p > 1:
        return _all_gather_matmul_symmetric(x, weight, tp)
    m = x.shape[0]
    pieces = x.new_empty((p, m, x.shape[1]))
    pieces[r].copy_(x)
    out = x.new_empty((p * m, weight.shape[1]))
    right, left = ops.global_rank(tp.group, (r + 1) % p), ops.global_rank(tp.group, (r - 1) % p)

    def transfer(step: int):
        t0 = time.perf_counter()
        recv, send = ops.sendrecv(pieces[(r - step) % p], right, pieces[(r - step - 1) % p], left, tp.group)
        recv.wait()
        send.wait()
        _note(timeline, "transfer", (r - step - 1) % p, t0)

    with concurrent.futures.ThreadPoolExecutor(1, "tp-comm") as side:
        for step in range(p):
            c = (r - step) % p
            pending = side.submit(transfer, step) if step < p - 1 else None
            if pending is not None and not overlap:
                pending.result()
            t0 = time.perf_counter()
            out[c * m:(c + 1) * m] = matmul(pieces[c], weight)
            _note(timeline, "matmul", c, t0)
            if pending is not None:
                pending.result()
    return out


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, tp: TPGroup | None = None, *,
                          overlap: bool = True, timeline: list | None = None, matmul=torch.matmul) -> torch.Tensor:
    """``reduce_scatter(x @ weight)`` on rows: ``x`` (p·m, k) with this rank's k columns,
    ``weight`` (k, n) this rank's rows of it; the result (m, n) is block ``rank`` of the
    product summed over the group, added in lesson 4's ring order."""
    _check(x, weight, "matmul_reduce_scatter")
    tp = tp or TPGroup()
    p, r = tp.size, tp.rank
    if x.shape[0] % p:
        raise ValueError(f"matmul_reduce_scatter: {x.shape[0]} rows do not split over {p} ranks")
    m = x.shape[0] // p
    if p == 1:
        return matmul(x, weight)
    if x.is_cuda:
        return _matmul_reduce_scatter_cuda(x, weight, tp, m)
    right, left = ops.global_rank(tp.group, (r + 1) % p), ops.global_rank(tp.group, (r - 1) % p)
    arrived = x.new_empty((m, weight.shape[1]))

    def rows(c: int) -> torch.Tensor:
        t0 = time.perf_counter()
        y = matmul(x[c * m:(c + 1) * m], weight)
        _note(timeline, "matmul", c, t0)
        return y

    def transfer(acc: torch.Tensor, chunk: int):
        t0 = time.perf_counter()
        recv, send = ops.sendrecv(acc, right, arrived, left, tp.group)
        recv.wait()
        send.wait()
        _note(timeline, "transfer", chunk, t0)

    acc = rows((r - 1) % p)
    with concurrent.futures.ThreadPoolExecutor(1, "tp-comm") as side:
        for step in range(p - 1):
            pending = side.submit(transfer, acc, (r - 2 - step) % p)
            if not overlap:
                pending.result()
            mine = rows((r - 2 - step) % p)           # computed while the running sum travels
            pending.result()
            acc = mine.add_(arrived)                  # own + arrival: the ring's order
    return acc


_BUFFERS: dict = {}


def _all_gather_matmul_symmetric(x: torch.Tensor, weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The GPU path: every rank's piece in lesson 12's symmetric memory; piece ``r - s`` is
    copied from its owner's buffer on a side stream while the main stream multiplies the
    piece copied before it; a closing barrier keeps every buffer until its readers are done."""
    from collectives.symmetric.gpu import SymmetricBuffer, no_multicast

    no_multicast()
    p, r, m = tp.size, tp.rank, x.shape[0]
    key = (x.numel(), x.dtype, id(tp.group))
    if key not in _BUFFERS:                              # a rendezvous is collective: once per shape
        _BUFFERS[key] = SymmetricBuffer(x.numel(), x.dtype, tp.group)
    buf = _BUFFERS[key]
    buf.buffer.copy_(x.reshape(-1))
    buf.handle.barrier(channel=0)                        # every piece is in its owner's buffer
    main, side = streams.current_stream(x.device), streams.new_stream(x.device, name="tp-copy")
    pieces = x.new_empty((p, m, x.shape[1]))
    pieces[r].copy_(x)
    out = x.new_empty((p * m, weight.shape[1]))
    ready = []
    side.wait_stream(main)
    with streams.use(side):
        for s in range(1, p):                            # copies run ahead on the side stream
            q = (r - s) % p
            pieces[q].copy_(buf.peers[q].view(m, -1))
            done = streams.new_event(x.device)
            done.record(side)
            ready.append((q, done))
    out[r * m:(r + 1) * m] = x @ weight
    for q, done in ready:
        main.wait_event(done)
        out[q * m:(q + 1) * m] = pieces[q] @ weight
    main.wait_stream(side)
    buf.handle.barrier(channel=1)                        # nobody reads our buffer any more
    return out


def _matmul_reduce_scatter_cuda(x: torch.Tensor, weight: torch.Tensor, tp: TPGroup, m: int) -> torch.Tensor:
    """The GPU path of :func:`matmul_reduce_scatter`: each running sum travels (NCCL p2p) on a
    side stream while the main stream multiplies the next chunk; events order the two."""
    p, r = tp.size, tp.rank
    right, left = ops.global_rank(tp.group, (r + 1) % p), ops.global_rank(tp.group, (r - 1) % p)
    main, side = streams.current_stream(x.device), streams.new_stream(x.device, name="tp-comm")
    acc = x[((r - 1) % p) * m:((r - 1) % p + 1) * m] @ weight
    for step in range(p - 1):
        c = (r - 2 - step) % p
        arrived = torch.empty_like(acc)
        side.wait_stream(main)                           # acc is computed, arrived allocated
        with streams.use(side):
            recv, send = ops.sendrecv(acc, right, arrived, left, tp.group)
            recv.wait()
            send.wait()
        streams.record_stream(acc, side)
        streams.record_stream(arrived, side)
        mine = x[c * m:(c + 1) * m] @ weight             # on the main stream, while the sum travels
        main.wait_stream(side)
        acc = mine.add_(arrived)
    return acc
