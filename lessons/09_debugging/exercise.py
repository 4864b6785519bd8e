"""Lesson 9 exercise: the analyzer that reads every rank's flight recorder and names the culprit.

Four tasks, in order; each uses only the given helpers and the tasks before it:

| task | what                                                        | stubs                             |
|------|-------------------------------------------------------------|-----------------------------------|
| 1    | the ranks that never entered collective #k of a group       | find_missing                      |
| 2    | the first collective #k whose calls differ, and who differs | find_mismatch                     |
| 3    | a cycle of waits: who waits on whom                         | wait_for_graph, find_wait_cycle   |
| 4    | the rank that keeps everyone waiting                        | find_stragglers                   |

Check your work:

    make check LESSON=09                                          # one PASS/FAIL line per task
    .venv/bin/python lessons/09_debugging/exercise.py --task 3 --verbose   # one task, every problem
    make grade LESSON=09                                          # the same verdicts, as points

The checks are the grader's: every fault and a healthy run with uneven all-to-alls, on
scenarios drawn from seeds nobody sees, a new set on every run, each answer compared with
what the scenario's own parameters say. Try
your functions first on the lab's scenarios, or on ``scenario_dumps(kind, seed)`` with the
public seeds 0-5 and ``expected(draw(kind, seed))``.

A dump is one rank's ``rank<r>.json`` as a dict: ``dump["rank"]``, ``dump["reason"]``,
``dump["entries"]`` (oldest first, torch's Flight Recorder fields: ``collective_seq_id``,
``p2p_seq_id``, ``profiling_name``, ``process_group``, ``pg_ranks``, ``is_p2p``, ``peer``,
``input_sizes``, ``input_dtypes``, ``state``, ``time_created_ns``, ``frames``, ...).
``collectives.debugging.scenario_dumps(kind, seed)`` makes every rank's dumps of a fault in
a millisecond; ``.venv/bin/python -m collectives diagnose --run skip`` runs one for real.

Course functions you may call (the sheet is checked against the code):

    dumps.group_of(entry) -> Group
        The group an entry was made on: ``("0", (0, 1, 2, 3))``.
    dumps.op_of(entry) -> str
        ``"gloo:send 0->1"`` -> ``"send"``.
    dumps.collective_entries(dump, group) -> dict[int, dict]
        This rank's collectives on ``group``, by sequence number (the ones still in its
        ring).
    dumps.last_seq(dump, group) -> int
        The last collective this rank entered on ``group`` (0: none).
    dumps.groups(dumps) -> list[Group]
        Every group any rank made a call on, in order of name.
    dumps.by_rank(dumps) -> dict[int, dict]
        Every rank's dump, keyed by its rank.
    dumps.is_dead(dump) -> bool
        The rank did not answer the dump request: its dump was recovered from its ring.
    dumps.blocking_call(dump) -> dict | None
        The call this rank was waiting in when it stopped: the call it started waiting in
        last, unless it completed something after that (then it had moved on). A call that
        failed -- a timeout, a lost peer -- still counts: the rank waited in it until then.
        None for a rank that waits in nothing (finished, computing) or died.
    dumps.pending(dump) -> list[dict]
        Calls posted or waited in that never completed (failed ones included).
    dumps.where(entry) -> str
        The line that made the call: ``"faults.py:78 (skipped_collective)"``.
    dumps.describe(entry) -> str
        ``"all_reduce #5"``, ``"send to rank 1 (p2p #3)"``.
    dumps.majority(values) -> object
        The value most ranks have; a tie goes to the value of the lowest rank among the
        tied.
    dumps.Missing(group, seq, op, missing, waiting)
        Ranks that never entered collective #seq of a group that others wait in.
    dumps.Mismatch(group, seq, field, differ, values)
        The first collective of a group where the ranks' calls differ.
    dumps.WaitCycle(ranks, waits)
        Ranks each waiting for the next, the last for the first: nobody can move.
    dumps.Straggler(group, rank, late_in, of, median_lag, worst_seq)
        A rank that enters a group's collectives last, most of the time, by a clear margin.

The reference is ``collectives/debugging/analyze.py``; the lesson page is
docs/lessons/09-debugging.md.
"""

