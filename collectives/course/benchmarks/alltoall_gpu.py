"""``bench-alltoall local --backend nccl``: lesson 11's all-to-alls against NCCL's, under the course's rule.

One process per GPU; at every size each contender exchanges the same ordinary tensor of
``nbytes`` per rank (``p`` equal blocks) into the same output tensor:

* ``dist.all_to_all_single`` -- NCCL's all-to-all (the row keeps the name the lesson's
  figures read), called directly: ``distributed_c10d.all_to_all_single``;
* ``linear``, ``pairwise``, ``bruck`` -- the lesson's (:mod:`collectives.alltoall`);
* ``dist.all_to_all_single, NCCL window`` -- NCCL's all-to-all between buffers NCCL
  registered as a symmetric window on every rank (where this torch offers the
  registration; else under ``skipped``, with why).

The run follows the course's rule for GPU comparisons (``docs/benchmarks.md``;
:mod:`collectives.course.benchmarks.gpu_timing`):

* **launched the same way**: ``launch="eager"`` issues every contender from Python;
  ``launch="graph"`` captures every one, NCCL's included, in a CUDA graph per size and
  replays it;
* **untraced**: NCCL is called directly, and the rank runs without the course's trace, so
  the lesson's own ``isend``/``irecv`` calls are torch's too (the messages of each call are
  counted from the trace first, before it comes off);
* **the same bytes**: every contender moves ``nbytes`` per rank between the caller's two
  ordinary tensors. Only the window works in memory of its own: ``inputs="copied"`` times
  its copy in and out with it, ``inputs="resident"`` leaves its input in the window;
* **CUDA events**, runs issued back to back, the slowest rank's; the median and spread of
  :data:`~collectives.course.benchmarks.gpu_timing.ROUNDS` rounds, each round timing every
  contender once, in turn.

Every contender is first checked at every size, as launched (a replay included), against
NCCL's result on integer-valued data, bit for bit; one that differs or raises is not timed
at that size, and says so under ``skipped``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...core import trace
from . import gpu_timing as rule

NCCL = "dist.all_to_all_single"
WINDOW = "dist.all_to_all_single, NCCL window"
OURS = ("linear", "pairwise", "bruck")


def _contenders(x: torch.Tensor, out: torch.Tensor, inputs: str) -> tuple[dict, dict, list[str]]:
    """name -> run(numel), an all-to-all of ``x[:numel]`` into ``out[:numel]``; name -> the
    (input, output) tensors it reads and writes; what could not run, and why."""
    import collectives.alltoall as a2a

    runs = {NCCL: lambda n: rule.nccl_all_to_all_single(out[:n], x[:n])}
    for name in OURS:
        fn = getattr(a2a, f"{name}_all_to_all")
        runs[name] = lambda n, fn=fn: fn(out[:n], x[:n])
    places = dict.fromkeys(runs, (x, out))
    skipped = []
    cap = x.numel()
    window, why = rule.nccl_window(2 * cap, x.dtype, dist.group.WORLD)
    if window is None:
        skipped.append(f"{WINDOW}: {why}")
    else:
        there, back = window[:cap], window[cap:]

        def in_window(n):
            rule.nccl_all_to_all_single(back[:n], there[:n])

        def copied(n):
            there[:n].copy_(x[:n])
            in_window(n)
            out[:n].copy_(back[:n])
        runs[WINDOW] = copied if inputs == "copied" else in_window
        places[WINDOW] = (x, out) if inputs == "copied" else (there, back)
    return runs, places, skipped


def check(runs: dict, places: dict, n: int) -> dict[str, object]:
    """Each contender, as launched and warmed up, against NCCL's all-to-all of the same
    integer-valued input of ``n`` elements: True, False or the error it raised (every
    contender is judged in the tensors it reads and writes: the window's own, when resident)."""
    rank, ok = dist.get_rank(), {}
    x = places[NCCL][0]
    values = ((torch.arange(n, device=x.device) * 7 + 1000 * rank) % 4099).to(x.dtype)
    expected = torch.empty_like(values)
    rule.nccl_all_to_all_single(expected, values)
    for name, run in runs.items():
        src, dst = places[name]
        try:
            run(n)                          # warm: a replayed contender is captured here
            src[:n].copy_(values)
            dst[:n].zero_()
            _synchronize(x)
            dist.barrier()
            run(n)
            _synchronize(x)
            ok[name] = bool(torch.equal(dst[:n], expected))
        except Exception as exc:  # noqa: BLE001 - reported: the contender is then not timed at this size
            ok[name] = f"raised {rule.said(exc)}"
        src[:n].zero_()                     # zeros from here: every timed run moves the same values
        _synchronize(x)
        dist.barrier()
    return ok


def _synchronize(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def _messages(sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> dict[tuple[str, int], int]:
    """Messages this rank sends in one call of each of the lesson's all-to-alls, per size, from the trace."""
    import collectives.alltoall as a2a
    found = {}
    for n in sizes:
        for name in OURS:
            with trace.recording() as t:
                getattr(a2a, f"{name}_all_to_all")(out[:n], x[:n])
            found[name, n] = len([e for e in t if e.kind in ("isend", "send")])
    return found


def batch(nbytes: int, iters: int) -> int:
    """Runs per timed batch: ``iters`` up to 1 MiB, a quarter of it above (each run is longer), at least 3."""
    return iters if nbytes <= 1 << 20 else max(3, iters // 4)


def in_rank(sizes: list[int], iters: int, launch: str = "eager", inputs: str = "copied",
            rounds: int = rule.ROUNDS) -> dict:
    """Runs on every rank, one GPU each: :func:`measure` on that GPU."""
    rule.check_launch(launch)
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return measure(sizes, iters, launch, inputs, rounds, torch.device("cuda", torch.cuda.current_device()))


def measure(sizes: list[int], iters: int, launch: str, inputs: str, rounds: int, device: torch.device) -> dict:
    """On every rank: messages counted, every contender checked at every size, then timed in
    interleaved rounds. Rows as ``bench-alltoall local`` writes them (times the slowest
    rank's), with the rule's fields. (On a CPU, with ``launch="eager"``, the same code runs
    under gloo: how the tests see it work.)"""
    rule.check_launch(launch)
    rule.check_inputs(inputs)
    p = dist.get_world_size()
    numels = [max(p, nbytes // 4 // p * p) for nbytes in sizes]
    x = torch.zeros(max(numels), device=device)
    out = torch.zeros(max(numels), device=device)
    messages = _messages(numels, x, out)
    rule.untrace_rank()
    plain, places, skipped = _contenders(x, out, inputs)
    runs = rule.launched(plain, launch)
    rows, checked = [], {}
    for n in numels:
        judged = checked[n * 4] = check(runs, places, n)
        good = {}
        for name, run in runs.items():
            if judged[name] is True:
                good[name] = lambda run=run, n=n: run(n)
            else:
                why = "differs from NCCL" if judged[name] is False else judged[name]
                skipped.append(f"{name} at {n * 4} bytes: {why}")
        samples = rule.rounds(good, iters=batch(n * 4, iters), skipped=skipped, where=f" at {n * 4} bytes",
                              count=rounds, device=device)
        for name, times in samples.items():
            middle, spread = rule.summary(times)
            rows.append(dict(name=name, nbytes=n * 4, verified=True, seconds=middle, spread=spread, times=times,
                             messages=messages.get((name, n)), launch=launch))
    return {"rows": rows, "world_size": p, "checked": {str(k): v for k, v in checked.items()},
            **rule.fields(launch, inputs, skipped)}
