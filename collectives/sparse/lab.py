"""The convergence lab: what sparsification costs in accuracy and buys in time, on real data,
against what torch users pick today.

Data-parallel training on scikit-learn's ``load_digits`` (1,797 8×8 images of handwritten
digits, shipped with the package: no download) with torch's ``DistributedDataParallel`` and
one communication hook per run:

==============  ===========================================================================
``dense``       DDP's own all-reduce (float32)
``bf16``        torch's ``bf16_compress_hook``: half the bytes, nothing dropped
``powersgd1``   torch's ``powerSGD_hook``, rank 1 (low-rank, with error feedback)
``powersgd4``   the same, rank 4
``topk_ef``     top-k 1 % per bucket with error feedback (:func:`~.hooks.sparse_hook_async`)
``topk_no_ef``  the same without a residual: what is not sent is lost
``dgc``         top-k 1 % with DGC's corrections (:mod:`.dgc`): per layer, momentum
                correction and factor masking (SGD), warm-up of the density
``dgc_no_mask`` the same but for factor masking: a sent entry keeps its velocity
==============  ===========================================================================

Three models: :class:`DigitsMLP` (4,810 parameters: messages are latency, not bytes),
:class:`WideMLP` (0.83 M parameters, 3.3 MB of gradients: at 1 Gbit/s a dense all-reduce
outlasts the step's arithmetic several times over) and :class:`DigitsCNN` (two convolutions,
0.15 M parameters: more arithmetic per byte of gradient). Two optimizers: SGD with momentum (with
DGC, the momentum moves into the hook) and Adam.

:func:`train` returns, per run, the test accuracy at regular steps with the training time
spent until then (evaluation not counted), and the bytes each rank puts on the wire per
step. scikit-learn is the ``lab`` extra (``.venv/bin/pip install -e '.[lab]'``; ``make test``
installs it).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..core import launch, trace
from .dgc import DGCState, dgc_hook
from .hooks import SparseHookState, on_a_thread, register_sparse_hook, sparse_hook_async

RUNS = ("dense", "bf16", "powersgd1", "powersgd4", "topk_ef", "topk_no_ef", "dgc", "dgc_no_mask")
SPARSE_RUNS = ("topk_ef", "topk_no_ef", "dgc", "dgc_no_mask")
OPTIMIZERS = ("sgd", "adam")


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


class WideMLP(nn.Module):
    """64 -> 512 -> 512 -> 512 -> 512 -> 10: 826,890 parameters (3.3 MB of float32 gradients);
    with 1 MiB buckets, one DDP bucket per hidden layer, so communication can overlap backward.
    He initialization (torch's default shrinks the signal at every ReLU layer, and four of
    them take epochs to start learning)."""

    def __init__(self, hidden: int = 512, depth: int = 4):
        super().__init__()
        widths = [64] + [hidden] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.out = nn.Linear(hidden, 10)
        for layer in self.hidden:
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)

    def forward(self, x):
        for layer in self.hidden:
            x = torch.relu(layer(x))
        return self.out(x)


class DigitsCNN(nn.Module):
    """A small convolutional network on the 8×8 images: two 3×3 convolutions (32 and 64
    channels), a 2×2 max-pool, then 1024 -> 128 -> 10. 151,306 parameters, most of them in
    the first fully connected layer (0.6 MB of float32 gradients); far more arithmetic per
    parameter than the MLPs, so communication is a smaller share of its step."""

    def __init__(self, channels: tuple[int, int] = (32, 64), hidden: int = 128):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels[0], 3, padding=1)
        self.conv2 = nn.Conv2d(channels[0], channels[1], 3, padding=1)
        self.fc1 = nn.Linear(channels[1] * 16, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        x = F.max_pool2d(torch.relu(self.conv2(torch.relu(self.conv1(x)))), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


MODELS = {"mlp": DigitsMLP, "wide": WideMLP, "cnn": DigitsCNN}


def bf16_hook(process_group, bucket):
    """torch's ``bf16_compress_hook``, called under a name of its own: DDP refuses that name
    unless CUDA and NCCL are present, but the hook itself runs on gloo, which all-reduces
    bfloat16 (cast, all-reduce, cast back: what it does on GPUs)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return default_hooks.bf16_compress_hook(process_group, bucket)


# DDP checks the hook's annotations as objects, not strings (this file has postponed annotations).
bf16_hook.__annotations__ = {"process_group": dist.ProcessGroup, "bucket": dist.GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}


