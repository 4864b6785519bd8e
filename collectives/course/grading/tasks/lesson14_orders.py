"""Lesson 14's schedules judged as data: 1F1B's order (task 3) and ZB-H1's (task 5).

The probe (a world of one: no messages) asks the student's function for every rank's order
on a set of pipelines, p and m public; the judge plays each schedule with the lesson's
simulator, which the student's code never touches. A schedule must be complete and run on
paper without deadlock (a :class:`~collectives.pipeline.Deadlock` names the cycle); 1F1B's
must then be 1F1B's own, step by step; ZB-H1's may be any order that splits every backward,
keeps 1F1B's limit of p − r micro-batches awaiting B on rank r, and finishes in ZB-H1's time
with F = B = W = 1 unit: 3m + p − 1.
"""

from __future__ import annotations

from .world import Grading, Probe, Verdict, outcome_problem

HERE = __name__
CASES_1F1B = ((1, 3), (2, 2), (2, 5), (3, 2), (4, 4), (4, 8), (5, 3))
CASES_ZB = ((1, 3), (2, 2), (2, 4), (3, 5), (4, 4), (4, 8))


def _plain(value, kinds: tuple[str, ...]):
    """``value`` as a list of (kind, mb) pairs of plain str and int, else None."""
    if not isinstance(value, (list, tuple)):
        return None
    out = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            return None
        kind, mb = item
        if not isinstance(kind, str) or kind not in kinds or not isinstance(mb, int) or isinstance(mb, bool):
            return None
        out.append((str(kind), int(mb)))
    return out


def probe_orders(probe: Probe, name: str, cases, kinds: tuple[str, ...]) -> dict:
    fn = probe.student(name)
    out = {}
    for p, m in cases:
        key = f"p={p}, m={m}"
        orders, first = [], None
        for rank in range(p):
            outcome = probe.call(key, fn, p, m, rank)
            orders.append(_plain(outcome.value, kinds))
            outcome.value = None
            if first is None and (outcome.error or outcome.not_written):
                first = outcome
        out[key] = (first, orders)
    return out


def _judge(grading: Grading, name: str, cases, kinds, check) -> Verdict:
    from ....pipeline import Deadlock, InvalidSchedule, from_orders, simulate
    verdict = Verdict()
    run = grading.world(f"{HERE}:probe_orders", 1, name, cases, kinds)
    for p, m in cases:
        key = f"p={p}, m={m}"
        where = f"{name}, {key}"
        first, orders = run.results[0][key]
        if first is not None and outcome_problem(where, first, verdict):
            continue
        bad = next((r for r, order in enumerate(orders) if order is None), None)
        if bad is not None:
            verdict.add(f"{where}: rank {bad}'s order is not a list of (kind, micro-batch) pairs, kinds {kinds}")
            continue
        try:
            timeline = simulate(from_orders(orders), m)
        except (Deadlock, InvalidSchedule) as exc:
            verdict.add(f"{where}: {exc}")
            continue
        problem = check(p, m, orders, timeline)
        verdict.add(problem and f"{where}: {problem}")
    return verdict


def _check_1f1b(p: int, m: int, orders, timeline) -> str | None:
    from ....pipeline import one_f_one_b_order
    for r, order in enumerate(orders):
        warm = next((i for i, (k, _) in enumerate(order) if k == "B"), len(order))
        want = one_f_one_b_order(p, m, r)
        if warm != min(p - r, m):
            return (f"rank {r} runs {warm} forwards before its first backward; 1F1B runs min(p − r, m) = "
                    f"{min(p - r, m)}: p − 1 − r to warm up, then one before each backward")
        if order != want:
            at = next(i for i, (a, b) in enumerate(zip(order + [None] * len(want), want)) if a != b)
            got = order[at] if at < len(order) else "nothing"
            return f"rank {r}'s order differs from 1F1B's at step {at}: {got}, expected {want[at]}"
    return None


def _check_zb(p: int, m: int, orders, timeline) -> str | None:
    for r, order in enumerate(orders):
        ws = {mb for k, mb in order if k == "W"}
        missing = sorted(set(range(m)) - ws)
        if missing:
            return f"rank {r} runs no W for micro-batch {missing[0]}: ZB-H1 splits every backward into B and W"
        waiting, most = 0, 0
        for k, _ in order:
            waiting += 1 if k == "F" else -1 if k == "B" else 0
            most = max(most, waiting)
        if most > p - r:
            return (f"rank {r} holds {most} micro-batches awaiting their B at once; ZB-H1 keeps 1F1B's limit, "
                    f"p − r = {p - r}")
    best = 3 * m + p - 1
    if timeline.makespan > best:
        return (f"with F = B = W = 1 unit it takes {timeline.makespan:g} units; ZB-H1 takes 3m + p − 1 = {best}: "
                "the W's do not fill the gaps where a rank waits")
    return None


def judge_1f1b(grading: Grading) -> Verdict:
    return _judge(grading, "one_f_one_b_order", CASES_1F1B, ("F", "B"), _check_1f1b)


def judge_zb_h1(grading: Grading) -> Verdict:
    return _judge(grading, "zb_h1_order", CASES_ZB, ("F", "B", "W"), _check_zb)
