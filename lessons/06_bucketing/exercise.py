"""Lesson 6 exercise: a DDP-style bucketed gradient reducer.

Fill in the stubs in task order; each task builds on the ones before it. The rest of the
class -- set-up, forward, the hook that calls you, the launch of one bucket, the
end-of-backward callback -- is given: read it first, it tells you what state there is.

| task | what                                   | stub                                   |
|------|----------------------------------------|----------------------------------------|
| 1    | bucket assignment                      | assign_buckets                         |
| 2    | mark a gradient ready, launch in order | BucketedReducer._mark_ready            |
| 3    | finish backward: wait, write back      | BucketedReducer._finalize              |
| 4    | rebuild buckets from the observed order| BucketedReducer._rebuild_buckets       |
| 5    | unused parameters                      | _find_unused, _globally_used           |
| 6    | gradient accumulation without sync     | BucketedReducer.no_sync                |

Check your work:

    .venv/bin/python lessons/06_bucketing/exercise.py                         # PASS/FAIL per task
    .venv/bin/torchrun --nproc-per-node 4 lessons/06_bucketing/exercise.py    # the same, under torchrun
    make check LESSON=06                                                      # the same, from make
    make grade LESSON=06                                                      # the points

Each task is judged outside your process: every rank trains on batches you cannot know in
advance, and the gradients, the parameters and every all-reduce (one per bucket, of the
bucket's size, launched as soon as it and the buckets before it are complete) are held to
what DDP promises, simulated rank by rank.

Course functions you may call (the sheet is checked against the code):

    ops.global_rank(group, group_rank) -> int
        The global rank of ``group_rank`` in ``group``: what ``send``/``recv`` take.
    trace.label(text)
        Tag the events made inside the block (e.g. "reduce-scatter step 2"); under a running
        ``torch.profiler``, the block is also a range of that name in its trace.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from collectives import ops, trace
from collectives.course.grading.runner import run_tasks

LESSON = 6
MiB = 1 << 20


def assign_buckets(params, bucket_cap_bytes: int, first_bucket_cap_bytes: int | None = None,
                   order: list[int] | None = None) -> list[list[int]]:
    """Lesson 6, task 1: group tensors into buckets; return each bucket's indices into ``params``.

    TODO:     walk the tensors in ``order`` (default: reversed registration order,
              ``n-1, ..., 0``) and put each into the open bucket of its (dtype, device).
              A bucket closes as soon as it holds at least its cap in bytes:
              ``first_bucket_cap_bytes`` for the first bucket of a (dtype, device)
              (``None``: the same as ``bucket_cap_bytes``), ``bucket_cap_bytes`` after.
              Buckets still open at the end are kept. Return the buckets sorted by the
              position (in ``order``) of their first tensor.
    APPROACH: a dict (dtype, device) -> (indices, bytes so far) for the open buckets, and a
              count of closed buckets per key to know which cap applies.
    EXAMPLE:  float64 sizes, backward order: 32, 512, 128, 2048, 128, 1024 bytes
              (indices 5, 4, 3, 2, 1, 0), cap 544  ->  [[5, 4], [3, 2], [1, 0]];
              cap 1 MiB, first cap 32  ->  [[5], [4, 3, 2, 1, 0]].
    HINT:     bytes = t.numel() * t.element_size(). Reject an ``order`` that is not a
              permutation of range(len(params)) with a ValueError.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 6, task 1: assign_buckets")


@dataclass
class Bucket:
    """Gradients of one dtype on one device, reduced by one all-reduce."""

    params: list[int]            # indices into reducer.params, in the order they sit in `flat`
    flat: torch.Tensor           # every gradient of the bucket end to end: what is all-reduced
    views: list[torch.Tensor]    # views[k]: the slice of `flat` for params[k], shaped like it
    pending: int = 0             # gradients still to arrive this iteration
    work: object = None          # the in-flight all-reduce, waited on at the end of backward


@dataclass
class BackwardStats:
    """One synchronized backward on this rank, in ``time.perf_counter()`` seconds."""

    start: float = math.nan
    param_ready: dict = field(default_factory=dict)
    bucket_bytes: list = field(default_factory=list)
    bucket_ready: list = field(default_factory=list)
    bucket_launched: list = field(default_factory=list)
    bucket_done: list = field(default_factory=list)
    end: float = math.nan
    finished: float = math.nan

    def relative(self) -> dict:
        t0 = self.start

        def rel(xs):
            return [x - t0 for x in xs]
        return dict(param_ready={i: t - t0 for i, t in self.param_ready.items()},
                    bucket_bytes=list(self.bucket_bytes), bucket_ready=rel(self.bucket_ready),
                    bucket_launched=rel(self.bucket_launched), bucket_done=rel(self.bucket_done),
                    end=self.end - t0, finished=self.finished - t0)


