"""Lesson 14's graded tasks: the forward pass with its shape agreed once, a GPipe step, 1F1B's
order, any order of F, B and W run, and ZB-H1's order.

Every rank's stage (integer weights, ReLU, float64: every sum exact in any order) and the
micro-batches and targets are drawn from the ranks' secrets; the judge rebuilds them and runs
the whole model itself, so it knows every activation and every gradient each message must
carry. Each rank is held to messages only (no library collective), and to exactly the
messages the design sends and receives -- the shape once per link, one activation forward
and one gradient back per micro-batch, each carrying that micro-batch's values (its
fingerprint, read from the tap), nothing else either way. The stage's gradients, the losses
and the stage's record of its steps are read back; the order of the sends in the tap must
agree with that record. The orders of tasks 3 and 5 are judged in :mod:`.lesson14_orders`.
"""

from __future__ import annotations

import torch

from . import P2P, GradedTask
from .allreduce import messages_only
from .lesson14_orders import judge_1f1b, judge_zb_h1
from .tap import fingerprint
from .world import Grading, Probe, Verdict, outcome_problem

HERE = __name__
SIZES = (2, 4)
M, ROWS, WIDTH, LAYERS = 4, 3, 4, 2
SHAPE_SLOTS = 4


# ---- the model and its data, drawn from the secrets --------------------------------------

