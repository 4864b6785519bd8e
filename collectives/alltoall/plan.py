"""What an all-to-all works out once and reuses: its plan.

Moving the blocks is the transport's job; everything else a call does is host work, paid
again on every call: checking the arguments, cutting the tensors into p blocks, working
out the peers' global ranks, building the list of point-to-point operations. On a GPU
that host work is the call's floor: the GPU waits for the host to post, so a call that
spends 200 µs in Python takes 200 µs however few bytes it moves.

A training step calls the same all-to-all on the same buffers step after step, so the
work can be done once. A :class:`Plan` is made on the first call with a given (buffers,
shapes, dtypes, splits, group) and holds the result: the blocks as views of the caller's
own memory (a receive lands straight in the output, nothing is concatenated), the global
ranks, and the ``P2POp`` lists ready for ``batch_isend_irecv``. A later call with the
same arguments skips the checks -- they would pass again -- and posts at once.

A plan keeps its buffers' memory alive, so it lives only as long as the tensors it was
made for: when either is freed, the plan goes too (and at most :data:`MAX_PLANS` are
kept). Check mode (``COLLECTIVES_CHECK=1``) checks every call anyway: its comparison
across ranks is what it is for.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist

from ..core import ops, trace
from ..core.ops import ReduceOp

__all__ = ["Plan", "plan_for", "clear_plans", "MAX_PLANS", "check_all_to_all_args"]

MAX_PLANS = 16
_PLANS: dict = {}


def _is_split_list(value) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


def check_all_to_all_args(output, input, output_split_sizes, input_split_sizes, group, what: str,
                          agree: dict | None = None):
    """Check an all-to-all's arguments before anything is sent; return ``(rows_out, rows_in)``,
    the block sizes along dim 0 (lists of p), or None for a rank outside ``group``.

    Everything checked here depends on this rank's arguments only, so a wrong call raises
    on the rank that made it before any message leaves it. In check mode the ranks then
    compare (:mod:`collectives.core.checkmode`): algorithm, dtype, the rows' shape, ``agree``
    (a machine layout), and every pair's rows -- rank s's ``input_split_sizes[d]`` against
    rank d's ``output_split_sizes[s]``.
    """
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not ops.check_all_reduce_args(input, ReduceOp.SUM, group, what=what, compare=False):
        return None
    rank, p = ops.group_rank_and_size(group)
    if output.dtype != input.dtype:
        raise TypeError(f"{what}: rank {rank}'s output is {output.dtype} but its input is {input.dtype}")
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError(f"{what}: rank {rank}: input and output need at least one dimension (blocks are rows)")
    if input.shape[1:] != output.shape[1:]:
        raise ValueError(f"{what}: rank {rank}: input rows {tuple(input.shape[1:])} and output rows "
                         f"{tuple(output.shape[1:])} differ")
    if output.numel() > 1 and torch._debug_has_internal_overlap(output) == 1:
        raise ValueError(f"{what}: rank {rank}'s output has elements that share memory (an expanded tensor)")
    splits = []
    for name, sizes, t in (("output_split_sizes", output_split_sizes, output),
                           ("input_split_sizes", input_split_sizes, input)):
        if sizes is None:
            if t.shape[0] % p:
                raise ValueError(f"{what}: rank {rank}: the {name[:-12]}'s {t.shape[0]} rows do not split into "
                                 f"{p} equal blocks; pass {name}")
            splits.append([t.shape[0] // p] * p)
            continue
        if not _is_split_list(sizes) or len(sizes) != p or any(s < 0 for s in sizes):
            raise ValueError(f"{what}: rank {rank}: {name} must be {p} non-negative integers, got {sizes!r}")
        if sum(sizes) != t.shape[0]:
            raise ValueError(f"{what}: rank {rank}: {name} {list(sizes)} add up to {sum(sizes)} rows, "
                             f"but the {name[:-12]} has {t.shape[0]}")
        splits.append(list(sizes))
    if output_split_sizes is None and input_split_sizes is None and output.shape[0] != input.shape[0]:
        raise ValueError(f"{what}: rank {rank}: equal blocks need as many output rows as input rows, got "
                         f"{output.shape[0]} and {input.shape[0]}; pass both split lists for uneven blocks")
    if ops.check_mode():
        ops.compare_across_ranks(what, input, ReduceOp.SUM, group,
                                 {"rows of": tuple(input.shape[1:]), **(agree or {})},
                                 pairs=(splits[1], splits[0]))
    return splits[0], splits[1]


def alias(base: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    """A 1-D view of ``numel`` elements of contiguous ``base`` from element ``start``.

    Made with ``set_`` on base's storage rather than by slicing: a slice remembers the
    tensor it came from, which would keep the caller's tensor object alive as long as the
    plan, and the plan would never learn that its tensors were freed."""
    out = torch.empty(0, dtype=base.dtype, device=base.device)
    return out.set_(base.untyped_storage(), base.storage_offset() + start, (numel,), (1,))


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


class Blocks:
    """A flat buffer seen as p blocks of rows: ``blocks[i]`` a contiguous 1-D view."""

    def __init__(self, flat: torch.Tensor, rows: list[int], row_numel: int):
        self.flat, self.rows, self.row_numel = flat, rows, row_numel
        self.starts = [o * row_numel for o in _offsets(rows)]
        self.blocks = [alias(flat, s, r * row_numel) for s, r in zip(self.starts, rows)]

    def block(self, i: int) -> torch.Tensor:
        return self.blocks[i]


class Plan:
    """One all-to-all's arguments, worked out: blocks, ranks, and what to post.

    ``src``/``dst`` are the input and output as :class:`Blocks`, over the caller's memory
    when it is contiguous, else over a staging buffer of the plan's own (filled from the
    input by :meth:`stage_in`, copied to the output by :meth:`stage_out`). Algorithms keep
    what they build from it in :attr:`cache` (their ``P2POp`` lists, their buffers)."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, rows_out: list[int], rows_in: list[int], group):
        self.group = group
        self.rank, self.p = ops.group_rank_and_size(group)
        self.globals = [ops.global_rank(group, r) for r in range(self.p)]
        row_numel = math.prod(input.shape[1:])
        self.staged_in = not _plain(input)
        self.staged_out = not _plain(output)
        src = _staging(input) if self.staged_in else input.detach().view(-1)
        dst = _staging(output) if self.staged_out else output.detach().view(-1)
        self.src = Blocks(alias(src, 0, src.numel()), rows_in, row_numel)
        self.dst = Blocks(alias(dst, 0, dst.numel()), rows_out, row_numel)
        self.cuda = src.is_cuda or dst.is_cuda
        self.cache: dict = {}

    def stage_in(self, input: torch.Tensor) -> None:
        if self.staged_in:
            self.src.flat.view(input.shape).copy_(input.detach())

    def stage_out(self, output: torch.Tensor) -> None:
        if self.staged_out and output.numel():
            output.detach().copy_(self.dst.flat.view(output.shape))

    def copy_self(self) -> None:
        """This rank's own block: one copy, input to output, no message."""
        if self.dst.rows[self.rank]:
            self.dst.blocks[self.rank].copy_(self.src.blocks[self.rank])

    def p2p(self, recvs: list[tuple[torch.Tensor, int]], sends: list[tuple[torch.Tensor, int]]) -> list:
        """The ``P2POp`` list posting every receive ``(buffer, group rank)``, then every send;
        empty buffers left out (both ends know the size is zero)."""
        g = self.group
        return ([dist.P2POp(dist.irecv, b, self.globals[r], group=g) for b, r in recvs if b.numel()]
                + [dist.P2POp(dist.isend, b, self.globals[r], group=g) for b, r in sends if b.numel()])


