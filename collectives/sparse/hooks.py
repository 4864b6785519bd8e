"""Sparse all-reduce in training: DDP communication hooks, and lesson 6's reducer.

torch's ``DistributedDataParallel`` lets a user replace its per-bucket all-reduce::

    ddp = DistributedDataParallel(model, process_group=pg)
    register_sparse_hook(ddp, SparseHookState(density=0.01))    # sets state.group = pg

DDP calls the hook once per bucket as soon as the bucket's gradients are in, with the
bucket only -- **not its process group**: the state carries the group, and must carry
DDP's own (:func:`register_sparse_hook` copies it; a state left at ``group=None`` on a
DDP model of a subgroup would reduce over the whole world). The hook returns a future
holding the averaged gradients. Two hooks, the plain one first:

* :func:`sparse_hook` does the whole sparse all-reduce and returns a completed future:
  backward waits for every bucket's communication before it computes the next bucket.
* :func:`sparse_hook_async` selects now and returns the future of the all-gather in flight
  (:func:`~collectives.sparse.sparse_all_reduce_async`), as torch's PowerSGD hook chains
  its collectives: backward computes the next buckets while the pairs travel. Same bits.

:func:`on_a_thread` wraps a hook so that its own work -- the selection -- runs on a thread
of its own while backward goes on: on a CPU, what a stream is on a GPU.

Error feedback needs memory that outlives the step, and it belongs to **parameters**, not
to buckets: DDP rebuilds its buckets once, after the first iteration, in the order the
gradients really arrived. On the lab's ``DigitsMLP`` bucket 0 goes from ``[fc1.w, fc1.b,
fc2.w, fc2.b]`` to ``[fc2.b, fc2.w, fc1.b, fc1.w]``: the same size, every element at
another place. :class:`ParameterMemory` keeps each parameter's residual in its own slice
and moves it when the layout changes.

As in torch's default hook, gradients are divided by the world size *before* the
reduction, so at density 1 the hook is bit for bit DDP's own all-reduce, and the residual
holds averaged units.
"""

# (no `from __future__ import annotations`: DDP checks the hook's annotations as objects)

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..bucketing import BucketedReducer
from .all_reduce import SparseInfo, SparseWork, sparse_all_reduce, sparse_all_reduce_async


class ParameterMemory:
    """Per-parameter state (a residual, a velocity) kept as one flat buffer per bucket layout.

    A bucket's gradients lie end to end in its buffer, in the order of its parameters. For
    each layout (the bucket's parameters, in order) one flat buffer of the bucket's size
    holds every parameter's slice at the place its gradient has, so the sparse all-reduce
    adds a whole bucket's memory in one operation. A layout seen for the first time (DDP's
    rebuild, lesson 6's too) gets a new buffer into which every parameter's slice is moved
    -- once -- from wherever it was.
    """

    def __init__(self):
        self._slices: dict[int, torch.Tensor] = {}           # id(parameter) -> its 1-D slice
        self._flats: dict[tuple[int, ...], torch.Tensor] = {}  # layout -> the flat buffer

    def flat(self, params, like: torch.Tensor) -> torch.Tensor:
        """The buffer for a bucket holding ``params`` end to end (``like``: its buffer)."""
        layout = tuple(id(p) for p in params)
        flat = self._flats.get(layout)
        if flat is not None:
            return flat
        sizes = [p.numel() for p in params]
        if sum(sizes) != like.numel():
            raise ValueError(f"a bucket of {like.numel()} elements holding parameters of {sum(sizes)}: "
                             "the bucket's gradients are not its parameters end to end")
        flat = torch.zeros_like(like)
        start = 0
        for p, size in zip(params, sizes):
            old = self._slices.get(id(p))
            if old is not None:
                flat[start:start + size].copy_(old)         # this parameter's memory, moved
            self._slices[id(p)] = flat[start:start + size]
            start += size
        moved = set(layout)
        self._flats = {key: buf for key, buf in self._flats.items() if not moved & set(key)}
        self._flats[layout] = flat
        return flat

    def of(self, param) -> torch.Tensor | None:
        """``param``'s memory, shaped like it (None before its first bucket)."""
        mine = self._slices.get(id(param))
        return None if mine is None else mine.view(param.shape)

    def __len__(self) -> int:
        return len(self._slices)


