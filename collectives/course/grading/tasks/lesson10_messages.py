"""Lesson 10's messages judged by what they carry, not only by how many bytes.

A ring all-gather's every message is one rank's piece (or, sent parameter by parameter,
one rank's shard of one parameter); a ring reduce-scatter's every message is a running sum
of one block over a run of neighbouring ranks (lesson 4). The judge knows every rank's
input, so it knows every block such a message may carry: :func:`blocks` lists them as
fingerprints (the tap's order-sensitive sum, :func:`collectives.course.grading.tasks.tap.fingerprint`,
and the sum of magnitudes), and :func:`unmatched` names the messages that carry none -- a
zero-filled decoy, a message whose data came through some other channel, a wrong block.

Sums are compared to a relative tolerance (the ranks add in their own order); everything
else must match to rounding.
"""

from __future__ import annotations

import os

import torch

from ....sharded import ShardGroup
from .tap import fingerprint
from .world import Probe

LIBRARY = "the task asks for lesson 4's ring (ring_reduce_scatter / ring_all_gather: point-to-point messages)"
REL = 1e-5


def print_of(t: torch.Tensor) -> tuple[int, float, float]:
    v = t.detach().reshape(-1).double()
    return v.numel(), fingerprint(v), float(v.abs().sum())


def pieces(group: ShardGroup, fulls_by_rank) -> list[tuple[int, float, float]]:
    """What an all-gather of each rank's piece may send: each piece whole, or one parameter's
    shard of it. ``fulls_by_rank[r]`` (or one list for every rank): the full tensors rank r's
    piece is cut from."""
    out = []
    for r in range(group.p):
        fulls = fulls_by_rank[r] if isinstance(fulls_by_rank[0], (list, tuple)) else fulls_by_rank
        shards = group.shard([f.double() for f in fulls], r)
        out.append(print_of(torch.cat(shards)))
        out += [print_of(s) for s in shards]
    return out


def blocks(group: ShardGroup, grads_by_rank, average: bool = True) -> list[tuple[int, float, float]]:
    """What a ring reduce-scatter of the packed ``grads_by_rank[r]`` may send: block c summed
    over any run of 1 to p-1 neighbouring ranks (either direction is a run), whole or one
    parameter's part of it, and the same divided by p (a student may average first)."""
    p = group.p
    packed = [group.pack([g.double() for g in grads]).view(p, -1) for grads in grads_by_rank]
    out = []
    for c in range(p):
        for start in range(p):
            run = torch.zeros_like(packed[0][c])
            for length in range(1, p):
                run = run + packed[(start + length - 1) % p][c]
                for scale in ((1.0, 1.0 / p) if average else (1.0,)):
                    whole = run * scale
                    out.append(print_of(whole))
                    out += [print_of(v) for v in group.shard_views(whole)]
    return out


def matches(call, candidates) -> bool:
    return any(call.numel == n and abs(call.fingerprint - f) <= REL * w + 1e-9
               and abs(call.weight - w) <= REL * w + 1e-9 for n, f, w in candidates)


def unmatched(sends, candidates) -> list[int]:
    """Indices of the sends that carry none of ``candidates``."""
    return [k for k, c in enumerate(sends) if not matches(c, candidates)]


def library_calls(calls) -> list[str]:
    """Every process-group call that is not a point-to-point message: a library collective (the
    store and the backend are every task's business: :meth:`Run.problems` judges them)."""
    return sorted({c.kind for c in calls if c.kind not in ("send", "recv") and "." not in c.kind})


# ---- shared by the probes and judges of lesson 10 -------------------------------------------

def draw() -> int:
    return int.from_bytes(os.urandom(4), "little")


def common_seed(probe: Probe, key: str) -> int:
    """A seed every rank of the world shares: rank 0's, drawn from its secret and sent to
    each peer (outside every case: not the student's message; sends alone, so that a world
    offering messages only can run it). The judge gets it as ``run.seed(0, key)``."""
    import torch.distributed as dist

    seed = torch.tensor([probe.seed(key) % 1_000_000 if probe.rank == 0 else 0], dtype=torch.int64)
    if probe.rank == 0:
        for peer in range(1, probe.size):
            dist.send(seed, peer)
    else:
        dist.recv(seed, 0)
    return int(seed.item())


def tensor(seed: int, shape) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed % (1 << 62)))


def judge_ring(where, calls, elements, carried, what, verdict) -> None:
    """Library collectives score nothing; the ring's bytes exactly; every message a block it may carry."""
    library = library_calls(calls)
    if library:
        verdict.add(f"{where}: called {', '.join(library)}: {LIBRARY}; {what}")
        return
    sends = [c for c in calls if c.kind == "send"]
    sent = sum(c.numel for c in sends)
    if sent != elements:
        verdict.add(f"{where}: sent {sent} elements; the ring sends exactly {elements} ({what})")
        return
    wrong = unmatched(sends, carried)
    if wrong:
        verdict.add(f"{where}: message {wrong[0] + 1} of {len(sends)} ({sends[wrong[0]].numel} elements) carries "
                    "none of the blocks this ring sends (a rank's piece, or a running sum of the gradients): "
                    "every block must travel in the messages")


def copy_or_none(t: torch.Tensor) -> torch.Tensor | None:
    """A copy of ``t``, or None when its storage cannot hold it (freed)."""
    if t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size():
        return None
    return t.detach().clone()
