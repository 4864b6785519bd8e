"""Run a schedule on paper first: is it complete, can it deadlock, how long, how much memory.

The runner's rules (:mod:`.runner`): a rank runs its steps in its list's order; sends
never wait (``isend``); a step waits only for the message it consumes --

* ``F`` of micro-batch i on chunk c > 0 waits for ``F`` of i on chunk c − 1 (the activation);
* ``B`` of i on chunk c < C − 1 waits for ``B`` of i on chunk c + 1 (the gradient); on the
  last chunk for its own ``F`` of i;
* ``W`` of i on chunk c for its own ``B`` of i.

:func:`validate` checks a schedule names every step once, on the rank that holds its
chunk, in an order the rank itself can run. :func:`simulate` then plays it: a rank whose
next step's message has been sent runs it. When no rank can move and some have steps
left, the schedule deadlocks; the ranks wait for each other in a cycle, and
:class:`Deadlock` names it -- which rank waits at which step for which rank's step.

With step times (``costs``: seconds of F, B, W, and the full backward when B and W are one)
and a message time, the same play gives each step's start and end: the makespan, each
rank's idle share (its bubble) and the micro-batches it holds at most (:class:`Timeline`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .schedules import Step

UNIT = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}    # equal layers: B costs F, W costs F


class Deadlock(RuntimeError):
    """The schedule cannot finish: ``cycle`` lists (rank, position, step, waits for) around it."""

    def __init__(self, cycle: list[tuple[int, int, Step, Step]], p: int, interleaved: bool = False):
        self.cycle = cycle
        parts = [f"stage {r} waits at step {i} ({_say(s, interleaved)}) for stage {w.chunk % p}'s "
                 f"{_say(w, interleaved)}" for r, i, s, w in cycle]
        super().__init__("the schedule deadlocks: " + "; ".join(parts) + " -- a cycle, so none of them moves")


def _say(step: Step, interleaved: bool = False) -> str:
    return f"{step.kind} of micro-batch {step.mb}" + (f" on chunk {step.chunk}" if interleaved else "")


class InvalidSchedule(ValueError):
    pass


def split_steps(schedule) -> set[tuple[int, int]]:
    """(mb, chunk) pairs whose backward is split: their rank lists a W for them."""
    return {(s.mb, s.chunk) for steps in schedule for s in steps if s.kind == "W"}


def validate(schedule, m: int, num_chunks: int | None = None) -> int:
    """Check every step is listed once, on its chunk's rank, each after what it needs locally;
    return the number of chunks C. Raises :class:`InvalidSchedule` naming the first problem."""
    p = len(schedule)
    chunks = sorted({s.chunk for steps in schedule for s in steps})
    C = num_chunks or (max(chunks) + 1 if chunks else p)
    if C % p:
        raise InvalidSchedule(f"{C} chunks do not spread evenly over {p} ranks")
    split = split_steps(schedule)
    for r, steps in enumerate(schedule):
        seen: set[tuple[str, int, int]] = set()
        for i, s in enumerate(steps):
            if s.kind not in ("F", "B", "W"):
                raise InvalidSchedule(f"rank {r} step {i}: kind {s.kind!r} is not F, B or W")
            if not 0 <= s.mb < m or not 0 <= s.chunk < C or s.chunk % p != r:
                raise InvalidSchedule(f"rank {r} step {i} ({s}): micro-batch or chunk out of range, or a chunk "
                                      f"that lives on rank {s.chunk % p}")
            key = (s.kind, s.mb, s.chunk)
            if key in seen:
                raise InvalidSchedule(f"rank {r} lists {_say(s)} twice")
            need = {"B": "F", "W": "B"}.get(s.kind)
            if need and (need, s.mb, s.chunk) not in seen:
                raise InvalidSchedule(f"rank {r} step {i}: {_say(s)} comes before its {need}")
            seen.add(key)
        for c in range(r, C, p):
            for i in range(m):
                for kind in ("F", "B") + (("W",) if (i, c) in split else ()):
                    if (kind, i, c) not in seen:
                        raise InvalidSchedule(f"rank {r} never runs {kind} of micro-batch {i} on chunk {c}")
    return C


def dependency(step: Step, num_chunks: int) -> Step | None:
    """The step on another rank whose message ``step`` waits for (None: nothing remote)."""
    if step.kind == "F" and step.chunk > 0:
        return Step("F", step.mb, step.chunk - 1)
    if step.kind == "B" and step.chunk < num_chunks - 1:
        return Step("B", step.mb, step.chunk + 1)
    return None


@dataclass
class Timeline:
    """A schedule played out: per rank its steps with (start, end), and what follows."""

    spans: list[list[tuple[Step, float, float]]]
    peak_held: list[int] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((e for spans in self.spans for _, _, e in spans), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(e - s for _, s, e in self.spans[rank])

    def bubble(self) -> float:
        """Idle share of all ranks' time from the first start to the last end."""
        total = self.makespan * len(self.spans)
        return 1 - sum(self.busy(r) for r in range(len(self.spans))) / total if total else 0.0


