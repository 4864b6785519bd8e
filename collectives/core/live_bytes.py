"""Peak live tensor memory on any device, CPU included: a meter of storage bytes.

``torch.cuda.max_memory_allocated`` answers "how much at most?" on a GPU only; on CPU
nothing counts. :class:`LiveBytes` counts what the allocator would: every tensor storage
that comes into being while it runs, from its birth to its death::

    with LiveBytes() as meter:
        loss = model(x).square().mean(); loss.backward(); opt.step(); opt.zero_grad()
    meter.peak     # the most bytes alive at once above the start
    meter.live     # bytes alive at the end above the start (negative: fewer than at the start)

How it sees them:

* a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every operator's
  outputs; a storage none of the inputs had is a new allocation (a view or an in-place
  result shares an input's storage and is not). Each new storage gets a
  :func:`weakref.finalize` (torch keeps one Python object per live storage), which takes
  its bytes off when the last tensor on it dies;
* ``UntypedStorage.resize_`` -- how FSDP frees a gathered parameter and brings it back
  without a new tensor -- is wrapped while the meter runs, so growing and shrinking a
  storage counts, including one that existed before the start;
* a tensor subclass (FSDP2's ``DTensor``) counts by the plain tensors inside it.

The peak is taken after every operator and every resize. What it does not see: scratch
an operator allocates and frees inside itself, memory a library holds outside tensors
(gloo's, NCCL's), sparse tensors, tensors made from Python data (``torch.tensor([...])``,
``torch.from_numpy``: no operator makes them), and storages from before the start that die
untracked. The dispatch
mode is per thread: work handed to another thread is seen when wrapped in :func:`carry`.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

_active: LiveBytes | None = None


def active() -> LiveBytes | None:
    """The meter running now (in any thread), or ``None``."""
    return _active


def _plain(t) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data (itself, or a subclass's inner tensors)."""
    if not isinstance(t, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _plain(getattr(t, n))]
    return [t]


def _storages(tree) -> dict:
    """``{key: storage}`` of the plain tensors in a pytree (args, kwargs, outputs)."""
    out = {}
    for leaf in tree_leaves(tree):
        for t in _plain(leaf):
            if t.device.type == "meta" or t.layout != torch.strided:
                continue                            # no storage of bytes (sparse tensors: not counted)
            s = t.untyped_storage()
            out[s._cdata] = s
    return out


class _Mode(TorchDispatchMode):
    def __init__(self, meter: LiveBytes):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.meter._after_op((args, kwargs), out)
        return out


class LiveBytes:
    """Counts the bytes of tensor storages alive while it runs (see the module).

    ``peak``: the most bytes alive at once above the start; ``live``: bytes alive now
    above the start; ``allocated``: bytes of every storage created or grown, in total.
    One meter at a time; it is not reentrant."""

    def __init__(self):
        self.live = self.peak = self.allocated = 0
        self._bytes: dict[int, int] = {}        # storage key -> bytes it has now, as counted
        self._lock = threading.RLock()          # finalizers may run inside a locked update
        self._mode = None
        self._resize = None

    # -- counting ----------------------------------------------------------------------------------
    def _track(self, key: int, storage, counted: int) -> None:
        self._bytes[key] = counted
        weakref.finalize(storage, self._died, key).atexit = False

    def _set(self, key: int, nbytes: int) -> None:
        delta = nbytes - self._bytes[key]
        self._bytes[key] = nbytes
        self.live += delta
        self.allocated += max(delta, 0)
        self.peak = max(self.peak, self.live)

    def _died(self, key: int) -> None:
        with self._lock:
            nbytes = self._bytes.pop(key, None)
            if nbytes is not None:
                self.live -= nbytes

    def _after_op(self, inputs, outputs) -> None:
        with self._lock:
            before = _storages(inputs)
            for key, s in _storages(outputs).items():
                if key in self._bytes:
                    self._set(key, s.nbytes())          # an `out=` or in-place op may have grown it
                elif key not in before:
                    self._track(key, s, 0)              # born in this op
                    self._set(key, s.nbytes())
            self.peak = max(self.peak, self.live)

    def _resized(self, storage, old: int) -> None:
        with self._lock:
            key = storage._cdata
            if key not in self._bytes:
                self._track(key, storage, old)          # from before the start: only the change counts
            self._set(key, storage.nbytes())

    # -- running -------------------------------------------------------------------------------------
    def __enter__(self) -> LiveBytes:
        global _active
        if _active is not None:
            raise RuntimeError("LiveBytes: another meter is already running; they do not nest")
        _active = self
        original = self._resize = torch.UntypedStorage.resize_
        meter = self

        def resize_(storage, size):
            old = storage.nbytes()
            result = original(storage, size)
            meter._resized(storage, old)
            return result
        torch.UntypedStorage.resize_ = resize_
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        try:
            self._mode.__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._resize
            _active = None

    def thread(self):
        """A context that lets this meter see a worker thread's allocations too."""
        return _Mode(self)


def carry(fn):
    """``fn`` wrapped so that, run on another thread, the meter running now (if any) sees
    what it allocates: pass the result to a thread pool instead of ``fn``."""
    meter = _active
    if meter is None:
        return fn

    def run(*args, **kwargs):
        if _active is not meter:                 # the meter stopped before the thread ran
            return fn(*args, **kwargs)
        with meter.thread():
            return fn(*args, **kwargs)
    return run
