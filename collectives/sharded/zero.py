"""Lesson 10: ZeRO-1 and ZeRO-2 -- the model replicated, the optimizer state (and gradients) sharded.

After ZeRO (Rajbhandari et al., 2020), stages 1 and 2. Every rank holds the whole model and
computes the whole gradient, as in data parallel training; what it keeps of the optimizer
is only its rows of every parameter (:mod:`collectives.sharded.shard`'s dim-0 layout)::

    backward          g (full, every rank)
    reduce-scatter    g -> my rows of mean(g)          (p-1)/p · Ψ elements sent
    step              Adam on my rows only             optimizer state 8 B · Ψ/p (fp32)
    all-gather        my rows -> everybody's rows      (p-1)/p · Ψ elements sent

Reduce-scatter plus all-gather move exactly what one ring all-reduce moves (lesson 4): the
optimizer state shrinks p-fold for free.

* **ZeRO-1** (:class:`ZeRO` with ``stage=1``): one reduce-scatter over every gradient
  after backward, the full gradients kept until then (4 B · Ψ).
* **ZeRO-2** (``stage=2``): the gradients reduce-scattered bucket by bucket *during*
  backward, with lesson 6's buckets (:func:`collectives.bucketing.buckets.assign_buckets`):
  a bucket whose last gradient has arrived is packed, its full gradients freed, and its
  reduce-scatter started on a thread of its own (the same order on every rank) while
  backward goes on computing; at most ``max_in_flight`` buckets travel at once (a new one
  first waits for the oldest), and the end of backward waits for the rest. A rank holds
  its gradient rows and at most ``max_in_flight`` packed buckets.

Several backwards before one step (gradient accumulation) add into the rows' gradients. A
parameter no backward reached keeps no gradient, and its bucket is reduce-scattered at the
end of backward without it -- as ``fully_shard`` leaves an unused parameter's gradient None.
A parameter used on some ranks and not on others needs ``find_unused_parameters=True``, as
DDP does (:mod:`.usage`): ZeRO-1 learns in ``step`` what every rank used (one all-gather of
a flag per parameter, always made: without the switch such a parameter is refused there,
before anything changes); ZeRO-2 learns it after each forward from autograd's graph, as
DDP, and launches its buckets in bucket order (one forward through ``model`` per backward,
as DDP's switch needs). A rank adds zeros for a parameter it did not use; one no rank used
keeps no gradient.

A rank's rows of a parameter are contiguous in it, so the optimizer steps on views of the
model's own parameters: no second copy of the weights (fp32 here; the mixed-precision
masters are :mod:`collectives.sharded.fsdp`'s).
"""

from __future__ import annotations

import concurrent.futures
import functools
import time

import torch
import torch.distributed as dist
from torch import nn

from collectives.bucketing.buckets import assign_buckets
from collectives.core import live_bytes, ops

from .shard import ShardGroup, all_gather, reduce_scatter
from .state import check_layout, clip_grad_norm_
from .usage import across, first_partial, reached

DEFAULT_BUCKET_CAP_BYTES = 1 << 20


