"""Lesson 11's tasks 6 and 7: a top-k dispatch with a capacity, and balancing the experts.

Task 6 hands each rank its tokens, their k experts and gates (multiples of 1/8, so every
sum the judge expects is exact); the judge works out for itself which choices fit --
first choices of every token, in token order, then second choices, at most ``capacity``
rows per expert from each rank -- and holds the student to the batch each expert was
handed (every kept row, from every rank in source order, slot order within a source, in
one call), to the dropped count and to out[t] = Σ_j gate·y over the kept choices.

Task 7 hands each rank its choices and router probabilities and a bias, and holds it to
the load-balancing loss of its own tokens and to the bias moved by γ·sign(mean − load)
with the loads summed over every rank (which needs messages: no library collective).
"""

from __future__ import annotations

import torch

from . import P2P, GradedTask
from .allreduce import messages_only
from .world import Grading, Probe, Verdict, outcome_problem, same

HERE = __name__
SIZES = (1, 2, 3, 4)
HIDDEN = 3


def values(seed: int, numel: int, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randint(-100, 100, (numel,), generator=gen).to(dtype)


def own_tensor(value) -> torch.Tensor | None:
    """A copy of ``value`` if it is a plain tensor (no subclass of the student's), else None."""
    if type(value) is not torch.Tensor:
        return None
    return value.detach().cpu().clone(memory_format=torch.contiguous_format)


# ---- task 6: top-k with a capacity ------------------------------------------------------

TOPK_CASES = (("top-2, capacity 2", 2, 9, 2), ("top-3, nothing dropped", 3, 6, None),
              ("top-2, no tokens on odd ranks", 2, 5, 1))


def _topk_input(key: str, p: int, s: int, seed: int):
    _, k, tokens, capacity = next(c for c in TOPK_CASES if c[0] == key)
    if "odd ranks" in key and s % 2:
        tokens = 0
    E = 2 * p if p > 1 else 3               # two experts a rank; three alone, for top-3
    x = values(seed, tokens * HIDDEN, torch.float32).view(tokens, HIDDEN)
    scores = values(seed ^ 0x33, tokens * E, torch.float32).view(tokens, E) + torch.arange(E) * 1e-3
    experts = scores.topk(k, dim=1).indices if tokens else torch.zeros(0, k, dtype=torch.int64)
    gates = (values(seed ^ 0x44, tokens * k, torch.float32).view(tokens, k) % 8 + 1) / 8
    return x, experts, gates, E, capacity if capacity is not None else tokens * k + 1


def expert_value(e: int, rows: torch.Tensor) -> torch.Tensor:
    return rows * (e + 2) - e


def kept(experts: torch.Tensor, E: int, capacity: int) -> torch.Tensor:
    """[T, k]: each choice's slot in its expert's buffer, −1 where it does not fit."""
    T, k = experts.shape
    slot = torch.full((T, k), -1, dtype=torch.int64)
    taken = [0] * E
    for j in range(k):
        for t in range(T):
            e = int(experts[t, j])
            if taken[e] < capacity:
                slot[t, j] = taken[e]
            taken[e] += 1
    return slot


def probe_topk(probe: Probe) -> dict:
    fn = probe.student("topk_dispatch_combine")
    out = {}
    for key, *_ in TOPK_CASES:
        x, experts, gates, E, capacity = _topk_input(key, probe.size, probe.rank, probe.seed(key))
        seen = []

        def expert_fn(e, rows, seen=seen):
            seen.append((int(e), own_tensor(rows)))
            return expert_value(int(e), rows)

        outcome = probe.call(key, fn, x.clone(), experts.clone(), gates.clone(), E, capacity, expert_fn)
        got = dropped = None
        if isinstance(outcome.value, tuple) and len(outcome.value) == 2:
            got = own_tensor(outcome.value[0])
            dropped = int(outcome.value[1]) if isinstance(outcome.value[1], int) else None
        outcome.value = None
        out[key] = (outcome, got, dropped, seen)
    return out


def _topk_problem(made, r: int, p: int, got, dropped, seen) -> str | None:
    x, experts, gates, E, capacity = made[r]
    slots = [kept(m[1], E, capacity) for m in made]
    expected = x.new_zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            if slots[r][t, j] >= 0:
                expected[t] += gates[t, j] * expert_value(int(experts[t, j]), x[t])
    want_dropped = int((slots[r] < 0).sum())
    local = range(r * (E // p), (r + 1) * (E // p))
    for e, rows in seen:
        if e not in local or rows is None:
            return f"called expert {e} on rank {r}, which holds experts {list(local)}, or handed it no plain tensor"
    for e in local:
        calls = [rows for ee, rows in seen if ee == e]
        parts = []
        for m, slot in zip(made, slots):
            mine = (m[1] == e) & (slot >= 0)
            order = torch.argsort(slot[mine])
            parts.append(m[0][mine.nonzero()[:, 0]][order])
        want = torch.cat(parts)
        if not calls and want.shape[0] == 0:
            continue
        if len(calls) != 1:
            return f"called expert {e} {len(calls)} times, expected once with all its rows"
        if calls[0].shape[0] != want.shape[0]:
            return (f"handed expert {e} {calls[0].shape[0]} rows, expected {want.shape[0]}: at most capacity "
                    f"{capacity} from each rank, the choices past it dropped")
        if same(want, calls[0]):
            return (f"expert {e} was handed other rows than the ones that fit: every token's first choice, in "
                    f"token order, takes its slot before any second choice (capacity {capacity} per rank), "
                    "rows from every rank in source order")
    if dropped != want_dropped:
        return f"returned dropped = {dropped}, expected {want_dropped} (choices past capacity {capacity})"
    if got is None:
        return "returned something other than (a plain torch.Tensor, an int)"
    problem = same(expected, got)
    return problem and (f"{problem}: out[t] is Σ_j gates[t, j] · (expert output of choice j) over the kept "
                        "choices")


def _topk_traffic(made, r: int, p: int, calls) -> str | None:
    """No fewer elements sent than the kept rows for other ranks' experts and the results owed back."""
    E = made[0][3]
    home = lambda e: int(e) // (E // p)                                                  # noqa: E731
    rows = 0
    for s, m in enumerate(made):
        slot = kept(m[1], E, m[4])
        for e, fits in zip(m[1].reshape(-1), slot.reshape(-1)):
            if fits >= 0 and ((s == r and home(e) != r) or (s != r and home(e) == r)):
                rows += 1
    sent = sum(c.numel for c in calls if c.kind == "send")
    if sent < rows * HIDDEN:
        return (f"sent {sent} elements, but the kept rows for other ranks' experts and the results owed back "
                f"come to {rows * HIDDEN}: the rows travel as messages")
    return None


def _judge_topk(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(*SIZES):
        run = grading.world(f"{HERE}:probe_topk", size)
        for key, *_ in TOPK_CASES:
            made = [_topk_input(key, size, s, run.seed(s, key)) for s in range(size)]
            for r in range(size):
                where = f"topk_dispatch_combine, world of {size}, rank {r}, case {key}"
                outcome, got, dropped, seen = run.results[r][key]
                if outcome_problem(where, outcome, verdict):
                    continue
                problem = (_topk_problem(made, r, size, got, dropped, seen)
                           or messages_only(None, size, r, run.of(r, key))
                           or _topk_traffic(made, r, size, run.of(r, key)))
                verdict.add(problem and f"{where}: {problem}")
        if verdict.not_written or verdict.problems:
            break
    return verdict


# ---- task 7: balancing -------------------------------------------------------------------

BALANCE_CASES = ("skewed loads", "loads again")
GAMMA = 0.125


def _balance_input(p: int, s: int, seed: int):
    E, T, k = 4, 6, 2
    skew = torch.tensor([3.0, 2.0, 1.0, 0.0]) * (1 if s % 2 == 0 else -1)
    scores = values(seed, T * E, torch.float32).view(T, E) / 50 + skew
    experts = scores.topk(k, dim=1).indices
    probs = torch.softmax(scores, dim=1)
    bias = (values(seed ^ 0x55, E, torch.float32) % 8) / 4
    return experts, probs, bias


def probe_balance(probe: Probe) -> dict:
    fn = probe.student("balance_experts")
    out = {}
    for key in BALANCE_CASES:
        experts, probs, bias = _balance_input(probe.size, probe.rank, probe.seed(key))
        moved = bias.clone()
        outcome = probe.call(key, fn, moved, experts.clone(), probs.clone(), GAMMA)
        loss = outcome.value
        loss = float(loss) if isinstance(loss, float) or type(loss) is torch.Tensor and loss.numel() == 1 else None
        outcome.value = None
        out[key] = (outcome, loss, own_tensor(moved))
    return out


def _balance_problem(made, r: int, loss, bias) -> str | None:
    experts, probs, bias0 = made[r]
    E = probs.shape[1]
    f = torch.bincount(experts.reshape(-1), minlength=E).double() / experts.numel()
    want_loss = float(E * (f * probs.double().mean(0)).sum())
    if loss is None or abs(loss - want_loss) > 1e-5 * max(1.0, abs(want_loss)):
        return (f"returned loss {loss}, expected {want_loss:.6f} = E · Σ_e f_e · P_e, f_e the share of this rank's "
                "T·k choices that went to e, P_e the mean router probability of e")
    load = sum(torch.bincount(m[0].reshape(-1), minlength=E) for m in made)
    want = bias0 + GAMMA * torch.sign(load.double().mean() - load.double()).float()
    if bias is None or not torch.equal(bias, want):
        got = "not a tensor" if bias is None else [round(float(v), 4) for v in bias - bias0]
        return (f"moved the bias by {got}, expected {[round(float(v), 4) for v in want - bias0]}: γ·sign(mean − "
                f"load_e), the loads {load.tolist()} summed over every rank (down for overloaded experts)")
    return None


def _judge_balance(grading: Grading) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(*SIZES):
        run = grading.world(f"{HERE}:probe_balance", size)
        for key in BALANCE_CASES:
            made = [_balance_input(size, s, run.seed(s, key)) for s in range(size)]
            for r in range(size):
                where = f"balance_experts, world of {size}, rank {r}, case {key}"
                outcome, loss, bias = run.results[r][key]
                if outcome_problem(where, outcome, verdict):
                    continue
                sent = sum(c.numel for c in run.of(r, key) if c.kind == "send")
                problem = (_balance_problem(made, r, loss, bias) or messages_only(None, size, r, run.of(r, key))
                           or (f"sent {sent} elements: every rank's loads reach every rank only as messages"
                               if size > 1 and sent < 4 else None))
                verdict.add(problem and f"{where}: {problem}")
        if verdict.not_written or verdict.problems:
            break
    return verdict


TASKS = [
    GradedTask(11, 6, "top-k dispatch with a capacity", 5, _judge_topk, ("topk_dispatch_combine",), routes=P2P),
    GradedTask(11, 7, "balancing the experts", 3, _judge_balance, ("balance_experts",), routes=P2P),
]
