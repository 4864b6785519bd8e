"""Whole training steps on GPUs under the course's rule for fair comparisons.

``bench-ddp --backend nccl`` (lesson 6: the bucketed reducer against torch DDP) and
``bench-sharded --backend nccl`` (lesson 10: ZeRO-1/2/3 against torch DDP and FSDP2) time
training steps -- forward, backward with its communication, optimizer step -- not single
collectives. Their contenders follow the rule (``docs/benchmarks.md``,
:mod:`~collectives.course.benchmarks.gpu_timing`) this way:

1. **launched the same way**: every contender's step is issued from Python, ``eager``. None is
   replayed from a CUDA graph: the course's reducers keep their state in Python hooks that run
   during backward (which gradients arrived, which bucket is full), and a replay runs no
   Python, so no contender is captured, torch's included (:data:`NO_GRAPH`);
2. **untraced**: the rank takes the course's trace off first (:func:`untrace`), so the course's
   own collectives, like torch's, are NCCL's calls;
3. **the same work**: every contender trains the same model from the same weights on the same
   batch, already on the GPU; whatever a contender copies (gradients into buckets, parameters
   into shards) is inside its step (``inputs``: ``copied``);
4. **interleaved rounds**: every contender is built and warmed, then each takes one step per
   round, in turn (:func:`in_rounds`): one step issued untimed, one between CUDA events, the
   slowest rank's; the record keeps the median and the spread of the rounds.

Peak memory is not measured here: every contender is alive during the rounds, so each one's
memory is measured alone, before (the benchmark's own code).
"""

from __future__ import annotations

from typing import Callable

import torch

from . import gpu_timing as rule

LAUNCH, INPUTS = "eager", "copied"
NO_GRAPH = ("--launch graph is not offered for training steps: the course's reducers run Python hooks "
            "during backward, which a CUDA graph's replay does not run; every contender runs eager")


def untrace() -> None:
    """Take the course's trace off this rank (:func:`~gpu_timing.untrace_rank`)."""
    rule.untrace_rank()


def in_rounds(steps: dict[str, Callable[[], object]], rounds: int, device: torch.device,
              warmup: int = 0) -> dict[str, dict]:
    """Each of ``steps`` (name -> one training step) warmed ``warmup`` times, then timed once
    per round, in turn, for ``rounds`` rounds (:func:`~gpu_timing.rounds`). Returns name ->
    ``{"seconds": median, "spread": [lowest, highest], "times": every round's}``. A step
    that raises is a broken contender, not a size it cannot take: a RuntimeError names it."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    for _ in range(warmup):
        for step in steps.values():
            step()
    skipped: list[str] = []
    samples = rule.rounds(steps, iters=1, skipped=skipped, count=rounds, device=device)
    if skipped:
        raise RuntimeError("training steps that could not be timed: " + "; ".join(skipped))
    out = {}
    for name, times in samples.items():
        middle, spread = rule.summary(times)
        out[name] = dict(seconds=middle, spread=spread, times=times)
    return out


def fields() -> dict:
    """The record's words on the rule (:func:`~gpu_timing.fields`): eager, copied, nothing
    skipped, and why no contender is replayed (``why_eager``)."""
    return dict(rule.fields(LAUNCH, INPUTS, []), why_eager=NO_GRAPH)


def time_steps(built: dict, x: torch.Tensor, iters: int, device) -> dict:
    """Each contender of ``built`` (name -> its forward and its optimizer step) timed as one
    training step on ``x`` (:func:`in_rounds`; the first, untimed, builds the optimizer's
    state), then closed where it can be."""
    steps = {name: (lambda fwd=fwd, step=step: (fwd(x).square().mean().backward(), step()))
             for name, (fwd, step) in built.items()}
    try:
        return in_rounds(steps, iters, device, warmup=1)
    finally:
        for fwd, _ in built.values():
            if hasattr(fwd, "close"):
                fwd.close()
