"""A mixture-of-experts layer with dispatch and combine written as all-to-alls.

Each rank holds T tokens and E/p of the E experts. A router scores every token against
every expert and keeps its top k (GShard's top-2; Switch's top-1 is k = 1). Each expert
takes at most C = ⌈capacity_factor · T · k / E⌉ tokens *from each rank*, first choices
first, in token order; what does not fit is dropped (its contribution is zero, and
counted). Then::

    route      logits = x · W_router, gates = top-k of softmax       (every rank, its tokens)
    permute    the kept (token, choice) rows sorted by expert, then by slot
    counts     one all-to-all of E/p counts per pair: who receives how many rows per expert
    dispatch   all-to-all of the rows (uneven splits, sizes from the counts)
    compute    expert e: its rows from every source, concatenated in source order
    return     all-to-all back (the dispatch's splits swapped)
    combine    out[t] = Σ_j gate[t, j] · y_j[t], un-permuted by index

Every all-to-all is :class:`AllToAll`, an autograd function whose backward is the
reverse all-to-all: the gradient of a row goes back the way the row came.

:func:`moe_reference` computes the same layer in one process from every rank's tokens,
with the same experts and one router copy per rank (what data parallelism replicates);
because every expert sees the same rows in the same order, the distributed layer's output
and gradients equal it bit for bit in fp32.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import ops, trace
from .flat import pairwise_all_to_all

__all__ = ["AllToAll", "all_to_all_autograd", "Routing", "capacity_for", "route", "dispatch_order",
           "combine", "expert_forward", "moe_dispatch_combine", "make_router", "make_expert", "exchange_counts",
           "MoELayer", "moe_reference"]


class AllToAll(torch.autograd.Function):
    """``output = all_to_all(input)`` along dim 0; backward: the reverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, input, output_split_sizes, input_split_sizes, group, algorithm):
        ctx.splits = (list(output_split_sizes), list(input_split_sizes))
        ctx.group, ctx.algorithm = group, algorithm
        output = input.new_empty((sum(output_split_sizes), *input.shape[1:]))
        algorithm(output, input.contiguous(), list(output_split_sizes), list(input_split_sizes), group)
        return output

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        ctx.algorithm(grad_in, grad.contiguous(), in_splits, out_splits, ctx.group)
        return grad_in, None, None, None, None


def all_to_all_autograd(input, output_split_sizes, input_split_sizes, group=None, algorithm=None):
    """:class:`AllToAll` with the pairwise all-to-all by default."""
    return AllToAll.apply(input, output_split_sizes, input_split_sizes, group, algorithm or pairwise_all_to_all)


@dataclass
class Routing:
    expert: torch.Tensor      # [T, k] expert of each choice
    gate: torch.Tensor        # [T, k] its weight (differentiable: the router learns through it)
    slot: torch.Tensor        # [T, k] position in the expert's buffer, −1 where dropped
    counts: list[int]         # kept rows per expert, E of them
    dropped: int              # (token, choice) pairs over capacity
    capacity: int


def capacity_for(tokens: int, num_experts: int, k: int, factor: float) -> int:
    """Rows an expert takes from one rank: ⌈factor · tokens · k / E⌉."""
    return math.ceil(factor * tokens * k / num_experts)


def route(x: torch.Tensor, weight: torch.Tensor, k: int, capacity: int, bias=None) -> Routing:
    """Top-k routing with a capacity: first choices take their slots before second choices."""
    logits = x @ weight
    if bias is not None:
        logits = logits + bias
    gate, expert = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    E = weight.shape[1]
    with torch.no_grad():
        taken = torch.zeros(E, dtype=torch.int64, device=x.device)
        slot = torch.empty_like(expert)
        for j in range(k):
            onehot = F.one_hot(expert[:, j], E)
            position = torch.cumsum(onehot, 0) - 1 + taken
            slot[:, j] = position.gather(1, expert[:, j:j + 1]).squeeze(1)
            taken += onehot.sum(0)
        dropped = int((slot >= capacity).sum())
        slot[slot >= capacity] = -1
        counts = torch.clamp(taken, max=capacity).tolist()
    return Routing(expert, gate, slot, counts, dropped, capacity)


