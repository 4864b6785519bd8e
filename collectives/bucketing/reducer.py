"""Lesson 6: DDP-style gradient bucketing, after PyTorch's ``c10d::Reducer``.

Data-parallel training averages every gradient over the ranks every step. The plain way
-- backward, then one all-reduce per gradient -- pays one latency α per parameter and
leaves the network idle while backward computes. DDP's ``Reducer`` fixes both:

* **buckets** -- gradients are copied into a few flat buffers (lesson 5's fusion), so a
  model of 100 tensors costs a handful of all-reduces, not 100;
* **overlap** -- backward produces gradients from the last layer to the first, so the
  buckets are filled in that order, and each bucket's all-reduce starts (asynchronously)
  the moment its last gradient arrives, while backward goes on with earlier layers.

::

    time ->          backward                                     | end of backward
    compute    | head | layer 3 | layer 2 | layer 1 | embedding |
    hooks        g g    g g g     g g g     g g g     g
    bucket 0     [copy]-> all-reduce b0
    bucket 1                [copy]------> all-reduce b1
    bucket 2                               [copy]------> all-reduce b2
    bucket 3                                                [copy]-> all-reduce b3
                                                                   wait all, write .grad

Cost, for n bytes of gradients in B buckets on p ranks (ring all-reduce each):
``2(p−1)·B·α + 2(p−1)/p·n·β`` -- the bytes each rank sends, ``2(p−1)/p·n``, do not
depend on B. What the step *waits for* after backward is roughly the all-reduce of the
last bucket plus any queue of earlier ones: small buckets make B·α large, one huge bucket
cannot start before backward ends. Between the two lies the minimum: the U-shape the lab
measures (DDP's default: 25 MiB buckets, and a 1 MiB first bucket so communication starts
early).

:class:`BucketedReducer` wraps a module the way ``torch.nn.parallel.DistributedDataParallel``
does and follows the design of its C++ ``Reducer``: buckets per (dtype, device),
post-accumulate-grad hooks that mark parameters ready, buckets launched strictly in index
order, an end-of-backward callback that waits and writes back, a one-time rebuild of the
buckets from the order gradients really arrived in, unused-parameter maps, ``no_sync()``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from ..core import ops, trace

# The bucket layout and the backward timeline live in .buckets; importable from here too.
from .buckets import BackwardStats, Bucket, assign_buckets  # noqa: F401

MiB = 1 << 20


class BucketedReducer(nn.Module):
    """Data-parallel wrapper that all-reduces gradients in buckets, overlapped with backward.

    Used like ``DistributedDataParallel``::

        model = BucketedReducer(net, bucket_cap_mb=25)
        loss_fn(model(x), y).backward()       # gradients arrive averaged over the ranks
        optimizer.step()

    Args:
        module: the model; every rank starts from rank 0's parameters and buffers.
        bucket_cap_mb: bucket size in MiB (DDP: 25); ``first_bucket_cap_mb`` for the first.
        find_unused_parameters: parameters that get no gradient on some rank are allowed;
            those unused on *every* rank keep ``grad is None``.
        gradient_as_bucket_view: after backward, ``param.grad`` is a view into its bucket
            (saves the write-back copy and one gradient's worth of memory).
        group: the process group (default: the world).
        broadcast_buffers: before every forward that follows a synced one (and the first),
            copy rank 0's buffers (BatchNorm's running statistics) to every rank, as DDP's
            default does; ``False`` lets each rank keep its own.

    Sparse gradients (``nn.Embedding(sparse=True)``) are refused at construction: they do
    not fit a flat bucket (DDP reduces each on its own).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, first_bucket_cap_mb: float = 1,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 group=None, broadcast_buffers: bool = True):
        super().__init__()
        if bucket_cap_mb <= 0 or first_bucket_cap_mb <= 0:
            raise ValueError(f"bucket caps must be positive, got {bucket_cap_mb} and {first_bucket_cap_mb} MiB")
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.bucket_cap_bytes = max(1, int(bucket_cap_mb * MiB))
        self.first_bucket_cap_bytes = max(1, int(first_bucket_cap_mb * MiB))
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # named_parameters() lists a tied Parameter once; frozen ones need no reduction.
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        sparse = [name for name, m in module.named_modules() if getattr(m, "sparse", False) is True
                  and any(p.requires_grad for p in m.parameters(recurse=False))]
        if sparse:
            raise ValueError(f"BucketedReducer: {sparse} produce sparse gradients (sparse=True), "
                             "which do not fit a flat bucket; build them with sparse=False, or "
                             "use torch DDP, which all-reduces sparse gradients on their own")
        self.broadcast_buffers = broadcast_buffers
        # As DDP: the buffers are listed once, here (walking the modules every forward costs
        # the host more than the broadcast of a model without buffers); one registered later
        # is not broadcast.
        self._module_buffers = list(module.buffers())
        self._buffers_before_forward = True    # as DDP: after a synced forward, and at first
        self._broadcast_from_rank0()
        self.buckets: list[Bucket] = []
        self._where: list[tuple[int, int]] = []      # param index -> (bucket, slot in bucket)
        self._install_buckets(assign_buckets(self.params, self.bucket_cap_bytes,
                                             self.first_bucket_cap_bytes))
        n = len(self.params)
        self._sync = True                 # False inside no_sync()
        self._expect_hooks = False        # the last forward was synced: its backward reduces
        self._started = False             # a hook of this backward ran (callback queued)
        self._next_bucket = 0             # every bucket before this one has been launched
        self._marked = [False] * n        # parameter marked ready this iteration
        self._used = [False] * n          # its hook ran since the last synced step
        self._unused_in_forward: list[int] = []   # found unreachable from the outputs
        self._ready_order: list[int] = []  # hook order of the first synced backward
        self._order_observed = False
        self._rebuilt = False
        self.stats = BackwardStats()
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._hook, i))
                       for i, p in enumerate(self.params)]

    # ---- set-up ---------------------------------------------------------------------

    def _comm_device(self) -> torch.device:
        """Where small bookkeeping tensors go: NCCL only reduces GPU tensors."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _broadcast_from_rank0(self) -> None:
        """Every replica starts from rank 0's state: one broadcast per (dtype, device)."""
        self._broadcast(list(self.module.parameters()) + self._module_buffers, "initial broadcast")

    def _broadcast(self, state: list[torch.Tensor], label: str) -> None:
        """Copy group rank 0's ``state`` to every rank: one broadcast per (dtype, device)."""
        by_key: dict[tuple, list[torch.Tensor]] = {}
        for t in state:
            by_key.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad(), trace.label(label):
            for tensors in by_key.values():
                flat = torch.cat([t.detach().reshape(-1) for t in tensors])
                dist.broadcast(flat, src=ops.global_rank(self.group, 0), group=self.group)
                offset = 0
                for t in tensors:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _install_buckets(self, layout: list[list[int]]) -> None:
        """Allocate one flat buffer per bucket and a view of it per parameter."""
        self.buckets, self._where = [], [(-1, -1)] * len(self.params)
        for b, members in enumerate(layout):
            first = self.params[members[0]]
            if any(self.params[i].dtype != first.dtype or self.params[i].device != first.device
                   for i in members):
                raise ValueError(f"bucket {b} mixes dtypes or devices")
            flat = torch.zeros(sum(self.params[i].numel() for i in members),
                               dtype=first.dtype, device=first.device)
            views, offset = [], 0
            for slot, i in enumerate(members):
                p = self.params[i]
                view = flat[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()
                views.append(view)
                self._where[i] = (b, slot)
                if self.gradient_as_bucket_view and p.grad is not None:
                    view.copy_(p.grad)      # a rebuild keeps the gradient, now in the new bucket
                    p.grad = view
            self.buckets.append(Bucket(list(members), flat, views, len(members)))

    @property
    def bucket_indices(self) -> list[list[int]]:
        """The layout: each bucket's parameter indices (into :attr:`params`), bucket 0 first."""
        return [list(b.params) for b in self.buckets]

    # ---- forward --------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._started:
            raise RuntimeError("the previous backward did not finish reducing its gradients "
                               "(it raised part-way); build a new BucketedReducer")
        if (torch.is_grad_enabled() and self._order_observed and not self._rebuilt
                and not self.find_unused_parameters):       # as DDP: no rebuild then
            self._rebuild_buckets()
        if self.broadcast_buffers and self._buffers_before_forward and self._module_buffers:
            self._broadcast(self._module_buffers, "buffers")   # rank 0's running stats
        out = self.module(*args, **kwargs)
        self._expect_hooks = torch.is_grad_enabled() and self._sync
        self._buffers_before_forward = self._expect_hooks
        if self._expect_hooks:
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            self.stats = BackwardStats(bucket_bytes=[b.flat.numel() * b.flat.element_size()
                                                     for b in self.buckets])
            for key in ("bucket_ready", "bucket_launched", "bucket_done"):
                setattr(self.stats, key, [math.nan] * len(self.buckets))
            for t in outputs:
                t.register_hook(self._note_backward_start)
            self._unused_in_forward = self._find_unused(outputs) if self.find_unused_parameters else []
        return out

    def _note_backward_start(self, grad):
        if math.isnan(self.stats.start):
            self.stats.start = time.perf_counter()

    def _find_unused(self, outputs: list[torch.Tensor]) -> list[int]:
        """Indices of parameters the autograd graph of ``outputs`` does not reach.

        Walk ``grad_fn.next_functions`` from the outputs; every parameter in the graph ends
        in an ``AccumulateGrad`` node whose ``.variable`` is the parameter. The ones never
        met will get no gradient: they are marked ready (with zeros) as soon as backward
        starts, so their buckets do not hold up the others.
        """
        reached = {id(t) for t in outputs if t.grad_fn is None}
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        seen = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if hasattr(node, "variable"):
                reached.add(id(node.variable))
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
        return [i for i, p in enumerate(self.params) if id(p) not in reached]

    # ---- backward: hooks, buckets, the end-of-backward callback ------------------------

    def _hook(self, index: int, param: torch.Tensor) -> None:
        """Runs after ``param.grad`` has been accumulated (once per backward)."""
        self._used[index] = True
        if not self._expect_hooks:          # forward ran under no_sync(): keep it local
            return
        now = time.perf_counter()
        if not self._started:
            self._start_backward(now)
        self.stats.param_ready[index] = now
        if not self._order_observed:
            self._ready_order.append(index)
        self._mark_ready(index)

    def _start_backward(self, now: float) -> None:
        """First hook of a synced backward: ask autograd to call us back when it ends."""
        self._started = True
        if math.isnan(self.stats.start):
            self.stats.start = now
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        for i in self._unused_in_forward:
            self._mark_ready(i)

    def _mark_ready(self, index: int) -> None:
        """Put parameter ``index``'s gradient, divided by the world size, into its bucket;
        launch every bucket that is now complete -- strictly in index order.

        Exactly DDP's arithmetic, so that the two agree bit for bit at every p: a gradient
        copied into its bucket is multiplied by ``1/p`` on the way (one pass instead of a
        copy and a divide); a gradient already in its bucket (``gradient_as_bucket_view``)
        is divided by p in place. The two differ in the last bit whenever 1/p is not
        exact (p = 3, 5, 6, ...)."""
        if self._marked[index]:
            raise RuntimeError(f"parameter {self.names[index]!r} was marked ready twice in one "
                               "iteration (backward called twice after one forward?)")
        self._marked[index] = True
        b, slot = self._where[index]
        bucket = self.buckets[b]
        view = bucket.views[slot]
        param = self.params[index]
        grad = param.grad
        if grad is None:                                   # no gradient here: contribute zeros
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():          # already accumulated in the bucket
            view.div_(self.world_size)                     # as DDP: div_, not mul_(1/p)
        else:
            torch.mul(grad, 1.0 / self.world_size, out=view)   # copy and scale in one pass
            if self.gradient_as_bucket_view:
                param.grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            self.stats.bucket_ready[b] = time.perf_counter()
            # Every rank must issue the same all-reduces in the same order, whatever order
            # its hooks ran in: launch bucket k only after buckets 0..k-1.
            while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
                self._launch(self._next_bucket)
                self._next_bucket += 1

    def _launch(self, b: int) -> None:
        """Start bucket ``b``'s all-reduce without waiting for it."""
        bucket, stats = self.buckets[b], self.stats
        stats.bucket_launched[b] = time.perf_counter()
        with trace.label(f"bucket {b}"):
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
        if not bucket.flat.is_cuda:   # on CPU the future completes when the data is reduced
            bucket.work.get_future().add_done_callback(
                lambda _, b=b: stats.bucket_done.__setitem__(b, time.perf_counter()))

    def _backward_end(self) -> None:
        """Queued by the first hook; autograd runs it once the whole backward is done."""
        self.stats.end = time.perf_counter()
        missing = [self.names[i] for i, marked in enumerate(self._marked) if not marked]
        self._finalize()
        self._end_iteration()
        self.stats.finished = time.perf_counter()
        if missing and not self.find_unused_parameters:
            raise RuntimeError(f"parameters received no gradient on this rank: {missing}. Pass "
                               "find_unused_parameters=True when some parameters may go unused.")

    def _finalize(self) -> None:
        """Launch what is left, wait for every bucket, write the averages into ``.grad``."""
        for i, marked in enumerate(self._marked):     # no hook ran: zeros (or a no_sync grad)
            if not marked:
                self._mark_ready(i)
        used = self._globally_used() if self.find_unused_parameters else None
        for b, bucket in enumerate(self.buckets):
            bucket.work.wait()
            bucket.work = None
            if math.isnan(self.stats.bucket_done[b]):
                self.stats.bucket_done[b] = time.perf_counter()
        grads, views = [], []
        for bucket in self.buckets:
            for i, view in zip(bucket.params, bucket.views):
                param = self.params[i]
                if used is not None and not used[i]:
                    continue                   # no rank used it: its grad stays as it was (None)
                if self.gradient_as_bucket_view:
                    param.grad = view
                elif param.grad is None:       # unused here, used elsewhere
                    param.grad = view.clone()
                else:
                    grads.append(param.grad)
                    views.append(view)
        if grads:
            torch._foreach_copy_(grads, views)   # every copy back in one call

    def _globally_used(self) -> list[bool]:
        """All-reduce this rank's used-map (one int per parameter): used anywhere?"""
        used = torch.tensor(self._used, dtype=torch.int32, device=self._comm_device())
        with trace.label("used map"):
            dist.all_reduce(used, group=self.group)
        return (used > 0).tolist()

    def _end_iteration(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._marked = [False] * len(self.params)
        self._used = [False] * len(self.params)
        self._next_bucket = 0
        self._started = False
        self._expect_hooks = False
        self._order_observed = True

    # ---- rebuild, no_sync ---------------------------------------------------------------

    def _rebuild_buckets(self) -> None:
        """Once, before the second synced forward: re-bucket in the order the gradients
        really arrived. Rank 0's order is broadcast, so every rank builds the same layout."""
        seen = set(self._ready_order)
        rest = [i for bucket in self.buckets for i in bucket.params if i not in seen]
        order = torch.tensor(self._ready_order + rest, dtype=torch.int64, device=self._comm_device())
        with trace.label("rebuild buckets"):
            dist.broadcast(order, src=ops.global_rank(self.group, 0), group=self.group)
        self._install_buckets(assign_buckets(self.params, self.bucket_cap_bytes,
                                             self.first_bucket_cap_bytes, order.tolist()))
        self._rebuilt = True

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside the block only accumulate ``.grad`` locally;
        the next synced backward reduces the sum."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def close(self) -> None:
        """Remove the gradient hooks (the module can then be wrapped again)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

