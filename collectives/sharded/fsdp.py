"""Lesson 10: ZeRO-3 / FSDP -- parameters sharded too, each layer gathered just when it is needed.

After ZeRO stage 3 (Rajbhandari et al., 2020) in the shape of PyTorch's FSDP2
(``fully_shard``): the model is cut into *units* (its layers); between steps a rank holds
only its rows of every parameter (:mod:`collectives.sharded.shard`). For each unit::

    forward    all-gather its parameters -> compute -> free them
    backward   all-gather them again     -> compute -> reduce-scatter the gradients, free
    step       Adam on this rank's rows (fp32 masters)

Three collectives of Ψ elements instead of data parallel's one all-reduce (two halves):
1.5x the bytes, for memory (4 + 4 + 8) · Ψ/p instead of 16 · Ψ (fp32 Adam).

Freeing, for real: a layer's forward saves its weight for the backward, and autograd holds
the parameter itself. So each unit's full parameters are made once and freed by shrinking
their storage to nothing (FSDP2's way); a gather grows it back and copies the all-gathered
buffer in. Between forward and backward nothing of them stays alive, and at the peak a rank
holds one unit gathered, the next one's all-gather, one unit's gradients and their packed
reduce-scatter input -- at most one reduce-scatter in flight, its input dropped once reduced
(:class:`collectives.core.live_bytes.LiveBytes` counts it; the tests hold it to FSDP2's).

Overlap: the gathers and reduce-scatters run on a side stream -- on CPU a thread of their
own, in the order they were issued, which is the same on every rank -- so the next unit's
all-gather (prefetched when this one starts) and the previous unit's reduce-scatter
travel while this unit computes. ``max_alive`` bounds how many units are gathered at once
(a prefetch waits for a later chance rather than exceed it). :attr:`FSDP.timeline` records
when each transfer and each unit's compute ran, for the lab's figure.

Mixed precision (:class:`MixedPrecision`, as FSDP2's ``MixedPrecisionPolicy``): the rows are
cast to ``param_dtype`` before the all-gather, the unit computes in it, its gradients are
reduce-scattered in ``reduce_dtype`` and added to fp32 gradients of the fp32 masters.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from collectives.core import live_bytes, streams
from collectives.core.ops import ReduceOp
from collectives.ring import ring_all_reduce

from .shard import ShardGroup, all_gather, reduce_scatter
from .zero import _rank_and_size, optimizer_state_bytes, tensor_bytes


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes on the wire and in compute (``None``: the masters' own, fp32)."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def hybrid_groups(ranks_per_machine: int):
    """``(shard_group, replicate_group)`` of this rank when ranks are placed machine-major,
    ``ranks_per_machine`` to a machine (every rank must call it: it creates every group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_machine < 1 or world % ranks_per_machine:
        raise ValueError(f"hybrid_groups: {world} ranks do not split into machines of {ranks_per_machine}")
    machines = world // ranks_per_machine
    shard = replicate = None
    for m in range(machines):
        g = dist.new_group(list(range(m * ranks_per_machine, (m + 1) * ranks_per_machine)))
        shard = g if rank // ranks_per_machine == m else shard
    for local in range(ranks_per_machine):
        g = dist.new_group([m * ranks_per_machine + local for m in range(machines)])
        replicate = g if rank % ranks_per_machine == local else replicate
    return shard, replicate


class SideStream:
    """Where the communication runs: a thread of its own on CPU (``overlap``), a CUDA
    stream on GPUs, or inline. ``submit(fn)`` returns something with ``.result()``.

    On a GPU the tensors ``fn`` makes (a gathered layer, a reduced shard) belong to the side
    stream's memory, and the issuing stream reads them. ``release`` says how the allocator
    learns when their memory may be reused:

    * ``"record_stream"``: ``result()`` marks them as used by the issuing stream; a tensor the
      host frees stays allocated until the GPU has passed that use -- when the host runs
      ahead, several gathered layers at once;
    * ``"stream_order"`` (as FSDP2): nothing is marked. Every ``submit`` first makes the side
      stream wait for the issuing stream, and only the side stream allocates from that memory,
      so whatever the side stream makes after a free runs after every read issued before it:
      the memory is reusable as soon as the host frees it.
    """

    def __init__(self, device, overlap: bool, release: str = "record_stream"):
        self.device, self.overlap, self.release = device, overlap, release
        self.cuda = streams.is_cuda(device)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "fsdp-comm") if overlap and not self.cuda else None
        self.stream = streams.new_stream(device, name="fsdp-comm") if overlap and self.cuda else None

    def submit(self, fn, keep=()):
        """Run ``fn`` here; ``keep``: tensors of the issuing stream it reads (on a GPU the
        allocator is told they are in use on the side stream until it is done)."""
        if self.pool is not None:
            return self.pool.submit(live_bytes.carry(fn))     # a running meter sees the thread's tensors
        if self.stream is None:
            return _Done(fn(), None, None)
        for t in keep:
            streams.record_stream(t, self.stream)
        self.stream.wait_stream(streams.current_stream(self.device))
        with streams.use(self.stream):
            value = fn()
        done = streams.new_event(self.device)
        done.record(self.stream)
        return _Done(value, done, self)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class _Done:
    def __init__(self, value, event, side):
        self.value, self.event, self.side = value, event, side

    def result(self):
        if self.event is not None:
            streams.current_stream(self.side.device).wait_event(self.event)
            if self.side.release == "record_stream":
                for t in self.value if isinstance(self.value, list) else []:
                    streams.record_stream(t, streams.current_stream(self.side.device))
        return self.value


