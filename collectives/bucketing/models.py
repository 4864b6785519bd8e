"""The models lesson 6 trains, their data, and the timeline picture.

* :class:`TinyTransformer` -- a small encoder-only language model built in code (no
  downloads): an embedding, a few ``nn.TransformerEncoderLayer``, a head. Its parameters
  range from a 128-element LayerNorm bias to the vocabulary-sized embedding and head, which
  is what makes bucketing interesting.
* :class:`DeepMLP` -- many equal layers and little compute per byte of gradient: the
  communication-heavy case.
* The small float64 models the tests and the exercise use: :class:`SmallMLP` (sizes chosen
  so that bucket caps give exactly 1, 2 or 3 buckets), :class:`TiedNet` (a weight used
  twice), :class:`BranchNet` (a branch only some ranks use, and one no rank uses),
  :class:`TwoBranchNet` (gradient order that differs between ranks).
* :func:`plot_timeline` -- backward compute against bucket all-reduces, from
  :attr:`BucketedReducer.stats <collectives.bucketing.BucketedReducer.stats>`.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn


class DeviceTime(torch.autograd.Function):
    """Identity whose backward waits ``seconds`` without using the CPU.

    A stand-in for backward kernels running on an accelerator: on a GPU the host and the
    network are free while a layer's backward runs, which is what lets DDP hide its
    all-reduces. On a CPU, backward *is* the CPU; this lets the lab show both worlds.
    """

    @staticmethod
    def forward(ctx, x, seconds: float):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class TinyTransformer(nn.Module):
    """Token embedding + learned positions, ``layers`` encoder layers, LayerNorm, a head.

    ``device_ms`` > 0 adds that many milliseconds of off-CPU "device time" to the backward
    of every layer (:class:`DeviceTime`).
    """

    def __init__(self, vocab: int = 2048, d_model: int = 128, nhead: int = 4, ff: int = 512,
                 layers: int = 2, seq: int = 32, device_ms: float = 0.0):
        super().__init__()
        self.seq, self.vocab, self.device_ms = seq, vocab, device_ms
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(0.02 * torch.randn(seq, d_model))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, nhead, ff, dropout=0.0, batch_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
            if self.device_ms:
                x = DeviceTime.apply(x, self.device_ms / 1e3)
        return self.head(self.norm(x))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))

    def batch(self, size: int, seed: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(self.vocab, (size, self.seq + 1), generator=g)
        tokens = tokens.to(device) if device is not None else tokens
        return tokens[:, :-1], tokens[:, 1:]


class DeepMLP(nn.Module):
    """``depth`` Linear(width, width) + tanh layers: lots of gradient, little compute."""

    def __init__(self, width: int = 512, depth: int = 8):
        super().__init__()
        self.width = width
        self.net = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)

    def batch(self, size: int, seed: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(size, self.width, generator=g), torch.randn(size, self.width, generator=g)
        return (x, y) if device is None else (x.to(device), y.to(device))


def make_model(kind: str, **sizes) -> nn.Module:
    """``"transformer"`` or ``"mlp"``, with keyword sizes for the constructor."""
    if kind == "transformer":
        return TinyTransformer(**sizes)
    if kind == "mlp":
        return DeepMLP(**sizes)
    raise ValueError(f"unknown model {kind!r}: use 'transformer' or 'mlp'")


# ---- the small float64 models of the tests and the exercise --------------------------

class SmallMLP(nn.Module):
    """8 -> 16 -> 16 -> 4. In float64 its parameters, in backward order (last registered
    first), take 32, 512, 128, 2048, 128 and 1024 bytes: 3872 in all. Caps of 1 MiB,
    2720 bytes and 544 bytes give exactly 1, 2 and 3 buckets (see the tests)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class TiedNet(nn.Module):
    """An embedding whose weight is also the output projection (one Parameter, used twice)."""

    def __init__(self, vocab: int = 10, dim: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


class BranchNet(nn.Module):
    """A trunk, a branch every rank uses, a branch only ranks told ``use_b`` use, and a
    layer nobody uses."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.branch_a = nn.Linear(8, 4)
        self.branch_b = nn.Linear(8, 4)
        self.never = nn.Linear(8, 4)

    def forward(self, x, use_b: bool = True):
        h = torch.tanh(self.trunk(x))
        out = self.branch_a(h)
        return out + self.branch_b(h) if use_b else out


class TwoBranchNet(nn.Module):
    """``head(f(x) + g(x))``; ``f_first`` decides which branch forward computes first.
    Autograd runs the later-created branch first, so the order gradients arrive in
    depends on it -- the tests give each rank a different order."""

    def __init__(self):
        super().__init__()
        self.f1, self.f2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.g1, self.g2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x, f_first: bool = True):
        def f():
            return self.f2(torch.tanh(self.f1(x)))

        def g():
            return self.g2(torch.tanh(self.g1(x)))
        if f_first:
            a = f()
            b = g()
        else:
            b = g()
            a = f()
        return self.head(a + b)


# ---- the timeline --------------------------------------------------------------------

def plot_timeline(stats: dict, ax=None, title: str = ""):
    """Draw one rank's backward: gradient-ready ticks against bucket all-reduce bars.

    ``stats`` is ``reducer.stats.relative()`` (times in seconds since backward started).
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 2.2 + 0.35 * len(stats["bucket_bytes"])))
    ms = 1e3
    ready = sorted(stats["param_ready"].values())
    ax.vlines([t * ms for t in ready], -0.9, -0.1, color="tab:blue", lw=1)
    ax.text(0, -0.5, "gradient hooks ", ha="right", va="center", fontsize=8)
    for b, nbytes in enumerate(stats["bucket_bytes"]):
        y = b + 1
        t_ready, t0, t1 = stats["bucket_ready"][b], stats["bucket_launched"][b], stats["bucket_done"][b]
        ax.barh(y, (t1 - t0) * ms, left=t0 * ms, height=0.6, color="tab:orange", alpha=0.8)
        ax.plot([t_ready * ms], [y], "k|", ms=10)
        ax.text(t1 * ms, y, f" {nbytes / 2**20:.2f} MiB", va="center", fontsize=7)
    ax.axvline(stats["end"] * ms, color="tab:red", ls="--", lw=1)
    ax.axvline(stats["finished"] * ms, color="tab:green", ls=":", lw=1)
    ax.set_yticks([0 - 0.5] + [b + 1 for b in range(len(stats["bucket_bytes"]))],
                  [""] + [f"bucket {b}" for b in range(len(stats["bucket_bytes"]))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since backward started (red: backward ends, green: gradients written)")
    ax.set_title(title or "backward compute (hooks) against bucket all-reduces (bars)")
    return ax
