"""Lesson 10 on GPUs: ZeRO-1/2/3 against torch's DDP and FSDP2 on NCCL, checked and timed.

    .venv/bin/python tools/gpu_lesson10.py --out DIR          # every GPU count of this host
    .venv/bin/python tools/gpu_lesson10.py --out DIR --max-gpus 2

For every GPU count p from 1 to the host's (or ``--max-gpus``): the lesson's model trained
three steps from one seed on p ranks with GPU tensors, by torch's ``fully_shard`` (fp32,
and bf16 with fp32 masters), torch's DDP, and lesson 10's ZeRO-3 (ring and torch's
collectives, and bf16), ZeRO-1 and ZeRO-2; the largest parameter difference of each
against torch's, and whether the bits are equal (``DIR/10-sharded-gpu-checks.json``). Then
``bench-sharded --backend nccl`` on all the GPUs (``DIR/10-sharded-nccl.json``, and the
page's figure and claims under ``DIR/img``): its step times under the rule for fair GPU
comparisons (every contender eager and untraced, interleaved rounds; the record's ``rule``),
its peak memory measured with each contender alone. The checks' record times nothing
(``gpu_timing.compares_nothing()``). Every record names the device, the GPU count,
torch and NCCL versions, the date, the command and the git commit.

NVLink SHARP (multicast) stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set before any process starts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from collectives import launch  # noqa: E402
from collectives.course.benchmarks.gpu_timing import compares_nothing  # noqa: E402
from collectives.sharded import FSDP, MixedPrecision, ZeRO  # noqa: E402

STEPS = 3


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3)).to(device)


def _batch(step, device):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(4, 5, generator=g).to(device)


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2, foreach=False)


def _train(forward, step, device):
    losses = []
    for s in range(STEPS):
        loss = forward(_batch(s, device)).float().square().mean()
        loss.backward()
        step()
        losses.append(loss.item())
    return losses


def _fsdp2(device, mp=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    m = _model(device)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=mp)} if mp else {}
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(m, **kw)
    opt = _adam(m.parameters())
    losses = _train(m, lambda: (opt.step(), opt.zero_grad()), device)
    return losses, [q.full_tensor().detach().cpu() for q in m.parameters()]


def _ddp(device):
    from torch.nn.parallel import DistributedDataParallel
    m = DistributedDataParallel(_model(device), device_ids=[device.index])
    opt = _adam(m.parameters())
    losses = _train(m, lambda: (opt.step(), opt.zero_grad()), device)
    return losses, [q.detach().cpu() for q in m.parameters()]


def _ours3(device, use_torch, mixed=None, release="record_stream"):
    f = FSDP(_model(device), use_torch=use_torch, mixed=mixed, release=release)
    opt = _adam(f.parameters())
    losses = _train(f, lambda: (opt.step(), opt.zero_grad()), device)
    out = [t.cpu() for t in f.full_parameters()]
    f.close()
    return losses, out


def _ours3_wide(device, release):
    """ZeRO-3 on torch's collectives, 4 layers of 1024 (the benchmark's kind of model, big enough
    for the host to run ahead of the GPU), 3 steps: the two ways of releasing memory must give
    the same bits, or one of them lets a buffer be reused too early."""
    from collectives.course.benchmarks.sharded import make_model
    f = FSDP(make_model(4, 1024, device), use_torch=True, release=release)
    opt = _adam(f.parameters())
    losses = []
    for s in range(STEPS):
        g = torch.Generator().manual_seed(1000 * s + dist.get_rank())
        loss = f(torch.randn(64, 1024, generator=g).to(device)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = [t.cpu() for t in f.full_parameters()]
    f.close()
    return losses, out


def _ours12(device, stage, use_torch):
    m = _model(device)
    z = ZeRO(m, stage=stage, optimizer=_adam, use_torch=use_torch, bucket_cap_bytes=100)
    losses = _train(m, lambda: (z.step(), z.zero_grad()), device)
    return losses, [q.detach().cpu() for q in m.parameters()]


# The standard each check is held to, the CPU tests' (tests/test_10_sharded.py): the same bits where
# both sides add in the same order -- two addends (p <= 2) have one order, and ZeRO-3 on torch's
# reduce-scatter adds as fully_shard does -- and within a tolerance where the orders differ (NCCL's
# all-reduce for DDP, the course's ring for ZeRO): float addition is not associative.
TOLERANCE = {"fp32": 1e-6, "bf16": 1e-4}


def standard(name: str, p: int) -> float:
    """0.0 (bit for bit) or the largest parameter difference allowed for check ``name`` on p ranks."""
    if p <= 2 or ("(torch collectives" in name and "fully_shard" in name) or "against record_stream" in name:
        return 0.0
    return TOLERANCE["bf16" if "bf16" in name else "fp32"]


def holds(name: str, p: int, result: dict) -> bool:
    """Whether a check's result meets its standard."""
    limit = standard(name, p)
    return bool(result["bit_equal"]) if limit == 0.0 else result["max_abs_diff"] <= limit


