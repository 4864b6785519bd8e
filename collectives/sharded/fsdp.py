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

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from collectives.core.ops import ReduceOp
from collectives.ring import ring_all_reduce

from .groups import reshard_groups
from .shard import ShardGroup, all_gather, reduce_scatter
from .side import SideStream
from .state import check_layout, clip_grad_norm_, load_sharded, save_sharded
from .usage import across, first_partial
from .zero import _rank_and_size, optimizer_state_bytes, tensor_bytes


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes on the wire and in compute (``None``: the masters' own, fp32)."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


class _Unit:
    """One layer: its parameters (full-size only while gathered) and this rank's rows."""

    def __init__(self, index, module, params, p, rank, device, dtype):
        self.index, self.module, self.params = index, module, params
        self.group = ShardGroup([q.shape for q in params], p)
        self.piece = torch.zeros(self.group.shard_numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for view, spec, q in zip(self.group.shard_views(self.piece), self.group.specs, params):
                view.copy_(spec.shard(q.detach().float(), rank))
        self.shards = [nn.Parameter(spec.unpad(v, rank), requires_grad=q.requires_grad)
                       for v, spec, q in zip(self.group.shard_views(self.piece), self.group.specs, params)]
        self.trainable = [j for j, q in enumerate(params) if q.requires_grad]   # frozen ones get no hook
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
        self.versions = [q._version for q in params]   # a write after wrapping bumps one
        self.gathered = False      # full parameters present
        self.pending = None        # the in-flight all-gather
        self.pending_layout = None # how its buffer unpacks: this unit's group, or mid_layout
        self.mid = None            # reshard_after_forward=k: this rank's piece of a k-way sharding
        self.mid_layout = None
        self.ready = 0             # gradients arrived this backward
        self.reduced = False       # its gradients reduce-scattered this backward
        self.ran = False           # its forward ran since the last backward
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
    gradient shard averaged across them by an all-reduce, see :func:`.groups.hybrid_groups`).
    ``release``: on GPUs, how gathered layers' memory is handed back (:class:`SideStream`).
    ``reshard_after_forward`` (FSDP2's switch): True frees a unit after its forward and
    gathers it again for its backward; False keeps it whole from its forward to its
    backward -- two collectives a unit instead of three, the memory of the whole model at
    the end of the forward; an int k (dividing p) keeps a k-way sharding within groups of k
    consecutive ranks (a machine's), so the backward's all-gather stays inside the group. Use like ``fully_shard``::

        fsdp = FSDP(model)
        opt = torch.optim.Adam(fsdp.parameters(), lr=1e-3)     # this rank's rows
        fsdp(x).square().mean().backward(); opt.step(); opt.zero_grad()

    The gradients are the rows': ``fsdp.parameters()[i].grad`` (the model's own parameters
    hold no gradient between steps); clip them with :meth:`clip_grad_norm_`. Frozen
    parameters (``requires_grad`` False) are sharded and never reduced; a parameter no
    backward reached keeps no gradient, as under ``fully_shard``, and every rank must then
    leave out the same ones. ``reduce_scatter_unused_params`` (FSDP2's switch) lets ranks
    use different parameters of a unit (a branch only some batches take): a unit is
    reduce-scattered once its backward is over, a rank adding zeros for what it did not
    use, so every trainable parameter gets the mean over all ranks; a unit whose forward
    ran on some ranks only is refused at the start of backward, naming the ranks, if
    prefetch gathered it everywhere (any unit but the first). A parameter written after
    wrapping (``nn.init.zeros_(model[0].weight)``) is refused at the next forward: its
    full tensor is freed between steps, so the write went nowhere. Every rank must list the
    same parameters in the same order (checked at wrap time, :func:`.state.check_layout`).
    """

    def __init__(self, model: nn.Module, units=None, *, use_torch: bool = False, prefetch: bool = True,
                 max_alive: int = 2, mixed: MixedPrecision | None = None, group=None, replicate_group=None,
                 release: str = "record_stream", reshard_after_forward: bool = True,
                 reduce_scatter_unused_params: bool = False):
        if max_alive < 1:
            raise ValueError(f"FSDP: max_alive must be at least 1, got {max_alive}")
        if release not in ("record_stream", "stream_order"):
            raise ValueError(f"FSDP: release must be 'record_stream' or 'stream_order', got {release!r}")
        self.reduce_scatter_unused_params = reduce_scatter_unused_params
        self.rank, self.p = _rank_and_size(group)
        self.reshard_after_forward, self.reshard_to, self.mid_group, self.mid_rank = \
            reshard_groups(reshard_after_forward, self.p, self.rank, group)
        self.model, self.use_torch, self.group = model, use_torch, group
        self.replicate_group = replicate_group
        self.prefetch, self.max_alive = prefetch, max_alive
        self.mixed = mixed or MixedPrecision()
        units = list(units) if units is not None else [m for m in model.children() if any(True for _ in m.parameters())]
        owned, self.units = set(), []
        params = [q for q in model.parameters()]
        if not params:
            raise ValueError("FSDP: the model has no parameters")
        self.names = {id(q): name for name, q in model.named_parameters()}
        check_layout(model.named_parameters(), group, "FSDP")
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
            if self.reshard_to is not None:
                self.units[-1].mid_layout = ShardGroup([s.shape for s in self.units[-1].group.specs], self.reshard_to)
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
            for j in u.trainable:
                self._hooks.append(u.params[j].register_post_accumulate_grad_hook(self._make_grad_ready(u)))

    # -- the public face -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's rows of every parameter (fp32 masters): what the optimizer steps."""
        return [s for u in self.units for s in u.shards]

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter whole, gathered now (a collective: every rank must call it)."""
        self._check_writes()
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

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every row's gradient by the norm of the whole gradient, over every rank's rows."""
        return clip_grad_norm_(self.parameters(), max_norm, self.group, self.use_torch)

    def named_shards(self) -> list[tuple[str, tuple[int, ...], nn.Parameter]]:
        """(name, full shape, this rank's rows) of every parameter: what a sharded checkpoint holds."""
        return [(self.names[id(q)], tuple(q_shape), s) for u in self.units
                for q, q_shape, s in zip(u.params, [sp.shape for sp in u.group.specs], u.shards)]

    def save(self, folder: str, optimizer=None) -> str:
        """This rank's rows (and ``optimizer``'s moments) to ``folder``: :func:`.state.save_sharded`."""
        names, shapes, shards = zip(*self.named_shards())
        return save_sharded(folder, names, shapes, shards, self.rank, self.p, optimizer)

    def load(self, folder: str, optimizer=None) -> None:
        """This rank's rows from a checkpoint saved on any number of ranks (:func:`.state.load_sharded`)."""
        names, shapes, shards = zip(*self.named_shards())
        load_sharded(folder, names, shapes, shards, self.rank, self.p, optimizer)

    def _check_writes(self, units=None) -> None:
        for u in units or self.units:
            for q, v in zip(u.params, u.versions):
                if q._version != v:
                    raise RuntimeError(f"FSDP on rank {self.rank}: parameter {self.names.get(id(q), '?')} was "
                                       "written after wrapping; its full tensor is freed between steps, so the "
                                       "write went nowhere. Initialise before FSDP(model), or write this rank's "
                                       "rows: fsdp.parameters()")

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

        mid, u.mid = u.mid, None        # resharded to a smaller group after forward: gather in it

        def work():
            t0 = time.perf_counter()
            if mid is not None:
                gathered = mid.new_empty(self.reshard_to * u.mid_layout.shard_numel)
                all_gather(gathered, mid, use_torch=self.use_torch, group=self.mid_group)
            else:
                local = u.piece.to(dtype)
                gathered = local.new_empty(self.p * u.group.shard_numel)
                all_gather(gathered, local, use_torch=self.use_torch, group=self.group)
            self._note("all_gather", u.index, t0, time.perf_counter())
            return [gathered]
        u.pending, u.pending_layout = self.side.submit(work), u.mid_layout if mid is not None else u.group
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
            u.pending_layout.unpack_into(gathered, u.fulls)
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
            self._check_writes([u])
            u.ran = u.ran or torch.is_grad_enabled()
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
            if self.reshard_to is not None and torch.is_grad_enabled():
                # keep this rank's piece of a reshard_to-way sharding for the backward's gather
                u.mid = torch.cat(u.mid_layout.shard([f.detach() for f in u.fulls], self.mid_rank))
                self._free(u)
            elif self.reshard_after_forward or not torch.is_grad_enabled():
                self._free(u)
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outs:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(lambda grad: self._pre_backward(u))
            return None
        return hook

    def _pre_backward(self, u: _Unit) -> None:
        if not self._backward_started:
            if self.reduce_scatter_unused_params:
                self._check_units_ran()
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if not u.in_backward:
            u.in_backward = True
            if self.reduce_scatter_unused_params:   # a unit whose backward is over: zeros for the unused
                for w in self.units:
                    if w.in_backward and w is not u and not w.reduced and w.trainable:
                        self._reduce(w, w.trainable)
            self._finish_gather(u)
            self._maybe_prefetch(u.index - 1)
            u.entry = dict(what="backward", unit=u.index, start=time.perf_counter(), end=None)
            self.timeline.append(u.entry)

    def _make_grad_ready(self, u: _Unit):
        def hook(param):
            if u.reduced:       # reduced already (with zeros for the unused): a second would not match
                raise RuntimeError(f"FSDP on rank {self.rank}: a gradient reached unit {u.index} "
                                   f"({self.names.get(id(param), '?')}) after its reduce-scatter; a parameter "
                                   "used by a later unit's backward must belong to that unit")
            u.ready += 1
            if u.ready == len(u.trainable):
                self._reduce(u, u.trainable)
        return hook

    def _check_units_ran(self) -> None:
        """Every rank ran the same units' forwards, or every rank raises now, before any of
        the backward's collectives (one all-gather of a flag per unit, in the side's order)."""
        every = self.side.submit(lambda: [across([u.ran for u in self.units], self.group, self.use_torch,
                                                 self.device)]).result()[0]
        partial = first_partial([f"unit {u.index} ({self.names[id(u.params[0])]}, ...)" for u in self.units],
                                every, "ran its forward")
        if partial:
            self._abandon()
            raise RuntimeError(
                f"FSDP on rank {self.rank}: {partial}: its all-gathers and reduce-scatter cannot match across "
                "ranks. A branch some ranks skip must sit inside a unit that runs on every rank (its parameters "
                "then get zeros from the ranks that skip it)")

    def _abandon(self) -> None:
        """Back to between steps, nothing reduced: in-flight gathers drained, every unit freed."""
        for u in self.units:
            if u.pending is not None:
                u.pending.result()
                u.pending = None
            self._free(u)
            u.ran, u.mid = False, None

    def _reduce(self, u: _Unit, members: list[int]) -> None:
        u.reduced = True
        if u.entry is not None and u.entry["what"] == "backward":
            u.entry["end"] = time.perf_counter()
        reduce_dtype = self.mixed.reduce_dtype or self.mixed.param_dtype or torch.float32
        self._free(u)                   # the weights' last reader was this backward
        # at most one reduce-scatter in flight, as FSDP2: wait for the one before (its input
        # then goes) before this unit's input is made
        if self._reductions:
            self._reductions[-1][3].result()
        group = u.group if len(members) == len(u.params) else \
            ShardGroup([u.group.specs[j].shape for j in members], self.p)
        grads = [u.params[j].grad for j in members]     # an unused one: zeros (reduce_scatter_unused_params)
        packed = group.pack([g if g is not None else torch.zeros(spec.shape, dtype=reduce_dtype, device=self.device)
                             for g, spec in zip(grads, group.specs)], dtype=reduce_dtype)
        del grads
        for j in members:
            u.params[j].grad = None     # the full gradient goes once packed

        box = [packed]                  # work takes it out: nothing holds it once reduced

        def work():
            t0 = time.perf_counter()
            grads = box.pop()
            piece = grads.new_empty(group.shard_numel)
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
        self._reductions.append((u, members, group, self.side.submit(work, keep=tuple(box))))

    def _end_backward(self) -> None:
        if self.reduce_scatter_unused_params:     # the last unit whose backward ran, then those no
            ordered = [u for u in self.units if u.in_backward] + [u for u in self.units if not u.in_backward]
            for u in ordered:                      # backward reached (zeros, as fully_shard's)
                if not u.reduced and u.trainable:
                    self._reduce(u, u.trainable)
        for u in self.units if not self.reduce_scatter_unused_params else ():
            if 0 < u.ready < len(u.trainable):    # some parameters unused (on every rank): the others go
                self._reduce(u, [j for j in u.trainable if u.params[j].grad is not None])
        for u, members, group, future in self._reductions:
            piece = future.result()[0].float()
            for j, view, spec in zip(members, group.shard_views(piece), group.specs):
                grad = spec.unpad(view, self.rank)
                shard = u.shards[j]
                shard.grad = grad if shard.grad is None else shard.grad.add_(grad)
        self._reductions = []
        self._backward_started = False
        for u in self.units:
            u.in_backward, u.ready, u.mid, u.reduced, u.ran = False, 0, None, False, False
            if u.pending is not None:           # a prefetch nobody used: drain it
                u.pending.result()
                u.pending = None
            if u.gathered:                      # kept whole for a backward that never reached it
                self._free(u)
