"""What a task's messages must carry, checked against the record: content and volume.

A message's record holds a fingerprint of what it carried (:func:`~collectives.course.grading.
tasks.tap.fingerprint`: the same for the same elements in the same order). Where a task
defines its messages, the judge knows every block a message may carry -- a chunk of an
input, a partial reduction, a piece of the result -- and holds each send to them:

* :func:`carries_blocks` -- every message carries one of the blocks, element for element:
  a message of the right size with other data in it (zeros, a decoy of random values while
  the real data went through a file in ``/dev/shm``) does not pass for one;
* :func:`traffic_within` -- the elements a rank sent lie between what the algorithm must
  send and what it may send: no fewer (an answer found without messages) and no more (a
  library gather of everything, p times the bytes).
"""

from __future__ import annotations

import torch

from .tap import Call, fingerprint


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * (1 + abs(a) + abs(b))


def carries_blocks(calls: list[Call], blocks: list[torch.Tensor], what: str = "one of its blocks") -> str | None:
    """None when every non-empty send among ``calls`` carried one of ``blocks`` exactly (by
    fingerprint, among the blocks of its size); else what the first stray message was."""
    prints: dict[int, list[float]] = {}
    for block in blocks:
        prints.setdefault(block.numel(), []).append(fingerprint(block))
    for i, c in enumerate(x for x in calls if x.kind == "send" and x.numel):
        if not any(_close(c.fingerprint, f) for f in prints.get(c.numel, [])):
            return (f"message {i + 1} (to rank {c.peer}, {c.numel} elements) did not carry {what}: "
                    "a message must carry the data itself")
    return None


def traffic_within(calls: list[Call], least: int, most: int) -> str | None:
    """None when the elements sent lie in [``least``, ``most``]; else how far off they are."""
    sent = sum(c.numel for c in calls if c.kind == "send")
    if sent < least:
        return f"sent {sent} elements, but at least {least} must leave this rank: the data travels in messages"
    if sent > most:
        return f"sent {sent} elements, more than the {most} this algorithm sends"
    return None