def hook_for(run: str, optimizer: str = "sgd", density: float = 0.01, momentum: float = 0.9,
             warmup_steps: int = 0, group=None, seed: int = 0, hooks=None):
    """``(state, hook, optimizer momentum)`` for ``run``; ``hook`` None means DDP's own all-reduce.

    DGC with SGD moves the momentum into the hook (momentum correction), so the optimizer
    then has none; with Adam it keeps per-layer selection and the warm-up only. ``hooks``:
    where ``SparseHookState``, ``sparse_hook_async``, ``DGCState`` and ``dgc_hook`` come
    from (a lab's switch passes the exercise's); this package's by default."""
    state_cls = getattr(hooks, "SparseHookState", SparseHookState)
    dgc_cls = getattr(hooks, "DGCState", DGCState)
    if run == "dense":
        return None, None, momentum
    if run == "bf16":
        return group, bf16_hook, momentum
    if run in ("powersgd1", "powersgd4"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=int(run[-1]),
                                            start_powerSGD_iter=2, use_error_feedback=True, random_seed=seed)
        return state, powerSGD_hook.powerSGD_hook, momentum
    if run in ("topk_ef", "topk_no_ef"):
        return (state_cls(density=density, error_feedback=run == "topk_ef"),
                getattr(hooks, "sparse_hook_async", sparse_hook_async), momentum)
    if run in ("dgc", "dgc_no_mask"):
        corrected = optimizer == "sgd"
        state = dgc_cls(density=density, per_parameter=True, momentum=momentum if corrected else 0.0,
                        factor_masking=run == "dgc", warmup_steps=warmup_steps)
        return state, getattr(hooks, "dgc_hook", dgc_hook), 0.0 if corrected else momentum
    raise ValueError(f"unknown run {run!r}; runs are {', '.join(RUNS)}")


def _optimizer(name: str, params, lr: float, momentum: float):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")


def _accuracy(model, x, y) -> float:
    """Test accuracy, each rank scoring its p-th of the test set (the replicas are equal), the
    counts summed: an evaluation costs a p-th of one, and every rank leaves it together."""
    rank, p = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        counts = torch.tensor([(model(x[rank::p]).argmax(1) == y[rank::p]).sum().item(), len(y[rank::p])],
                              dtype=torch.float64)
    with trace.paused():
        dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def _wire_bytes(t: trace.Trace, p: int) -> float:
    """Bytes this rank put on the wire in ``t`` (all-gathers p−1 times, all-reduces 2(p−1)/p)."""
    total = 0.0
    for e in t.events:
        if e.kind in ("all_gather", "all_gather_into_tensor"):
            total += (p - 1) * e.nbytes
        elif e.kind == "all_reduce":
            total += 2 * (p - 1) / p * e.nbytes
        elif e.is_send or e.kind in trace.COLLECTIVES:
            total += e.nbytes
    return total


