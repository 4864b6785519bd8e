"""Lesson 2's graded tasks: the collectives built from send and recv.

Each function runs, in one world of 4 ranks, every root, six dtypes, sizes 0, 1 and odd,
two subgroups whose group ranks are not their global ranks, and strided and transposed
views, on inputs drawn from the ranks' secrets. The judge recomputes every result with
plain tensor arithmetic and holds every call's messages, read from the tap, to the
algorithm: who sends to whom, how many, how large, and that each message carried the
data it should (the root's tensor, piece i for rank i, the sender's own tensor: by the
tap's fingerprint). No library collective anywhere. Then bad input, each rank alone in a
group of its own, so that a rank that refuses leaves nobody waiting.
"""

from __future__ import annotations

import torch

from ....core.ops import ReduceOp
from ... import verify
from ...verify import ALL_DTYPES, SENTINEL, Case
from . import P2P, GradedTask
from .allreduce import expected_output, judge_cases, judge_expanded, messages_only, probe_cases
from .lesson01_messages import holds, refused
from .tap import Call
from .world import Grading, Probe, Verdict, outcome_problem, same, seed_of

HERE = __name__
ODD = 1001               # not divisible by 2, 3 or 4; 7 * 11 * 13, so it also transposes
ROOTED = ("broadcast", "tree_broadcast", "reduce", "scatter", "gather")
NOT_WRITTEN = "not written"
REDUCE_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)


# ---- the cases, and their inputs drawn from secrets -----------------------------------------

def cases_of(name: str, p: int) -> list[tuple]:
    """(numel, dtype, op, root, group, layout): every root (global ranks) with every dtype,
    sizes 0 and 1, a subgroup of the last p − 1 ranks and a pair {0, p − 1}, views; reduce
    also every op with every dtype, on the last rank as root (a covering set: each root
    meets each dtype, each op each dtype). all_gather has no root (None)."""
    rooted = name in ROOTED
    cases = []
    if name == "reduce":
        cases += [(ODD, dtype, op, p - 1, None, "contiguous") for dtype in ALL_DTYPES for op in REDUCE_OPS
                  if op != ReduceOp.SUM and (op != ReduceOp.AVG or dtype.is_floating_point)]
    for root in range(p) if rooted else [None]:
        cases += [(ODD, dtype, ReduceOp.SUM, root, None, "contiguous") for dtype in ALL_DTYPES]
        for n in (0, 1):
            cases += [(n, torch.float32, ReduceOp.SUM, root, None, "contiguous"),
                      (n, torch.int64, ReduceOp.MAX, root, None, "contiguous")]
    if p >= 3:
        last = tuple(range(1, p))
        for root in last if rooted else [None]:
            cases += [(7, torch.float32, ReduceOp.SUM, root, last, "contiguous"),
                      (7, torch.int32, ReduceOp.PRODUCT, root, last, "contiguous")]
        pair = (0, p - 1)
        cases += [(ODD, torch.float64, ReduceOp.MAX, root, pair, "contiguous") for root in (pair if rooted else [None])]
    for root in sorted({0, min(2, p - 1)}) if rooted else [None]:
        cases += [(ODD, torch.float32, ReduceOp.SUM, root, None, "strided"),
                  (ODD, torch.int64, ReduceOp.MIN, root, None, "transposed")]
    return cases


def key_of(case: tuple) -> str:
    numel, dtype, op, root, group, layout = case
    return (f"n={numel} {str(dtype)[6:]} {verify.op_name(op)}" + ("" if root is None else f" root {root}")
            + ("" if layout == "contiguous" else f" {layout}") + ("" if group is None else f" group {group}"))


def values_of(case: tuple, group_rank: int, secret: int, what: str = "tensor") -> torch.Tensor:
    """Group rank ``group_rank``'s ``what`` for ``case`` (integer-valued: exact whatever the order)."""
    numel, dtype, op = case[:3]
    return verify.make_values(Case(numel, dtype, op), group_rank, seed_of(secret, f"{what} {key_of(case)}"))


