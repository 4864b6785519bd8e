"""Mixture-of-experts routing, and its dispatch and combine written as all-to-alls.

Each rank holds T tokens and E/p of the E experts. A router scores every token against
every expert and keeps its top k (GShard's top-2; Switch's top-1 is k = 1). Each expert
takes at most C = ⌈capacity_factor · T · k / E⌉ tokens *from each rank*, first choices
first, in token order; what does not fit is dropped (its contribution is zero, and
counted). With C = T·k nothing is dropped (dropless, as DeepSeek-V3 trains). Then::

    route      logits = x · W_router; top k of logits + bias; gates = softmax at those k
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
from dataclasses import dataclass

import torch

from ..core import ops, trace
from .flat import pairwise_all_to_all

__all__ = ["AllToAll", "all_to_all_autograd", "Routing", "capacity_for", "route", "dispatch_order",
           "combine", "expert_forward", "moe_dispatch_combine", "make_router", "make_expert", "exchange_counts",
           "moe_reference", "flat_dispatch", "flat_combine", "run_experts", "limit_nodes", "assign_slots",
           "topk_dispatch_combine"]


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
    """A routing decision, on the tokens' device; its counts reach the host once (:meth:`host`)."""

    expert: torch.Tensor      # [T, k] expert of each choice
    gate: torch.Tensor        # [T, k] its weight (differentiable: the router learns through it)
    slot: torch.Tensor        # [T, k] position in the expert's buffer, −1 where dropped
    kept: torch.Tensor        # [E] kept rows per expert, on the device
    capacity: int
    _host: list | None = None

    def host(self, *more: torch.Tensor) -> list[list[int]]:
        """The kept rows per expert, then the dropped count, then each of ``more`` (integer
        tensors on the same device), read in one device-to-host copy: a layer's one wait."""
        parts = [self.kept, self.dropped_t.view(1), *(m.reshape(-1) for m in more)]
        flat = torch.cat(parts).tolist()
        out, at = [], 0
        for part in parts:
            out.append(flat[at:at + part.numel()])
            at += part.numel()
        self._host = out[:2]
        return out

    @property
    def dropped_t(self) -> torch.Tensor:
        return (self.slot < 0).sum().view(1).to(self.kept.dtype)

    @property
    def counts(self) -> list[int]:
        """Kept rows per expert, E of them (read from the device on first use)."""
        return (self._host or self.host())[0]

    @property
    def dropped(self) -> int:
        """(token, choice) pairs over capacity."""
        return (self._host or self.host())[1][0]


def capacity_for(tokens: int, num_experts: int, k: int, factor: float) -> int:
    """Rows an expert takes from one rank: ⌈factor · tokens · k / E⌉."""
    return math.ceil(factor * tokens * k / num_experts)


def route(x: torch.Tensor, weight: torch.Tensor, k: int, capacity: int, bias=None, *,
          node_limit: int | None = None, machines: int = 1) -> Routing:
    """Top-k routing with a capacity: first choices take their slots before second choices.

    ``bias`` (DeepSeek-V3's balancing bias) shifts which experts are chosen, not the gates:
    a token chooses by logits + bias; its gates are the unbiased softmax at those experts. ``node_limit``
    (DeepSeek-V3's node-limited routing): the experts split into ``machines`` equal groups,
    and a token chooses only among the ``node_limit`` groups with the highest sums of their
    best k/``machines`` scores. ``capacity = T·k`` keeps every choice (dropless)."""
    logits = x @ weight
    probs = torch.softmax(logits, dim=-1)
    E = weight.shape[1]
    with torch.no_grad():
        score = logits if bias is None else logits + bias
        if node_limit is not None and node_limit < machines:
            score = limit_nodes(score, k, node_limit, machines)
        expert = score.topk(k, dim=-1).indices
    gate = probs.gather(1, expert)
    return assign_slots(expert, gate, E, capacity)


