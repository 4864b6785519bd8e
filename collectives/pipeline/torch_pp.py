"""The same model, chunks and micro-batches through ``torch.distributed.pipelining``.

``torch_step`` builds one ``PipelineStage`` per chunk this rank holds (chunk c on rank
c mod p, as :mod:`.runner` places them), runs one step of torch's schedule -- GPipe,
1F1B, interleaved 1F1B, or its interleaved zero-bubble schedule (B and W split, as
ZB-H1) -- and returns the gradients per chunk. Torch cuts the batch into the micro-batches
itself (along dim 0); the loss is the one the course's stages start from: its gradient
with respect to the output is ``(y − t)/m`` exactly, and ``scale_grads=False`` leaves the
sum of the micro-batches' gradients as it is.

``spans``: after a step, each F, B and W torch's stages ran, ``(kind, mb, chunk, start, end)``
in ``time.perf_counter()`` seconds -- the runner's trace, so the same bubble is read from both
(:mod:`.measure`); a B that is the whole backward is a ``B`` with no ``W``.
"""

from __future__ import annotations

import time

import torch

from ..core import ops
from .stage import as_module, chunk_layers

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble"}


def surrogate_loss(m: int):
    """A loss whose gradient in ``y`` is ``(y − t)/m``: what :func:`.stage.loss_grad` hands B."""
    def loss(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (y * ((y - t) / m).detach()).sum()
    return loss


class TorchPipeline:
    """One rank's stages and one of torch's schedules, built once and stepped many times."""

    def __init__(self, layers, name: str, num_chunks: int, m: int, activation: str = "tanh", group=None):
        from torch.distributed import pipelining
        if name not in TORCH_SCHEDULES:
            raise ValueError(f"no torch schedule for {name!r}; known: {', '.join(TORCH_SCHEDULES)}")
        rank, p = ops.group_rank_and_size(group)
        self.rank, self.p, self.C, self.m = rank, p, num_chunks, m
        self.modules = {c: as_module(chunk_layers(layers, num_chunks, c), activation)
                        for c in range(rank, num_chunks, p)}
        device = layers[0][0].device
        stages = [pipelining.PipelineStage(mod, c, num_chunks, device, group=group)
                  for c, mod in self.modules.items()]
        cls = getattr(pipelining, TORCH_SCHEDULES[name])
        single = name in ("gpipe", "1f1b")
        self.schedule = cls(stages[0] if single else stages, n_microbatches=m, loss_fn=surrogate_loss(m),
                            scale_grads=False)
        self.spans: list[tuple[str, int, int, float, float]] = []
        for stage, c in zip(stages, self.modules):
            self._time(stage, c)

    def _time(self, stage, chunk: int) -> None:
        """Record each F, B and W of ``stage``: its methods, wrapped on the instance."""
        def wrap(kind: str, method):
            def timed(*args, **kwargs):
                start = time.perf_counter()
                out = method(*args, **kwargs)
                mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
                self.spans.append((kind, int(mb), chunk, start, time.perf_counter()))
                return out
            return timed
        stage.forward_one_chunk = wrap("F", stage.forward_one_chunk)
        stage.backward_one_chunk = wrap("B", stage.backward_one_chunk)
        stage.backward_weight_one_chunk = wrap("W", stage.backward_weight_one_chunk)

    def step(self, batch: torch.Tensor | None, target: torch.Tensor | None) -> None:
        self.spans = []
        for mod in self.modules.values():
            mod.zero_grad(set_to_none=True)
        holds_first, holds_last = 0 in self.modules, self.C - 1 in self.modules
        kwargs = {}
        if holds_last:
            kwargs["target"] = target
        if holds_first:
            self.schedule.step(batch, **kwargs)
        else:
            self.schedule.step(**kwargs)

    def grads(self) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        out = {}
        for c, mod in self.modules.items():
            lins = [x for x in mod if isinstance(x, torch.nn.Linear)]
            out[c] = [(lin.weight.grad, lin.bias.grad) for lin in lins]
        return out


def torch_step(layers, name: str, num_chunks: int, micro_batches, targets, activation: str = "tanh", group=None):
    """One step of torch's schedule ``name``; this rank's gradients per chunk."""
    pipe = TorchPipeline(layers, name, num_chunks, len(micro_batches), activation, group)
    pipe.step(torch.cat(micro_batches), torch.cat(targets))
    return pipe.grads()