def laid_out(values: torch.Tensor, layout: str):
    """(tensor, the buffer it lives in or None): ``values`` contiguous, as every other element
    of a buffer of sentinels, or as a transposed view."""
    if layout == "contiguous":
        return values.clone(), None
    tensor, base = verify.make_input(Case(values.numel(), values.dtype, layout=layout), 0)
    tensor.copy_(values.view(tensor.shape) if layout == "transposed" else values)
    return tensor, base


def _gaps_ok(base, layout: str) -> bool:
    return base is None or layout != "strided" or not bool((base[1::2] != SENTINEL).any())


def _members(p: int, group) -> list[int]:
    return list(group) if group is not None else list(range(p))


# ---- the rank's half ---------------------------------------------------------------------------

def probe_collective(probe: Probe, name: str) -> dict:
    import torch.distributed as dist

    fn = probe.student(name)
    cases = cases_of(name, probe.size)
    groups = {}
    for case in cases:                      # every rank makes every group, in the same order
        if case[4] is not None and case[4] not in groups:
            groups[case[4]] = dist.new_group(list(case[4]))
    solo = [dist.new_group([r]) for r in range(probe.size)]
    out = {}
    for case in cases:
        numel, dtype, op, root, group, layout = case
        members = _members(probe.size, group)
        if probe.rank not in members:
            continue
        i, m = members.index(probe.rank), len(members)
        extra = {} if group is None else {"group": groups[group]}
        tensor, base = laid_out(values_of(case, i, probe.secret), layout)
        outputs, bases = [tensor], [base]
        if name in ("broadcast", "tree_broadcast"):
            outcome = probe.call(key_of(case), fn, tensor, root, **extra)
        elif name == "reduce":
            outcome = probe.call(key_of(case), fn, tensor, root, op, **extra)
        elif name == "scatter":
            pieces = [values_of(case, j, probe.secret, "piece").reshape(tensor.shape) for j in range(m)] \
                if probe.rank == root else None
            outcome = probe.call(key_of(case), fn, tensor, pieces, root, **extra)
        else:                               # gather, all_gather: one landing tensor per member
            made = [laid_out(values_of(case, j, probe.secret, "landing"), layout) for j in range(m)]
            outputs, bases = [t for t, _ in made], [b for _, b in made]
            if name == "gather":
                if probe.rank != root:
                    outputs, bases = [], []
                outcome = probe.call(key_of(case), fn, tensor, outputs or None, root, **extra)
            else:
                outcome = probe.call(key_of(case), fn, outputs, tensor, **extra)
        if outcome.not_written:
            return {NOT_WRITTEN: outcome}        # a stub: nothing more to learn here
        gaps_ok = all(_gaps_ok(b, layout) for b in bases)
        out[key_of(case)] = (outcome, [t.detach().reshape(-1).clone() for t in outputs], gaps_ok)
    out.update(_bad_input(probe, name, fn, solo[probe.rank]))
    return out


def _bad_input(probe: Probe, name: str, fn, solo) -> dict:
    """What ``fn`` makes of bad input, this rank alone in ``solo``: each must raise ValueError."""
    me, other = probe.rank, (probe.rank + 1) % probe.size
    x = torch.ones(3)
    tries = {
        "broadcast": {"expanded tensor": lambda: fn(torch.ones(1).expand(3), me, group=solo)},
        "reduce": {"unsupported op": lambda: fn(x, me, ReduceOp.BAND, group=solo),
                   "AVG on integers": lambda: fn(torch.ones(3, dtype=torch.int64), me, ReduceOp.AVG, group=solo)},
        "scatter": {"scatter_list of the wrong length": lambda: fn(x, [x, x], me, group=solo),
                    "scatter_list missing on the root": lambda: fn(x, None, me, group=solo)},
        "gather": {"gather_list of the wrong length": lambda: fn(x, [], me, group=solo),
                   "gather_list of the wrong size": lambda: fn(x, [torch.ones(4)], me, group=solo)},
        "all_gather": {"tensor_list of the wrong length": lambda: fn([x, x], x, group=solo)},
    }
    if other != me:
        tries["broadcast"]["root outside the group"] = lambda: fn(x, other, group=solo)
        tries["reduce"]["root outside the group"] = lambda: fn(x, other, ReduceOp.SUM, group=solo)
    tries["tree_broadcast"] = tries["broadcast"]
    return {f"bad input: {what}": probe.call(f"bad input: {what}", call) for what, call in tries[name].items()}