def _values(seed: int, shape, low: int, high: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randint(low, high, shape, generator=gen).to(torch.float64)


def _layers(seed: int) -> list:
    # biases of 1..3 keep most units alive through the ReLUs: the messages carry real values
    return [(_values(seed + 2 * k, (WIDTH, WIDTH), -1, 2), _values(seed + 2 * k + 1, (WIDTH,), 1, 4))
            for k in range(LAYERS)]


def _batches(seed: int) -> list[torch.Tensor]:
    return [_values(seed + i, (ROWS, WIDTH), -3, 4) for i in range(M)]


def _probe_inputs(probe: Probe, key: str):
    from ....pipeline import Stage
    p, r = probe.size, probe.rank
    stage = Stage(_layers(probe.seed(key)), "relu")
    xs = _batches(probe.seed(key + "/x")) if r == 0 else [None] * M
    ts = _batches(probe.seed(key + "/t")) if r == p - 1 else [None] * M
    return stage, xs, ts


def _shape_print() -> float:
    return fingerprint(torch.tensor([2, ROWS, WIDTH, 0], dtype=torch.int64))


class Expected:
    """The whole model run in the judge: per rank its inputs, outputs, input gradients and
    weight gradients, and the losses."""

    def __init__(self, run, key: str, backward: bool):
        from ....pipeline import Stage
        p = run.size
        self.stages = [Stage(_layers(run.seed(r, key)), "relu") for r in range(p)]
        xs, ts = _batches(run.seed(0, key + "/x")), _batches(run.seed(p - 1, key + "/t"))
        self.inputs = [[None] * M for _ in range(p)]
        self.outputs = [[None] * M for _ in range(p)]
        self.grad_in = [[None] * M for _ in range(p)]
        self.losses = []
        for i in range(M):
            x = xs[i]
            for r, stage in enumerate(self.stages):
                self.inputs[r][i] = x
                x = self.outputs[r][i] = stage.forward(x, i)
            self.losses.append(self.stages[-1].loss_value(x, ts[i], M))
        if backward:
            for i in range(M):
                g = self.stages[-1].loss_grad(self.outputs[-1][i], ts[i], M)
                for r in range(p - 1, -1, -1):
                    g = self.grad_in[r][i] = self.stages[r].backward(g, i)


# ---- the messages -----------------------------------------------------------------------

def _which(fp: float, candidates: list) -> int | None:
    for i, t in enumerate(candidates):
        if t is not None and fingerprint(t) == fp:
            return i
    return None


def _carries(what: str, to: int, msgs, expected: list, inputs: list | None) -> str | None:
    """Each message in ``msgs`` carries micro-batch i's ``what`` (``expected[i]``), in order."""
    if len(msgs) != M:
        return f"sent {len(msgs)} {what}s to rank {to}, expected one per micro-batch ({M})"
    for i, call in enumerate(msgs):
        if call.fingerprint == fingerprint(expected[i]):
            continue
        if inputs is not None and _which(call.fingerprint, inputs) == i:
            return (f"the {what} of micro-batch {i} sent to rank {to} is this stage's input, not its output: "
                    "send what stage.forward returned")
        other = _which(call.fingerprint, expected)
        if other is not None:
            return (f"message {i} to rank {to} carries micro-batch {other}'s {what}: micro-batches go in "
                    "order, 0 to m − 1")
        return f"message {i} to rank {to} does not carry micro-batch {i}'s {what}"
    return None


def links_problem(r: int, p: int, calls, exp: Expected, backward: bool) -> str | None:
    """The sends and receives of rank r, held to the design both ways."""
    problem = messages_only(None, p, r, calls)
    if problem:
        return problem
    sends = [c for c in calls if c.kind == "send"]
    recvs = [c for c in calls if c.kind == "recv"]
    neighbours = {r - 1, r + 1} & set(range(p))
    stray = sorted({c.peer for c in sends + recvs} - neighbours)
    if stray:
        return f"exchanged messages with ranks {stray}: a stage talks only to its neighbours {sorted(neighbours)}"
    if r < p - 1:
        to_next = [c for c in sends if c.peer == r + 1]
        shapes = [c for c in to_next if c.numel == SHAPE_SLOTS and c.fingerprint == _shape_print()]
        if len(shapes) != 1:
            return (f"sent the shape {len(shapes)} times to rank {r + 1}: it is agreed once per link, before the "
                    "first activation")
        if to_next[0] is not shapes[0]:
            return f"the first message to rank {r + 1} is not the shape: it must come before the first activation"
        problem = _carries("activation", r + 1, to_next[1:], exp.outputs[r], exp.inputs[r])
        if problem:
            return problem
    if r > 0 and backward:
        problem = _carries("gradient", r - 1, [c for c in sends if c.peer == r - 1], exp.grad_in[r], None)
        if problem:
            return problem
    elif r > 0 and any(c.peer == r - 1 for c in sends):
        return f"sent to rank {r - 1}: the forward pass sends only to the next stage"
    want = {r - 1: 1 + M} if r > 0 else {}
    if r < p - 1 and backward:
        want[r + 1] = M
    got = {q: sum(1 for c in recvs if c.peer == q) for q in neighbours}
    for q, n in want.items():
        if got.get(q, 0) != n:
            return f"received {got.get(q, 0)} messages from rank {q}, expected {n}"
    extra = [q for q in got if got[q] and q not in want]
    if extra:
        return f"received from rank {extra[0]}, which sends this stage nothing"
    return None


def _send_order(r: int, p: int, calls) -> list[tuple[str, int]]:
    """The sends after the shape as ("F" | "B", position): which step each belongs to."""
    out, seen = [], {"F": 0, "B": 0}
    for c in calls:
        if c.kind != "send" or c.numel == SHAPE_SLOTS:
            continue
        kind = "F" if c.peer == r + 1 else "B"
        out.append((kind, seen[kind]))
        seen[kind] += 1
    return out


# ---- tasks 1, 2 and 4: the probes and the judges ---------------------------------------------

def probe_steps(probe: Probe, name: str, keys: list[str], orders: dict | None) -> dict:
    fn = probe.student(name)
    out = {}
    for key in keys:
        stage, xs, ts = _probe_inputs(probe, key)
        args = (stage, xs) if name == "pipeline_forward" else (stage, xs, ts)
        if orders is not None:
            args = (stage, [tuple(s) for s in orders[key][probe.rank]], xs, ts)
        outcome = probe.call(key, fn, *args)
        value = outcome.value
        if isinstance(value, list) and all(type(v) is torch.Tensor for v in value):
            value = [v.detach().clone() for v in value]
        elif isinstance(value, list) and all(isinstance(v, float) for v in value):
            value = list(value)
        else:
            value = "something else" if value is not None else None
        outcome.value = None
        grads = [(dw.clone(), db.clone()) for dw, db in stage.grads]
        out[key] = (outcome, value, grads, list(stage.log))
    return out


def _grads_problem(r: int, exp: Expected, grads, split: bool) -> str | None:
    want = exp.stages[r].grads
    flat_want = torch.cat([t.reshape(-1) for pair in want for t in pair])
    flat_got = torch.cat([t.reshape(-1) for pair in grads for t in pair])
    if torch.equal(flat_got, flat_want):
        return None
    if torch.equal(flat_got, 2 * flat_want):
        return ("every weight gradient is twice one process's: a micro-batch's gradient was accumulated twice"
                + (" (a B whose W is listed must leave the weight gradient to W)" if split else ""))
    if torch.equal(flat_got, M * flat_want):
        return (f"every weight gradient is {M}× one process's: the loss gradient was not divided by the m "
                "micro-batches (use stage.loss_grad)")
    return "the stage's weight gradients differ from one process's"


def _expected_log(order, split_mbs) -> list[tuple[str, int]]:
    return [("BW" if k == "B" and mb not in split_mbs else k, mb) for k, mb in order]


def _judge_steps(grading: Grading, name: str, cases: dict, backward: bool) -> Verdict:
    """``cases``: key -> each rank's order of (kind, mb) for p ranks, built per world size."""
    verdict = Verdict()
    for size in grading.sizes(*SIZES):
        orders = {key: build(size) for key, build in cases.items()}
        run = grading.world(f"{HERE}:probe_steps", size, name, list(cases),
                            orders if name == "run_schedule" else None)
        for key in cases:
            exp = Expected(run, key, backward)
            for r in range(size):
                where = f"{name}, world of {size}, rank {r}, case {key}"
                outcome, value, grads, log = run.results[r][key]
                if outcome_problem(where, outcome, verdict):
                    continue
                problem = _rank_problem(name, r, size, run.of(r, key), exp, orders[key], value, grads, log, backward)
                verdict.add(problem and f"{where}: {problem}")
        if verdict.not_written or verdict.problems:
            break
    return verdict


def _rank_problem(name, r, p, calls, exp: Expected, orders, value, grads, log, backward) -> str | None:
    if not backward:
        if not isinstance(value, list) or len(value) != M:
            return f"returned {value if value is None else 'something'} other than a list of {M} tensors"
        for i, (got, want) in enumerate(zip(value, exp.outputs[r])):
            if got.shape != want.shape or not torch.equal(got, want):
                return f"output {i} is not stage {r}'s output for micro-batch {i}"
        return links_problem(r, p, calls, exp, False)
    order = orders[r]
    split = {mb for k, mb in order if k == "W"}
    want_log = _expected_log(order, split)
    if log != want_log:
        backs = [mb for k, mb in log if k in ("B", "BW")]
        if name == "gpipe_step" and sorted(backs) == backs[::-1] and len(backs) > 1:
            return (f"ran the backward on micro-batches {backs}: GPipe's backward takes them in the forward's "
                    f"order, {sorted(backs)}, the order one process adds their gradients in")
        if any(k == "BW" for k, _ in log) and split:
            return ("ran the full backward (stage.backward) at a B whose W the schedule lists later: B must be "
                    "the input gradient alone, W the weight gradient")
        shown = " ".join(f"{k}{mb}" for k, mb in log)
        return f"ran the stage's steps as [{shown}], the schedule says [{' '.join(f'{k}{mb}' for k, mb in want_log)}]"
    problem = _grads_problem(r, exp, grads, bool(split)) or links_problem(r, p, calls, exp, True)
    if problem:
        return problem
    sent = _send_order(r, p, calls)
    if sent != _positions(order, r, p):
        return "its messages went out in another order than its steps ran: the record of steps is not what it did"
    want_losses = exp.losses if r == p - 1 else []
    if value != want_losses:
        return f"returned losses {value}, expected {want_losses}" + (" (the last rank's)" if r == p - 1 else "")
    return None


def _positions(order, r: int, p: int) -> list[tuple[str, int]]:
    out, seen = [], {"F": 0, "B": 0}
    for k, _ in order:
        if (k == "F" and r < p - 1) or (k == "B" and r > 0):
            out.append((k, seen[k]))
            seen[k] += 1
    return out


def _gpipe(p: int) -> list:
    return [[("F", i) for i in range(M)] + [("B", i) for i in range(M)] for _ in range(p)]


def _from(fn):
    return lambda p: [fn(p, M, r) for r in range(p)]


def _schedule_cases() -> dict:
    from ....pipeline import one_f_one_b_order, zb_h1_order
    return {"1F1B": _from(one_f_one_b_order), "ZB-H1": _from(zb_h1_order), "GPipe": _gpipe}


TASKS = [
    GradedTask(14, 1, "forward through the stages", 3,
               lambda g: _judge_steps(g, "pipeline_forward", {"forward": _gpipe}, False), ("pipeline_forward",),
               routes=P2P),
    GradedTask(14, 2, "GPipe step", 4, lambda g: _judge_steps(g, "gpipe_step", {"GPipe": _gpipe}, True),
               ("gpipe_step",), routes=P2P),
    GradedTask(14, 3, "1F1B's order", 3, judge_1f1b, ("one_f_one_b_order",), routes=P2P),
    GradedTask(14, 4, "any schedule run", 5, lambda g: _judge_steps(g, "run_schedule", _schedule_cases(), True),
               ("run_schedule",), routes=P2P),
    GradedTask(14, 5, "ZB-H1's order", 4, judge_zb_h1, ("zb_h1_order",), routes=P2P),
]