from __future__ import annotations

import statistics  # noqa: F401 - task 4 needs a median

from collectives.course.grading.runner import run_tasks
from collectives.debugging import KINDS, LAB, draw, dumps_for, scenario_dumps  # noqa: F401 - to try your code
from collectives.debugging.dumps import (  # noqa: F401
    Mismatch,
    Missing,
    Straggler,
    WaitCycle,
    blocking_call,
    by_rank,
    collective_entries,
    describe,
    group_of,
    groups,
    is_dead,
    last_seq,
    majority,
    op_of,
    pending,
    where,
)
from collectives.debugging.faults import expected  # noqa: F401 - what a scenario must show

LESSON = 9
MIN_LAG = 0.02              # seconds: a straggler keeps the others waiting at least this long (median)
MIN_COLLECTIVES = 3         # collectives every rank entered, before anyone is called a straggler
FIELDS = ("operation", "sizes", "dtype")
UNEVEN = ("all_to_all", "all_to_all_single")   # sizes that may differ from rank to rank, by design


# ---- task 1: who never came ---------------------------------------------------------------------

def find_missing(dumps: list[dict]) -> list[Missing]:
    """Lesson 9, task 1: the ranks that never entered the collective the others wait in.

    TODO:     for each group (``groups(dumps)``): the collective entries of the group that
              never completed (``pending``, not ``is_p2p``); #k is the smallest of their
              ``collective_seq_id``. The members (``group[1]``, those with a dump) whose
              ``last_seq`` on the group is below k never entered it. Report
              ``Missing(group ranks, k, op of a stuck entry, missing, waiting)`` -- waiting:
              the members whose entry #k is not completed -- when someone is missing.
    APPROACH: a rank's k-th call meets the others' k-th call, whatever its arguments: a rank
              that skipped one is simply one call short when the others start their last.
    EXAMPLE:  ranks 0, 1, 3 have all_reduce #5 started, rank 2's last is #4 completed
              ->  [Missing((0, 1, 2, 3), 5, "all_reduce", (2,), (0, 1, 3))].
    HINT:     ``collective_entries(dump, group)`` maps seq -> entry for one rank.
    CALLS:    dumps.collective_entries, dumps.last_seq, dumps.groups, dumps.pending, dumps.Missing
    """
    raise NotImplementedError("Lesson 9, task 1: find_missing")


# ---- task 2: who called something else -------------------------------------------------------------

def find_mismatch(dumps: list[dict]) -> list[Mismatch]:
    """Lesson 9, task 2: per group, the first collective whose calls differ, and who differs.

    TODO:     for each group, for each seq every member has in its dump (ascending): compare
              the members' calls on FIELDS in order -- "operation" (``op_of``), "sizes"
              (``str`` of ``input_sizes[0]`` for one tensor, of the list for several),
              "dtype" (``",".join(input_dtypes)``); an ``all_to_all``/``all_to_all_single``'s
              sizes are not compared (UNEVEN: its inputs may differ from rank to rank). At the
              first field that takes more than
              one value: the expected value is ``majority({rank: value})``; report
              ``Mismatch(group ranks, seq, field, ranks whose value differs,
              tuple(sorted({rank: value}.items())))`` and go on to the next group.
    APPROACH: ranks pair their k-th calls, so the first seq where they disagree is where the
              program went wrong; what follows is only its echo.
    EXAMPLE:  at #5 rank 1 called broadcast [1] and ranks 0, 2, 3 all_reduce [1000]
              ->  Mismatch((0, 1, 2, 3), 5, "operation", (1,), ((0, "all_reduce"), ...)).
    HINT:     a seq missing from one rank's dump (the ring came round) cannot be compared:
              use the intersection of the members' seqs.
    CALLS:    dumps.op_of, dumps.where, dumps.majority, dumps.Mismatch
    """
    raise NotImplementedError("Lesson 9, task 2: find_mismatch")


