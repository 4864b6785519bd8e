"""``.venv/bin/python -m collectives bench-sharded-agreement``: does lesson 10's ZeRO-3 still agree
with ``fully_shard`` -- in value and in peak memory -- on a model larger than the tests'?

::

    .venv/bin/python -m collectives bench-sharded-agreement                   # 3 ranks, 4 layers of 1024
    .venv/bin/python -m collectives bench-sharded-agreement --layers 2 --width 16 --world 2 --out /tmp

The model is bench-sharded's (an MLP of ``--layers`` square layers of ``--width``, Adam
lr 1e-3), trained ``--steps`` steps from one seed, each rank its own batches, by torch's
FSDP2 (``fully_shard`` per layer) and by lesson 10's ZeRO-3 on lesson 4's ring and on
torch's collectives, in fp32 and with bf16 gathers and reductions over fp32 masters
(FSDP2's ``MixedPrecisionPolicy(bfloat16, bfloat16)``). For each: the largest difference of
any parameter from FSDP2's after the last step, whether every loss was equal, and the peak
of live tensor bytes above the start of one more step
(:class:`~collectives.core.live_bytes.LiveBytes`, the largest of any rank) over FSDP2's.

Writes ``docs/data/10-sharded-agreement.json`` (device, versions, date, command, commit, host
cores and load, rows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from ...core import launch, live_bytes
from ...sharded import FSDP, MixedPrecision
from ..catalog import ROOT
from ..site import claims
from .sharded import make_model

DATA = ROOT / "docs" / "data"
POLICIES = {"fp32": None, "bf16": torch.bfloat16}


def _batches(width: int, batch: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    return [torch.randn(batch, width, generator=g) for _ in range(steps + 1)]


def _train(forward, params, batches, steps):
    opt = torch.optim.Adam(params, lr=1e-3, foreach=False)
    losses = []
    for x in batches[:steps]:
        loss = forward(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with live_bytes.LiveBytes() as meter:           # one more step, metered
        forward(batches[steps]).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return losses, meter.peak


def _in_rank(layers: int, width: int, batch: int, steps: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    batches = _batches(width, batch, steps)
    out = {}
    for policy, dtype in POLICIES.items():
        m = make_model(layers, width, "cpu")
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype else MixedPrecisionPolicy()
        for layer in m:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mp_policy=mp)
        fully_shard(m, mp_policy=mp)
        dist.barrier()
        losses, peak = _train(m, list(m.parameters()), batches, steps)
        theirs = [q.full_tensor().detach().clone() for q in m.parameters()]
        out[("fsdp2", policy)] = dict(losses=losses, peak=peak)
        del m
        for name, use_torch in (("ring", False), ("torch", True)):
            f = FSDP(make_model(layers, width, "cpu"), use_torch=use_torch,
                     mixed=MixedPrecision(dtype, dtype) if dtype else None)
            dist.barrier()
            ours_losses, ours_peak = _train(f, f.parameters(), batches, steps)
            # the last (metered) step moved both: compare after it
            ours = f.full_parameters()
            diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(ours, theirs))
            out[(name, policy)] = dict(losses=ours_losses, peak=ours_peak, diff=diff,
                                       exact=all(torch.equal(a, b) for a, b in zip(ours, theirs)))
            f.close()
    return out


def run(args) -> dict:
    ranks = launch.run(_in_rank, args.world, args=(args.layers, args.width, args.batch, args.steps), timeout=3600)
    rows = []
    for policy in POLICIES:
        fsdp2 = [r[("fsdp2", policy)] for r in ranks]
        for name in ("ring", "torch"):
            ours = [r[(name, policy)] for r in ranks]
            rows.append(dict(contender=f"ZeRO-3 ({name})", policy=policy,
                             max_abs_diff=max(o["diff"] for o in ours),
                             bit_equal=all(o["exact"] for o in ours),
                             losses_equal=all(o["losses"] == f["losses"] for o, f in zip(ours, fsdp2)),
                             peak_bytes=max(o["peak"] for o in ours), fsdp2_peak_bytes=max(f["peak"] for f in fsdp2),
                             peak_over_fsdp2=max(o["peak"] for o in ours) / max(f["peak"] for f in fsdp2)))
    return dict(world_size=args.world, layers=args.layers, width=args.width, batch=args.batch, steps=args.steps,
                rows=rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    parser = argparse.ArgumentParser(prog=".venv/bin/python -m collectives bench-sharded-agreement",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=3, help="local ranks (gloo)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="steps before the comparison")
    parser.add_argument("--out", default=str(DATA), help="folder of the JSON record (default docs/data)")
    args = parser.parse_args(argv)
    if args.world < 1 or args.layers < 1 or args.width < 1 or args.steps < 1:
        parser.error("--world, --layers, --width and --steps must be at least 1")
    result = run(args)
    meta = claims.environment(backend="gloo", commit=claims.commit(),
                              command=" ".join([".venv/bin/python -m collectives bench-sharded-agreement",
                                                *argv]).strip())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "10-sharded-agreement.json"
    path.write_text(json.dumps({"bench": "bench-sharded-agreement", "meta": meta, **result}, indent=1) + "\n")
    for r in result["rows"]:
        print(f"{r['contender']:20s} {r['policy']}: max |diff| {r['max_abs_diff']:.3g} "
              f"(bit equal {r['bit_equal']}, losses equal {r['losses_equal']}), "
              f"peak {r['peak_over_fsdp2']:.3f}x FSDP2's")
    print(f"wrote {path}")
    return 0
