"""Reduction operators and argument checks shared by every hand-written collective.

Every algorithm in the course does three things besides communicating: it checks its
arguments, it combines an incoming buffer into an accumulator with the requested
``ReduceOp``, and (for AVG) it divides once at the end. They live here so that each
lesson's code shows only its communication pattern.

AVG is computed as SUM followed by one division by the group size -- the same order the
equivalence harness uses for the reference, so integer-valued inputs agree bit for bit.

**Check mode.** With ``COLLECTIVES_CHECK=1`` in the environment (``launch.run(...,
check=True)``; on in the exercise runner and under the grader), the argument check also
compares the call across the ranks of the group -- algorithm, element count, dtype, op,
group -- and raises :class:`ArgumentMismatch` on every rank, naming the ranks that differ.
It is the course's counterpart of ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which checks
``torch.distributed``'s own collectives the same way. Without it, ranks that pass tensors
of different sizes meet in the middle of the algorithm, where gloo aborts the process
("Received data size doesn't match expected size").
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import trace

ReduceOp = dist.ReduceOp

SUPPORTED_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)
OP_NAMES = {ReduceOp.SUM: "SUM", ReduceOp.PRODUCT: "PRODUCT", ReduceOp.MIN: "MIN",
            ReduceOp.MAX: "MAX", ReduceOp.AVG: "AVG"}


def op_name(op) -> str:
    return OP_NAMES.get(op, str(op))


class ArgumentMismatch(ValueError):
    """The ranks of a group called a collective with arguments that do not agree."""


_check_mode: bool | None = None     # read once per process: every call of every algorithm asks


def check_mode() -> bool:
    """True when ``COLLECTIVES_CHECK`` asks for the cross-rank argument check. Read once per
    process; a forked rank reads it again, after the launcher has set its environment."""
    global _check_mode
    if _check_mode is None:
        _check_mode = os.environ.get("COLLECTIVES_CHECK", "0").lower() not in ("", "0", "false", "no")
    return _check_mode


def _forget_check_mode() -> None:
    global _check_mode
    _check_mode = None


os.register_at_fork(after_in_child=_forget_check_mode)


def check_all_reduce_args(tensor, op=ReduceOp.SUM, group=None, *, what: str = "all_reduce",
                          compare: bool = True) -> None:
    """Raise a clear error for input an in-place all-reduce cannot honour.

    * ``tensor`` must be a ``torch.Tensor``;
    * ``op`` one of SUM, PRODUCT, MIN, MAX, AVG (AVG only on floating dtypes);
    * no two elements may share memory (an ``expand``-ed tensor): an in-place result
      cannot be written to both. gloo's own ``all_reduce`` crashes on such a tensor;
    * in check mode (:func:`check_mode`), every rank of the group passes the same
      algorithm, element count, dtype, op and group (:func:`compare_across_ranks`).
      The comparison is itself a collective: a call that not every rank makes (a check
      inside a cache miss, say) passes ``compare=False``.

    It also tells the launcher which collective this rank is in (:func:`trace.note_call`),
    so a rank that dies inside it is reported by name.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if op not in SUPPORTED_OPS:
        raise ValueError(f"{what}: unsupported op {op}; use one of "
                         + ", ".join(OP_NAMES.values()))
    if op == ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{what}: ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}")
    if tensor.numel() > 1 and torch._debug_has_internal_overlap(tensor) == 1:
        raise ValueError(f"{what}: the tensor has elements that share memory (an expanded "
                         f"tensor, stride {tuple(tensor.stride())}); pass a tensor with distinct "
                         "elements, e.g. tensor.contiguous()")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{what}: group must be a ProcessGroup from dist.new_group, got {type(group).__name__}")
    trace.note_call(what)
    if compare and check_mode():
        compare_across_ranks(what, tensor, op, group)


def _describe_call(what, tensor, op, group) -> dict[str, str]:
    ranks = "the world" if group is None else "ranks " + _ranks_text(dist.get_process_group_ranks(group))
    return {"algorithm": what, "elements": str(tensor.numel()),
            "dtype": str(tensor.dtype).replace("torch.", ""), "op": op_name(op),
            "group": ranks, "device": tensor.device.type}


def _ranks_text(ranks) -> str:
    return ", ".join(map(str, ranks))


