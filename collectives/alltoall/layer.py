"""The MoE layer: route, dispatch, the experts, combine -- flat or deduplicated across machines.

The pieces are :mod:`.moe`'s (routing, the flat dispatch and combine) and :mod:`.dedup`'s
(the dispatch that sends a token across to a machine once); balancing is :mod:`.balance`'s.
"""

from __future__ import annotations

import time

import torch

from ..core import ops
from .dedup import dedup_combine, dedup_dispatch
from .flat import pairwise_all_to_all
from .moe import Routing, capacity_for, flat_combine, flat_dispatch, make_expert, make_router, route, run_experts

__all__ = ["MoELayer", "PhaseTimer"]


class PhaseTimer:
    """Phase times that never stop the host: CUDA events recorded on the stream (on the CPU,
    ``time.perf_counter``). :meth:`close` ends a call; :meth:`result` reads the last one --
    on a GPU after waiting for its last event, which only whoever asks for the times pays."""

    def __init__(self):
        self.marks: list = []
        self.closed: tuple = ((), [])

    def mark(self, x: torch.Tensor) -> None:
        if x.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def close(self, names: tuple[str, ...]) -> None:
        self.closed, self.marks = (names, self.marks), []

    def result(self) -> dict:
        names, marks = self.closed
        if not marks:
            return {}
        if not isinstance(marks[0], float):
            marks[-1].synchronize()
            return {n: a.elapsed_time(b) / 1e3 for n, a, b in zip(names, marks, marks[1:])}
        return {n: b - a for n, a, b in zip(names, marks, marks[1:])}


class MoELayer(torch.nn.Module):
    """E experts spread over the group's ranks, E/p each; tokens dispatched by all-to-all.

    ``forward(x)`` takes this rank's [T, hidden] tokens and returns their [T, hidden]
    outputs. After each call ``stats`` holds the dropped choices, the rows received per
    local expert, and ``timings`` the seconds of dispatch, expert compute and combine
    (on a GPU from CUDA events, read when asked for: the only host synchronisation of a
    flat call is the counts', one copy of the sent and received counts together).

    ``capacity_factor=None``: dropless, every choice kept. ``dedup=(D, M)``: the
    node-deduplicating dispatch and combine (:mod:`.dedup`) on D ranks × M machines.
    ``node_limit``: each token's experts on at most that many machines (needs ``dedup``'s
    layout or ``machines``). ``aux_loss``: after a call, ``self.aux_loss`` holds the
    Switch/GShard load-balancing loss of its routing (:mod:`.balance`).
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, k: int = 2, capacity_factor: float | None = 1.25,
                 group=None, seed: int = 0, algorithm=None, dedup: tuple[int, int] | None = None,
                 node_limit: int | None = None, machines: int | None = None):
        super().__init__()
        rank, p = ops.group_rank_and_size(group)
        if num_experts % p or not 1 <= k <= num_experts:
            raise ValueError(f"MoELayer: {num_experts} experts must split evenly over {p} ranks and "
                             f"1 ≤ k ≤ experts (k={k})")
        if dedup is not None and (group is not None or dedup[0] * dedup[1] != p):
            raise ValueError(f"MoELayer: dedup=(D, M) needs the world and D·M = {p}, got {dedup}")
        self.hidden, self.num_experts, self.k, self.factor = hidden, num_experts, k, capacity_factor
        self.group, self.algorithm = group, algorithm or pairwise_all_to_all
        self.rank, self.dedup, self.node_limit = rank, dedup, node_limit
        self.machines = machines or (dedup[1] if dedup else 1)
        self.local = num_experts // p
        self.first = rank * self.local
        self.router = torch.nn.Parameter(make_router(seed, hidden, num_experts))
        weights = [make_expert(seed, self.first + e, hidden, ffn) for e in range(self.local)]
        self.w1 = torch.nn.ParameterList([torch.nn.Parameter(w) for w, _ in weights])
        self.w2 = torch.nn.ParameterList([torch.nn.Parameter(w) for _, w in weights])
        self.register_buffer("logit_bias", torch.zeros(num_experts))
        self.stats: dict = {}
        self.routing: Routing | None = None
        self._timer = PhaseTimer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden \
                or not x.is_floating_point():
            raise ValueError(f"MoELayer: expected floating [tokens, {self.hidden}] tokens, got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        timer = self._timer
        timer.mark(x)
        capacity = x.shape[0] * self.k if self.factor is None else \
            capacity_for(x.shape[0], self.num_experts, self.k, self.factor)
        routing = route(x, self.router, self.k, capacity, self.logit_bias,
                        node_limit=self.node_limit, machines=self.machines)
        if self.dedup is None:
            rows, counts, state = flat_dispatch(x, routing, self.num_experts, self.group, self.algorithm)
        else:
            rows, counts, state = dedup_dispatch(x, routing, self.num_experts, self.dedup, self.rank)
        timer.mark(x)
        y = run_experts(rows, counts, self.w1, self.w2)
        timer.mark(x)
        if self.dedup is None:
            out = flat_combine(y, routing, state, x.shape[0], self.group, self.algorithm)
        else:
            out = dedup_combine(y, state)
        timer.mark(x)
        self.routing = routing
        self.stats = {"dropped": routing.dropped, "capacity": routing.capacity,
                      "received_per_expert": counts, "received": sum(counts)}
        timer.close(("dispatch", "experts", "combine"))
        return out

    @property
    def timings(self) -> dict:
        """Seconds of the last call's dispatch, experts and combine (on a GPU: waits for it)."""
        return self._timer.result()