def _compare(ours, theirs):
    exact = ours[0] == theirs[0] and all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))
    diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(ours[1], theirs[1]))
    return {"bit_equal": exact, "max_abs_diff": diff}


def _checks():
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    fsdp2, ddp, mp = _fsdp2(device), _ddp(device), _fsdp2(device, torch.bfloat16)
    out = {}
    for use_torch in (False, True):
        name = "torch collectives" if use_torch else "ring"
        out[f"ZeRO-3 ({name}) vs fully_shard"] = _compare(_ours3(device, use_torch), fsdp2)
        out[f"ZeRO-3 ({name}) vs DDP"] = _compare(_ours3(device, use_torch), ddp)
        for stage in (1, 2):
            out[f"ZeRO-{stage} ({name}) vs DDP"] = _compare(_ours12(device, stage, use_torch), ddp)
    out["ZeRO-3 (torch collectives, freed in stream order) vs fully_shard"] = _compare(
        _ours3(device, True, release="stream_order"), fsdp2)
    out["ZeRO-3 freed in stream order against record_stream, 4 layers of 1024"] = _compare(
        _ours3_wide(device, "stream_order"), _ours3_wide(device, "record_stream"))
    bf16 = MixedPrecision(torch.bfloat16, torch.bfloat16)
    out["ZeRO-3 bf16 (torch collectives) vs fully_shard bf16"] = _compare(_ours3(device, True, bf16), mp)
    out["ZeRO-3 bf16 (ring) vs fully_shard bf16"] = _compare(_ours3(device, False, bf16), mp)
    p = dist.get_world_size()
    for name, result in out.items():
        result.update(standard=standard(name, p) or "bits", holds=holds(name, p, result))
    return out


def _meta(argv) -> dict:
    from collectives.course.site import claims
    commit = claims.commit()
    return {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU",
            "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "command": " ".join([".venv/bin/python tools/gpu_lesson10.py", *argv]), "commit": commit}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description="lesson 10 on GPUs: checks and bench-sharded --backend nccl")
    ap.add_argument("--out", required=True, help="folder for the JSON records")
    ap.add_argument("--max-gpus", type=int, default=0, help="at most this many GPUs (default: all)")
    ap.add_argument("--bench-args", default="--layers 8 --width 4096 --batch 256 --iters 10",
                    help="arguments of bench-sharded")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("no GPU: nothing to do")
        return 1
    n = torch.cuda.device_count() if not args.max_gpus else min(args.max_gpus, torch.cuda.device_count())
    record = {"meta": _meta(argv), **compares_nothing(), "checks": {}}     # values checked; bench-sharded times
    for p in range(1, n + 1):
        try:
            record["checks"][p] = launch.run(_checks, p, backend="nccl", timeout=600)
        except Exception as exc:  # noqa: BLE001 - recorded, and the next size still runs
            record["checks"][p] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(f"{p} GPU(s):", json.dumps(record["checks"][p].get("error") if isinstance(record["checks"][p], dict)
                                         else record["checks"][p][0], indent=1))
        (out / "10-sharded-gpu-checks.json").write_text(json.dumps(record, indent=1) + "\n")
    failed = [f"p={p}: {name}" for p, per in record["checks"].items() if isinstance(per, list)
              for name, result in per[0].items() if not result.get("holds")]
    failed += [f"p={p}: {per['error']}" for p, per in record["checks"].items() if isinstance(per, dict)]
    record["failed"] = failed
    (out / "10-sharded-gpu-checks.json").write_text(json.dumps(record, indent=1) + "\n")
    print("every check holds its standard" if not failed else "FAILED: " + "; ".join(failed))
    bench = [sys.executable, "-m", "collectives", "bench-sharded", "--backend", "nccl", "--world", str(n),
             "--out", str(out), "--img", str(out / "img"), *args.bench_args.split()]
    print(" ".join(bench))
    code = subprocess.run(bench, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
    return code or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
