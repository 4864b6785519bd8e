"""A model cut into chunks, and one chunk's three steps: F, B and W.

The model is a stack of ``L`` equal layers, ``y = act(x·Wᵀ + b)``: every layer costs the
same, so a chunk's time is proportional to its layers and a pipeline's bubbles show
cleanly, even on a CPU. Chunk ``c`` of ``C`` holds layers ``c·L/C .. (c+1)·L/C − 1``.

A :class:`Stage` runs one chunk with the backward pass split in two, after the
zero-bubble schedules (Qi et al.)::

    F  forward:          keep each layer's input, return the chunk's output
    B  input gradient:   grad of the chunk's input, from grad of its output (what the
                         previous stage waits for); keeps each layer's pre-activation grad
    W  weight gradient:  dW = gᵀ·x, db = Σ g for each layer, added to the gradients;
                         then the micro-batch's activations are freed

``backward`` is B then W at once, the plain backward. The arithmetic is autograd's own
(``addmm``, ``tanh_backward``, ``g.t().mm(x)``), so a pipeline's gradients are the bits
one process's ``loss.backward()`` makes, accumulated micro-batch by micro-batch in the
same order.

The loss is half the squared error, averaged over the micro-batches: the last stage
starts the backward pass from ``(y − target)/m`` (:func:`loss_grad`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

ACTIVATIONS = ("tanh", "relu")


def make_layers(num_layers: int, width: int, seed: int = 0, dtype=torch.float32,
                integer: bool = False, device=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_layers`` pairs ``(W, b)`` of a ``width``-wide model, drawn from ``seed``.

    ``integer``: weights in {−1, 0, 1} and biases in {−2..2} (with ``relu`` and float64 every
    sum is exact, so gradients agree bit for bit in any order: what the grader uses).
    ``device``: where they live (drawn on the CPU, so every device gets the same values).
    """
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        if integer:
            w = torch.randint(-1, 2, (width, width), generator=gen).to(dtype)
            b = torch.randint(-2, 3, (width,), generator=gen).to(dtype)
        else:
            w = (torch.randn(width, width, generator=gen) / width ** 0.5).to(dtype)
            b = (torch.randn(width, generator=gen) * 0.1).to(dtype)
        layers.append((w.to(device), b.to(device)) if device is not None else (w, b))
    return layers


def chunk_layers(layers: list, num_chunks: int, chunk: int) -> list:
    """The layers of ``chunk`` when ``layers`` are cut into ``num_chunks`` equal chunks."""
    if num_chunks < 1 or len(layers) % num_chunks:
        raise ValueError(f"{len(layers)} layers do not cut into {num_chunks} equal chunks")
    if not 0 <= chunk < num_chunks:
        raise ValueError(f"chunk {chunk} is not one of 0..{num_chunks - 1}")
    per = len(layers) // num_chunks
    return layers[chunk * per:(chunk + 1) * per]


def loss_grad(y: torch.Tensor, target: torch.Tensor, m: int) -> torch.Tensor:
    """Gradient of ``0.5·Σ(y − target)² / m`` with respect to ``y``: where B starts."""
    return (y - target) / m


def loss_value(y: torch.Tensor, target: torch.Tensor, m: int) -> float:
    return float(0.5 * ((y - target) ** 2).sum() / m)