def _plain(t: torch.Tensor) -> bool:
    """Memory a block view can alias as it is: contiguous, no lazy conjugate or negation
    (an alias made from the storage would drop the flag: ``x.conj()`` would arrive unconjugated)."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _staging(t: torch.Tensor) -> torch.Tensor:
    """A plain contiguous buffer of ``t``'s elements (filled by :meth:`Plan.stage_in`)."""
    if t.is_conj() or t.is_neg():
        return torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    return ops.work_buffer(t)


def post(p2p: list) -> list:
    """Post a ``P2POp`` list in one ``batch_isend_irecv`` (one NCCL group on GPUs; on gloo,
    each in list order); return the handles to wait on."""
    return list(dist.batch_isend_irecv(p2p)) if p2p else []


def wait(works) -> None:
    for work in works:
        work.wait()


def _split_key(sizes):
    if sizes is None:
        return None
    if isinstance(sizes, (list, tuple)) and all(type(s) is int for s in sizes):
        return tuple(sizes)
    raise TypeError("not a list of ints")          # never cached: the check will say what is wrong


def _memory(t: torch.Tensor) -> tuple:
    """Which memory ``t`` is: its storage's identity (a plan's views keep the storage alive,
    so no other storage can take its place while the plan exists), the storage's address and
    size now (a ``resize_`` that moved it is a new buffer), where ``t`` starts in it, and the
    lazy conjugate and negation bits (``x`` and ``x.conj()`` share every address)."""
    storage = t.untyped_storage()
    return (storage._cdata, storage.data_ptr(), storage.nbytes(), t.storage_offset(), t.is_conj(), t.is_neg())


