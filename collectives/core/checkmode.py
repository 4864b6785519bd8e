"""Check mode: every rank of a group compares a call's arguments before it communicates.

With ``COLLECTIVES_CHECK=1`` (``launch.run(..., check=True)``; on in the exercise runner),
every course algorithm describes its call -- algorithm, element count, dtype, op, group,
device, and whatever else must agree (a layout, a density, a transport) -- and the ranks
of the group compare the descriptions. An all-to-all describes its pairs too (``pairs``):
the rows it sends each rank and expects from each, so a sender of 5 rows meets a receiver
expecting 3 in the check, not in the transport; its element count may differ by rank. Ranks that differ all raise
:class:`ArgumentMismatch`, naming who differs and how, instead of meeting in the middle of
the algorithm, where gloo aborts ("Received data size doesn't match expected size") or
waits for a message that never comes. It is the course's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.

The comparison travels through the **rendezvous store**, not the process group::

    rank r:  store.set("collectives/check/<group>/<k>/<r>", description)
             wait until every rank of the group has set call k, read them, compare

so the messages a test or a grader records at the process group are the algorithm's own,
with check mode on or off. Each group counts its checked calls (k = 0, 1, ...) on every
rank, so a rank that skipped a call is found too: the others wait at call k, and the
launcher's watchdog reports them "waiting in check of ring_all_reduce (call 5 of the
world) for ranks 2". A store round trip costs about 0.2 ms on 4 local ranks, against about
8 ms for an ``all_gather_object`` of the same description.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from . import trace

ReduceOp = dist.ReduceOp
PREFIX = "collectives/check"


class ArgumentMismatch(ValueError):
    """The ranks of a group called a collective with arguments that do not agree."""


_enabled: bool | None = None       # read once per process: every call of every algorithm asks
_calls: dict[tuple, int] = {}       # (store, group ranks) -> checked calls so far, on this rank


def enabled() -> bool:
    """True when ``COLLECTIVES_CHECK`` asks for the cross-rank argument check. Read once per
    process; a forked rank reads it again, after the launcher has set its environment."""
    global _enabled
    if _enabled is None:
        _enabled = os.environ.get("COLLECTIVES_CHECK", "0").lower() not in ("", "0", "false", "no")
    return _enabled


def _forget() -> None:
    global _enabled
    _enabled = None
    _calls.clear()


os.register_at_fork(after_in_child=_forget)


def _ranks(group) -> tuple[int, ...]:
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _ranks_text(ranks) -> str:
    return ", ".join(map(str, ranks))


def describe(what: str, tensor: torch.Tensor, op, group, agree: dict | None = None,
             uneven: bool = False) -> dict[str, str]:
    """The description ranks compare: what the algorithm needs to be the same everywhere
    (``uneven``: the element count may differ by rank, the pairs say what must match)."""
    ranks = "the world" if group is None else "ranks " + _ranks_text(_ranks(group))
    out = {"algorithm": what, "elements": "(by rank)" if uneven else str(tensor.numel()),
           "dtype": str(tensor.dtype).replace("torch.", ""), "op": getattr(op, "name", None) or str(op),
           "group": ranks, "device": tensor.device.type}
    for key, value in (agree or {}).items():
        out[key] = repr(value) if not isinstance(value, str) else value
    return out


def _wait_for(store, keys: list[str], timeout: float, status: str) -> list[bool]:
    """Spin on ``store.check`` (a file store's own ``wait`` polls every 10 ms) until every key
    exists or ``timeout`` passes; returns which keys exist."""
    deadline = time.monotonic() + timeout
    delay = 5e-5
    while not store.check(keys):
        if time.monotonic() > deadline:
            return [store.check([k]) for k in keys]
        trace._set_status(status)
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)
    return [True] * len(keys)


def compare_across_ranks(what: str, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                         agree: dict | None = None, timeout: float | None = None,
                         pairs: tuple[list[int], list[int]] | None = None) -> None:
    """Raise :class:`ArgumentMismatch` on every rank of ``group`` unless all of them call
    ``what`` with the same description (:func:`describe`); a no-op outside check mode.

    ``agree``: further arguments that must be the same on every rank ({"layout": (2, 2)}).
    ``pairs``: an all-to-all's ``(rows sent to each group rank, rows expected from each)``:
    rank s's sends[d] must equal rank d's receives[s] for every pair.
    ``timeout``: seconds to wait for the other ranks (default ``COLLECTIVES_CHECK_TIMEOUT``,
    else 300); a rank that never comes is named in the error.
    """
    if not enabled() or not dist.is_initialized() or dist.get_rank(group) < 0:
        return
    if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        return                  # a CUDA graph being captured records no host-side exchange
    store = dist.distributed_c10d._get_default_store()
    ranks = _ranks(group)
    key = (id(store), ranks)
    call = _calls.get(key, 0)
    _calls[key] = call + 1
    mine = describe(what, tensor, op, group, agree, uneven=pairs is not None)
    if pairs is not None:
        mine["pairs"] = json.dumps([list(pairs[0]), list(pairs[1])])
    base = f"{PREFIX}/{'-'.join(map(str, ranks))}/{call}/"
    store.set(base + str(dist.get_rank()), json.dumps(mine))
    keys = [base + str(r) for r in ranks]
    where = "the world" if group is None else f"the group of ranks {_ranks_text(ranks)}"
    limit = timeout if timeout is not None else float(os.environ.get("COLLECTIVES_CHECK_TIMEOUT", "300"))
    present = _wait_for(store, keys, limit, f"in check of {what} (call {call} on {where})")
    trace._set_status("")
    if not all(present):
        missing = [r for r, ok in zip(ranks, present) if not ok]
        raise ArgumentMismatch(f"{what}: rank{'s' if len(missing) > 1 else ''} {_ranks_text(missing)} did not "
                               f"make checked call {call} on {where} within {limit:g} s: a rank skipped a "
                               "collective, or called them in another order (checked because COLLECTIVES_CHECK=1)")
    everyone = [json.loads(v) for v in store.multi_get(keys)]
    differences = []
    if pairs is not None and all("pairs" in desc for desc in everyone):
        differences += _pair_differences([json.loads(desc.pop("pairs")) for desc in everyone], ranks)
        mine.pop("pairs")
    for field in mine:
        seen: dict[str, list[int]] = {}
        for rank, desc in zip(ranks, everyone):
            seen.setdefault(desc.get(field, "(not given)"), []).append(rank)
        if len(seen) > 1:
            differences.append(f"{field} " + " vs ".join(
                f"{value} on rank{'s' if len(rs) > 1 else ''} {_ranks_text(rs)}" for value, rs in seen.items()))
    if differences:   # one line: it is what a RankError's summary and a FAIL line show
        raise ArgumentMismatch(f"{what}: the ranks disagree on its arguments: " + "; ".join(differences)
                               + " (checked because COLLECTIVES_CHECK=1)")


def _pair_differences(pairs: list, ranks) -> list[str]:
    """Every pair (s, d) where rank s sends a number of rows rank d does not expect."""
    out = []
    for s, (sends, _) in enumerate(pairs):
        for d, (_, receives) in enumerate(pairs):
            if s < len(receives) and d < len(sends) and sends[d] != receives[s]:
                out.append(f"rank {ranks[s]} sends rank {ranks[d]} {sends[d]} rows but rank {ranks[d]} "
                           f"expects {receives[s]} from rank {ranks[s]}")
    return out[:4] + ([f"{len(out) - 4} more pairs"] if len(out) > 4 else [])
