"""Lesson 10: what a sharded model's user needs around the step -- the same layout on every
rank, the gradient norm over every shard, and checkpoints saved on p ranks and loaded on q.

* :func:`check_layout` -- every rank lists the same parameters (names, shapes, dtypes, which
  train) in the same order, or each rank learns which rank differs, and where, before
  anything is sharded: two ranks that packed their parameters in different orders would
  reduce-scatter one rank's weight gradient into another's bias and train on without a word.
  Cheap: one all-gather of a few integers per parameter, once, at wrap time.
* :func:`clip_grad_norm_` -- ``torch.nn.utils.clip_grad_norm_`` over shards: each rank adds
  the squares of its own rows' gradients, one all-reduce of one number gives the global norm,
  and every rank scales its rows by the same factor.
* :func:`save_sharded` / :func:`load_sharded` -- each rank writes its rows of every parameter
  (and of Adam's moments) with the rows' place in the full tensor; a world of any size reads
  the files and keeps the rows its own layout gives it. FSDP2's distributed checkpoint
  (``torch.distributed.checkpoint``) does the same with DTensor metadata.
"""

from __future__ import annotations

import os
import zlib

import torch
import torch.distributed as dist

from collectives.core import ops
from collectives.core.ops import ReduceOp
from collectives.ring import ring_all_reduce

from .shard import ShardSpec


def _code(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFF_FFFF


def check_layout(named, group=None, what: str = "FSDP") -> None:
    """Raise on every rank unless every rank of ``group`` lists the same ``(name, tensor)``
    pairs -- names, shapes, dtypes, ``requires_grad`` -- in the same order."""
    rank, p = ops.group_rank_and_size(group)
    named = list(named)
    rows = [f"{name} {tuple(q.shape)} {q.dtype} {'trains' if q.requires_grad else 'frozen'}" for name, q in named]
    if p == 1:
        return
    device = named[0][1].device if named else torch.device("cpu")     # NCCL's tensors live on its GPU
    count = torch.tensor([len(rows)], dtype=torch.int64, device=device)
    counts = torch.zeros(p, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(counts, count, group=group)
    most = int(counts.max())
    mine = torch.full((most,), -1, dtype=torch.int64)
    mine[:len(rows)] = torch.tensor([_code(r) for r in rows], dtype=torch.int64)
    every = torch.zeros(p * most, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine.to(device), group=group)
    every, counts = every.view(p, most).cpu(), counts.cpu()
    for r in range(1, p):
        differ = (every[r] != every[0]).nonzero().view(-1)
        if differ.numel():
            i = int(differ[0])
            here = rows[i] if i < len(rows) else "nothing"
            raise RuntimeError(f"{what}: rank {r} lists its parameters differently from rank 0 "
                               f"(rank 0 has {int(counts[0])}, rank {r} {int(counts[r])}; the first difference "
                               f"is parameter {i}, on rank {rank} here: {here}). Every rank must build the same "
                               "model, registering its parameters in the same order")


def clip_grad_norm_(shards, max_norm: float, group=None, use_torch: bool = False) -> torch.Tensor:
    """Scale every shard's gradient so that the norm of the whole gradient -- all ranks' rows
    -- is at most ``max_norm``; return that norm (before clipping), the same on every rank."""
    grads = [s.grad for s in shards if s.grad is not None]
    device = shards[0].device if len(shards) else torch.device("cpu")
    local = torch.zeros(1, dtype=torch.float64, device=device)
    for g in grads:
        local += g.detach().double().square().sum()
    if use_torch:
        dist.all_reduce(local, op=ReduceOp.SUM, group=group)
    else:
        ring_all_reduce(local, op=ReduceOp.SUM, group=group)
    norm = local.sqrt().float()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)      # as torch's: one fp32 factor
    for g in grads:
        g.mul_(coef)
    return norm[0]


def _rows_of(optimizer, shard) -> dict:
    state = optimizer.state.get(shard, {}) if optimizer is not None else {}
    return {k: v for k, v in state.items() if torch.is_tensor(v) and tuple(v.shape) == tuple(shard.shape)}


def save_sharded(folder: str, names, shapes, shards, rank: int, p: int, optimizer=None) -> str:
    """Write this rank's rows of every parameter (and its optimizer's row-shaped state) to
    ``folder/rank{rank}-of-{p}.pt``; returns the path."""
    os.makedirs(folder, exist_ok=True)
    out = {"p": p, "rank": rank, "params": {}}
    for name, shape, shard in zip(names, shapes, shards):
        lo, hi = ShardSpec(tuple(shape), p).owned_rows(rank)
        steps = optimizer.state.get(shard, {}).get("step") if optimizer is not None else None
        out["params"][name] = dict(shape=tuple(shape), lo=lo, hi=hi, rows=shard.detach().clone(),
                                   state={k: v.detach().clone() for k, v in _rows_of(optimizer, shard).items()},
                                   step=float(steps) if steps is not None else None)
    path = os.path.join(folder, f"rank{rank}-of-{p}.pt")
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def load_sharded(folder: str, names, shapes, shards, rank: int, q: int, optimizer=None) -> None:
    """Fill this rank's rows (of a world of ``q``) from the files :func:`save_sharded` wrote on
    any number of ranks: each parameter's rows are cut from the saved ranks' rows. Adam's
    moments come along when ``optimizer`` is given (its state is made for the shards)."""
    files = sorted(f for f in os.listdir(folder) if f.startswith("rank") and f.endswith(".pt"))
    saved = [torch.load(os.path.join(folder, f), weights_only=False) for f in files]
    if not saved:
        raise FileNotFoundError(f"load_sharded: no rank files in {folder}")
    p = saved[0]["p"]
    if sorted(s["rank"] for s in saved) != list(range(p)):
        raise ValueError(f"load_sharded: {folder} holds ranks {sorted(s['rank'] for s in saved)} of {p}")
    for name, shape, shard in zip(names, shapes, shards):
        parts = [s["params"].get(name) for s in sorted(saved, key=lambda s: s["rank"])]
        if any(x is None or tuple(x["shape"]) != tuple(shape) for x in parts):
            raise ValueError(f"load_sharded: {name} {tuple(shape)} is not in the checkpoint with that shape")
        lo, hi = ShardSpec(tuple(shape), q).owned_rows(rank)
        with torch.no_grad():
            shard.copy_(_cut([x["rows"] for x in parts], parts, lo, hi, shape))
        if optimizer is not None and parts[0]["step"] is not None:
            state = optimizer.state[shard]
            state["step"] = torch.tensor(parts[0]["step"])
            for key in parts[0]["state"]:
                state[key] = _cut([x["state"][key] for x in parts], parts, lo, hi, shape)


def _cut(pieces, parts, lo: int, hi: int, shape) -> torch.Tensor:
    """Rows ``[lo, hi)`` of the full tensor, from the saved ranks' rows (a 0-d tensor is one row)."""
    full_rows = torch.cat([x.reshape((-1,) + tuple(shape[1:])) for x in pieces])
    return full_rows[lo:hi].clone()