# ---- task 3: who waits on whom ------------------------------------------------------------------------

def wait_for_graph(dumps: list[dict]) -> dict[int, list[tuple[int, str]]]:
    """Lesson 9, task 3: ``{rank: [(rank it waits for, what it waits in), ...]}`` for every rank.

    TODO:     a rank's ``blocking_call`` (None: it waits for nobody). A point-to-point call
              waits for its ``peer`` -- unless the peer has the matching call pending without
              an error (a recv from this rank for a send to it, a send for a recv, same
              group): then the two are in the transfer together. A collective #k waits for
              the members of its group whose ``last_seq`` is below k (task 1's rule).
    APPROACH: what a rank waits in is its last started call that nothing completed after.
    EXAMPLE:  rank 0 in send to 1, rank 1 in send to 0  ->  {0: [(1, ...)], 1: [(0, ...)]}.
              rank 0 in send to 1, rank 1 in recv from 0  ->  {0: [], 1: []}.
    HINT:     "what": f"rank {r} in {describe(call)}, {where(call)}".
    CALLS:    dumps.last_seq, dumps.blocking_call, dumps.pending, dumps.where, dumps.describe
    """
    raise NotImplementedError("Lesson 9, task 3: wait_for_graph")


def find_wait_cycle(dumps: list[dict]) -> WaitCycle | None:
    """Lesson 9, task 3: a cycle of waits, as ``WaitCycle(ranks, waits)``, or None.

    TODO:     search :func:`wait_for_graph` from each rank ``start`` in ascending order,
              depth first, following waits in ascending order of the rank waited for, through
              ranks above ``start`` only; the first path that comes back to ``start`` is the
              cycle: ``ranks`` from ``start`` in the direction of the waits, ``waits`` the
              "what" of each step.
    APPROACH: visiting only ranks above the start finds each cycle once, from its smallest rank.
    EXAMPLE:  every rank of 4 sends to its right neighbour first  ->  ranks (0, 1, 2, 3).
    HINT:     keep the path and a set of ranks already explored from this start.
    CALLS:    dumps.WaitCycle
    """
    raise NotImplementedError("Lesson 9, task 3: find_wait_cycle")


# ---- task 4: who keeps everyone waiting ------------------------------------------------------------

def find_stragglers(dumps: list[dict], min_lag: float = MIN_LAG) -> list[Straggler]:
    """Lesson 9, task 4: per group, the rank that enters the collectives last, most of the time.

    TODO:     for each group with at least two members and MIN_COLLECTIVES seqs every member
              has, #1 not counted (it measures how the ranks started, not how they run): at
              each such seq, the last to enter (largest ``time_created_ns``; a tie
              goes to the lower rank) and its lag: its time minus the latest of the others',
              in seconds. The rank last most often (a tie: the lower rank) is a straggler when
              it was last in more than half of the seqs and the median of its lags is at least
              ``min_lag``: ``Straggler(group ranks, rank, times last, seqs, median lag, the seq
              of its largest lag)``.
    APPROACH: the lag is how long everyone else had already waited when it came.
    EXAMPLE:  rank 3 sleeps 50 ms before each of 5 all-reduces  ->
              [Straggler((0, 1, 2, 3), 3, 4, 4, ~0.05, ...)]  (#2 to #5).
    HINT:     the clocks of ranks on one host agree; across hosts they drift (see the page).
    CALLS:    dumps.Straggler
    """
    raise NotImplementedError("Lesson 9, task 4: find_stragglers")


if __name__ == "__main__":
    run_tasks(LESSON)