class Stage:
    """One chunk of layers on one rank, with F, B and W as separate steps.

    ``forward(x, mb)``, ``backward_input(grad_y, mb)``, ``backward_weight(mb)`` and
    ``backward(grad_y, mb)`` (B then W); ``grads`` holds the accumulated ``(dW, db)``
    per layer. ``log`` lists the steps run, ``(kind, mb)``; ``held``/``peak_held`` count
    micro-batches whose activations are kept (from F until W), ``held_bytes``/``peak_bytes``
    the bytes of what is kept for them (layer inputs, then the gradients W needs).
    """

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], activation: str = "tanh"):
        if not layers:
            raise ValueError("a stage needs at least one layer")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
        self.weights = [(w.detach().clone(), b.detach().clone()) for w, b in layers]
        self.activation = activation
        self.grads = [(torch.zeros_like(w), torch.zeros_like(b)) for w, b in self.weights]
        self._inputs: dict[int, list[torch.Tensor]] = {}    # mb -> each layer's input, and the output
        self._grads: dict[int, list[torch.Tensor]] = {}     # mb -> each layer's pre-activation grad
        self.log: list[tuple[str, int]] = []
        self.peak_held = 0
        self.held_bytes = 0
        self.peak_bytes = 0

    @property
    def held(self) -> int:
        return len(self._inputs)

    def output_shape(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape F returns for an input of ``input_shape``."""
        return tuple(input_shape[:-1]) + (self.weights[-1][0].shape[0],) if self.weights else tuple(input_shape)

    def forward(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        if mb in self._inputs:
            raise RuntimeError(f"F of micro-batch {mb} ran twice before its backward")
        self.log.append(("F", mb))
        kept = [x]
        for w, b in self.weights:
            z = torch.addmm(b, kept[-1], w.t())
            kept.append(torch.tanh(z) if self.activation == "tanh" else torch.relu(z))
        self._inputs[mb] = kept
        self.peak_held = max(self.peak_held, self.held)
        self._count(kept, +1)
        return kept[-1]

    def backward_input(self, grad_y: torch.Tensor, mb: int) -> torch.Tensor:
        """B: the gradient of the chunk's input; the layers' gradients wait for W."""
        if mb not in self._inputs or mb in self._grads:
            raise RuntimeError(f"B of micro-batch {mb} without its F, or twice")
        self.log.append(("B", mb))
        kept, grads, g = self._inputs[mb], [], grad_y
        for i in range(len(self.weights) - 1, -1, -1):
            y = kept[i + 1]
            pre = (torch.ops.aten.tanh_backward(g, y) if self.activation == "tanh"
                   else torch.ops.aten.threshold_backward(g, y, 0))
            grads.append(pre)
            g = pre.mm(self.weights[i][0])
        grads.reverse()
        self._grads[mb] = grads
        self._count(kept[-1:], -1)          # the output was kept for B alone
        self._count(grads, +1)
        return g

    def backward_weight(self, mb: int) -> None:
        """W: add this micro-batch's weight and bias gradients, then free its activations."""
        if mb not in self._grads:
            raise RuntimeError(f"W of micro-batch {mb} before its B")
        self.log.append(("W", mb))
        kept, grads = self._inputs.pop(mb), self._grads.pop(mb)
        self._count(kept[:-1] + grads, -1)
        for (dw, db), x, g in zip(self.grads, kept, grads):
            dw.add_(g.t().mm(x))
            db.add_(g.sum(0))

    def _count(self, tensors, sign: int) -> None:
        self.held_bytes += sign * sum(t.numel() * t.element_size() for t in tensors)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def backward(self, grad_y: torch.Tensor, mb: int) -> torch.Tensor:
        """B and W at once: the plain backward of one micro-batch."""
        g = self.backward_input(grad_y, mb)
        self.backward_weight(mb)
        self.log[-2:] = [("BW", mb)]
        return g

    def loss_grad(self, y: torch.Tensor, target: torch.Tensor, m: int) -> torch.Tensor:
        """Where the last stage's B starts: :func:`loss_grad`."""
        return loss_grad(y, target, m)

    def loss_value(self, y: torch.Tensor, target: torch.Tensor, m: int) -> float:
        return loss_value(y, target, m)

    def flat_grads(self) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for pair in self.grads for t in pair]) if self.grads else torch.zeros(0)


def as_module(layers: list[tuple[torch.Tensor, torch.Tensor]], activation: str = "tanh") -> nn.Sequential:
    """The same layers as an ``nn.Sequential`` of ``Linear`` and activation: what one process
    and ``torch.distributed.pipelining`` run."""
    mods = []
    for w, b in layers:
        lin = nn.Linear(w.shape[1], w.shape[0], dtype=w.dtype, device=w.device)
        with torch.no_grad():
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        mods += [lin, nn.Tanh() if activation == "tanh" else nn.ReLU()]
    return nn.Sequential(*mods)


def one_process(layers, micro_batches, targets, activation: str = "tanh"):
    """One process's step: every micro-batch forward and backward through the whole model,
    gradients accumulated in micro-batch order. Returns ``(grads per layer, losses)``."""
    model = as_module(layers, activation)
    m, losses = len(micro_batches), []
    for x, t in zip(micro_batches, targets):
        y = model(x)
        losses.append(loss_value(y.detach(), t, m))
        y.backward(loss_grad(y.detach(), t, m))
    lins = [mod for mod in model if isinstance(mod, nn.Linear)]
    return [(lin.weight.grad, lin.bias.grad) for lin in lins], losses