def dispatch_order(routing: Routing) -> torch.Tensor:
    """Positions (t·k + j) of the kept choices, sorted by expert then slot: the send order."""
    flat_slot = routing.slot.reshape(-1)
    kept = torch.nonzero(flat_slot >= 0).squeeze(1)
    key = routing.expert.reshape(-1)[kept] * max(routing.capacity, 1) + flat_slot[kept]
    return kept[torch.argsort(key, stable=True)]


def combine(returned: torch.Tensor, routing: Routing, order: torch.Tensor, tokens: int) -> torch.Tensor:
    """Un-permute: out[t] = Σ_j gate[t, j] · (the row choice j of token t came back with, or 0)."""
    k = routing.expert.shape[1]
    out = None
    for j in range(k):
        mine = (order % k) == j
        y = returned.new_zeros((tokens, returned.shape[1])).index_copy(0, order[mine] // k, returned[mine])
        term = routing.gate[:, j:j + 1] * y
        out = term if out is None else out + term
    return out


def expert_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w1) @ w2


def make_router(seed: int, hidden: int, num_experts: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(hidden, num_experts, generator=gen) / math.sqrt(hidden)


def make_expert(seed: int, expert: int, hidden: int, ffn: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 100_003 + expert + 1)
    return (torch.randn(hidden, ffn, generator=gen) / math.sqrt(hidden),
            torch.randn(ffn, hidden, generator=gen) / math.sqrt(ffn))


def exchange_counts(counts: list[int], group=None) -> torch.Tensor:
    """[p, E/p]: row s holds how many rows rank s sends to each of this rank's experts."""
    rank, p = ops.group_rank_and_size(group)
    device = ops.rank_device()
    send = torch.tensor(counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    with trace.label("moe: counts per expert"):
        pairwise_all_to_all(recv, send, group=group)
    return recv.view(p, len(counts) // p).cpu()


def moe_dispatch_combine(x: torch.Tensor, expert_of: torch.Tensor, num_experts: int, expert_fn,
                         group=None) -> torch.Tensor:
    """Top-1 dispatch and combine, the layer's skeleton: token t goes to expert ``expert_of[t]``
    (on rank ``expert_of[t] // (E/p)``), comes back as ``expert_fn(e, rows)`` and lands in place.

    Tokens are sorted by expert (stably: token order within an expert), the counts per
    expert exchanged, the rows sent with uneven splits; each local expert e runs once on
    its rows from every source, concatenated in source order; the results go back the
    reverse way and are un-permuted. Returns [T, ...] like ``x``.
    """
    rank, p = ops.group_rank_and_size(group)
    if num_experts % p:
        raise ValueError(f"moe_dispatch_combine: {num_experts} experts do not split evenly over {p} ranks")
    if expert_of.shape != (x.shape[0],) or (expert_of.numel() and not 0 <= int(expert_of.min())
                                            <= int(expert_of.max()) < num_experts):
        raise ValueError(f"moe_dispatch_combine: rank {rank}: expert_of must hold one expert in "
                         f"[0, {num_experts}) per token")
    El = num_experts // p
    order = torch.argsort(expert_of, stable=True)
    counts = torch.bincount(expert_of, minlength=num_experts).tolist()
    recv_counts = exchange_counts(counts, group)                                 # [p, El]
    send_splits = [sum(counts[q * El:(q + 1) * El]) for q in range(p)]
    recv_splits = recv_counts.sum(1).tolist()
    received = all_to_all_autograd(x.index_select(0, order), recv_splits, send_splits, group)
    pieces = received.split(recv_counts.reshape(-1).tolist())
    back = [None] * (p * El)
    for e in range(El):
        y = expert_fn(rank * El + e, torch.cat([pieces[s * El + e] for s in range(p)]))
        for s, part in enumerate(y.split(recv_counts[:, e].tolist())):
            back[s * El + e] = part
    returned = all_to_all_autograd(torch.cat(back), send_splits, recv_splits, group)
    return returned.index_select(0, torch.argsort(order))


class MoELayer(torch.nn.Module):
    """E experts spread over the group's ranks, E/p each; tokens dispatched by all-to-all.

    ``forward(x)`` takes this rank's [T, hidden] tokens and returns their [T, hidden]
    outputs. After each call ``stats`` holds the dropped choices, the rows received per
    local expert, and ``timings`` the seconds of dispatch, expert compute and combine.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, k: int = 2, capacity_factor: float = 1.25,
                 group=None, seed: int = 0, algorithm=None):
        super().__init__()
        rank, p = ops.group_rank_and_size(group)
        if num_experts % p or not 1 <= k <= num_experts:
            raise ValueError(f"MoELayer: {num_experts} experts must split evenly over {p} ranks and "
                             f"1 ≤ k ≤ experts (k={k})")
        self.hidden, self.num_experts, self.k, self.factor = hidden, num_experts, k, capacity_factor
        self.group, self.algorithm = group, algorithm or pairwise_all_to_all
        self.local = num_experts // p
        self.first = rank * self.local
        self.router = torch.nn.Parameter(make_router(seed, hidden, num_experts))
        weights = [make_expert(seed, self.first + e, hidden, ffn) for e in range(self.local)]
        self.w1 = torch.nn.ParameterList([torch.nn.Parameter(w) for w, _ in weights])
        self.w2 = torch.nn.ParameterList([torch.nn.Parameter(w) for _, w in weights])
        self.register_buffer("logit_bias", torch.zeros(num_experts))
        self.stats: dict = {}
        self.timings: dict = {}

    def _sync(self, x):
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        return time.perf_counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden \
                or not x.is_floating_point():
            raise ValueError(f"MoELayer: expected floating [tokens, {self.hidden}] tokens, got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        p, El = self.num_experts // self.local, self.local
        t0 = self._sync(x)
        routing = route(x, self.router, self.k, capacity_for(x.shape[0], self.num_experts, self.k, self.factor),
                        self.logit_bias)
        order = dispatch_order(routing)
        send_rows = x.index_select(0, order // self.k)
        recv_counts = exchange_counts(routing.counts, self.group)               # [p, El]
        send_splits = [sum(routing.counts[q * El:(q + 1) * El]) for q in range(p)]
        recv_splits = recv_counts.sum(1).tolist()
        with trace.label("moe: dispatch"):
            received = all_to_all_autograd(send_rows, recv_splits, send_splits, self.group, self.algorithm)
        t1 = self._sync(x)
        pieces = received.split(recv_counts.reshape(-1).tolist())
        back = [None] * (p * El)
        for e in range(El):
            rows = torch.cat([pieces[s * El + e] for s in range(p)])
            y = expert_forward(rows, self.w1[e], self.w2[e])
            for s, part in enumerate(y.split(recv_counts[:, e].tolist())):
                back[s * El + e] = part
        back_rows = torch.cat(back) if back else received
        t2 = self._sync(x)
        with trace.label("moe: combine"):
            returned = all_to_all_autograd(back_rows, send_splits, recv_splits, self.group, self.algorithm)
        out = combine(returned, routing, order, x.shape[0])
        t3 = self._sync(x)
        self.stats = {"dropped": routing.dropped, "capacity": routing.capacity,
                      "received_per_expert": recv_counts.sum(0).tolist(), "received": sum(recv_splits)}
        self.timings = {"dispatch": t1 - t0, "experts": t2 - t1, "combine": t3 - t2}
        return out


def moe_reference(xs: list[torch.Tensor], routers: list[torch.Tensor], experts: list[tuple], k: int,
                  capacity_factor: float, bias=None) -> tuple[list[torch.Tensor], list[int]]:
    """The same MoE in one process: ``xs[r]`` and ``routers[r]`` are rank r's tokens and
    router copy, ``experts[e] = (w1, w2)``. Returns every rank's output and its dropped count."""
    p, E = len(xs), len(experts)
    routings, orders, sends = [], [], []
    for x, w in zip(xs, routers):
        r = route(x, w, k, capacity_for(x.shape[0], E, k, capacity_factor), bias)
        order = dispatch_order(r)
        routings.append(r)
        orders.append(order)
        sends.append(x.index_select(0, order // k).split(r.counts))       # per expert
    outputs_by = [[None] * E for _ in range(p)]
    for e in range(E):
        y = expert_forward(torch.cat([sends[s][e] for s in range(p)]), *experts[e])
        for s, part in enumerate(y.split([routings[s].counts[e] for s in range(p)])):
            outputs_by[s][e] = part
    outs = [combine(torch.cat(outputs_by[s]), routings[s], orders[s], xs[s].shape[0]) for s in range(p)]
    return outs, [r.dropped for r in routings]