def simulate(schedule, m: int, costs: dict | list | None = None, message: float = 0.0,
             num_chunks: int | None = None, overhead: float = 0.0) -> Timeline:
    """Play ``schedule`` (validated first); raise :class:`Deadlock` with the cycle if it cannot
    finish, else return its :class:`Timeline` under ``costs`` (default: F = B = W = 1).

    ``costs``: one dict of a whole stage's step times for every rank, or a list of them, one
    per rank (stages that run at different speeds); ``message``: the time from a step's end
    to the start of the step that consumes its message; ``overhead``: the time a rank takes
    between two steps when it waits for nothing."""
    C = validate(schedule, m, num_chunks)
    per_rank = costs if isinstance(costs, list) else [costs] * len(schedule)
    if len(per_rank) != len(schedule):
        raise ValueError(f"{len(per_rank)} ranks' costs for a schedule of {len(schedule)} ranks")
    rank_costs = [{**UNIT, **(c or {})} for c in per_rank]
    split = split_steps(schedule)
    p = len(schedule)
    done: dict[Step, float] = {}
    at = [0] * p
    clock = [0.0] * p
    spans: list[list] = [[] for _ in range(p)]
    held, peak = [0] * p, [0] * p
    while True:
        moved = False
        for r in range(p):
            while at[r] < len(schedule[r]):
                s = schedule[r][at[r]]
                dep = dependency(s, C)
                if dep is not None and dep not in done:
                    break
                kind = "BW" if s.kind == "B" and (s.mb, s.chunk) not in split else s.kind
                start = max(clock[r] + (overhead if at[r] else 0.0),
                            done[dep] + message if dep is not None else 0.0)
                end = start + rank_costs[r][kind] / (C // p)
                done[Step(s.kind, s.mb, s.chunk)] = end
                clock[r] = end
                spans[r].append((s, start, end))
                held[r] += 1 if s.kind == "F" else -1 if kind in ("BW", "W") else 0
                peak[r] = max(peak[r], held[r])
                at[r] += 1
                moved = True
        if all(at[r] == len(schedule[r]) for r in range(p)):
            return Timeline(spans, peak)
        if not moved:
            raise Deadlock(_cycle(schedule, at, C), p, C > p)


def _cycle(schedule, at: list[int], C: int) -> list[tuple[int, int, Step, Step]]:
    """Follow 'rank r waits for the rank that runs its dependency' until a rank repeats."""
    p = len(schedule)
    waits = {}
    for r in range(p):
        if at[r] < len(schedule[r]):
            s = schedule[r][at[r]]
            dep = dependency(s, C)
            waits[r] = (at[r], s, dep, dep.chunk % p)
    r = next(iter(waits))
    path: list[int] = []
    while r not in path:
        path.append(r)
        r = waits[r][3]
    loop = path[path.index(r):]
    return [(q, waits[q][0], waits[q][1], waits[q][2]) for q in loop]
