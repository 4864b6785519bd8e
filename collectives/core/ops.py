"""Reduction operators and argument checks shared by every hand-written collective.

Every algorithm in the course does three things besides communicating: it checks its
arguments, it combines an incoming buffer into an accumulator with the requested
``ReduceOp``, and (for AVG) it divides once at the end. They live here so that each
lesson's code shows only its communication pattern.

AVG is computed as SUM followed by one division by the group size -- the same order the
equivalence harness uses for the reference, so integer-valued inputs agree bit for bit.

**Check mode.** With ``COLLECTIVES_CHECK=1`` in the environment (``launch.run(...,
check=True)``; on in the exercise runner), the argument check also compares the call
across the ranks of the group -- algorithm, element count, dtype, op, group, and what the
caller names in ``agree=`` -- and raises :class:`ArgumentMismatch` on every rank, naming
the ranks that differ (:mod:`collectives.core.checkmode`). It is the course's counterpart
of ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. Without it, ranks that pass tensors of different
sizes meet in the middle of the algorithm, where gloo aborts the process ("Received data
size doesn't match expected size").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import checkmode, nccl_memory, trace

ReduceOp = dist.ReduceOp

SUPPORTED_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)
OP_NAMES = {ReduceOp.SUM: "SUM", ReduceOp.PRODUCT: "PRODUCT", ReduceOp.MIN: "MIN",
            ReduceOp.MAX: "MAX", ReduceOp.AVG: "AVG"}


def op_name(op) -> str:
    return OP_NAMES.get(op, str(op))


ArgumentMismatch = checkmode.ArgumentMismatch
check_mode = checkmode.enabled
compare_across_ranks = checkmode.compare_across_ranks


def is_member(group=None) -> bool:
    """Whether this rank belongs to ``group`` (the world when ``group`` is None).

    ``dist.new_group(ranks)`` hands the ranks outside ``ranks`` a placeholder
    (``dist.GroupMember.NON_GROUP_MEMBER``) instead of a process group; ``dist.all_reduce``
    called with it returns at once, doing nothing.
    """
    if group is None:
        return True
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return False
    return isinstance(group, dist.ProcessGroup) and dist.get_rank(group) >= 0


def check_all_reduce_args(tensor, op=ReduceOp.SUM, group=None, *, what: str = "all_reduce",
                          compare: bool = True, agree: dict | None = None) -> bool:
    """Raise a clear error for input an in-place all-reduce cannot honour; return whether
    this rank takes part.

    * ``tensor`` must be a ``torch.Tensor``;
    * a rank outside ``group`` takes no part: the result is ``False`` and the caller
      returns at once, leaving the tensor as it was -- what ``dist.all_reduce`` does;
    * ``op`` one of SUM, PRODUCT, MIN, MAX, AVG (AVG only on floating dtypes; MIN and MAX
      not on complex ones, which have no order);
    * no two elements may share memory (an ``expand``-ed tensor): an in-place result
      cannot be written to both. gloo's own ``all_reduce`` crashes on such a tensor;
    * in check mode (:func:`check_mode`), every rank of the group passes the same
      algorithm, element count, dtype, op and group, and the same value of every entry
      of ``agree`` (``{"layout": (2, 2)}``; :mod:`collectives.core.checkmode`). The
      comparison meets the other ranks (through the store, not the process group): a
      call that not every rank makes (a check inside a cache miss, say) passes
      ``compare=False``.

    Apart from check mode's comparison, everything here depends only on the arguments,
    never on what a peer holds, so every rank raises the same error before any message is
    sent: nobody is left waiting. It also tells the launcher which collective this rank is
    in (:func:`trace.note_call`), so a rank that dies inside it is reported by name.
    Usage, first thing in every all-reduce::

        if not ops.check_all_reduce_args(tensor, op, group, what="ring_all_reduce"):
            return                                  # not in the group: nothing to do
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER \
            and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{what}: group must be a ProcessGroup from dist.new_group, got {type(group).__name__}")
    if not is_member(group):
        return False
    if op not in SUPPORTED_OPS:
        raise ValueError(f"{what}: unsupported op {op}; use one of "
                         + ", ".join(OP_NAMES.values()))
    if op == ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{what}: ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and tensor.is_complex():
        raise ValueError(f"{what}: ReduceOp.{op_name(op)} is not defined for complex tensors "
                         f"({tensor.dtype}): complex numbers have no order")
    if tensor.numel() > 1 and torch._debug_has_internal_overlap(tensor) == 1:
        raise ValueError(f"{what}: the tensor has elements that share memory (an expanded "
                         f"tensor, stride {tuple(tensor.stride())}); pass a tensor with distinct "
                         "elements, e.g. tensor.contiguous()")
    trace.note_call(what)
    if compare and check_mode():
        compare_across_ranks(what, tensor, op, group, agree)
    return True


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
    it is contiguous, else a copy (to be written back with :func:`write_back`).

    Always detached from autograd, as ``dist.all_reduce`` works on the data: a leaf that
    requires a gradient (an ``nn.Parameter``) refuses in-place arithmetic, its detached
    view of the same memory does not. The copy is a :func:`nccl_memory.temporary
    <collectives.core.nccl_memory.temporary>`: registered memory once registration has run."""
    tensor = tensor.detach()
    return tensor.view(-1) if tensor.is_contiguous() else nccl_memory.contiguous_copy(tensor)


def write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``tensor`` (its data, detached) unless it already is ``tensor``'s memory."""
    if tensor.numel() == 0:
        return
    if tensor.is_contiguous() and flat.data_ptr() == tensor.data_ptr():
        return
    tensor.detach().copy_(flat.view(tensor.shape))


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