def _rank_and_size(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("sharded training needs an initialized process group (dist.init_process_group)")
    return ops.group_rank_and_size(group)


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts with its storage)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen and storage.nbytes() > 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (Adam: exp_avg, exp_avg_sq, step)."""
    tensors = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


class ZeRO:
    """ZeRO-1 or ZeRO-2 data parallel training of ``model`` (see the module).

    ``optimizer`` builds the optimizer from a list of parameters (default Adam, lr 1e-3);
    it is given this rank's rows of each parameter. Use::

        zero = ZeRO(model, stage=2)
        loss_fn(model(x), y).backward()
        zero.step()                       # reduce-scatter (stage 1), step, all-gather
        zero.zero_grad()

    The gradients of this rank's rows are ``zero.shards[i].grad`` once reduced (stage 2: after
    backward; stage 1: in ``step``, which clips them when given ``clip_norm``).
    ``use_torch`` swaps lesson 4's ring for ``dist.reduce_scatter_tensor`` /
    ``dist.all_gather_into_tensor``. ``max_in_flight`` (stage 2): buckets reduce-scattering
    at once while backward computes; :attr:`timeline` records when each ran.
    ``find_unused_parameters`` (DDP's switch): ranks may use different parameters in a step.
    """

    def __init__(self, model: nn.Module, stage: int = 1, optimizer=None, *, use_torch: bool = False,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, group=None, max_in_flight: int = 2,
                 find_unused_parameters: bool = False):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO: stage must be 1 or 2 (stage 3 is collectives.sharded.FSDP), got {stage!r}")
        if bucket_cap_bytes <= 0:
            raise ValueError(f"ZeRO: bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
        if max_in_flight < 1:
            raise ValueError(f"ZeRO: max_in_flight must be at least 1, got {max_in_flight}")
        self.rank, self.p = _rank_and_size(group)
        check_layout(model.named_parameters(), group, f"ZeRO-{stage}")
        self.model, self.stage, self.use_torch, self.group = model, stage, use_torch, group
        self.params = [q for q in model.parameters() if q.requires_grad]
        self.names = [name for name, q in model.named_parameters() if q.requires_grad]
        self.find_unused_parameters = find_unused_parameters
        if not self.params:
            raise ValueError("ZeRO: the model has no parameter that requires a gradient")
        dtypes = {q.dtype for q in self.params}
        if len(dtypes) != 1 or not self.params[0].is_floating_point():
            raise ValueError(f"ZeRO: parameters must share one floating dtype, got {sorted(map(str, dtypes))}")
        if stage == 1:
            self.buckets = [list(range(len(self.params)))]
        else:
            self.buckets = assign_buckets(self.params, bucket_cap_bytes)
        self.groups = [ShardGroup([self.params[i].shape for i in b], self.p) for b in self.buckets]
        # this rank's rows of each parameter: a view of the parameter itself, stepped in place
        self.rows = {}
        for b, g in zip(self.buckets, self.groups):
            for i, spec in zip(b, g.specs):
                lo, hi = spec.owned_rows(self.rank)
                flat = self.params[i].detach().view(spec.rows, spec.row_numel)
                self.rows[i] = nn.Parameter(flat[lo:hi].view((hi - lo,) + spec.shape[1:]))
        self.shards = [self.rows[i] for i in range(len(self.params))]
        make = optimizer or functools.partial(torch.optim.Adam, lr=1e-3)
        self.optimizer = make(self.shards)
        self.reduced_buckets = 0
        self.max_in_flight = max_in_flight
        self.timeline: list[dict] = []
        self._pending = [len(b) for b in self.buckets]
        self._bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        self._inflight: list = []
        self._backward_started = False
        self._hooks = []
        self._side = concurrent.futures.ThreadPoolExecutor(1, "zero2-comm") if stage == 2 else None
        self._plan = None       # find_unused_parameters: (used anywhere, used here) of each, from the forward
        self._next = 0          # ... and the next bucket to launch, in bucket order
        if stage == 2:
            for i, q in enumerate(self.params):
                self._hooks.append(q.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i)))
            if find_unused_parameters:
                self._hooks.append(model.register_forward_hook(self._after_forward))

    # -- gradients -> this rank's rows of their mean -----------------------------------------
    def _pack(self, k: int, members: list[int]):
        """Bucket ``k``'s gradients of ``members`` packed for the reduce-scatter, the full ones freed."""
        g = self.groups[k] if len(members) == len(self.buckets[k]) else \
            ShardGroup([self.params[i].shape for i in members], self.p)
        packed = g.pack([self.params[i].grad if self.params[i].grad is not None else
                         torch.zeros_like(self.params[i]) for i in members])   # unused here: zeros
        for i in members:
            self.params[i].grad = None                  # the full gradients are packed: not needed any more
        return g, packed

    def _add_rows(self, members, g: ShardGroup, piece: torch.Tensor) -> None:
        for i, spec, view in zip(members, g.specs, g.shard_views(piece)):
            row_grad = spec.unpad(view, self.rank)
            shard = self.rows[i]
            shard.grad = row_grad if shard.grad is None else shard.grad.add_(row_grad)
        self.reduced_buckets += 1

    def _reduce_now(self, members) -> None:
        """Stage 1: every gradient in one reduce-scatter, here and now."""
        g, packed = self._pack(0, members)
        piece = packed.new_empty(g.shard_numel)
        # packed is ours to overwrite: the ring sums in it, no copy
        reduce_scatter(piece, packed, use_torch=self.use_torch, group=self.group, scratch=True)
        del packed
        self._add_rows(members, g, piece)

    def _launch(self, k: int, members: list[int]) -> None:
        """Stage 2: bucket ``k``'s reduce-scatter started on the side thread (after the oldest
        in flight, when ``max_in_flight`` are)."""
        while len(self._inflight) >= self.max_in_flight:     # before packing: never one more
            self._land(self._inflight.pop(0))
        g, packed = self._pack(k, members)
        box = [packed]
        del packed

        def work():
            t0 = time.perf_counter()
            grads = box.pop()
            piece = grads.new_empty(g.shard_numel)
            reduce_scatter(piece, grads, use_torch=self.use_torch, group=self.group, scratch=True)
            del grads                                   # the packed bucket goes once reduced
            self.timeline.append(dict(what="reduce_scatter", bucket=k, start=t0, end=time.perf_counter()))
            return piece
        self.timeline.append(dict(what="issue_reduce_scatter", bucket=k, start=time.perf_counter(), end=None))
        self._inflight.append((members, g, self._side.submit(live_bytes.carry(work))))

    def _land(self, entry) -> None:
        members, g, future = entry
        self._add_rows(members, g, future.result())

    def _after_forward(self, module, args, output) -> None:
        """Stage 2 with ``find_unused_parameters``: what this forward's graph reaches, here and on
        every rank; a bucket is full once the parameters used here have their gradients."""
        if not torch.is_grad_enabled():
            return
        here = reached(output, self.params)
        anywhere = [any(col) for col in zip(*across(here, self.group, self.use_torch, self.params[0].device))]
        self._plan = (anywhere, here)
        self._pending = [sum(1 for i in b if here[i] and anywhere[i]) for b in self.buckets]
        self._next = 0

    def _launch_in_order(self) -> None:
        anywhere = self._plan[0]
        while self._next < len(self.buckets) and self._pending[self._next] <= 0:
            members = [i for i in self.buckets[self._next] if anywhere[i]]
            if members:
                self._launch(self._next, members)
            self._next += 1

    def _grad_ready(self, i: int, param) -> None:
        if not self._backward_started:
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        k = self._bucket_of[i]
        self._pending[k] -= 1
        if self._plan is not None:
            self._launch_in_order()         # the same buckets in the same order on every rank
        elif self._pending[k] == 0:
            self._launch(k, self.buckets[k])

    def _end_backward(self) -> None:
        """Buckets a backward did not fill (a parameter unused) go without the unused ones, in
        bucket order; then every reduce-scatter in flight lands."""
        if self._plan is not None:
            self._pending = [0] * len(self.buckets)
            self._launch_in_order()
            self._plan = None
        for k, bucket in enumerate(self.buckets):
            if 0 < self._pending[k]:
                members = [i for i in bucket if self.params[i].grad is not None]
                if members:
                    self._launch(k, members)
        while self._inflight:
            self._land(self._inflight.pop(0))
        self._pending = [len(b) for b in self.buckets]
        self._backward_started = False
        self.timeline.append(dict(what="end_backward", bucket=None, start=time.perf_counter(), end=None))

    # -- the step ----------------------------------------------------------------------------
    def step(self, clip_norm: float | None = None):
        """Reduce-scatter what backward has not (all of it in stage 1), step, all-gather.
        ``clip_norm``: first scale the rows' gradients so the whole gradient's norm, over every
        rank's rows, is at most that; returns the norm before clipping (else None)."""
        if self.stage == 1:
            every = across([q.grad is not None for q in self.params], self.group, self.use_torch,
                           self.params[0].device)
            partial = first_partial(self.names, every)
            if partial and not self.find_unused_parameters:
                raise RuntimeError(f"ZeRO-1 on rank {self.rank}: parameter {partial} in this step; the ranks' "
                                   "reduce-scatters would not match. Pass find_unused_parameters=True (DDP's "
                                   "switch): a rank then adds zeros for what it did not use")
            members = [i for i in self.buckets[0] if any(row[i] for row in every)]
            if members:
                self._reduce_now(members)
        norm = None
        if clip_norm is not None:
            norm = clip_grad_norm_(self.shards, clip_norm, self.group, self.use_torch)
        self.optimizer.step()
        with torch.no_grad():
            for b, g in zip(self.buckets, self.groups):
                mine = torch.cat(g.shard([self.params[i].detach() for i in b], self.rank))
                gathered = mine.new_empty(self.p * g.shard_numel)
                all_gather(gathered, mine, use_torch=self.use_torch, group=self.group)
                g.unpack_into(gathered, [self.params[i] for i in b])   # straight into the weights
                del gathered
        return norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for q in self.params:
            q.grad = None

    def memory(self) -> dict:
        """Bytes this rank holds now: parameters, gradients, optimizer state."""
        return dict(params=tensor_bytes(self.params),
                    grads=tensor_bytes([q.grad for q in self.params] + [s.grad for s in self.shards]),
                    optimizer=optimizer_state_bytes(self.optimizer))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._side is not None:
            self._side.shutdown(wait=True)
