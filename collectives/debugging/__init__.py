"""Lesson 9: when collectives go wrong -- a flight recorder, and an analyzer that names the culprit.

A collective that hangs says nothing: every rank waits, and the one that is wrong waits
too, or has already left. Every rank's **flight recorder**
(:mod:`collectives.core.flight_recorder`, after torch's) keeps its last calls -- group,
sequence number, operation, sizes, dtype, peer, state, times, source line -- and dumps them
when the world is stopped. This lesson reads the dumps of all ranks side by side:

* :mod:`.dumps`     -- reading a dump: the group of a call, its sequence number, the call a
                       rank waits in; the answers the checks give (``Missing``, ...);
* :mod:`.analyze`   -- the four checks (the exercise's tasks): the rank that never entered
                       collective #k, the first collective whose calls differ, a cycle of
                       waits, a straggler;
* :mod:`.arguments` -- what else every rank must agree on: root, reduce op, outputs, state,
                       the two ends of a message;
* :mod:`.reading`   -- a dump directory, whatever it holds, read without a traceback;
* :mod:`.diagnose`  -- all of them together, with dead ranks and a link down, as a report
                       (``.venv/bin/python -m collectives diagnose DIR``);
* :mod:`.faults`    -- the bugs, as small training loops, and scenarios drawn from seeds;
* :mod:`.scenarios` -- a fault run for real, ended by the watchdog, a death or itself;
* :mod:`.synth`     -- the same scenarios' dumps without a world, in a millisecond;
* :mod:`.detail`    -- the same faults under torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
"""

from __future__ import annotations

from ..core.flight_recorder import FlightRecorder, read_ring
from .analyze import (MIN_COLLECTIVES, MIN_LAG, find_mismatch, find_missing, find_stragglers, find_wait_cycle,
                      wait_for_graph)
from .arguments import Unpaired, find_argument_mismatch, find_unpaired
from .diagnose import Finding, diagnose, find_dead, find_link_down, find_raised, report
from .dumps import (Missing, Mismatch, Straggler, WaitCycle, blocking_call, by_rank, collective_entries, describe,
                    group_of, groups, is_dead, last_seq, majority, op_of, pending, where)
from .faults import FINDING, HANGS, KINDS, LAB, Params, blame, draw, expected
from .reading import Dumps, read_dumps
from .scenarios import Outcome, load_dumps, run_scenario, run_scenarios
from .synth import dumps_for, handmade_dumps, scenario_dumps

__all__ = ["find_missing", "find_mismatch", "wait_for_graph", "find_wait_cycle", "find_stragglers",
           "diagnose", "report", "Finding", "find_dead", "find_link_down", "find_raised",
           "find_argument_mismatch", "find_unpaired", "Unpaired", "read_dumps", "Dumps",
           "Missing", "Mismatch", "WaitCycle", "Straggler", "MIN_LAG", "MIN_COLLECTIVES",
           "group_of", "op_of", "collective_entries", "last_seq", "groups", "by_rank", "is_dead",
           "blocking_call", "pending", "where", "describe", "majority",
           "KINDS", "HANGS", "LAB", "FINDING", "Params", "draw", "blame", "expected",
           "run_scenario", "run_scenarios", "Outcome", "load_dumps",
           "scenario_dumps", "dumps_for", "handmade_dumps", "FlightRecorder", "read_ring"]