def compare_across_ranks(what: str, tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> None:
    """Raise :class:`ArgumentMismatch` on every rank of ``group`` unless all of them call
    ``what`` with the same element count, dtype, op, group and device.

    One ``all_gather_object`` of a small description, made with the trace paused, so that
    traces and the patterns tests assert on are the same with the check on or off.
    """
    if not dist.is_initialized() or dist.get_rank(group) < 0:
        return
    if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        return                  # a CUDA graph being captured records no host-side exchange
    mine = _describe_call(what, tensor, op, group)
    everyone: list = [None] * dist.get_world_size(group)
    with trace.paused():
        dist.all_gather_object(everyone, mine, group=group)
    ranks = [global_rank(group, i) for i in range(len(everyone))]
    differences = []
    for key in mine:
        seen: dict[str, list[int]] = {}
        for rank, call in zip(ranks, everyone):
            seen.setdefault(call[key], []).append(rank)
        if len(seen) > 1:
            differences.append(f"{key} " + " vs ".join(
                f"{value} on rank{'s' if len(rs) > 1 else ''} {_ranks_text(rs)}" for value, rs in seen.items()))
    if differences:   # one line: it is what a RankError's summary and a FAIL line show
        raise ArgumentMismatch(f"{what}: the ranks disagree on its arguments: " + "; ".join(differences)
                               + " (checked because COLLECTIVES_CHECK=1)")


def combine_(acc: torch.Tensor, incoming: torch.Tensor, op) -> torch.Tensor:
    """``acc <- acc (op) incoming``, in place. AVG accumulates as SUM (see :func:`finish_`)."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return acc.add_(incoming)
    if op == ReduceOp.PRODUCT:
        return acc.mul_(incoming)
    if op == ReduceOp.MIN:
        return torch.minimum(acc, incoming, out=acc)
    if op == ReduceOp.MAX:
        return torch.maximum(acc, incoming, out=acc)
    raise ValueError(f"unsupported op {op}")


def finish_(tensor: torch.Tensor, op, group_size: int) -> torch.Tensor:
    """Apply what remains after the combining: for AVG, one division by the group size."""
    if op == ReduceOp.AVG:
        tensor.div_(group_size)
    return tensor


def work_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A flat, contiguous buffer holding ``tensor``'s elements: the tensor's own memory when
    it is contiguous, else a copy (to be written back with :func:`write_back`)."""
    return tensor.contiguous().view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()


def write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``tensor`` unless it already is ``tensor``'s memory."""
    if tensor.numel() == 0:
        return
    if tensor.is_contiguous() and flat.data_ptr() == tensor.data_ptr():
        return
    tensor.copy_(flat.view(tensor.shape))


def group_rank_and_size(group=None) -> tuple[int, int]:
    """This rank's index in ``group`` and the group's size (the world when ``group`` is None)."""
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group``: what ``send``/``recv`` take."""
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``parts`` contiguous chunks whose sizes differ by at most one.

    The first ``numel % parts`` chunks get one element more; with fewer elements than
    parts, the trailing chunks are empty. Returns ``[(start, end), ...]``.
    """
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class _Posted:
    """The handle of a receive and a send posted together, or of nothing (an empty message)."""

    def __init__(self, works=()):
        self.works = list(works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


DIRECT_NCCL_POSTING = True


def _post_together(send_buf, dst, recv_buf, src, group):
    """One NCCL group holding a receive and a send, posted through the process group itself."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if group is not None:
        src, dst = dist.get_group_rank(group, src), dist.get_group_rank(group, dst)
    device = recv_buf.device if recv_buf.is_cuda else send_buf.device
    if not recv_buf.numel() and not send_buf.numel():
        return None
    pg._start_coalescing(device)
    if recv_buf.numel():
        pg.recv([recv_buf], src, 0)
    if send_buf.numel():
        pg.send([send_buf], dst, 0)
    return pg._end_coalescing(device)


def sendrecv(send_buf: torch.Tensor, dst: int, recv_buf: torch.Tensor, src: int, group=None):
    """Post a receive of ``recv_buf`` from ``src`` and a send of ``send_buf`` to ``dst``;
    return the ``(receive, send)`` handles. ``dst``/``src`` are global ranks.

    An empty buffer is not posted at all: both ends know its size (a chunk of a tensor
    smaller than the world), and NCCL need not see a 0-byte message.

    On GPUs (NCCL) both go into one ``batch_isend_irecv``, and they must: NCCL runs
    point-to-point operations posted one by one to the same peer in order, on one stream,
    so when two ranks each post "receive from you, then send to you" each receive waits
    for a send queued behind the other's receive -- a deadlock, at every world of two.
    Grouped, NCCL starts both together; and the group runs on the group's own
    communicator, the one :mod:`collectives.core.nccl_memory` registers buffers with, so a
    transfer between registered buffers is zero-copy. The receive handle then waits for
    both; the send handle waits for nothing.

    On gloo they are posted one by one, receive first, so the caller can combine an
    arrival while its own send is still going.

    ``batch_isend_irecv`` builds and checks its ``P2POp`` list in Python, tens of µs a
    step; a ring's first step waits for them with the GPU idle. Unless a trace is
    recording (it sees calls through ``torch.distributed``'s functions), the pair goes to
    the process group's own coalescing calls instead -- the ones ``batch_isend_irecv``
    ends in (``DIRECT_NCCL_POSTING = False`` restores the public route, to compare).
    """
    if recv_buf.is_cuda or send_buf.is_cuda:
        if DIRECT_NCCL_POSTING and not trace.active():
            work = _post_together(send_buf, dst, recv_buf, src, group)
            return _Posted([work] if work is not None else ()), _Posted()
        p2p = []
        if recv_buf.numel():
            p2p.append(dist.P2POp(dist.irecv, recv_buf, src, group=group))
        if send_buf.numel():
            p2p.append(dist.P2POp(dist.isend, send_buf, dst, group=group))
        return _Posted(dist.batch_isend_irecv(p2p) if p2p else ()), _Posted()
    recv = _Posted([dist.irecv(recv_buf, src, group=group)] if recv_buf.numel() else [])
    send = _Posted([dist.isend(send_buf, dst, group=group)] if send_buf.numel() else [])
    return recv, send


def rank_device() -> torch.device:
    """The device this rank's tensors belong on: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