class BucketedReducer(nn.Module):
    """Data-parallel wrapper that all-reduces gradients in buckets, overlapped with backward.

    Used like ``torch.nn.parallel.DistributedDataParallel``::

        model = BucketedReducer(net, bucket_cap_mb=25)
        loss_fn(model(x), y).backward()       # gradients arrive averaged over the ranks
        optimizer.step()
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

    # ---- given: set-up -----------------------------------------------------------------

    def _comm_device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _broadcast_from_rank0(self) -> None:
        self._broadcast(list(self.module.parameters()) + list(self.module.buffers()), "initial broadcast")

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
                    view.copy_(p.grad)
                    p.grad = view
            self.buckets.append(Bucket(list(members), flat, views, len(members)))

    @property
    def bucket_indices(self) -> list[list[int]]:
        return [list(b.params) for b in self.buckets]

    # ---- given: forward ------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._started:
            raise RuntimeError("the previous backward did not finish reducing its gradients "
                               "(it raised part-way); build a new BucketedReducer")
        if (torch.is_grad_enabled() and self._order_observed and not self._rebuilt
                and not self.find_unused_parameters):       # as DDP: no rebuild then
            self._rebuild_buckets()
        if self.broadcast_buffers and self._buffers_before_forward:
            self._broadcast(list(self.module.buffers()), "buffers")   # rank 0's running stats
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
        """Lesson 6, task 5a: indices of parameters the autograd graph of ``outputs`` does not reach.

        TODO:     walk the graph from every output's ``grad_fn`` through
                  ``node.next_functions`` (pairs ``(node or None, input_nr)``); an
                  ``AccumulateGrad`` node has a ``.variable``: the parameter it feeds.
                  Return the indices (into ``self.params``) of parameters never reached.
        APPROACH: a stack and a ``seen`` set of nodes; collect ``id(node.variable)``. An
                  output that is itself a parameter (no ``grad_fn``) counts as reached.
        EXAMPLE:  BranchNet used with ``use_b=False``: branch_b and never are not reached
                  -> the indices of branch_b.weight, branch_b.bias, never.weight, never.bias.
        HINT:     the given ``_start_backward`` marks these ready (zeros) when backward
                  starts, so a bucket of unused parameters does not wait for the end.
        CALLS:    none
        """
        raise NotImplementedError("Lesson 6, task 5: _find_unused")

    # ---- given: the hook, the first hook, launching one bucket, the end of backward --------

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
        self._started = True
        if math.isnan(self.stats.start):
            self.stats.start = now
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        for i in self._unused_in_forward:
            self._mark_ready(i)

    def _launch(self, b: int) -> None:
        """Start bucket ``b``'s all-reduce without waiting for it (sets ``bucket.work``)."""
        bucket, stats = self.buckets[b], self.stats
        stats.bucket_launched[b] = time.perf_counter()
        with trace.label(f"bucket {b}"):
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
        if not bucket.flat.is_cuda:
            bucket.work.get_future().add_done_callback(
                lambda _, b=b: stats.bucket_done.__setitem__(b, time.perf_counter()))

    def _backward_end(self) -> None:
        self.stats.end = time.perf_counter()
        missing = [self.names[i] for i, marked in enumerate(self._marked) if not marked]
        self._finalize()
        self._end_iteration()
        self.stats.finished = time.perf_counter()
        if missing and not self.find_unused_parameters:
            raise RuntimeError(f"parameters received no gradient on this rank: {missing}. Pass "
                               "find_unused_parameters=True when some parameters may go unused.")

    def _end_iteration(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._marked = [False] * len(self.params)
        self._used = [False] * len(self.params)
        self._next_bucket = 0
        self._started = False
        self._expect_hooks = False
        self._order_observed = True

    # ---- your tasks ----------------------------------------------------------------------

    def _mark_ready(self, index: int) -> None:
        """Lesson 6, task 2: put parameter ``index``'s gradient into its bucket; launch buckets.

        TODO:     refuse a second mark in one iteration (RuntimeError; use ``self._marked``).
                  Find the bucket and view (``self._where[index]``). Write
                  ``grad / world_size`` into the view -- zeros when ``grad`` is None; when
                  the grad already *is* the view (``gradient_as_bucket_view``), divide in
                  place; after a copy under ``gradient_as_bucket_view``, point
                  ``param.grad`` at the view. Decrement ``bucket.pending``; when it hits 0,
                  record ``self.stats.bucket_ready[b]`` and launch, with ``self._launch``,
                  every bucket from ``self._next_bucket`` on whose pending is 0 -- stopping
                  at the first that is not.
        APPROACH: the in-order rule is what keeps ranks in step: each rank's hooks may run
                  in a different order, but every rank must issue bucket 0's all-reduce,
                  then bucket 1's, ...
        EXAMPLE:  3 buckets; bucket 1 completes first: nothing is launched; bucket 0
                  completes: buckets 0 and 1 are launched; then bucket 2 when it completes.
        HINT:     ``torch.mul(grad, 1.0 / p, out=view)`` scales and copies in one pass (a
                  multiply, as DDP does); ``grad.data_ptr() == view.data_ptr()`` tells you
                  the grad is already the view: then ``view.div_(p)``, as DDP does there
                  (a multiply by 1/p differs in the last bit at p = 3).
        CALLS:    none
        """
        raise NotImplementedError("Lesson 6, task 2: _mark_ready")

    def _finalize(self) -> None:
        """Lesson 6, task 3: at the end of backward, finish every bucket and write back.

        TODO:     1. mark ready every parameter not marked yet (their hook never ran):
                     this launches the buckets still waiting, so every rank issues every
                     all-reduce. 2. if ``self.find_unused_parameters``, get the global used
                     map: ``used = self._globally_used()``. 3. wait on every bucket's
                     ``work`` (then set it to None) and record ``self.stats.bucket_done[b]``
                     if still NaN. 4. write back: for each parameter, skip it if
                     ``used`` says no rank used it (its grad stays None); under
                     ``gradient_as_bucket_view`` set ``param.grad = view``; else copy the
                     view into ``param.grad`` (``view.clone()`` when grad is None).
        APPROACH: the bucket now holds the average: each rank added grad / p.
        EXAMPLE:  p = 2, grads 1.0 and 3.0: the bucket holds 0.5 + 1.5 = 2.0 on both ranks.
        HINT:     ``zip(bucket.params, bucket.views)`` walks a bucket's parameters;
                  ``torch._foreach_copy_(grads, views)`` copies many tensors in one call.
        CALLS:    none
        """
        raise NotImplementedError("Lesson 6, task 3: _finalize")

    def _rebuild_buckets(self) -> None:
        """Lesson 6, task 4: re-bucket once, in the order gradients really arrived.

        TODO:     the order is ``self._ready_order`` (the hook order of the first synced
                  backward) followed by the parameters missing from it, in current bucket
                  order. Broadcast rank 0's order (an int64 tensor on
                  ``self._comm_device()``, from the group's rank 0:
                  ``ops.global_rank(self.group, 0)``) so every rank agrees, compute
                  ``assign_buckets(self.params, self.bucket_cap_bytes,
                  self.first_bucket_cap_bytes, order)``, install it with
                  ``self._install_buckets`` and set ``self._rebuilt = True``.
        APPROACH: the given ``forward`` calls this once, before the second synced forward.
        EXAMPLE:  rank 0 saw [9, 8, 3, 2, 1, 0, 7, 6, 5, 4]; rank 1 saw another order:
                  both build buckets from rank 0's.
        HINT:     label the broadcast: ``with trace.label("rebuild buckets"):``.
        CALLS:    ops.global_rank, trace.label
        """
        raise NotImplementedError("Lesson 6, task 4: _rebuild_buckets")

    def _globally_used(self) -> list[bool]:
        """Lesson 6, task 5b: was each parameter used on *any* rank since the last synced step?

        TODO:     all-reduce ``self._used`` as an int32 tensor (on ``self._comm_device()``)
                  over ``self.group``; return a list of bools (sum > 0).
        APPROACH: one small all-reduce per synced step, and only with find_unused_parameters.
        EXAMPLE:  rank 0 used [1, 1, 0], rank 1 [1, 0, 0] -> [True, True, False].
        HINT:     ``(t > 0).tolist()``; label it ``trace.label("used map")``.
        CALLS:    trace.label
        """
        raise NotImplementedError("Lesson 6, task 5: _globally_used")

    @contextlib.contextmanager
    def no_sync(self):
        """Lesson 6, task 6: forwards inside the block get a backward that only accumulates.

        TODO:     set ``self._sync = False`` for the duration of the block, and restore the
                  previous value after (also when the block raises).
        APPROACH: the given ``forward`` reads ``self._sync``; the given ``_hook`` then only
                  records that the parameter was used. The next synced backward reduces
                  the accumulated ``.grad``.
        EXAMPLE:  ``with model.no_sync(): loss(model(x1)).backward()`` then
                  ``loss(model(x2)).backward()`` -> grad = average over ranks of g1 + g2.
        HINT:     ``try: yield`` / ``finally:``.
        CALLS:    none
        """
        raise NotImplementedError("Lesson 6, task 6: no_sync")
        yield  # (makes this a generator, as contextmanager needs)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


if __name__ == "__main__":
    run_tasks(LESSON)
