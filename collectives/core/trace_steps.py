"""The steps of a recorded run, for the site's trace player.

A :class:`Capture` listens to the trace (:func:`collectives.core.trace.add_listener`) and
keeps, on its rank, the payload of every message and a snapshot of one buffer at every call;
:func:`step_levels` numbers the communication in causal steps -- a message's step is one more
than the last step whose data its sender had received when it sent -- so that the buffers
"after step k" come from the run itself, not from re-deriving the algorithm. The messages are
paired as the Chrome trace's flows are (:func:`collectives.core.trace_export.match_messages`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from . import trace as _trace
from .trace import COLLECTIVES, Event, Trace
from .trace_export import _group_key, match_messages


class Capture:
    """On one rank: the payload of every recorded call, and a snapshot of ``watch`` at each.

    A listener of the trace (:func:`~collectives.core.trace.add_listener`) while the block
    runs, inside the :func:`~collectives.core.trace.recording` it is given::

        with trace.recording() as t, Capture(buffer, t) as cap:
            ring_all_reduce(buffer)

    ``log`` holds ``(phase, seq)`` -- ``seq`` the event's in ``t`` -- in the order the calls
    were made ("post") and completed ("done"); ``snapshots[i]`` is ``watch`` as it was when
    ``log[i]`` happened, ``start`` and ``end`` before and after the block. A send's payload
    is taken when it is posted, a receive's when it completes, a collective's contribution
    when it is posted. Small tensors only: everything is copied.
    """

    def __init__(self, watch: torch.Tensor, recording: Trace, max_numel: int = 4096):
        if watch.numel() > max_numel:
            raise ValueError(f"Capture copies the buffer at every call: {watch.numel()} elements is more "
                             f"than {max_numel}; record a smaller run")
        self.watch, self.recording = watch, recording
        self._remove = None
        self._last = -1                     # the seq of the last call noted
        self.log: list[tuple[str, int]] = []
        self.snapshots: list[list] = []
        self.payloads: dict[int, Any] = {}
        self.landing: dict[int, tuple[int, int]] = {}   # a receive into ``watch`` itself: its elements
        self.start: list = []
        self.end: list = []

    def _values(self, tensors):
        if isinstance(tensors, torch.Tensor):
            return tensors.detach().reshape(-1).cpu().clone()
        flat = [t.detach().reshape(-1).cpu() for t in (tensors or []) if isinstance(t, torch.Tensor)]
        return torch.cat(flat) if flat else torch.empty(0)

    def _inside_watch(self, t) -> tuple[int, int] | None:
        """The elements of ``watch`` that ``t`` is, when it is a contiguous piece of it."""
        w = self.watch
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or not t.is_contiguous() \
                or t.untyped_storage().data_ptr() != w.untyped_storage().data_ptr():
            return None
        lo = t.storage_offset() - w.storage_offset()
        return (lo, lo + t.numel()) if 0 <= lo and lo + t.numel() <= w.numel() else None

    def _note(self, phase: str, event: Event, tensors) -> None:
        if phase == "post" and event.is_recv and (where := self._inside_watch(tensors)) is not None:
            self.landing[event.seq] = where
        self.log.append((phase, event.seq))
        self.snapshots.append(self.watch.detach().reshape(-1).cpu().tolist())
        if (phase == "post" and not event.is_recv) or (phase == "done" and event.is_recv):
            self.payloads[event.seq] = self._values(tensors)

    def _listen(self, kind, peer, tensors, group):
        """A call is being made: the trace has just recorded it (the listeners hear after)."""
        events = self.recording.events
        if not _trace.active() or not events or events[-1].seq <= self._last:
            return None                     # not recorded (paused): not part of the run
        event = events[-1]
        self._last = event.seq
        self._note("post", event, tensors)

        def end(stage, error=None):
            if stage == "completed":
                self._note("done", event, tensors)
        return end

    def __enter__(self) -> "Capture":
        self.start = self.watch.detach().reshape(-1).cpu().tolist()
        self._remove = _trace.add_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        self._remove()
        self.end = self.watch.detach().reshape(-1).cpu().tolist()

    def to_dict(self, describe=None) -> dict:
        """Plain data (picklable, JSON-able); ``describe(tensor) -> object`` renders payloads."""
        describe = describe or (lambda t: t.tolist())
        return dict(log=self.log, snapshots=self.snapshots, start=self.start, end=self.end,
                    payloads={seq: describe(t) for seq, t in self.payloads.items()}, landing=self.landing)


def buffer_after(capture: dict, events: dict[int, Event], rank: int, levels: dict, step: int) -> list:
    """This rank's buffer once step ``step`` is over: as it was at its first call belonging to a
    later step -- the posting of a send or collective, or the completion of a receive -- or at
    the end. Receives of later steps posted into the buffer itself before that moment may
    have landed already: their elements are taken as they were when each was posted."""
    log, snaps = capture["log"], capture["snapshots"]
    later = lambda seq: levels.get((rank, seq), 0) > step      # noqa: E731
    at = next((i for i, (phase, seq) in enumerate(log) if later(seq) and (
        (phase == "post" and not events[seq].is_recv) or (phase == "done" and not events[seq].is_send))), None)
    state = list(capture["end"] if at is None else snaps[at])
    if at is None:
        return state
    for j, (phase, seq) in enumerate(log[:at + 1]):
        if phase == "post" and seq in capture["landing"] and later(seq):
            lo, hi = capture["landing"][seq]
            state[lo:hi] = snaps[j][lo:hi]
    return state


def step_levels(traces: list[Trace], logs: list[list[tuple[str, int]]]) -> dict[tuple[int, int], int]:
    """The causal step of every send, receive and collective: ``{(rank, seq): step}``, from 1.

    A send's step is one more than the highest step among the receives and collectives
    that had completed on its rank when it was posted (``logs[rank]``: the order of posts
    and completions, from a :class:`Capture`); a receive's is its send's; a collective's is
    one more than the highest such step over all its members. A ring's step s is then
    step s + 1 on every rank, and a tree's leaves send at step 1, their parents at 2.
    """
    flows, _ = match_messages(traces)
    sender = {(f.recv.rank, f.recv.seq): (f.send.rank, f.send.seq) for f in flows}
    by_seq = [{e.seq: e for e in t.events} for t in traces]
    instance: dict[tuple[int, int], tuple] = {}      # a collective call -> (group, k-th on it)
    members: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for t in traces:
        count: dict = defaultdict(int)
        for e in sorted(t.events, key=lambda e: e.seq):
            if e.kind in COLLECTIVES:
                key = (_group_key(e), count[_group_key(e)])
                count[_group_key(e)] += 1
                instance[(e.rank, e.seq)] = key
                members[key].append((e.rank, e.seq))
    level: dict[tuple[int, int], int] = {}
    proposal: dict[tuple[int, int], int] = {}        # a collective member's own 1 + what it had seen
    position, seen = [0] * len(traces), [0] * len(traces)
    progress = True
    while progress:
        progress = False
        for r, log in enumerate(logs):
            while position[r] < len(log):
                phase, seq = log[position[r]]
                e, me = by_seq[r][seq], (r, seq)
                if phase == "post" and e.is_send:
                    level[me] = seen[r] + 1
                elif phase == "post" and e.kind in COLLECTIVES:
                    proposal[me] = seen[r] + 1
                    key = instance[me]
                    if all(m in proposal for m in members[key]):
                        for m in members[key]:
                            level[m] = max(proposal[x] for x in members[key])
                elif phase == "done" and not e.is_send:
                    known = level.get(sender[me]) if e.is_recv and me in sender else level.get(me)
                    if known is None:
                        break                      # wait until the other ranks have got that far
                    level[me] = known
                    seen[r] = max(seen[r], known)
                position[r] += 1
                progress = True
    for receiver, send in sender.items():       # receives whose completion was never logged
        if receiver not in level and send in level:
            level[receiver] = level[send]
    return level
