"""Lesson 6: the buckets the reducer fills, and the timeline of one backward.

* :func:`assign_buckets` -- which gradients share a bucket: walk them in the order backward
  is expected to produce them, one open bucket per (dtype, device), closed at its cap (a
  smaller cap for the first, so communication starts early). The reducer calls it at
  construction and once more, with the order the gradients really arrived in, to rebuild.
* :class:`Bucket` -- one bucket: a flat buffer, a view of it per parameter, how many
  gradients are still to come, and its in-flight all-reduce.
* :class:`BackwardStats` -- when each gradient arrived and each bucket filled, launched and
  finished in one synchronized backward: what the lab plots against the compute.

:class:`~collectives.bucketing.reducer.BucketedReducer` uses all three; they are
re-exported from :mod:`collectives.bucketing.reducer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def assign_buckets(params, bucket_cap_bytes: int, first_bucket_cap_bytes: int | None = None,
                   order: list[int] | None = None) -> list[list[int]]:
    """Group tensors into buckets; return each bucket as a list of indices into ``params``.

    ``order`` lists the indices in the order their gradients are expected to be ready
    (default: reversed registration order, the usual order of backward). Walking it, each
    tensor joins the open bucket of its (dtype, device); a bucket closes as soon as it
    holds at least its cap -- ``first_bucket_cap_bytes`` for the first bucket of each
    (dtype, device), ``bucket_cap_bytes`` after that. Buckets are returned sorted by when
    their first tensor is expected, so bucket 0 is the first to fill.

    Example: sizes in backward order 32, 512, 128, 2048 bytes, cap 544 -> [[a, b], [c, d]].
    """
    first_bucket_cap_bytes = bucket_cap_bytes if first_bucket_cap_bytes is None else first_bucket_cap_bytes
    order = list(reversed(range(len(params)))) if order is None else [int(i) for i in order]
    if sorted(order) != list(range(len(params))):
        raise ValueError(f"order must list each of the {len(params)} indices once, got {order}")
    position = {index: k for k, index in enumerate(order)}
    open_buckets: dict[tuple, tuple[list[int], int]] = {}   # (dtype, device) -> (indices, bytes)
    closed_per_key: dict[tuple, int] = {}
    buckets: list[list[int]] = []
    for index in order:
        tensor = params[index]
        key = (tensor.dtype, tensor.device)
        members, nbytes = open_buckets.pop(key, ([], 0))
        members.append(index)
        nbytes += tensor.numel() * tensor.element_size()
        cap = first_bucket_cap_bytes if closed_per_key.get(key, 0) == 0 else bucket_cap_bytes
        if nbytes >= cap:
            buckets.append(members)
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
        else:
            open_buckets[key] = (members, nbytes)
    buckets.extend(members for members, _ in open_buckets.values())
    return sorted(buckets, key=lambda members: position[members[0]])


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

    start: float = math.nan                 # backward reached the module's outputs
    param_ready: dict = field(default_factory=dict)   # parameter index -> its hook ran
    bucket_bytes: list = field(default_factory=list)
    bucket_ready: list = field(default_factory=list)     # its last gradient arrived
    bucket_launched: list = field(default_factory=list)  # its all-reduce was started
    bucket_done: list = field(default_factory=list)      # its all-reduce finished
    end: float = math.nan                   # the end-of-backward callback ran
    finished: float = math.nan              # gradients written back

    def relative(self) -> dict:
        """Every time in seconds since :attr:`start` (plain data: picklable, plottable)."""
        t0 = self.start

        def rel(xs):
            return [x - t0 for x in xs]
        return dict(param_ready={i: t - t0 for i, t in self.param_ready.items()},
                    bucket_bytes=list(self.bucket_bytes), bucket_ready=rel(self.bucket_ready),
                    bucket_launched=rel(self.bucket_launched), bucket_done=rel(self.bucket_done),
                    end=self.end - t0, finished=self.finished - t0)
