"""Keeping the experts busy alike: the two ways MoE models are balanced today.

A router left alone sends most tokens to a few experts: they learn fastest, score
higher, and get more. The all-to-all then waits for the busiest rank, and with a capacity
the overflow is dropped. Two remedies:

* **an auxiliary loss** (Switch Transformer; GShard's is the same idea): with f_e the
  fraction of the T·k choices that went to expert e and P_e the router's mean probability
  for e, add ``coefficient · E · Σ_e f_e · P_e``. It is smallest (= 1·coefficient) when
  both are uniform, and its gradient (through P) pushes probability away from busy
  experts. It is a second objective, and it pulls against the first.
* **a bias, no loss** (DeepSeek-V3's auxiliary-loss-free balancing): each expert has a
  bias added to its score when choosing experts only -- the gates stay the unbiased
  softmax -- and after every step the bias of each overloaded expert drops by γ, each
  underloaded one rises by γ. Loads are counted over every rank (one all-reduce of E
  counts), so every rank's router copy moves alike. DeepSeek-V3 pairs it with no token
  dropping at all (``MoELayer(capacity_factor=None)``).
"""

from __future__ import annotations

import torch

from ..core import ops
from .moe import Routing

__all__ = ["load_balancing_loss", "expert_load", "update_bias", "balance_experts"]


def load_balancing_loss(x: torch.Tensor, weight: torch.Tensor, routing: Routing,
                        coefficient: float = 1.0) -> torch.Tensor:
    """Switch's auxiliary loss of this rank's tokens: coefficient · E · Σ_e f_e · P_e."""
    E = weight.shape[1]
    probs = torch.softmax(x @ weight, dim=-1)
    f = torch.bincount(routing.expert.reshape(-1), minlength=E).to(probs.dtype) / routing.expert.numel()
    return coefficient * E * (f * probs.mean(0)).sum()


def expert_load(routing: Routing, num_experts: int, group=None) -> torch.Tensor:
    """Choices per expert summed over the group's ranks (one ring all-reduce of E counts)."""
    from ..ring import ring_all_reduce
    load = torch.bincount(routing.expert.reshape(-1).cpu(), minlength=num_experts).to(torch.int64)
    load = load.to(ops.rank_device())
    if ops.group_rank_and_size(group)[1] > 1:
        ring_all_reduce(load, group=group)
    return load.cpu()


@torch.no_grad()
def update_bias(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> None:
    """DeepSeek-V3's update: bias_e += γ·sign(mean load − load_e), in place."""
    bias.add_(gamma * torch.sign(load.double().mean() - load.double()).to(bias.dtype).to(bias.device))


def balance_experts(bias: torch.Tensor, expert: torch.Tensor, probs: torch.Tensor, gamma: float,
                    group=None) -> torch.Tensor:
    """Both balancers from a step's routing (task 7's contract): returns this rank's
    load-balancing loss E·Σ_e f_e·P_e (``expert`` [T, k] the choices, ``probs`` [T, E] the
    router's probabilities), and moves ``bias`` in place by γ·sign(mean load − load_e),
    the loads summed over every rank of ``group``."""
    E = probs.shape[1]
    f = torch.bincount(expert.reshape(-1), minlength=E).to(probs.dtype) / max(expert.numel(), 1)
    loss = E * (f * probs.mean(0)).sum()
    load = torch.bincount(expert.reshape(-1).cpu(), minlength=E).to(torch.int64)
    from ..ring import ring_all_reduce
    if ops.group_rank_and_size(group)[1] > 1:
        load = load.to(ops.rank_device())
        ring_all_reduce(load, group=group)
    update_bias(bias, load.cpu(), gamma)
    return loss