# ---- the judge's half --------------------------------------------------------------------------

def _judge_collective(grading: Grading, name: str) -> Verdict:
    verdict = Verdict()
    for size in grading.sizes(4):
        run = grading.world(f"{HERE}:probe_collective", size, name)
        stub = next((result[NOT_WRITTEN] for result in run.results if NOT_WRITTEN in result), None)
        if stub is not None:
            return Verdict(not_written=stub.not_written)
        for case in cases_of(name, size):
            _judge_case(run, name, case, verdict)
            if len(verdict.problems) > 20:
                break
        for r in range(size):
            for key, outcome in run.results[r].items():
                if key.startswith("bad input: "):
                    refused(f"{name}, world of {size}, rank {r}, case {key}", outcome, verdict)
        if verdict.not_written or verdict.problems:
            break
    return verdict


def _judge_case(run, name: str, case: tuple, verdict: Verdict) -> None:
    numel, dtype, op, root, group, layout = case
    members = _members(run.size, group)
    m = len(members)
    key = key_of(case)
    inputs = [values_of(case, j, run.secrets[r]) for j, r in enumerate(members)]
    root_i = members.index(root) if root is not None else None
    pieces = [values_of(case, j, run.secrets[root], "piece") for j in range(m)] if name == "scatter" else None
    for i, r in enumerate(members):
        where = f"{name}, world of {run.size}, rank {r}, case {key}"
        outcome, outputs, gaps_ok = run.results[r][key]
        if outcome_problem(where, outcome, verdict):
            continue
        if name in ("broadcast", "tree_broadcast"):
            expected = [inputs[root_i]]
        elif name == "reduce":
            expected = [expected_output(Case(numel, dtype, op), inputs)] if r == root else None
        elif name == "scatter":
            expected = [pieces[i]]
        elif name == "gather":
            expected = inputs if r == root else None
        else:
            expected = inputs
        problem = None
        for j, want in enumerate(expected or []):
            problem = same(want, outputs[j]) if j < len(outputs) else "no output"
            if problem:
                listed = "gather_list" if name == "gather" else "tensor_list"
                what = "tensor" if name not in ("gather", "all_gather") else f"{listed}[{j}]"
                problem = f"{what}: {problem}"
                break
        if problem is None and not gaps_ok:
            problem = "wrote between the elements of a strided view"
        if problem is None:
            problem = _pattern(name, run.of(r, key), numel, dtype, i, root_i, members, inputs, pieces)
        verdict.add(problem and f"{where}: {problem}")


def _pattern(name, calls, n, dtype, i, root_i, members, inputs, pieces) -> str | None:
    """This member's messages in one call, held to the algorithm (see the module doc)."""
    problem = messages_only(None, 0, 0, calls)
    if problem or n == 0:
        return problem
    m = len(members)
    others = [r for j, r in enumerate(members) if j != i]
    root = members[root_i] if root_i is not None else None
    me_root = root_i == i
    if name == "broadcast":
        sends, recvs = (others, []) if me_root else ([], [root])
        carried = {r: inputs[root_i] for r in sends}
    elif name == "tree_broadcast":
        v = (i - root_i) % m
        high = v.bit_length()
        children = [v + (1 << k) for k in range(high, m.bit_length()) if v + (1 << k) < m]
        sends = [members[(c + root_i) % m] for c in children]
        recvs = [] if v == 0 else [members[(v - (1 << (high - 1)) + root_i) % m]]
        carried = {r: inputs[root_i] for r in sends}
    elif name in ("reduce", "gather"):
        sends, recvs = ([], others) if me_root else ([root], [])
        carried = {r: inputs[i] for r in sends}
    elif name == "scatter":
        sends, recvs = (others, []) if me_root else ([], [root])
        carried = {r: pieces[members.index(r)] for r in sends}
    else:                                   # all_gather
        sends, recvs = others, others
        carried = {r: inputs[i] for r in sends}
    return (_exactly(calls, "send", sends, n, dtype) or _exactly(calls, "recv", recvs, n, dtype)
            or _carried(calls, carried))