def _key(what, output, input, output_split_sizes, input_split_sizes, group, extra):
    if not (isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor)):
        raise TypeError("not tensors")
    return (what, _memory(output), _memory(input), output.shape, input.shape, output.stride(), input.stride(),
            output.dtype, input.dtype, output.device, input.device, _split_key(output_split_sizes),
            _split_key(input_split_sizes), group, extra, dist.isend, dist.irecv)


def plan_for(what: str, output, input, output_split_sizes, input_split_sizes, group, *, extra=None,
             check=None, agree: dict | None = None) -> Plan | None:
    """The plan of this call: the cached one when the same call was made before on the same
    buffers, else a new one, made after :func:`check_all_to_all_args`
    (and ``check(plan)``, for what an algorithm checks besides) have passed. None on a rank
    outside ``group``: nothing to do. ``extra``: anything else the plan depends on (a layout);
    ``agree``: what check mode compares besides (:func:`check_all_to_all_args`).

    The key holds everything the checks and the plan depend on -- buffers' storages,
    shapes, strides, dtypes, devices, this rank's splits, the group, ``extra``, and which
    ``isend`` is installed (a trace installed later must see the messages) -- so a call
    that finds its plan would pass the checks again."""
    try:
        key = _key(what, output, input, output_split_sizes, input_split_sizes, group, extra)
        plan = None if ops.check_mode() else _PLANS.get(key)
    except TypeError:                                   # something unhashable: the check will say what
        key = plan = None
    if plan is not None:
        trace.note_call(what)
        return plan
    checked = check_all_to_all_args(output, input, output_split_sizes, input_split_sizes, group, what,
                                    agree() if callable(agree) else agree)
    if checked is None:
        return None
    plan = Plan(output, input, checked[0], checked[1], group)
    if check is not None:
        check(plan)
    if key is not None:
        _remember(key, plan, output, input)
    return plan


def _remember(key, plan: Plan, output: torch.Tensor, input: torch.Tensor) -> None:
    old = _PLANS.pop(key, None)
    if old is not None:
        _forget(old)
    while len(_PLANS) >= MAX_PLANS:
        _forget(_PLANS.pop(next(iter(_PLANS))))
    _PLANS[key] = plan
    drop = _drop_if_same
    plan.finalizers = [weakref.finalize(t, drop, key, weakref.ref(plan)) for t in (output, input)]


def _drop_if_same(key, plan_ref) -> None:
    plan = _PLANS.get(key)
    if plan is not None and plan is plan_ref():
        del _PLANS[key]
        _forget(plan)


def _forget(plan: Plan) -> None:
    for f in getattr(plan, "finalizers", ()):
        f.detach()


def clear_plans() -> None:
    """Forget every plan (and release the memory they hold)."""
    while _PLANS:
        _forget(_PLANS.pop(next(iter(_PLANS))))


def cached_plans() -> int:
    return len(_PLANS)