@dataclass
class SparseHookState:
    """Settings and per-parameter memory of :func:`sparse_hook` / :func:`sparse_hook_async`."""

    density: float | None = None        # top-k mode ...
    threshold: float | None = None      # ... or threshold mode
    error_feedback: bool = True         # keep what was not sent for the next step
    transport: str = "allgather"        # allgather | split | dense | auto
    selection: str = "auto"             # top-k method (collectives.sparse.select)
    group: object = None                # DDP's process group: DDP does not pass it to the hook
    per_parameter: bool = False         # top-k of each parameter instead of the bucket's (DGC)
    residuals: ParameterMemory = field(default_factory=ParameterMemory)
    selection_state: dict = field(default_factory=dict)   # layout -> "reuse" thresholds
    sent: int = 0                       # elements sent by this rank, since creation
    elements: int = 0                   # elements reduced, since creation

    def residual_for(self, params, flat: torch.Tensor) -> torch.Tensor | None:
        """The residual of a bucket holding ``params``: each parameter's own, in its place."""
        return self.residuals.flat(params, flat) if self.error_feedback else None

    def density_now(self) -> float | None:
        """The density of this step (a warm-up changes it: :class:`~collectives.sparse.dgc.DGCState`)."""
        return self.density

    def _arguments(self, params, flat: torch.Tensor) -> dict:
        layout = tuple(id(p) for p in params)
        return dict(density=self.density_now() if self.threshold is None else None, threshold=self.threshold,
                    transport=self.transport, selection=self.selection, group=self.group,
                    state=self.selection_state.setdefault(layout, {}),
                    segments=[p.numel() for p in params] if self.per_parameter and self.threshold is None else None)

    def _count(self, info: SparseInfo, flat: torch.Tensor) -> None:
        self.sent += info.kept
        self.elements += flat.numel()

    def reduce_(self, params, flat: torch.Tensor) -> torch.Tensor:
        """Sparse-all-reduce a bucket (``flat``, already divided by the world size) in place; SUM."""
        info = sparse_all_reduce(flat, self.residual_for(params, flat), **self._arguments(params, flat))
        self._count(info, flat)
        return flat

    def start_(self, params, flat: torch.Tensor) -> SparseWork:
        """The same, left in flight: selection now, the sum when the returned work completes."""
        work = sparse_all_reduce_async(flat, self.residual_for(params, flat), **self._arguments(params, flat))
        self._count(work.info, flat)
        return work


def sparse_hook(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: average the bucket's gradients by a sparse all-reduce, then
    return a completed future (backward waits for the communication)."""
    flat = bucket.buffer()
    flat.div_(dist.get_world_size(state.group))      # as DDP's allreduce_hook: divide, then sum
    state.reduce_(bucket.parameters(), flat)
    fut = torch.futures.Future()
    fut.set_result(flat)
    return fut


def sparse_hook_async(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that returns while the pairs travel: the selection and the
    residual's update now, then the future of the collective in flight, the adding of what
    arrives chained to it. DDP waits for it at the end of backward, not before the next bucket."""
    flat = bucket.buffer()
    flat.div_(dist.get_world_size(state.group))
    return state.start_(bucket.parameters(), flat).get_future()


def on_a_thread(hook):
    """``hook`` with its own work moved off backward's thread: a CPU's stream.

    On a GPU a hook's selection is kernels queued on a stream: the hook returns at once and
    backward goes on. On a CPU the hook *is* the work -- the selection reads the whole
    bucket -- and DDP calls it on the thread that computes backward, which stops until it
    returns. The hook returned here hands each call to one thread of its own (first in,
    first out, so every rank starts its collectives in the same order) and returns a future
    at once, completed with the inner hook's future; backward computes the next bucket's
    gradients on its core while the selection runs on another. Same calls, same order, same
    bits; an exception in the hook reaches DDP through the future. It costs a core per rank.
    """
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hook")

    def threaded(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        result: torch.futures.Future = torch.futures.Future()

        def deliver(done):
            try:
                result.set_result(done.value())
            except BaseException as error:               # noqa: BLE001 - DDP raises it from the future
                result.set_exception(error)

        def work():
            try:
                hook(state, bucket).add_done_callback(deliver)
            except BaseException as error:               # noqa: BLE001
                result.set_exception(error)

        worker.submit(work)
        return result

    threaded.__name__ = f"{getattr(hook, '__name__', 'hook')}_on_a_thread"
    threaded.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
    return threaded


def register_sparse_hook(ddp, state: SparseHookState, hook=sparse_hook_async) -> SparseHookState:
    """``ddp.register_comm_hook(state, hook)`` with ``state.group`` set to DDP's own process
    group (DDP reduces over it; the hook is not told). A state already given another group
    is refused."""
    group = ddp.process_group
    if state.group is not None and state.group is not group:
        raise ValueError("register_sparse_hook: state.group is not the DDP model's process group; the hook "
                         "must reduce over the group DDP reduces over")
    state.group = group
    ddp.register_comm_hook(state, hook)
    return state


class SparseBucketedReducer(BucketedReducer):
    """Lesson 6's reducer with a sparse all-reduce per bucket (error feedback per parameter).

    ``SparseBucketedReducer(model, density=0.01)`` trains like ``BucketedReducer(model)``
    with every bucket's all-reduce replaced by
    :func:`collectives.sparse.sparse_all_reduce_async`: selection when the bucket fills, the
    pairs in flight while backward goes on. The bucket already holds gradients divided by
    the world size, so it is summed. Lesson 6 rebuilds its buckets too: residuals follow
    their parameters (:class:`ParameterMemory`).
    """

    def __init__(self, module, *, density=None, threshold=None, error_feedback=True,
                 transport="allgather", selection="auto", per_parameter=False, **kwargs):
        super().__init__(module, **kwargs)
        self.sparse = SparseHookState(density, threshold, error_feedback, transport, selection, self.group,
                                      per_parameter)

    def _launch(self, b: int) -> None:
        bucket, stats = self.buckets[b], self.stats
        stats.bucket_launched[b] = time.perf_counter()
        bucket.work = self.sparse.start_([self.params[i] for i in bucket.params], bucket.flat)
        bucket.work.get_future().add_done_callback(
            lambda _, b=b: stats.bucket_done.__setitem__(b, time.perf_counter()))
