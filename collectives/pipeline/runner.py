"""One runner for every schedule: steps in the list's order, activations and gradients as
``isend``/``irecv`` messages, nothing else.

Rank r holds the chunks ``r, r + p, ...`` (:class:`Pipeline`). A step of chunk c::

    F(i, c):  x = micro-batch i (c = 0) or irecv from rank of c − 1    y = stage.forward(x)
              c < C − 1: isend y to rank of c + 1       c = C − 1: keep (y − t_i)/m for B
    B(i, c):  g = irecv from rank of c + 1 (c = C − 1: the kept loss gradient)
              gx = stage.backward_input(g) if a W of (i, c) follows, else stage.backward(g)
              c > 0: isend gx to rank of c − 1
    W(i, c):  stage.backward_weight(i)

Sends never wait: each ``isend``'s handle is kept and waited for only when the whole step
is done (gloo's ``isend`` completes when the peer receives), so a rank only ever waits for
a message its schedule consumes now -- the rule the simulator (:mod:`.simulate`) plays,
which is why a schedule it passes cannot hang here. Every message
carries a tag naming (micro-batch, chunk, direction), so an activation can never be taken
for a gradient between the same two ranks (interleaved, p = 2: both flow both ways).

A second, visible step: the receive of the next step's message is posted before this step
computes (``prefetch``), so it arrives while the rank works instead of after.

Shapes are agreed once, at the first step: chunk 0's rank knows the micro-batch's shape,
works out its output's with ``stage.output_shape`` and sends it on as a small int64 tensor
(:func:`shape_message`); every later step allocates receive buffers from what it learned.

Cost per micro-batch and boundary: one activation forward, one gradient back, each
α + a·β for a = rows × width × element size; a step moves 2·m·a bytes across each cut.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..core import ops
from .schedules import Step
from .simulate import simulate
from .stage import Stage

SHAPE_SLOTS = 4      # [ndim, d0, d1, d2]: activations of up to three dimensions
SHAPE_TAG = 1 << 20


def shape_message(shape, device=None) -> torch.Tensor:
    """The int64 tensor that tells the next stage an activation's shape: [ndim, d0, d1, d2]
    (on ``device``: the activations' own, so that NCCL carries it too)."""
    if len(shape) > SHAPE_SLOTS - 1:
        raise ValueError(f"an activation of {len(shape)} dimensions; at most {SHAPE_SLOTS - 1} travel")
    return torch.tensor([len(shape), *shape] + [0] * (SHAPE_SLOTS - 1 - len(shape)), dtype=torch.int64,
                        device=device)


def shape_from(message: torch.Tensor) -> tuple[int, ...]:
    ndim = int(message[0])
    return tuple(int(d) for d in message[1:1 + ndim])


def tag(mb: int, chunk: int, num_chunks: int, gradient: bool) -> int:
    """The message tag of micro-batch ``mb``'s activation (or gradient) leaving ``chunk``."""
    return 2 * (mb * num_chunks + chunk) + int(gradient)


class Pipeline:
    """One rank's part of a pipeline: its stages by chunk, and the runner of schedules.

    ``stages``: ``{chunk: Stage}`` for the chunks this rank holds (``r, r + p, ...`` of
    ``num_chunks``). :meth:`step` runs one training step; ``spans`` then holds each
    step's (step, start, end) in ``time.perf_counter()`` seconds, the trace a timeline
    is drawn from.
    """

    def __init__(self, stages: dict[int, Stage], num_chunks: int, group=None):
        self.rank, self.p = ops.group_rank_and_size(group)
        if num_chunks < self.p or num_chunks % self.p or sorted(stages) != list(range(self.rank, num_chunks, self.p)):
            raise ValueError(f"rank {self.rank} of {self.p} holds chunks {list(range(self.rank, num_chunks, self.p))}"
                             f" of {num_chunks}; got {sorted(stages)}")
        self.stages, self.C, self.group = stages, num_chunks, group
        self.in_shape: dict[int, tuple[int, ...]] = {}    # chunk -> its input's shape, agreed once
        first_weight = stages[min(stages)].weights[0][0]
        self.dtype, self.device = first_weight.dtype, first_weight.device   # what activations travel as
        self.synchronize = self.device.type == "cuda"     # spans of a GPU's work: wait for it first
        self.spans: list[tuple[Step, float, float]] = []

    def _peer(self, chunk: int) -> int:
        return ops.global_rank(self.group, chunk % self.p)

    def agree_shapes(self, first: torch.Tensor | None) -> None:
        """Pass every chunk's input shape down the chunks, once: a chain of small messages.
        ``first`` is a micro-batch on chunk 0's rank (None elsewhere); activations travel in
        the weights' dtype, on their device."""
        sends = []
        for c in sorted(self.stages):
            if c == 0:
                self.in_shape[0] = tuple(first.shape)
            elif (c - 1) % self.p == self.rank:       # one rank holds both chunks (p = 1): no message
                self.in_shape[c] = self.stages[c - 1].output_shape(self.in_shape[c - 1])
            else:
                msg = torch.empty(SHAPE_SLOTS, dtype=torch.int64, device=self.device)
                dist.recv(msg, self._peer(c - 1), group=self.group, tag=SHAPE_TAG + c)
                self.in_shape[c] = shape_from(msg)
            if c < self.C - 1 and (c + 1) % self.p != self.rank:
                out = shape_message(self.stages[c].output_shape(self.in_shape[c]), self.device)
                sends.append(dist.isend(out, self._peer(c + 1), group=self.group, tag=SHAPE_TAG + c + 1))
        for work in sends:
            work.wait()

    def step(self, schedule, micro_batches: list, targets: list | None = None, *, check: bool = True) -> list[float]:
        """Run this rank's list of ``schedule`` (a list per rank, checked first with the
        simulator: an invalid or deadlocking schedule is refused before any message).
        ``micro_batches`` are read on chunk 0's rank, ``targets`` on the last chunk's (elsewhere
        lists of m ``None``); returns the losses of the micro-batches whose last chunk is here."""
        if len(schedule) != self.p:
            raise ValueError(f"a schedule for {len(schedule)} ranks, in a group of {self.p}")
        if check:
            simulate(schedule, len(micro_batches), num_chunks=self.C)
        return self.run(schedule[self.rank], micro_batches, targets)

    def run(self, steps: list[Step], micro_batches: list, targets: list | None = None, *,
            prefetch: bool = True) -> list[float]:
        """Run ``steps``, this rank's part of a schedule, unchecked. A B is the input gradient
        alone when ``steps`` has a W for the same micro-batch and chunk (W runs on B's rank).

        ``prefetch``: post the receive of the next step's message before computing this step,
        so it lands while this rank computes (a posted receive never blocks: no new deadlock).
        """
        m = len(micro_batches)
        if not self.in_shape:
            self.agree_shapes(micro_batches[0])
        split = {(s.mb, s.chunk) for s in steps if s.kind == "W"}
        loss_grads: dict[int, torch.Tensor] = {}
        losses: list[float] = []
        posted: dict[int, tuple] = {}
        mailbox: dict[int, torch.Tensor] = {}     # messages between two chunks of this rank (p = 1)
        self.spans = []
        sends = []

        def post(k: int) -> None:
            if k < len(steps) and k not in posted:
                wanted = self._incoming(steps[k])
                if wanted is not None and wanted[1] is not None:
                    shape, peer, message_tag = wanted
                    buf = torch.empty(shape, dtype=self.dtype, device=self.device)
                    posted[k] = (dist.irecv(buf, peer, group=self.group, tag=message_tag), buf)

        def send(t: torch.Tensor, to_chunk: int, message_tag: int) -> None:
            if to_chunk % self.p == self.rank:
                mailbox[message_tag] = t
            else:
                sends.append(dist.isend(t.contiguous(), self._peer(to_chunk), group=self.group, tag=message_tag))

        for k, s in enumerate(steps):
            stage, c, i = self.stages[s.chunk], s.chunk, s.mb
            post(k)
            if prefetch:
                post(k + 1)
            if k in posted:
                work, message = posted.pop(k)
                work.wait()
            elif self._incoming(s) is not None:
                message = mailbox.pop(self._incoming(s)[2])
            if self.synchronize:
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            if s.kind == "F":
                y = stage.forward(micro_batches[i] if c == 0 else message, i)
                if c == self.C - 1:
                    loss_grads[i] = stage.loss_grad(y, targets[i], m)
                    losses.append(stage.loss_value(y, targets[i], m))
                else:
                    send(y, c + 1, tag(i, c, self.C, False))
            elif s.kind == "B":
                g = loss_grads.pop(i) if c == self.C - 1 else message
                gx = stage.backward_input(g, i) if (i, c) in split else stage.backward(g, i)
                if c > 0:
                    send(gx, c - 1, tag(i, c, self.C, True))
            else:
                stage.backward_weight(i)
            if self.synchronize:
                torch.cuda.synchronize(self.device)
            self.spans.append((s, start, time.perf_counter()))
        for work in sends:
            work.wait()
        return losses

    def _incoming(self, s: Step):
        """(shape, peer, tag) of the message step ``s`` consumes (peer None: from this rank's
        own other chunk), or None."""
        src = s.chunk - 1 if s.kind == "F" and s.chunk > 0 else s.chunk + 1 if s.kind == "B" and \
            s.chunk < self.C - 1 else None
        if src is None:
            return None
        shape = self.in_shape[s.chunk] if s.kind == "F" else self.stages[s.chunk].output_shape(self.in_shape[s.chunk])
        peer = None if src % self.p == self.rank else self._peer(src)
        return shape, peer, tag(s.mb, src, self.C, s.kind == "B")


def make_pipeline(layers, num_chunks: int, activation: str = "tanh", group=None) -> Pipeline:
    """This rank's :class:`Pipeline` of ``layers`` cut into ``num_chunks`` chunks."""
    from .stage import chunk_layers
    rank, p = ops.group_rank_and_size(group)
    stages = {c: Stage(chunk_layers(layers, num_chunks, c), activation) for c in range(rank, num_chunks, p)}
    return Pipeline(stages, num_chunks, group)
