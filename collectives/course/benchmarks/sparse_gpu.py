"""``bench-sparse --backend nccl``: lesson 8's sparse all-reduce against NCCL's dense one, under
the course's rule for fair GPU comparisons (``docs/benchmarks.md``, :mod:`.gpu_timing`).

* **both sides eager**: the sparse all-reduce reads sizes back to the host (threshold mode's
  counts, the split transport's pairs per owner), which a CUDA graph cannot capture; so NCCL's
  all-reduce is issued from Python too;
* **no trace wrapper on either side**: the rank takes the course's trace off
  (:func:`~.gpu_timing.untrace_rank`) once the bytes each contender sends are counted from one
  traced call; NCCL's all-reduce is called directly (:func:`~.gpu_timing.nccl_all_reduce`);
* **the same work counted** (``inputs: copied``): every contender -- NCCL's included -- starts
  from the caller's gradient, copied into the buffer it reduces in place (a reduce destroys
  its input), and ends with the sum in that buffer (:data:`INCLUDES`);
* **interleaved rounds**: every contender, the selections alone and the density sweep, once
  per round, in turn (:func:`~.gpu_timing.rounds`); each time is the median of the rounds, with
  their spread (lowest, highest).

The result has the shape of the CPU run's (``dense``, ``rows``, ``sweep``: the same tables),
plus ``spread`` per contender and ``rule`` (:func:`~.gpu_timing.fields`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...core import trace
from ...sparse import keep_count
from ...sparse.select import threshold_indices, topk_indices
from ..impl import resolve
from . import gpu_timing as rule

LAUNCH, INPUTS = "eager", "copied"
WHY_EAGER = ("the sparse all-reduce reads sizes back to the host (threshold counts, the split transport's pairs), "
             "which a CUDA graph cannot capture: every contender, NCCL's included, is issued from Python")
INCLUDES = {"dense": "a copy of the caller's gradient into the buffer, then NCCL's all-reduce of it in place, "
                     "called directly (torch.distributed.distributed_c10d)",
            "sparse": "the same copy, then the selection, the transport's collectives (torch's own functions, "
                      "untraced) and the sum of what arrives, in place",
            "select": "the selection alone: the indices and their values copied out, no communication"}


def _runs(x: torch.Tensor, density: float, sweep, variants, selection: str, impl: str, thr: float):
    """``(runs, rows)``: every contender's run by name, and the main density's rows as
    ``(variant, mode name, mode, selection)``."""
    reduce_ = resolve(impl + ":sparse_all_reduce")

    def sparse(transport, mode, how):
        buf, state = torch.empty_like(x), {}

        def run():
            buf.copy_(x)
            return reduce_(buf, transport=transport, selection=how, state=state, **mode)
        return run

    def select(how, d):
        state, kd = {}, keep_count(x.numel(), d)
        if how == "threshold":
            return lambda: x.index_select(0, threshold_indices(x, thr))
        return lambda: x.index_select(0, topk_indices(x, kd, how, state))

    dense_buf = torch.empty_like(x)
    runs = {"dense": lambda: (dense_buf.copy_(x), rule.nccl_all_reduce(dense_buf))}
    rows = [(v, f"top-k ({selection})", {"density": density}, selection) for v in variants]
    if variants:                      # the main density's other selections, as on CPUs
        rows += [("allgather", f"top-k ({s})", {"density": density}, s) for s in ("sample", "reuse", "topk")
                 if s != selection]
        rows.append(("allgather", "threshold", {"threshold": thr}, "threshold"))
    for variant, mode_name, mode, how in rows:
        runs[f"{variant}, {mode_name}"] = sparse(variant, mode, "auto" if how == "threshold" else how)
        runs.setdefault(f"select {how} {density:g}", select(how, density))
    for d in sweep:
        for variant in ("allgather", "split"):
            runs[f"{variant} {d:g}"] = sparse(variant, {"density": d}, selection)
        runs.setdefault(f"select {selection} {d:g}", select(selection, d))
    return runs, rows


def compare_on_gpu(x: torch.Tensor, density: float, sweep, iters: int, variants, selection: str, impl: str,
                   wire_bytes) -> dict:
    """On every rank of an NCCL world: the contenders' bytes counted from one traced call each,
    then every contender timed untraced, eager, in interleaved rounds. ``wire_bytes(trace, p)``
    counts a traced call's bytes (:func:`.sparse.wire_bytes`)."""
    p = dist.get_world_size()
    thr = float(torch.quantile(x[: 1 << 20].abs().float(), 1 - density))
    runs, rows = _runs(x, density, sweep, variants, selection, impl, thr)
    sent, used = {}, {}
    for name, run in runs.items():
        if name == "dense" or name.startswith("select"):
            continue
        with trace.recording() as t:
            info = run()
        sent[name], used[name] = wire_bytes(t, p), info.transport
    rule.untrace_rank()                      # recording() put the wrappers back: off before timing
    skipped: list[str] = []
    samples = rule.rounds(runs, iters=iters, skipped=skipped, device=x.device)
    times = {name: rule.summary(s) for name, s in samples.items()}
    dense, _ = times["dense"]
    out = dict(p=p, n=x.numel(), density=density, dense=dense, dense_sent=2 * (p - 1) / p * x.numel() * 4,
               rows=[], sweep=[], spread={name: spread for name, (_, spread) in times.items()},
               includes=dict(INCLUDES), why_eager=WHY_EAGER, rule=rule.fields(LAUNCH, INPUTS, skipped))
    for variant, mode_name, _, how in rows:
        name = f"{variant}, {mode_name}"
        if name in times and f"select {how} {density:g}" in times:
            out["rows"].append(dict(variant=variant, mode=mode_name, seconds=times[name][0],
                                    select=times[f"select {how} {density:g}"][0], sent=sent[name], used=used[name]))
    for d in sweep:
        names = (f"allgather {d:g}", f"split {d:g}", f"select {selection} {d:g}")
        if all(n in times for n in names):
            out["sweep"].append(dict(density=d, allgather=times[names[0]][0], split=times[names[1]][0],
                                     select=times[names[2]][0]))
    return out


def record_rule(results: dict) -> dict:
    """The rule's fields for a whole run's record (every gradient kind's world): how every
    contender was launched, what was counted, and every contender any world dropped."""
    skipped = [line for value in results.values() if isinstance(value, dict) and isinstance(value.get("rule"), dict)
               for line in value["rule"]["skipped"]]
    return rule.fields(LAUNCH, INPUTS, skipped)