@torch.no_grad()
def assign_slots(expert: torch.Tensor, gate: torch.Tensor, num_experts: int, capacity: int) -> Routing:
    """Each choice's place in its expert's buffer: every token's first choice in token order,
    then every second choice, ...; a choice past ``capacity`` is dropped (slot −1)."""
    E, k = num_experts, expert.shape[1]
    taken = torch.zeros(E, dtype=torch.int64, device=expert.device)
    slot = torch.empty_like(expert)
    for j in range(k):                # no one_hot, no boolean indexing: nothing here waits for the GPU
        onehot = torch.zeros(expert.shape[0], E, dtype=torch.int64, device=expert.device)
        onehot.scatter_(1, expert[:, j:j + 1], 1)
        position = torch.cumsum(onehot, 0) - 1 + taken
        slot[:, j] = position.gather(1, expert[:, j:j + 1]).squeeze(1)
        taken += onehot.sum(0)
    slot = torch.where(slot >= capacity, -1, slot)
    return Routing(expert, gate, slot, torch.clamp(taken, max=capacity), capacity)


def limit_nodes(score: torch.Tensor, k: int, node_limit: int, machines: int) -> torch.Tensor:
    """``score`` with every expert outside each token's best ``node_limit`` machines set to −inf;
    a machine's rank is the sum of its best ⌈k/machines⌉ scores."""
    T, E = score.shape
    per = score.view(T, machines, E // machines)
    top = per.topk(min(max(1, -(-k // machines)), E // machines), dim=-1).values.sum(-1)     # [T, machines]
    keep = torch.zeros(T, machines, dtype=torch.bool, device=score.device)
    keep.scatter_(1, top.topk(node_limit, dim=-1).indices, True)
    return score.masked_fill(~keep.repeat_interleave(E // machines, dim=1), float("-inf"))


def dispatch_order(routing: Routing) -> torch.Tensor:
    """Positions (t·k + j) of the kept choices, sorted by expert then slot: the send order.
    Dropped choices sort last and are cut off at the kept count (known on the host)."""
    flat_slot = routing.slot.reshape(-1)
    E = routing.kept.numel()
    cap = max(routing.capacity, 1)
    key = torch.where(flat_slot >= 0, routing.expert.reshape(-1) * cap + flat_slot, E * cap)
    return torch.argsort(key, stable=True)[:sum(routing.counts)]


def combine(returned: torch.Tensor, routing: Routing, order: torch.Tensor, tokens: int) -> torch.Tensor:
    """Un-permute: out[t] = Σ_j gate[t, j] · (the row choice j of token t came back with, or 0)."""
    k = routing.expert.shape[1]
    H = returned.shape[1]
    ys = returned.new_zeros((tokens * k, H)).index_copy(0, order, returned).view(tokens, k, H)
    out = None
    for j in range(k):
        term = routing.gate[:, j:j + 1] * ys[:, j]
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


def exchange_counts(counts, group=None) -> torch.Tensor:
    """[p, E/p]: row s holds how many rows rank s sends to each of this rank's experts.
    ``counts``: a list (the result is on the CPU) or a tensor (the result stays on its device:
    no wait for the host)."""
    rank, p = ops.group_rank_and_size(group)
    on_device = isinstance(counts, torch.Tensor)
    device = counts.device if on_device else ops.rank_device()
    send = counts.to(device, torch.int64) if on_device else torch.tensor(counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    with trace.label("moe: counts per expert"):
        pairwise_all_to_all(recv, send, group=group)
    recv = recv.view(p, send.numel() // p)
    return recv if on_device else recv.cpu()


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


@dataclass
class FlatState:
    """What :func:`flat_combine` needs from :func:`flat_dispatch`."""

    order: torch.Tensor         # the kept choices (t·k + j) in send order
    send: list[int]
    recv: list[int]
    recv_counts: torch.Tensor   # [p, E/p] rows from each source for each local expert


def flat_dispatch(x: torch.Tensor, routing: Routing, num_experts: int, group=None, algorithm=None):
    """One row per kept (token, choice) to its expert's rank: the counts, then the rows.
    Returns this rank's experts' rows (expert by expert, each in source order, then slot),
    the rows per local expert, and the state :func:`flat_combine` needs."""
    rank, p = ops.group_rank_and_size(group)
    El = num_experts // p
    k = routing.expert.shape[1]
    recv_device = exchange_counts(routing.kept, group)                            # [p, El], on the device
    recv_counts = torch.tensor(routing.host(recv_device)[2], dtype=torch.int64).view(p, El)   # the one wait
    order = dispatch_order(routing)
    send = [sum(routing.counts[q * El:(q + 1) * El]) for q in range(p)]
    recv = recv_counts.sum(1).tolist()
    with trace.label("moe: dispatch"):
        received = all_to_all_autograd(x.index_select(0, order // k), recv, send, group, algorithm)
    pieces = received.split(recv_counts.reshape(-1).tolist())
    batch = [pieces[s * El + e] for e in range(El) for s in range(p)]
    rows = torch.cat(batch) if batch else received
    return rows, recv_counts.sum(0).tolist(), FlatState(order, send, recv, recv_counts)


def flat_combine(y: torch.Tensor, routing: Routing, state: FlatState, tokens: int, group=None,
                 algorithm=None) -> torch.Tensor:
    """The experts' outputs (in :func:`flat_dispatch`'s batch order) back, then
    out[t] = Σ_j gate[t, j] · y_j[t], choice by choice."""
    p, El = state.recv_counts.shape
    parts = y.split(state.recv_counts.t().reshape(-1).tolist())                 # [expert][source]
    back = [parts[e * p + s] for s in range(p) for e in range(El)]
    with trace.label("moe: combine"):
        returned = all_to_all_autograd(torch.cat(back) if back else y, state.send, state.recv, group, algorithm)
    return combine(returned, routing, state.order, tokens)


def run_experts(rows: torch.Tensor, counts: list[int], w1, w2) -> torch.Tensor:
    """Each local expert once on its rows (``rows`` expert by expert, ``counts`` of each)."""
    outs = [expert_forward(part, a, b) for part, a, b in zip(rows.split(counts), w1, w2)]
    return torch.cat(outs) if outs else rows


def moe_reference(xs: list[torch.Tensor], routers: list[torch.Tensor], experts: list[tuple], k: int,
                  capacity_factor: float | None, bias=None, *, node_limit=None, machines: int = 1,
                  routings_out: list | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """The same MoE in one process: ``xs[r]`` and ``routers[r]`` are rank r's tokens and
    router copy, ``experts[e] = (w1, w2)``. Returns every rank's output and its dropped count
    (``routings_out``, if given, receives every rank's :class:`Routing`)."""
    p, E = len(xs), len(experts)
    routings, orders, sends = [], [], []
    for x, w in zip(xs, routers):
        capacity = x.shape[0] * k if capacity_factor is None else capacity_for(x.shape[0], E, k, capacity_factor)
        r = route(x, w, k, capacity, bias, node_limit=node_limit, machines=machines)
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
    if routings_out is not None:
        routings_out.extend(routings)
    return outs, [r.dropped for r in routings]


def topk_dispatch_combine(x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor, num_experts: int,
                          capacity: int, expert_fn, group=None) -> tuple[torch.Tensor, int]:
    """Top-k dispatch and combine with a capacity, given the routing (task 6's contract).

    ``experts[t, j]``/``gates[t, j]``: choice j of token t and its weight. Each expert takes at
    most ``capacity`` rows from this rank, first choices before second choices, in token order
    (:func:`assign_slots`); the rest are dropped. Expert e's rank calls ``expert_fn(e, rows)``
    once, on its rows from every source in source order (slot order within a source).
    Returns ``(out, dropped)``: out[t] = Σ_j gates[t, j]·y_j[t] over the kept choices."""
    rank, p = ops.group_rank_and_size(group)
    if num_experts % p or experts.shape != gates.shape or experts.shape[0] != x.shape[0]:
        raise ValueError(f"topk_dispatch_combine: rank {rank}: experts and gates must be [tokens, k] and "
                         f"{num_experts} experts split evenly over {p} ranks")
    routing = assign_slots(experts, gates, num_experts, capacity)
    rows, counts, state = flat_dispatch(x, routing, num_experts, group)
    first = rank * (num_experts // p)
    outs = [expert_fn(first + e, part) for e, part in enumerate(rows.split(counts))]
    y = torch.cat(outs) if outs else rows
    return flat_combine(y, routing, state, x.shape[0], group), routing.dropped
