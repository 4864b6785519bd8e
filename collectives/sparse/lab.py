"""The convergence lab: what sparsification costs in accuracy, on real data, against what
torch users pick today.

Data-parallel training of a small MLP on scikit-learn's ``load_digits`` (1,797 8×8 images
of handwritten digits, shipped with the package: no download), 4 ranks, torch's
``DistributedDataParallel`` with one communication hook per run:

==================  ==========================================================================
``dense``           DDP's own all-reduce (float32)
``topk_ef``         top-k 1 % per bucket with error feedback (:func:`~.hooks.sparse_hook`)
``topk_no_ef``      the same without a residual: what is not sent is lost
``threshold``       threshold mode (SINGA's) with error feedback
``fp16``            torch's ``fp16_compress_hook``: half the bytes, nothing dropped
``powersgd``        torch's ``powerSGD_hook``, rank 2 (low-rank, with error feedback)
==================  ==========================================================================

Each run returns its test-accuracy curve (one point per epoch) and the bytes each rank
handed to collectives per step, counted by the trace. scikit-learn is the ``lab`` extra
(``pip install -e '.[lab]'``; ``make test`` installs it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..core import launch, trace
from .hooks import SparseHookState, sparse_hook

RUNS = ("dense", "topk_ef", "topk_no_ef", "threshold", "fp16", "powersgd")


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """``(x_train, y_train, x_test, y_test)``: pixels scaled to [0, 1], a seeded shuffle."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_test = int(len(y) * test_fraction)
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


class DigitsMLP(nn.Module):
    """64 -> 64 -> 10: 4,810 parameters, one DDP bucket."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _hook_for(run: str, density: float, threshold: float):
    """``(state, hook)`` for DDP's ``register_comm_hook``, or None for DDP's default."""
    if run == "dense":
        return None
    if run == "topk_ef":
        return SparseHookState(density=density), sparse_hook
    if run == "topk_no_ef":
        return SparseHookState(density=density, error_feedback=False), sparse_hook
    if run == "threshold":
        return SparseHookState(threshold=threshold), sparse_hook
    if run == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        return None, default_hooks.fp16_compress_hook
    if run == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=2, min_compression_rate=1,
                                            use_error_feedback=True, random_seed=0)
        return state, powerSGD_hook.powerSGD_hook
    raise ValueError(f"unknown run {run!r}; runs are {', '.join(RUNS)}")


def train(run: str = "dense", epochs: int = 12, batch: int = 16, lr: float = 0.1, momentum: float = 0.0,
          density: float = 0.01, threshold: float = 0.01, seed: int = 0, data=None) -> dict:
    """On every rank of a world: train with ``run``'s hook; return the accuracy curve and bytes.

    Each rank takes every p-th training example; a step uses ``batch`` examples per rank
    (a global batch of p·batch). Plain SGD, so that the comparison is about the gradients
    that arrive, not an optimizer's memory of them. ``final`` is the mean test accuracy of
    the last three epochs (one epoch's figure moves by a point or two from epoch to epoch).
    ``data``: :func:`load_digits_split`'s four tensors, if already loaded.
    """
    from torch.nn.parallel import DistributedDataParallel

    rank, p = dist.get_rank(), dist.get_world_size()
    x_train, y_train, x_test, y_test = data if data is not None else load_digits_split(seed)
    x_mine, y_mine = x_train[rank::p], y_train[rank::p]
    torch.manual_seed(seed)
    model = DigitsMLP()
    ddp = DistributedDataParallel(model)
    hook = _hook_for(run, density, threshold)
    if hook is not None:
        ddp.register_comm_hook(*hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    steps = len(y_mine) // batch
    curve, bytes_per_step = [], []
    shuffle = torch.Generator().manual_seed(seed + 1)
    for epoch in range(epochs):
        order = torch.randperm(len(y_mine), generator=shuffle)
        for s in range(steps):
            rows = order[s * batch:(s + 1) * batch]
            opt.zero_grad()
            with trace.recording() as t:
                F.cross_entropy(ddp(x_mine[rows]), y_mine[rows]).backward()
            bytes_per_step.append(sum(e.nbytes for e in t.collectives()))
            opt.step()
        with torch.no_grad():
            curve.append((model(x_test).argmax(1) == y_test).float().mean().item())
    params = sum(q.numel() for q in model.parameters())
    return dict(run=run, curve=curve, final=sum(curve[-3:]) / len(curve[-3:]), params=params,
                bytes_per_step=sum(bytes_per_step[4:]) / max(len(bytes_per_step) - 4, 1),
                dense_bytes=params * 4)


def _train_each(runs, kwargs) -> dict[str, dict]:
    return {run: train(run, **kwargs) for run in runs}


def compare(runs=RUNS, world_size: int = 4, timeout: float = 600, **kwargs) -> dict[str, dict]:
    """Every run, one after the other, in one world of ``world_size`` ranks; rank 0's results
    (the replicas agree). The data is loaded once, before the ranks start."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401 - its first import takes seconds: once, here

    kwargs.setdefault("data", load_digits_split(kwargs.get("seed", 0)))
    return launch.run(_train_each, world_size, args=(tuple(runs), kwargs), timeout=timeout)[0]