def _exactly(calls: list[Call], kind: str, peers: list[int], n: int, dtype) -> str | None:
    got = [c for c in calls if c.kind == kind]
    if sorted(c.peer for c in got) != sorted(peers):
        verb, to = ("sent to", "to") if kind == "send" else ("received from", "from")
        return (f"{verb} ranks {sorted(c.peer for c in got)}; expected "
                + (f"one message {to} each of {sorted(peers)}" if peers else f"no message {to} anybody"))
    wrong = [c for c in got if c.numel != n or c.dtype != str(dtype)[6:]]
    if wrong:
        return f"{kind} of {wrong[0].numel} {wrong[0].dtype} elements, expected {n} {str(dtype)[6:]} (the whole tensor)"
    return None


def _carried(calls: list[Call], carried: dict) -> str | None:
    for c in calls:
        if c.kind == "send" and c.peer in carried and not holds(c, carried[c.peer]):
            return f"the message to rank {c.peer} did not hold the data it should"
    return None


# ---- task 6: all-reduce = reduce + broadcast ------------------------------------------------

def _reduce_broadcast_pattern(run):
    """Through group rank 0: it receives every other rank's input and sends the result back."""
    drawn: dict[str, tuple] = {}          # case -> (inputs, result): drawn once, not once a rank

    def pattern(case, p, i, calls):
        problem = messages_only(case, p, i, calls)
        sends = [c for c in calls if c.kind == "send"]
        if problem or p == 1:
            return problem or (f"sent {len(sends)} messages in a group of one" if sends else None)
        if case.numel == 0:
            return None
        members = _members(run.size, case.group)
        if case.name not in drawn:
            inputs = [verify.make_values(case, j, run.secrets[r]) for j, r in enumerate(members)]
            drawn[case.name] = inputs, expected_output(case, inputs)
        inputs, result = drawn[case.name]
        n, dtype, others = case.numel, case.dtype, members[1:]
        if i == 0:
            problem = _exactly(calls, "recv", others, n, dtype) or _exactly(calls, "send", others, n, dtype)
            if problem is None and case.values == "int" and _carried(calls, {r: result for r in others}):
                problem = "a message it broadcast did not hold the result"
            return problem
        return (_exactly(calls, "send", members[:1], n, dtype) or _exactly(calls, "recv", members[:1], n, dtype)
                or _carried(calls, {members[0]: inputs[i]}))
    return pattern


def probe_all_reduce(probe: Probe, cases: list[Case]) -> dict:
    return probe_cases(probe, "all_reduce_via_reduce_broadcast", cases)


def _judge_reduce_broadcast(grading: Grading) -> Verdict:
    verdict = Verdict()
    name = "all_reduce_via_reduce_broadcast"
    for size in grading.sizes(4):
        # the harness's whole covering set, but for the 1 Mi-element case: nothing in reduce +
        # broadcast depends on the size, and that one case cost as much as all the others
        cases = verify.default_cases(size, large=False)
        run = grading.world(f"{HERE}:probe_all_reduce", size, cases)
        judge_cases(run, cases, verdict, what=name, pattern=_reduce_broadcast_pattern(run))
        if verdict.not_written or verdict.problems:
            break
    if verdict.ok:
        judge_expanded(grading, name, verdict)
    return verdict


def _task(name: str):
    return lambda grading: _judge_collective(grading, name)


TASKS = [
    GradedTask(2, 1, "broadcast (linear)", 2, _task("broadcast"), ("broadcast",), routes=P2P),
    GradedTask(2, 2, "reduce (linear, five ops)", 3, _task("reduce"), ("reduce",), routes=P2P),
    GradedTask(2, 3, "scatter", 2, _task("scatter"), ("scatter",), routes=P2P),
    GradedTask(2, 4, "gather", 2, _task("gather"), ("gather",), routes=P2P),
    GradedTask(2, 5, "all_gather", 2, _task("all_gather"), ("all_gather",), routes=P2P),
    GradedTask(2, 6, "all-reduce = reduce + broadcast", 2, _judge_reduce_broadcast,
               ("all_reduce_via_reduce_broadcast",), routes=P2P),
    GradedTask(2, 7, "broadcast along a binomial tree", 2, _task("tree_broadcast"), ("tree_broadcast",), routes=P2P),
]
