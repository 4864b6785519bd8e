"""Deep Gradient Compression's corrections to top-k with error feedback (Lin et al., ICLR 2018).

Top-k with a residual delays the small entries of the gradient; it does not lose them. Three
things still go wrong in training, and DGC corrects each. Every correction here is a switch
of :class:`DGCState`, off by default, so each can be measured alone:

**Selection per parameter** (``per_parameter=True``). A bucket holds layers whose gradients
differ in scale by orders of magnitude: top-k over the bucket sends the loudest layer's
entries and starves the others for many steps. Per parameter, every layer sends
⌈density·size⌉ of its own (k is still the same on every rank: no count exchange).

**Momentum correction** (``momentum=m``) **and factor masking** (``factor_masking=True``).
With momentum SGD the optimizer applies a velocity ``u ← m·u + g``. If the residual keeps
*gradients*, an entry sent after t steps arrives as one lump, without the momentum its
delayed pieces would have had. DGC moves the momentum into the hook and keeps the
*velocity* in the residual::

    u ← m·u + g              the velocity, per parameter (ParameterMemory, like the residual)
    v ← v + u                the residual accumulates velocity: sparse_all_reduce(u, v)
    send top-k of v; v[sent] ← 0
    u[sent] ← 0              factor masking: a sent entry's momentum is stale, drop it

and the optimizer is plain SGD (no momentum of its own): at density 1 without masking,
the update is momentum SGD's, to rounding. With masking a sent entry restarts its
velocity, which is what keeps old momentum from pushing the weights after the update has
been applied; at density 1 it turns the update into plain SGD.

**Warm-up** (``warmup_steps=s``). Early in training the gradient changes fast and the
residual's delayed entries are stale when they arrive. DGC sends more at first: the density
falls geometrically from ``warmup_density`` to ``density`` over the first s steps (DGC:
25 %, 6.25 %, 1.56 %, 0.4 % over the first four epochs).

With Adam there is no momentum to move (Adam keeps its own moments per entry, from what
arrives): per-parameter selection and warm-up apply, momentum correction does not.
DGC's fourth correction, local gradient clipping, is not here.
"""

# (no `from __future__ import annotations`: DDP checks the hook's annotations as objects)

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .all_reduce import SparseInfo, SparseWork
from .hooks import ParameterMemory, SparseHookState


@dataclass
class DGCState(SparseHookState):
    """:class:`~collectives.sparse.hooks.SparseHookState` with DGC's corrections, each optional."""

    momentum: float = 0.0               # momentum correction: the hook keeps the velocity (optimizer: no momentum)
    factor_masking: bool = True         # with momentum: zero the velocity where the residual was sent
    warmup_steps: int = 0               # density falls from warmup_density to density over these steps
    warmup_density: float = 0.25
    velocities: ParameterMemory = field(default_factory=ParameterMemory)
    step: int = 0                       # optimizer steps so far (counted at the last bucket)

    def density_now(self) -> float | None:
        if self.density is None or self.step >= self.warmup_steps or self.warmup_density <= self.density:
            return self.density
        fraction = self.step / self.warmup_steps
        return max(self.density, self.warmup_density * (self.density / self.warmup_density) ** fraction)

    def start_(self, params, flat: torch.Tensor) -> SparseWork:
        """Momentum correction around the sparse all-reduce of one bucket (``flat``: g / p)."""
        velocity = None
        if self.momentum:
            velocity = self.velocities.flat(params, flat)
            velocity.mul_(self.momentum).add_(flat)          # u <- m u + g
            flat.copy_(velocity)                             # the residual accumulates u
        work = SparseHookState.start_(self, params, flat)    # v <- v + u; top-k of v; v[sent] <- 0
        if velocity is not None and self.factor_masking:
            mask_sent_(velocity, work.info)                  # u[sent] <- 0
        return work

    def reduce_(self, params, flat: torch.Tensor) -> torch.Tensor:
        self.start_(params, flat).wait()
        return flat


def mask_sent_(memory: torch.Tensor, info: SparseInfo) -> torch.Tensor:
    """Zero ``memory`` (1-D, a bucket's) where this rank sent its entries."""
    if info.indices is None:
        return memory.zero_() if info.kept else memory    # everything sent (or not a member)
    return memory.index_fill_(0, info.indices, 0)


def dgc_hook(state: DGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook with DGC's corrections, left in flight as
    :func:`~collectives.sparse.hooks.sparse_hook_async` is."""
    flat = bucket.buffer()
    flat.div_(dist.get_world_size(state.group))
    work = state.start_(bucket.parameters(), flat)
    if bucket.is_last():
        state.step += 1
    return work.get_future()