def train(run: str = "dense", model: str = "mlp", optimizer: str = "sgd", epochs: int = 12, batch: int = 32,
          lr: float = 0.05, momentum: float = 0.9, density: float = 0.01, warmup_epochs: float = 1.0,
          seed: int = 0, data=None, evals_per_epoch: int = 4, target: float | None = None,
          stop_at_target: bool = False, max_epochs: int | None = None, bucket_cap_mb: float = 1.0,
          hook_thread: bool = True, hooks=None) -> dict:
    """On every rank of a world: train ``model`` with ``run``'s hook; return the curve and bytes.

    Each rank takes every p-th training example; a step uses ``batch`` examples per rank
    (a global batch of p·batch). The test accuracy is taken ``evals_per_epoch`` times an
    epoch; ``curve`` lists ``(step, training seconds so far, accuracy)``, the seconds this
    rank spent in steps (forward, backward with its communication, the optimizer), the
    evaluations left out (they end in an all-reduce, so the next step starts together).
    ``final`` is the mean accuracy of the evaluations of epoch ``epochs`` (None if the run
    stopped before it).

    ``target``: a time-to-accuracy run. A run that has not reached it after ``epochs`` goes
    on, up to ``max_epochs``, until it does -- the time to an accuracy is not bounded by
    another run's schedule; with ``stop_at_target`` it stops at the first evaluation that
    reaches it. ``data``: :func:`load_digits_split`'s four tensors, if already loaded.
    ``hook_thread``: the sparse hooks select on a thread of their own (:func:`~.hooks.on_a_thread`),
    so backward goes on meanwhile; torch's hooks run as torch ships them.
    ``hooks``: the sparse hooks' source (:func:`hook_for`).
    """
    from torch.nn.parallel import DistributedDataParallel

    rank, p = dist.get_rank(), dist.get_world_size()
    x_train, y_train, x_test, y_test = data if data is not None else load_digits_split(seed)
    x_mine, y_mine = x_train[rank::p], y_train[rank::p]
    steps_per_epoch = len(y_mine) // batch
    torch.manual_seed(seed)
    net = MODELS[model]()
    if run.startswith("powersgd") and dist.get_backend() == "gloo":
        # PowerSGD's callback waits for a second all-reduce inside itself; gloo runs callbacks
        # on its two work threads, so two buckets in flight block both and nothing moves.
        # One bucket (bucket_cap_mb given: the first bucket takes that cap too) runs.
        bucket_cap_mb = max(bucket_cap_mb, 25.0)
    ddp = DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb)
    state, hook, opt_momentum = hook_for(run, optimizer, density, momentum,
                                         int(warmup_epochs * steps_per_epoch), seed=seed, hooks=hooks)
    if run in SPARSE_RUNS:
        getattr(hooks, "register_sparse_hook", register_sparse_hook)(ddp, state,
                                                                     on_a_thread(hook) if hook_thread else hook)
    elif hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = _optimizer(optimizer, ddp.parameters(), lr, opt_momentum)
    every = max(1, steps_per_epoch // evals_per_epoch)
    curve, seconds, step, wire, final = [], 0.0, 0, None, None
    count_at = 4 + int(warmup_epochs * steps_per_epoch) * run.startswith("dgc")
    shuffle = torch.Generator().manual_seed(seed + 1)
    reached = False
    for epoch in range(max(epochs, max_epochs or epochs)):
        order = torch.randperm(len(y_mine), generator=shuffle)
        for s in range(steps_per_epoch):
            rows = order[s * batch:(s + 1) * batch]
            t0 = time.perf_counter()
            opt.zero_grad()
            if step == count_at:                # buckets rebuilt, PowerSGD compressing, warm-up done: count once
                with trace.recording() as t:
                    F.cross_entropy(ddp(x_mine[rows]), y_mine[rows]).backward()
                wire = _wire_bytes(t, p)
            else:
                F.cross_entropy(ddp(x_mine[rows]), y_mine[rows]).backward()
            opt.step()
            seconds += time.perf_counter() - t0
            step += 1
            if step % every == 0:                # (the evaluation's all-reduce lines the ranks up again)
                curve.append((step, seconds, _accuracy(net, x_test, y_test)))
                reached = reached or (target is not None and curve[-1][2] >= target)
                if reached and stop_at_target:
                    break
        if epoch + 1 == epochs and step == epochs * steps_per_epoch:     # epoch ``epochs`` ran to its end
            this_epoch = [acc for s, _, acc in curve if s > step - steps_per_epoch] or [curve[-1][2]]
            final = sum(this_epoch) / len(this_epoch)
        if (reached and stop_at_target) or (epoch + 1 >= epochs and (target is None or reached)):
            break
    params = sum(q.numel() for q in net.parameters())
    dense_wire = 2 * (p - 1) / p * params * 4
    return dict(run=run, model=model, optimizer=optimizer, seed=seed, curve=curve, steps=step,
                seconds=seconds, final=final, params=params, steps_per_epoch=steps_per_epoch,
                bytes_per_step=dense_wire if run == "dense" or wire is None else wire, dense_bytes=dense_wire)


def _train_each(configs: list[dict], common: dict) -> list[dict]:
    return [train(**{**common, **config}) for config in configs]


def compare(runs=RUNS, world_size: int = 4, timeout: float = 600, **kwargs) -> dict[str, dict]:
    """Every run, one after the other, in one world of ``world_size`` ranks; rank 0's results
    (the replicas agree), by run name. The data is loaded once, before the ranks start."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401 - its first import takes seconds: once, here

    kwargs.setdefault("data", load_digits_split(kwargs.get("seed", 0)))
    results = launch.run(_train_each, world_size, args=([{"run": r} for r in runs], kwargs), timeout=timeout)[0]
    return {r["run"]: r for r in results}