def sendrecv(send_buf: torch.Tensor, dst: int, recv_buf: torch.Tensor, src: int, group=None,
             *, post_empty: bool = False):
    """Post a receive of ``recv_buf`` from ``src`` and a send of ``send_buf`` to ``dst``;
    return the ``(receive, send)`` handles. ``dst``/``src`` are global ranks.

    An empty buffer is not posted at all: both ends know its size (a chunk of a tensor
    smaller than the world), and NCCL need not see a 0-byte message. ``post_empty=True``
    posts it anyway on gloo, for algorithms whose number of messages must not depend on
    the tensor's size: if ranks are (wrongly) handed tensors of different sizes, every
    receive still has its send, a message longer than its receive aborts gloo at once, and
    nobody waits for a message that never comes.

    On GPUs (NCCL) both go into one ``batch_isend_irecv``, and they must: the communicator
    is created eagerly (the launcher passes ``device_id``), and then NCCL runs a process
    group's point-to-point operations posted one by one in order, on one stream, whatever
    their peer. When two ranks each post "receive from you, then send to you", each
    receive waits for a send queued behind the other's receive: a deadlock, at every
    message size (a blocking send-then-recv pair between two NCCL ranks hangs at 4 KiB
    too). Grouped, NCCL starts both together; and the group runs on the group's own
    communicator, the one :mod:`collectives.core.nccl_memory` registers buffers with, so a
    transfer between registered buffers is zero-copy. The receive handle then waits for
    both; the send handle waits for nothing.

    On gloo they are posted one by one, receive first, so the caller can combine an
    arrival while its own send is still going.
    """
    if recv_buf.is_cuda or send_buf.is_cuda:
        return _Posted(post_exchange([(recv_buf, src)], [(send_buf, dst)], group)), _Posted()
    recv = _Posted([dist.irecv(recv_buf, src, group=group)] if recv_buf.numel() or post_empty else [])
    send = _Posted([dist.isend(send_buf, dst, group=group)] if send_buf.numel() or post_empty else [])
    return recv, send


def post_exchange(recvs: list[tuple[torch.Tensor, int]], sends: list[tuple[torch.Tensor, int]],
                  group=None) -> list:
    """Post every receive ``(buffer, src)``, then every send ``(buffer, dst)`` (global ranks);
    return the handles, each with ``wait()``. Empty buffers are not posted.

    An all-to-all or an all-gather among a few peers, written as messages -- what Fairring
    does with ``ncclSend``/``ncclRecv`` inside one NCCL group. On NCCL they go into one
    ``batch_isend_irecv`` (for the reason :func:`sendrecv` gives). On gloo the receives
    are posted first, and it matters: gloo moves a message's bytes only once the receiver
    has announced its buffer, and when two ranks each post "send to you, then receive from
    you", the two directions of their connection mostly take turns instead of flowing at
    once -- on the simulated cluster, 16 MiB each way over one link took markedly longer
    posted sends first (the runs: ``docs/lessons/07-hierarchical-notes.md``).
    """
    recvs = [(buf, src) for buf, src in recvs if buf.numel()]
    sends = [(buf, dst) for buf, dst in sends if buf.numel()]
    if any(buf.is_cuda for buf, _ in recvs + sends):
        p2p = [dist.P2POp(dist.irecv, buf, src, group=group) for buf, src in recvs]
        p2p += [dist.P2POp(dist.isend, buf, dst, group=group) for buf, dst in sends]
        return list(dist.batch_isend_irecv(p2p)) if p2p else []
    works = [dist.irecv(buf, src, group=group) for buf, src in recvs]
    return works + [dist.isend(buf, dst, group=group) for buf, dst in sends]


def on_gpus(backend: str) -> bool:
    """Whether a world started with ``backend`` puts its ranks on GPUs: NCCL, or a backend
    string that names one for CUDA tensors (``"cpu:gloo,cuda:nccl"``, the grader's
    ``"cpu:graded,cuda:graded"``)."""
    return "nccl" in backend or "cuda:" in backend


def rank_device() -> torch.device:
    """The device this rank's tensors belong on: its GPU when the world runs on GPUs, else
    the CPU.

    The world's backend says which (:func:`on_gpus`)."""
    if dist.is_initialized() and on_gpus(str(dist.get_backend())):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