class _Unit:
    """One layer: its parameters (full-size only while gathered) and this rank's rows."""

    def __init__(self, index, module, params, p, rank, device, dtype):
        self.index, self.module, self.params = index, module, params
        self.group = ShardGroup([q.shape for q in params], p)
        self.piece = torch.zeros(self.group.shard_numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for view, spec, q in zip(self.group.shard_views(self.piece), self.group.specs, params):
                view.copy_(spec.shard(q.detach().float(), rank))
        self.shards = [nn.Parameter(spec.unpad(v, rank)) for v, spec in zip(self.group.shard_views(self.piece),
                                                                          self.group.specs)]
        # the full parameters, made once: freeing one shrinks its storage to nothing and
        # gathering grows it back, so what autograd saved of it (the weight a layer keeps
        # for its backward, a view of this storage) holds no memory between the two (FSDP2's
        # way). While freed, the Parameter itself shows an empty tensor: safe to read.
        self.fulls, self.empty = [], torch.empty(0, dtype=dtype, device=device)
        for q in params:                # one at a time: never a whole unit more than the model
            full = torch.empty(q.shape, dtype=dtype, device=device)
            full.untyped_storage().resize_(0)
            q.data = self.empty         # the model's own tensor goes (if nothing else holds it)
            self.fulls.append(full)
        self.gathered = False      # full parameters present
        self.pending = None        # the in-flight all-gather
        self.ready = 0             # gradients arrived this backward
        self.in_backward = False
        self.entry = None          # this unit's open compute record in FSDP.timeline


class FSDP:
    """ZeRO-3 training of ``model``, sharded unit by unit (see the module).

    ``units``: the modules gathered as one (default: ``model``'s children that hold
    parameters, in order -- the order forward runs them); together they must hold every
    parameter. ``prefetch`` gathers the next unit while this one computes; ``max_alive``
    (≥ 1) bounds gathered units. ``use_torch`` swaps lesson 4's ring for torch's
    collectives. Hybrid sharding: ``group`` the ranks of one machine (shard inside it) and
    ``replicate_group`` the ranks holding the same rows on the other machines (each
    gradient shard averaged across them by an all-reduce, see :func:`hybrid_groups`).
    ``release``: on GPUs, how gathered layers' memory is handed back (:class:`SideStream`).
    Use like ``fully_shard``::

        fsdp = FSDP(model)
        opt = torch.optim.Adam(fsdp.parameters(), lr=1e-3)     # this rank's rows
        fsdp(x).square().mean().backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, model: nn.Module, units=None, *, use_torch: bool = False, prefetch: bool = True,
                 max_alive: int = 2, mixed: MixedPrecision | None = None, group=None, replicate_group=None,
                 release: str = "record_stream"):
        if max_alive < 1:
            raise ValueError(f"FSDP: max_alive must be at least 1, got {max_alive}")
        if release not in ("record_stream", "stream_order"):
            raise ValueError(f"FSDP: release must be 'record_stream' or 'stream_order', got {release!r}")
        self.rank, self.p = _rank_and_size(group)
        self.model, self.use_torch, self.group = model, use_torch, group
        self.replicate_group = replicate_group
        self.prefetch, self.max_alive = prefetch, max_alive
        self.mixed = mixed or MixedPrecision()
        units = list(units) if units is not None else [m for m in model.children() if any(True for _ in m.parameters())]
        owned, self.units = set(), []
        params = [q for q in model.parameters()]
        if not params:
            raise ValueError("FSDP: the model has no parameters")
        self.device = params[0].device
        for k, module in enumerate(units):
            mine = [q for q in module.parameters() if id(q) not in owned]
            if not mine:
                raise ValueError(f"FSDP: unit {k} ({type(module).__name__}) holds no parameter of its own")
            if any(q.dtype != torch.float32 for q in mine):
                raise ValueError(f"FSDP: unit {k}'s parameters must be float32 (the masters), "
                                 f"got {sorted({str(q.dtype) for q in mine})}")
            owned.update(id(q) for q in mine)
            self.units.append(_Unit(k, module, mine, self.p, self.rank, self.device,
                                    self.mixed.param_dtype or torch.float32))
        missing = [i for i, q in enumerate(params) if id(q) not in owned]
        if missing:
            raise ValueError(f"FSDP: parameters {missing} of the model belong to no unit; "
                             "every parameter must sit in one of the units")
        self.side = SideStream(self.device, overlap=prefetch, release=release)
        self.timeline: list[dict] = []
        self.peak_alive = 0
        self.peak_gathered_bytes = 0
        self._reductions: list = []
        self._backward_started = False
        self._hooks = []
        for u in self.units:
            self._free(u)
            self._hooks.append(u.module.register_forward_pre_hook(self._make_pre_forward(u)))
            self._hooks.append(u.module.register_forward_hook(self._make_post_forward(u)))
            for q in u.params:
                self._hooks.append(q.register_post_accumulate_grad_hook(self._make_grad_ready(u)))

    # -- the public face -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's rows of every parameter (fp32 masters): what the optimizer steps."""
        return [s for u in self.units for s in u.shards]

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter whole, gathered now (a collective: every rank must call it)."""
        out = []
        for u in self.units:
            gathered = u.piece.new_empty(self.p * u.group.shard_numel)
            all_gather(gathered, u.piece, use_torch=self.use_torch, group=self.group)
            out.extend(u.group.unpack(gathered))
        return out

    def memory(self, optimizer=None) -> dict:
        """Bytes this rank holds now: masters (and any gathered unit), gradients, optimizer state."""
        return dict(params=tensor_bytes([u.piece for u in self.units] + [q for u in self.units for q in u.params]),
                    grads=tensor_bytes([s.grad for u in self.units for s in u.shards]),
                    optimizer=optimizer_state_bytes(optimizer) if optimizer is not None else 0)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.side.close()

    # -- gather and free -------------------------------------------------------------------------
    def _alive(self) -> int:
        return sum(1 for u in self.units if u.gathered or u.pending is not None)

    def _note(self, what: str, unit: int, t0: float, t1: float) -> None:
        self.timeline.append(dict(what=what, unit=unit, start=t0, end=t1))

    def _start_gather(self, u: _Unit) -> None:
        if u.gathered or u.pending is not None:
            return
        dtype = self.mixed.param_dtype or torch.float32
        issued = time.perf_counter()

        def work():
            t0 = time.perf_counter()
            local = u.piece.to(dtype)
            gathered = local.new_empty(self.p * u.group.shard_numel)
            all_gather(gathered, local, use_torch=self.use_torch, group=self.group)
            self._note("all_gather", u.index, t0, time.perf_counter())
            return [gathered]
        u.pending = self.side.submit(work)
        self.timeline.append(dict(what="issue_all_gather", unit=u.index, start=issued, end=issued))
        self.peak_alive = max(self.peak_alive, self._alive())

    def _finish_gather(self, u: _Unit) -> None:
        if u.gathered:
            return
        self._start_gather(u)
        gathered = u.pending.result()[0]
        u.pending = None
        with torch.no_grad():
            for full in u.fulls:
                full.untyped_storage().resize_(full.numel() * full.element_size())
            u.group.unpack_into(gathered, u.fulls)
        del gathered                    # the flat buffer goes as soon as it is copied out
        for q, full in zip(u.params, u.fulls):
            q.data = full
        u.gathered = True
        alive = sum(q.numel() * q.element_size() for w in self.units if w.gathered for q in w.params)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, alive)

    def _free(self, u: _Unit) -> None:
        for q, full in zip(u.params, u.fulls):
            q.data = u.empty
            full.untyped_storage().resize_(0)
        u.gathered = False

    def _maybe_prefetch(self, k: int) -> None:
        if self.prefetch and 0 <= k < len(self.units) and self._alive() < self.max_alive:
            self._start_gather(self.units[k])

    # -- hooks -------------------------------------------------------------------------------------
    def _make_pre_forward(self, u: _Unit):
        def hook(module, args):
            self._finish_gather(u)
            self._maybe_prefetch(u.index + 1)
            u.entry = dict(what="forward", unit=u.index, start=time.perf_counter(), end=None)
            self.timeline.append(u.entry)
            dtype = self.mixed.param_dtype
            if dtype is not None:
                return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
            return None
        return hook

    def _make_post_forward(self, u: _Unit):
        def hook(module, args, output):
            u.entry["end"] = time.perf_counter()
            self._free(u)
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outs:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(lambda grad: self._pre_backward(u))
            return None
        return hook

    def _pre_backward(self, u: _Unit) -> None:
        if not self._backward_started:
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if not u.in_backward:
            u.in_backward = True
            self._finish_gather(u)
            self._maybe_prefetch(u.index - 1)
            u.entry = dict(what="backward", unit=u.index, start=time.perf_counter(), end=None)
            self.timeline.append(u.entry)

    def _make_grad_ready(self, u: _Unit):
        def hook(param):
            u.ready += 1
            if u.ready == len(u.params):
                self._reduce(u)
        return hook

    def _reduce(self, u: _Unit) -> None:
        if u.entry is not None and u.entry["what"] == "backward":
            u.entry["end"] = time.perf_counter()
        reduce_dtype = self.mixed.reduce_dtype or self.mixed.param_dtype or torch.float32
        self._free(u)                   # the weights' last reader was this backward
        # at most one reduce-scatter in flight, as FSDP2: wait for the one before (its input
        # then goes) before this unit's input is made
        if self._reductions:
            self._reductions[-1][1].result()
        packed = u.group.pack([q.grad for q in u.params], dtype=reduce_dtype)
        for q in u.params:
            q.grad = None               # the full gradient goes once packed

        box = [packed]                  # work takes it out: nothing holds it once reduced

        def work():
            t0 = time.perf_counter()
            grads = box.pop()
            piece = grads.new_empty(u.group.shard_numel)
            reduce_scatter(piece, grads, use_torch=self.use_torch, group=self.group, scratch=True)
            del grads                   # gone before the result is handed over
            if self.replicate_group is not None:
                if self.use_torch:
                    dist.all_reduce(piece, op=ReduceOp.AVG, group=self.replicate_group)
                else:
                    ring_all_reduce(piece, op=ReduceOp.AVG, group=self.replicate_group)
            self._note("reduce_scatter", u.index, t0, time.perf_counter())
            return [piece]
        del packed
        self._reductions.append((u, self.side.submit(work, keep=tuple(box))))

    def _end_backward(self) -> None:
        for u, future in self._reductions:
            piece = future.result()[0].float()
            for shard, view, spec in zip(u.shards, u.group.shard_views(piece), u.group.specs):
                grad = spec.unpad(view, self.rank)
                shard.grad = grad if shard.grad is None else shard.grad.add_(grad)
        reduced = {u.index for u, _ in self._reductions}
        self._reductions = []
        self._backward_started = False
        missing = [u.index for u in self.units if u.index not in reduced]
        for u in self.units:
            u.in_backward, u.ready = False, 0
            if u.pending is not None:           # a prefetch nobody used: drain it
                u.pending.result()
                u.pending = None
        if missing:
            raise RuntimeError(f"FSDP on rank {self.rank}: units {missing} got no gradient for every parameter "
                               "in backward; every parameter must be used")
