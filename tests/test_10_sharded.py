"""Lesson 10: ZeRO-1/2/3 and FSDP on the ring's halves, equal to torch's ``fully_shard`` and DDP.

What is checked:

* **the layout** -- dim-0 shards padded to ``ceil(rows/p)`` rows, packed rank-major for the
  reduce-scatter and unpacked after the all-gather, for world sizes 1-6 and shapes with
  fewer rows than ranks (pure data, no world);
* **equal to torch** -- the same model from the same seed trained three steps:
  ZeRO-3 (:class:`collectives.sharded.FSDP`) against ``fully_shard`` (FSDP2) bit for bit with
  torch's collectives (the same reduce-scatter, the same sums) at every size, and with the
  ring bit for bit at p ≤ 2 (two addends: one order), to 1e-6 beyond; ZeRO-1/2/3 against
  DDP bit for bit at p ≤ 2 and to 1e-6 beyond (gloo's all-reduce adds in another order);
  bf16 gathers and reduce-scatters with fp32 masters against FSDP2's ``MixedPrecisionPolicy``
  (bit for bit with torch's collectives; the ring's at p ≤ 2, to 1e-4 at 3);
* **memory, counted** -- bytes of parameters, gradients and optimizer state per rank, each
  stage against the formula of :mod:`collectives.sharded.cost` (up to padding and Adam's
  step counters) and ZeRO-3 against FSDP2's own tensors;
* **the trace** -- the ring's sends by default, ``reduce_scatter_tensor`` /
  ``all_gather_into_tensor`` under ``use_torch``; three collectives per unit and step;
* **hybrid sharding** -- ZeRO-3 inside two groups of three ranks, the gradient shards
  averaged across them, equal to DDP to 1e-6; ``reshard_after_forward=3`` at six ranks against
  ``fully_shard``'s (its bits on torch's collectives), the backward's all-gather in groups of 3;
* **overlap** -- prefetched gathers run while a unit computes, never more than
  ``max_alive`` units gathered; the exercise's :func:`forward_prefetch` likewise;
* **peak memory** -- :class:`~collectives.core.live_bytes.LiveBytes` counts a known pattern of
  allocations, views, frees and storage resizes exactly, on two threads; in a step of an MLP
  shaped like the benchmark's, ZeRO-3's peak live bytes stay within 1.05x FSDP2's;
* **bad input** -- clear errors before anything is sent;
* **edges, against fully_shard** -- frozen parameters, a layer skipped in a step, two
  backwards before a step, ``reshard_after_forward=False`` (two collectives a unit, counted in
  the trace), clipping by the global norm; ZeRO-2 accumulating and skipping against DDP, its
  reduce-scatter in flight while the backward computes (from the trace); a write after
  wrapping and ranks listing their parameters differently refused, naming the parameter and
  the rank; the exercise's ``zero3_train`` equal to ``fully_shard`` bit for bit at two ranks,
  fp32 and bf16; a checkpoint saved on three ranks loaded on two, rows and Adam's moments;
  a parameter used on some ranks only: ``reduce_scatter_unused_params`` against fully_shard's
  switch and ZeRO-1/2's ``find_unused_parameters`` against DDP's (bit for bit), ZeRO-1 without
  it and a unit run on some ranks only refused, naming the parameter and the ranks;
* **the agreement benchmark** -- its record at a tiny size.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from collectives import launch, trace
from collectives.core.live_bytes import LiveBytes, carry
from collectives.course.catalog import world_timeout
from collectives.course.impl import resolve
from collectives.sharded import (
    FSDP,
    MixedPrecision,
    ShardGroup,
    ShardSpec,
    ZeRO,
    comm_elements,
    hybrid_groups,
    memory_bytes,
    tensor_bytes,
)
from collectives.sharded.cost import FP32_ADAM

LESSON = 10
WORLD_TIMEOUT = max(world_timeout(), 120.0)
STEPS = 3
TOL = 1e-6
BF16_TOL = 1e-4          # parameters after 3 steps, bf16 gradients summed in another order


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)          # 7 and 6 and 3 rows: uneven over 2..6 ranks, fewer rows than ranks
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3))


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(4, 5, generator=g)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2, foreach=False)


def _train(forward, step_fn):
    losses = []
    for s in range(STEPS):
        loss = forward(batch(s)).float().square().mean()
        loss.backward()
        step_fn()
        losses.append(loss.item())
    return losses


def torch_fsdp2(mp=None, memory=False, reshard=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    m = make_model()
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=mp)} if mp else {}
    if reshard is not None:
        kw["reshard_after_forward"] = reshard
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(m, **kw)
    opt = adam(m.parameters())
    losses = _train(m, lambda: (opt.step(), opt.zero_grad()))
    mem = None
    if memory:
        m(batch(9)).square().mean().backward()
        mem = dict(params=tensor_bytes([q.to_local() for q in m.parameters()]),
                   grads=tensor_bytes([q.grad.to_local() for q in m.parameters()]),
                   optimizer=sum(v.to_local().numel() * v.element_size() if hasattr(v, "to_local") else v.numel() * 4
                                 for st in opt.state.values() for v in st.values()))
    return losses, [q.full_tensor().detach().clone() for q in m.parameters()], mem


def torch_ddp():
    from torch.nn.parallel import DistributedDataParallel
    m = DistributedDataParallel(make_model())
    opt = adam(m.parameters())
    losses = _train(m, lambda: (opt.step(), opt.zero_grad()))
    return losses, [q.detach().clone() for q in m.parameters()]


def ours_fsdp(use_torch, mixed=None, prefetch=True, max_alive=2, memory=False, reshard=True):
    m = make_model()
    f = FSDP(m, use_torch=use_torch, prefetch=prefetch, max_alive=max_alive, mixed=mixed,
             reshard_after_forward=reshard)
    opt = adam(f.parameters())
    with trace.recording() as t:
        losses = _train(f, lambda: (opt.step(), opt.zero_grad()))
    mem = None
    if memory:
        f(batch(9)).square().mean().backward()
        mem = f.memory(opt)
        opt.zero_grad()
    out = dict(losses=losses, params=f.full_parameters(), mem=mem, peak_alive=f.peak_alive,
               kinds=sorted({e.kind for e in t.events}), timeline=list(f.timeline),
               calls=[(e.kind, e.group) for e in t.events if e.peer is None and not e.is_recv],
               sends=[(e.group, e.peer) for e in t.sends()])
    f.close()
    return out


def ours_hybrid(ranks_per_machine: int) -> list[torch.Tensor]:
    """ZeRO-3 inside groups of ``ranks_per_machine``, gradients averaged across them."""
    shard, replicate = hybrid_groups(ranks_per_machine)
    f = FSDP(make_model(), group=shard, replicate_group=replicate)
    opt = adam(f.parameters())
    _train(f, lambda: (opt.step(), opt.zero_grad()))
    params = f.full_parameters()
    f.close()
    return params


def ours_zero(stage, use_torch, memory=False):
    m = make_model()
    z = ZeRO(m, stage=stage, optimizer=adam, use_torch=use_torch, bucket_cap_bytes=100)
    with trace.recording() as t:
        losses = _train(m, lambda: (z.step(), z.zero_grad()))
    mem = None
    if memory:
        m(batch(9)).square().mean().backward()
        if stage == 1:
            mem = z.memory()          # the full gradients, before step() reduce-scatters them
        else:
            mem = z.memory()
        z.zero_grad()
    return dict(losses=losses, params=[q.detach().clone() for q in m.parameters()], mem=mem,
                kinds=sorted({e.kind for e in t.events}), buckets=len(z.buckets))


def _same(a, b) -> tuple[bool, float]:
    exact = all(torch.equal(x, y) for x, y in zip(a, b))
    return exact, max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def _world(mode: str):
    """Every comparison of one world, plain data back. ``mode`` "light": the ring only, against
    DDP only (``fully_shard``'s set-up costs seconds per rank; it is compared at 1-3 ranks)."""
    full = mode == "full"
    fsdp2, ddp = torch_fsdp2(memory=full) if mode != "light" else None, torch_ddp()
    out = {"fsdp2_losses": fsdp2 and fsdp2[0], "ddp_losses": ddp[0], "fsdp2_mem": fsdp2 and fsdp2[2]}
    for use_torch in (False, True) if full else (False,):
        z3 = ours_fsdp(use_torch, memory=full)
        out[("z3", use_torch)] = dict(vs_fsdp2=fsdp2 and _same(z3["params"], fsdp2[1]),
                                      vs_ddp=_same(z3["params"], ddp[1]),
                                      losses=z3["losses"], kinds=z3["kinds"], sends=z3["sends"],
                                      peak_alive=z3["peak_alive"], mem=z3["mem"], timeline=z3["timeline"])
        for stage in (1, 2) if full else ():
            z = ours_zero(stage, use_torch, memory=full)
            out[(stage, use_torch)] = dict(vs_ddp=_same(z["params"], ddp[1]), losses=z["losses"], kinds=z["kinds"],
                                           mem=z["mem"], buckets=z["buckets"])
    if not full:                 # ZeRO-2 on torch's collectives: the ring's rounds are ZeRO-3's above
        z = ours_zero(2, True)
        out[(2, True)] = dict(vs_ddp=_same(z["params"], ddp[1]), losses=z["losses"], buckets=z["buckets"])
        if mode == "light":
            out["hybrid"] = _same(ours_hybrid(3), ddp[1])
            # reshard_after_forward=3 against fully_shard's: the backward's all-gather inside
            # groups of 3, on torch's collectives (fully_shard's sums) and on the ring
            theirs = torch_fsdp2(reshard=3)
            for use_torch in (True, False):
                k3 = ours_fsdp(use_torch, reshard=3)
                out[("reshard 3", use_torch)] = dict(vs_fsdp2=_same(k3["params"], theirs[1]),
                                                     losses=(k3["losses"], theirs[0]),
                                                     calls=k3["calls"], sends=k3["sends"])
    if full:
        mp = torch_fsdp2(mp=torch.bfloat16)
        ours = ours_fsdp(True, mixed=MixedPrecision(torch.bfloat16, torch.bfloat16))
        ring = ours_fsdp(False, mixed=MixedPrecision(torch.bfloat16, torch.bfloat16))
        out["mixed"] = dict(vs_fsdp2=_same(ours["params"], mp[1]), losses=(ours["losses"], mp[0]),
                            vs_fp32=_same(ours["params"], fsdp2[1]), ring=_same(ring["params"], mp[1]))
        one = ours_fsdp(False, prefetch=True, max_alive=1)
        out["max_alive_1"] = (one["peak_alive"], _same(one["params"], fsdp2[1]))
    if full and dist.get_world_size() == 3:
        out["peaks"] = _peaks()
    if dist.get_world_size() == 1:
        out["bad_input"] = _bad_input()
    return out


PEAK_LAYERS, PEAK_WIDTH = 4, 96           # square layers, as the benchmark's MLP, small


def _peak_model() -> nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(PEAK_LAYERS):
        mods += [nn.Linear(PEAK_WIDTH, PEAK_WIDTH), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def _peaks() -> dict:
    """Peak live bytes above the start of one training step (after a first one made the
    optimizer state) of FSDP2 and of ZeRO-3 on the ring and on torch's collectives."""
    from torch.distributed.fsdp import fully_shard
    x = torch.randn(8, PEAK_WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    peaks = {}
    for name in ("fsdp2", "ring", "torch"):
        m = _peak_model()
        if name == "fsdp2":
            for layer in m:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fwd = fully_shard(m)
            opt = adam(m.parameters())
        else:
            fwd = FSDP(m, use_torch=name == "torch")
            opt = adam(fwd.parameters())
        metered = []
        for step in range(3):            # the first makes the optimizer state; two are metered
            dist.barrier()
            with LiveBytes() if step else contextlib.nullcontext() as meter:
                fwd(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            if step:
                metered.append(meter.peak)
        # the lesser of two steps: ZeRO-3 gathers on a side thread, whose buffers meet the caller's
        # frees in the order the scheduler picks; on a loaded host one step in several holds a
        # shard more at its peak (fully_shard gathers on the caller's thread on a CPU)
        peaks[name] = min(metered)
        if name != "fsdp2":                        # between steps a freed weight reads as empty
            peaks[name + " numel between steps"] = sum(q.numel() for q in m.parameters())
            fwd.close()
    return peaks


PSI = 5 * 7 + 7 + 7 * 6 + 6 + 6 * 3 + 3            # parameters of make_model()
SHAPES = [(7, 5), (7,), (6, 7), (6,), (3, 6), (3,)]


def _owned(p: int, rank: int) -> int:
    g = ShardGroup(SHAPES, p)
    return sum((s.owned_rows(rank)[1] - s.owned_rows(rank)[0]) * s.row_numel for s in g.specs)


def _check_world(p: int, results: list, full: bool) -> None:
    for rank, out in enumerate(results):
        for use_torch in (False, True) if full else (False,):
            z3 = out[("z3", use_torch)]
            if z3["vs_fsdp2"] is not None:
                exact, diff = z3["vs_fsdp2"]
                if use_torch or p <= 2:     # the same sums in the same order as fully_shard's
                    assert exact and z3["losses"] == out["fsdp2_losses"], (p, rank, use_torch, diff)
                assert diff <= TOL, (p, rank, use_torch, diff)
            for key in [("z3", use_torch)] + [(k, use_torch) for k in ((1, 2) if full else ())] + \
                    ([] if full else [(2, True)]):
                exact, diff = out[key]["vs_ddp"]
                assert diff <= TOL, (p, key, diff)
                if p <= 2:              # two addends, one order: the bits of DDP's all-reduce
                    assert exact and out[key]["losses"] == out["ddp_losses"], (p, key, diff)
            # the trace shows which collectives ran
            if use_torch:
                assert {"reduce_scatter_tensor", "all_gather_into_tensor"} <= set(z3["kinds"]), z3["kinds"]
                assert "send" not in z3["kinds"]
            else:
                assert "reduce_scatter_tensor" not in z3["kinds"] and "all_gather_into_tensor" not in z3["kinds"]
                # per step and unit: 2 all-gathers + 1 reduce-scatter, p-1 sends each
                assert len(z3["sends"]) == 3 * STEPS * 3 * (p - 1), len(z3["sends"])
            assert z3["peak_alive"] <= 2
            _check_prefetch_order(z3["timeline"])
        assert out[(2, not full)]["buckets"] > 1        # ZeRO-2 reduce-scattered bucket by bucket
        if "hybrid" in out:                             # sharded inside 2 groups of 3, replicated across
            assert out["hybrid"][1] <= TOL, out["hybrid"]
            _check_reshard_int(p, rank, out)
        if full:
            _check_memory(p, rank, out)
            _check_mixed(p, out)
        if "peaks" in out:
            _check_peaks(out["peaks"])


def _check_reshard_int(p: int, rank: int, out: dict, k: int = 3) -> None:
    """``reshard_after_forward=k`` against ``fully_shard(module, reshard_after_forward=k)``:
    torch's collectives give its bits; the ring adds p addends in its own order (1e-6). From
    the trace: per step and unit, the forward's all-gather and the reduce-scatter over the
    world, the backward's all-gather in this rank's group of k consecutive ranks."""
    mine = tuple(range(rank // k * k, rank // k * k + k))
    got = out[("reshard 3", True)]
    exact, diff = got["vs_fsdp2"]
    assert exact and got["losses"][0] == got["losses"][1], (rank, diff)
    calls = got["calls"]
    assert calls.count(("all_gather_into_tensor", mine)) == STEPS * 3, calls
    assert calls.count(("all_gather_into_tensor", None)) == STEPS * 3, calls
    assert calls.count(("reduce_scatter_tensor", None)) == STEPS * 3, calls
    ring = out[("reshard 3", False)]
    assert ring["vs_fsdp2"][1] <= TOL, (rank, ring["vs_fsdp2"])
    sends = ring["sends"]
    inside = [peer for group, peer in sends if group == mine]
    # per step and unit: forward all-gather over p, backward's over k, reduce-scatter over p
    assert len(inside) == STEPS * 3 * (k - 1) and set(inside) <= set(mine) - {rank}, sends
    assert len(sends) == STEPS * 3 * ((p - 1) + (k - 1) + (p - 1)), len(sends)


def _check_peaks(peaks: dict) -> None:
    layer = 4 * (PEAK_WIDTH * PEAK_WIDTH + PEAK_WIDTH)
    for name in ("ring", "torch"):
        # ZeRO-3 (both ways) within 1.05x of fully_shard's peak; before its gathered weights
        # were freed for real, every layer's stayed alive until backward, above the bound
        assert peaks[name] <= 1.05 * peaks["fsdp2"], peaks
        assert peaks[name] >= 2 * layer, peaks        # a gathered unit and its gradient at least
        assert peaks[name + " numel between steps"] == 0, peaks


def _check_prefetch_order(timeline: list[dict]) -> None:
    """Unit i+1's all-gather is issued before unit i computes (forward), unit i-1's before
    unit i's backward: the order of the records, the same on every run."""
    seen = [(e["what"], e["unit"]) for e in timeline]
    first = seen[:seen.index(("backward", 0)) + 1]           # the first step
    for i in range(2):
        assert first.index(("issue_all_gather", i + 1)) < first.index(("forward", i)), first
    backward = first[first.index(("forward", 2)):]
    assert backward.index(("issue_all_gather", 1)) < backward.index(("backward", 2)), backward


def _check_memory(p: int, rank: int, out: dict) -> None:
    owned, padded = _owned(p, rank), ShardGroup(SHAPES, p).shard_numel
    per_layer = [ShardGroup(SHAPES[i:i + 2], p).shard_numel for i in (0, 2, 4)]
    steps = 4 * len(SHAPES)                          # Adam's step counter: one fp32 scalar a parameter
    f = memory_bytes(PSI, p, 3, FP32_ADAM)
    z3 = out[("z3", False)]["mem"]
    assert z3 == dict(params=4 * sum(per_layer), grads=4 * sum(per_layer), optimizer=8 * owned + steps), z3
    assert abs(z3["params"] - f["params"]) <= 4 * (sum(per_layer) - PSI / p) + 1e-9
    assert z3 == out["fsdp2_mem"], (z3, out["fsdp2_mem"])          # byte for byte what fully_shard holds
    z1, z2 = out[(1, False)]["mem"], out[(2, False)]["mem"]
    assert z1 == dict(params=4 * PSI, grads=4 * PSI, optimizer=8 * owned + steps), z1
    assert z2["params"] == 4 * PSI and z2["optimizer"] == 8 * owned + steps, z2
    assert z2["grads"] <= 4 * padded * len(SHAPES), z2   # only shards: one piece per bucket, no full grad
    assert memory_bytes(PSI, p, 1, FP32_ADAM)["grads"] == z1["grads"]


def _check_mixed(p: int, out: dict) -> None:
    exact, diff = out["mixed"]["vs_fsdp2"]
    ours, theirs = out["mixed"]["losses"]
    assert exact and ours == theirs, diff           # bf16 on the wire, fp32 masters: FSDP2's bits
    assert not out["mixed"]["vs_fp32"][0]           # and bf16 really was used
    exact, diff = out["mixed"]["ring"]              # the ring adds bf16 in its own order from p = 3
    assert (exact if p <= 2 else diff <= BF16_TOL), (p, diff)
    peak, (_, diff1) = out["max_alive_1"]
    assert peak == 1 and diff1 <= TOL


@pytest.mark.parametrize("p", [1, 2, 3, 6])
def test_zero_and_fsdp_equal_fully_shard_and_ddp(p):
    full = p in (2, 3)
    mode = "full" if full else "light" if p > 3 else "ring"
    results = launch.run(_world, p, args=(mode,), timeout=WORLD_TIMEOUT)
    _check_world(p, results, full)
    if p == 1:
        _check_bad_input(results[0]["bad_input"])


@pytest.mark.gpu
def test_nccl_gpu_tensors_equal_fully_shard_and_ddp():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))   # importable by name in spawned ranks too
    import gpu_lesson10 as gpu
    for p in (1, 2):
        for rank, checks in enumerate(launch.run(gpu._checks, p, backend="nccl", timeout=WORLD_TIMEOUT)):
            assert checks["ZeRO-3 (torch collectives) vs fully_shard"]["bit_equal"], (p, rank, checks)
            for name, c in checks.items():
                assert c["max_abs_diff"] <= (TOL if "bf16" not in name else 1e-2), (p, rank, name, c)


def test_layout_pads_packs_and_unpacks_every_size():
    g = torch.Generator().manual_seed(3)
    for p in range(1, 7):
        for shapes in ([(7, 5), (3,)], [(1, 4), (2, 2, 3)], [(13,)]):
            group = ShardGroup(shapes, p)
            fulls = [torch.randn(s, generator=g) for s in shapes]
            pieces = [torch.cat(group.shard(fulls, r)) for r in range(p)]
            assert all(x.numel() == group.shard_numel for x in pieces)
            for back, full in zip(group.unpack(torch.cat(pieces)), fulls):
                assert torch.equal(back, full)
            packed = group.pack(fulls).view(p, -1)
            for r in range(p):                       # the reduce-scatter hands rank r its shards
                assert torch.equal(packed[r], pieces[r])
            assert group.padding == p * group.shard_numel - group.numel >= 0


def test_live_bytes_counts_a_known_pattern():
    import threading
    kept = torch.zeros(1000)                         # 4000 bytes from before the start
    with LiveBytes() as meter:
        a = torch.empty(256)                         # +1024             live 1024
        b = torch.empty(512)                         # +2048             live 3072
        v = a.view(16, 16)                           # a view: nothing
        a.add_(1)                                    # in place: nothing
        del a                                        # v still holds it
        c = b[:128].clone()                          # +512              live 3584 (peak so far)
        del v, c                                     # -1024 -512        live 2048
        kept.untyped_storage().resize_(0)            # -4000             live -1952
        kept.untyped_storage().resize_(8000)         # +8000             live 6048
        d = b * 2                                    # +2048             live 8096: the peak
        del b, d                                     # -4096             live 4000
        got = []
        worker = threading.Thread(target=carry(lambda: got.append(torch.empty(250))))   # +1000 on another thread
        worker.start()
        worker.join()
        assert meter.live == 5000
        del got[:]                                   # -1000
    assert (meter.peak, meter.live, meter.allocated) == (8096, 4000, 1024 + 2048 + 512 + 8000 + 2048 + 1000)
    with pytest.raises(RuntimeError, match="already running"):
        with LiveBytes():
            with LiveBytes():
                pass


def test_cost_formulas():
    assert memory_bytes(1000, 4, 0)["total"] == 16_000
    assert memory_bytes(1000, 4, 1) == dict(params=2000, grads=2000, optimizer=3000, total=7000)
    assert memory_bytes(1000, 4, 2)["total"] == 2000 + 500 + 3000
    assert memory_bytes(1000, 4, 3)["total"] == 4000
    assert comm_elements(1000, 4, 3) == 1.5 * comm_elements(1000, 4, 0) == 1.5 * comm_elements(1000, 4, 2)
    with pytest.raises(ValueError, match="stage"):
        memory_bytes(1000, 4, 4)


def _bad_input():
    errors = []
    for make in (lambda: ZeRO(make_model(), stage=3), lambda: FSDP(make_model(), max_alive=0),
                 lambda: FSDP(make_model(), units=[make_model()[0]]),
                 lambda: ZeRO(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()), stage=1),
                 lambda: FSDP(make_model().double()), lambda: FSDP(make_model(), release="later"),
                 lambda: FSDP(make_model(), reshard_after_forward=2), lambda: ZeRO(make_model(), 2, max_in_flight=0)):
        try:
            make()
            errors.append("")
        except (ValueError, RuntimeError) as exc:
            errors.append(str(exc))
    return errors


def _check_bad_input(errors) -> None:
    assert "stage must be 1 or 2" in errors[0]
    assert "max_alive must be at least 1" in errors[1]
    assert "belong to no unit" in errors[2]
    assert "share one floating dtype" in errors[3]
    assert "must be float32" in errors[4]
    assert "release must be 'record_stream' or 'stream_order', got 'later'" in errors[5]
    assert "reshard_after_forward must be True, False or an int dividing the 1 ranks, got 2" in errors[6]
    assert "max_in_flight must be at least 1, got 0" in errors[7]
    with pytest.raises(ValueError, match="rank must be"):
        resolve("collectives.sharded:shard_rows")(torch.ones(3), 3, 3)


def _settle_world(stuck: bool):
    """bench-sharded's wait for an earlier contender's memory, with the allocator stood in
    for: rank 0 is back at the baseline at once, rank 1 on its fifth look (or never)."""
    from types import SimpleNamespace

    from collectives.course.benchmarks import sharded

    looks = {"n": 0}

    def allocated(device=None):
        looks["n"] += 1
        if dist.get_rank() == 0 or looks["n"] == 1:
            return 100
        return 900 if stuck or looks["n"] < 5 else 100

    fake, real_zeros = SimpleNamespace(type="cuda"), torch.zeros
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "synchronize", lambda d=None: None)
        mp.setattr(torch.cuda, "empty_cache", lambda: None)
        mp.setattr(torch.cuda, "memory_allocated", allocated)
        mp.setattr(torch, "zeros", lambda *a, device=None, **k: real_zeros(*a, **k))   # on the CPU
        base = sharded._settled(fake, None)
        got = sharded._settled(fake, base, patience=0.5 if stuck else 120.0)
    return base, got, looks["n"]


@pytest.mark.parametrize("stuck", [False, True])
def test_the_memory_baseline_waits_in_step_on_every_rank(stuck):
    """Ranks that see their memory released at different times go round the same number of
    times (a rank that left early would leave the others in a collective alone: a hang), and
    what is never released comes back as it is, after the patience runs out."""
    (b0, got0, n0), (b1, got1, n1) = launch.run(_settle_world, 2, args=(stuck,), timeout=WORLD_TIMEOUT)
    assert (b0, b1, got0) == (100, 100, 100)
    assert got1 == (900 if stuck else 100)
    # each look ends in an all-reduce: every rank makes as many as the slowest needs (rank 1
    # is back at its baseline on its fifth look), or as many as the patience allows
    assert n0 == n1 and (n1 >= 2 if stuck else n1 == 5)


# ---- what a user of fully_shard relies on, each against fully_shard on the same model ------------

class Branchy(nn.Module):
    """Three layers; the middle one runs only when ``use_b`` (a parameter unused in a step)."""

    def __init__(self, frozen: bool = False, swapped: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 3)
        self.use_b = True
        if frozen:
            self.a.bias.requires_grad_(False)
        if swapped:                         # the middle layer's parameters registered in the other order
            del self.b.weight, self.b.bias
            self.b.register_parameter("bias", nn.Parameter(torch.zeros(7)))
            self.b.register_parameter("weight", nn.Parameter(torch.zeros(7, 7)))

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.use_b:
            h = torch.relu(self.b(h))
        return self.c(h)


PLAN = [(True, 1), (False, 1), (True, 2)]       # per step: the middle layer used?, backwards before the step
CLIP = 0.05


def _edge_train(model, forward, params, clip):
    opt = adam(params)
    for s, (use_b, backwards) in enumerate(PLAN):
        model.use_b = use_b
        for k in range(backwards):               # gradient accumulation: two backwards, one step
            forward(batch(10 * s + k)).square().mean().backward()
        norm = clip(CLIP) if clip else None
        opt.step()
        opt.zero_grad()
    return opt, norm


def _edges():
    from torch.distributed.fsdp import fully_shard
    out = {}
    for frozen, reshard in ((False, True), (True, False)):
        theirs = Branchy(frozen)
        for layer in (theirs.a, theirs.b, theirs.c):
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(theirs, reshard_after_forward=reshard)
        params = list(theirs.parameters())
        trained = [q for q in params if q.requires_grad]
        _, their_norm = _edge_train(theirs, theirs, params, lambda c: torch.nn.utils.clip_grad_norm_(trained, c))
        want = [q.full_tensor().detach().clone() for q in params]
        for use_torch in (True, False):
            m = Branchy(frozen)
            f = FSDP(m, use_torch=use_torch, reshard_after_forward=reshard)
            with trace.recording() as t:
                _, norm = _edge_train(m, f, f.parameters(), f.clip_grad_norm_)
            out[(frozen, reshard, use_torch)] = dict(diff=_same(f.full_parameters(), want),
                                                     norms=(float(norm), float(their_norm.full_tensor())),
                                                     sends=sum(1 for e in t.sends() if e.numel > 1))  # not the norm's
            f.close()
    # ZeRO-2: a frozen parameter, accumulation and an unused parameter against DDP; its
    # reduce-scatter in flight in backward
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(Branchy(frozen=True), find_unused_parameters=True)
    _edge_train(ddp.module, ddp, ddp.parameters(), None)
    m = Branchy(frozen=True)
    z = ZeRO(m, stage=2, optimizer=adam, bucket_cap_bytes=7 * 7 * 4)
    opt = z.optimizer
    for s, (use_b, backwards) in enumerate(PLAN):
        m.use_b = use_b
        for k in range(backwards):
            m(batch(10 * s + k)).square().mean().backward()
        z.step()
        z.zero_grad()
    out["zero2"] = _same([q.detach() for q in m.parameters()], [q.detach() for q in ddp.parameters()])
    out["zero2 overlap"] = _zero2_overlap()
    del opt
    # refused with a clear error: a write after wrapping; parameters listed in another order
    f = FSDP(Branchy())
    nn.init.zeros_(f.model.a.weight)
    out["write"] = _error(lambda: f(batch(0)))
    f.close()
    out["layout"] = _error(lambda: FSDP(Branchy(swapped=dist.get_rank() == 1)))
    out["zero3_train"] = _zero3_train_against_fully_shard()
    out["unused"] = _unused_on_some_ranks()
    return out


class Gated(nn.Module):
    """A unit of two branches; the second runs only on the ranks in ``uses``. Computed first,
    it gets its gradients after the first's: ZeRO-2's bucket of ``extra`` and ``c`` fills after
    the bucket of ``main`` where ``extra`` is used, before it where not -- unless buckets are
    launched in bucket order, the ranks' reduce-scatters come in different orders."""

    def __init__(self):
        super().__init__()
        self.main, self.extra = nn.Linear(7, 7), nn.Linear(7, 7)
        self.uses = set()

    def forward(self, h):
        return self.extra(h) + self.main(h) if dist.get_rank() in self.uses else self.main(h)


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.g, self.c = nn.Linear(5, 7), Gated(), nn.Linear(7, 3)

    def forward(self, x):
        return self.c(torch.relu(self.g(torch.relu(self.a(x)))))


USES = [[{0}], [set()], [{1}, {0, 1}]]    # per step and backward: the ranks whose batch takes g.extra
# against DDP, one backward a step: DDP all-reduces the second backward's gradient added to the
# first's mean, ZeRO each backward's (or the sum's) mean -- the same to rounding, not to the bit
USES_DDP = [[{0}], [set()], [{1}]]


def _split_train(model, forward, step, plan=USES) -> list:
    """Train ``model`` along ``plan``; returns what ``step`` returned each step."""
    seen = []
    for s, uses in enumerate(plan):
        for k, ranks in enumerate(uses):
            model.g.uses = ranks
            forward(batch(10 * s + k)).square().mean().backward()
        seen.append(step())
    return seen


def _adam_step(params, rows):
    """Adam on ``params``: a step that returns this rank's rows of their gradients (``rows``
    picks them), None where a parameter has none -- what the step saw."""
    params = list(params)
    opt = adam(params)

    def step():
        grads = [None if q.grad is None else rows(q).detach().clone() for q in params]
        opt.step()
        opt.zero_grad()
        return grads
    return step


def _same_steps(ours, theirs, params, want) -> tuple[bool, bool, float]:
    """(every step's gradients the same -- None where the other's is None -- , the parameters
    the same, their largest difference)."""
    grads = all(len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and
                                                                        torch.equal(x, y)) for x, y in zip(a, b))
                for a, b in zip(ours, theirs))
    exact, diff = _same(params, want)
    return grads and len(ours) == len(theirs), exact, diff


def _unused_on_some_ranks() -> dict:
    """A parameter used on some ranks and not on others: FSDP with reduce_scatter_unused_params
    against fully_shard with set_reduce_scatter_unused_params(True), ZeRO-1/2 with
    find_unused_parameters against DDP's -- every step's gradients and the parameters after;
    the refusals, before anything changes."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    theirs = Split()
    for unit in (theirs.a, theirs.g, theirs.c):
        fully_shard(unit)
    fully_shard(theirs).set_reduce_scatter_unused_params(True)
    their_grads = _split_train(theirs, theirs, _adam_step(theirs.parameters(), lambda q: q.grad.to_local()))
    want = [q.full_tensor() for q in theirs.parameters()]
    out = {}
    for use_torch in (True, False):
        m = Split()
        f = FSDP(m, use_torch=use_torch, reduce_scatter_unused_params=True)
        grads = _split_train(m, f, _adam_step(f.parameters(), lambda q: q.grad))
        out[("fsdp", use_torch)] = _same_steps(grads, their_grads, f.full_parameters(), want)
        f.close()
    ddp = DistributedDataParallel(Split(), find_unused_parameters=True)
    rank, p = dist.get_rank(), dist.get_world_size()

    def rows(q):
        lo, hi = ShardSpec(tuple(q.shape), p).owned_rows(rank)
        return q.grad[lo:hi]
    their_grads = _split_train(ddp.module, ddp, _adam_step(ddp.parameters(), rows), USES_DDP)
    want = [q.detach().clone() for q in ddp.parameters()]
    for stage in (1, 2):
        m = Split()
        z = ZeRO(m, stage, optimizer=adam, bucket_cap_bytes=7 * 7 * 4, find_unused_parameters=True)

        def step():
            z.step()
            grads = [None if s.grad is None else s.grad.clone() for s in z.shards]
            z.zero_grad()
            return grads
        grads = _split_train(m, m, step, USES_DDP)
        out[("zero", stage)] = _same_steps(grads, their_grads, [q.detach() for q in m.parameters()], want)
        z.remove()
    # refused: ZeRO-1 without the switch; with FSDP, a whole unit run on some ranks only
    m = Split()
    z, before = ZeRO(m, 1, optimizer=adam), [q.detach().clone() for q in m.parameters()]
    m.g.uses = {0}
    m(batch(0)).square().mean().backward()
    out["zero1 refused"] = (_error(z.step), _same([q.detach() for q in m.parameters()], before)[0])
    m = Branchy()
    f = FSDP(m, reduce_scatter_unused_params=True)
    before = f.full_parameters()
    m.use_b = dist.get_rank() == 0

    def skipped():
        f(batch(0)).square().mean().backward()
    out["unit refused"] = (_error(skipped), _same(f.full_parameters(), before)[0], [s.grad for s in f.parameters()])
    f.close()
    return out


def _zero3_train_against_fully_shard() -> dict:
    """The exercise's task 6, solved: losses and the trained rows equal fully_shard's, fp32 and
    bf16 over fp32 masters (the grader's model: linear layers, GELU, a LayerNorm)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from collectives.course.grading.tasks.lesson10_training import make_model as train_model
    from collectives.sharded import zero3_train
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + 10 * s + dist.get_rank()))
               for s in range(3)]
    out = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        losses, pieces = zero3_train(train_model(1), batches, lr=1e-2, param_dtype=dtype)
        m = train_model(1)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype else MixedPrecisionPolicy()
        for child in m:
            if any(True for _ in child.parameters()):
                fully_shard(child, mp_policy=policy)
        fully_shard(m, mp_policy=policy)
        opt = adam(m.parameters())
        theirs = []
        for x in batches:
            loss = m(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            theirs.append(loss.item())
        units = [c for c in m if any(True for _ in c.parameters())]
        rows = [torch.cat(ShardGroup([q.shape for q in u.parameters()], dist.get_world_size()).shard(
            [q.full_tensor().detach() for q in u.parameters()], dist.get_rank())) for u in units]
        out[name] = (losses == theirs, _same(pieces, rows))
    return out


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward computes for a while (noted: when it began, when it ended)."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import time
        t0 = time.perf_counter()
        time.sleep(0.2)
        ctx.log.append((t0, time.perf_counter()))
        return grad, None


def _zero2_overlap() -> bool:
    """A ring reduce-scatter message of a later bucket in flight while the first layer's backward
    computes: ZeRO-2's reduce-scatter runs during backward, not after it or in its way."""
    m, log = make_model(), []
    z = ZeRO(m, stage=2, optimizer=adam, bucket_cap_bytes=100)
    with trace.recording() as t:
        h = _SlowBackward.apply(m[0](batch(0)), log)
        m[1:](h).square().mean().backward()
    z.step()
    z.remove()
    moving = [e for e in t.events if e.label.startswith("reduce-scatter") and e.t1 is not None]
    return any(e.t0 < end and e.t1 > start for e in moving for start, end in log)


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    return ""


def test_edges_behave_as_fully_shard_or_err_clearly():
    p = 2
    for rank, out in enumerate(launch.run(_edges, p, timeout=WORLD_TIMEOUT)):
        for (frozen, reshard, use_torch), got in ((k, v) for k, v in out.items() if isinstance(k, tuple)):
            # the clipping factor is the norm of shards' norms, summed in another order than
            # fully_shard's: equal to rounding (the gradients themselves are its bits)
            exact, diff = got["diff"]
            assert diff <= TOL, (rank, frozen, reshard, use_torch, diff)
            ours, theirs = got["norms"]
            assert abs(ours - theirs) <= 1e-6 * theirs, got["norms"]
        # the ring's messages: per backward and unit run, an all-gather in forward, another
        # before backward unless reshard_after_forward is False, and a reduce-scatter; plus the
        # step that skips the middle layer: its prefetch (issued as the first layer starts) is wasted
        units_run = [3 if use_b else 2 for use_b, _ in PLAN]
        for reshard, frozen in ((True, False), (False, True)):
            collectives = sum(n * backwards * (3 if reshard else 2) for n, (_, backwards) in zip(units_run, PLAN))
            assert out[(frozen, reshard, False)]["sends"] == (collectives + 1) * (p - 1), (reshard, out)
        exact, diff = out["zero2"]
        assert diff <= TOL, diff
        assert out["zero2 overlap"], "no reduce-scatter message was in flight during the backward's compute"
        assert "parameter a.weight was written after wrapping" in out["write"], out["write"]
        assert "rank 1 lists its parameters differently from rank 0" in out["layout"], out["layout"]
        for name, (same_losses, (exact, diff)) in out["zero3_train"].items():
            assert same_losses and exact, (rank, name, diff)      # two ranks: one order of sums, the bits
        _check_unused(rank, out["unused"])


def _check_unused(rank: int, got: dict) -> None:
    for key in (("fsdp", True), ("fsdp", False), ("zero", 1), ("zero", 2)):
        grads, exact, diff = got[key]
        assert grads and exact, (rank, key, grads, diff)      # two ranks: fully_shard's and DDP's bits
    error, unchanged = got["zero1 refused"]
    assert "ZeRO-1 on rank %d: parameter g.extra.weight was used on rank(s) [0] and not on rank(s) [1]" % rank \
        in error and "find_unused_parameters=True" in error and unchanged, error
    error, unchanged, grads = got["unit refused"]
    assert f"FSDP on rank {rank}: unit 1 (b.weight, ...) ran its forward on rank(s) [0] and not on rank(s) [1]" \
        in error and unchanged and grads == [None] * 6, error


def _checkpoint(folder: str, save: bool):
    """Save after two steps on this world, or load into a fresh model on this one: plain data back."""
    f = FSDP(make_model())
    opt = adam(f.parameters())
    if save:
        _train(f, lambda: (opt.step(), opt.zero_grad()))
        dist.barrier()
        f.save(folder, opt)
    else:
        f.load(folder, opt)
    moments = [opt.state[s]["exp_avg"].clone() for s in f.parameters()]
    steps = {float(opt.state[s]["step"]) for s in f.parameters()}
    params = f.full_parameters()
    f.close()
    return params, moments, steps


def test_a_checkpoint_saved_on_three_ranks_loads_on_two(tmp_path):
    saved = launch.run(_checkpoint, 3, args=(str(tmp_path), True), timeout=WORLD_TIMEOUT)
    loaded = launch.run(_checkpoint, 2, args=(str(tmp_path), False), timeout=WORLD_TIMEOUT)
    assert sorted(x.name for x in tmp_path.iterdir()) == [f"rank{r}-of-3.pt" for r in range(3)]
    want_params = saved[0][0]
    for params, moments, steps in loaded:
        assert all(torch.equal(a, b) for a, b in zip(params, want_params))
        assert steps == {float(STEPS)}
    # Adam's first moments: the rows of three ranks glued, cut again for two
    for i, shape in enumerate(SHAPES):
        full = torch.cat([saved[r][1][i] for r in range(3)])
        for rank in range(2):
            lo, hi = ShardSpec(shape, 2).owned_rows(rank)
            assert torch.equal(loaded[rank][1][i], full[lo:hi]), (i, rank)


def test_the_agreement_benchmark_writes_its_record_on_a_tiny_model(tmp_path, capsys):
    """bench-sharded-agreement at a tiny size: every contender and policy, the bits at two ranks,
    and the peak as the ratio of the two peaks (the 1.05x bound is the larger model's claim,
    and the peak test's above: at two layers of 96 the ring's own buffers weigh more)."""
    import json

    from collectives.course.benchmarks import sharded_agreement
    argv = ["--world", "2", "--layers", "2", "--width", "96", "--batch", "8", "--steps", "1", "--out", str(tmp_path)]
    assert sharded_agreement.main(argv) == 0
    record = json.loads((tmp_path / "10-sharded-agreement.json").read_text())
    assert {"command", "commit", "date", "device", "cpus", "torch"} <= set(record["meta"])
    assert "bench-sharded-agreement --world 2" in record["meta"]["command"]
    rows = {(r["contender"], r["policy"]): r for r in record["rows"]}
    assert set(rows) == {(f"ZeRO-3 ({c})", p) for c in ("ring", "torch") for p in ("fp32", "bf16")}
    for row in rows.values():
        assert row["bit_equal"] and row["losses_equal"] and row["max_abs_diff"] == 0, row
        assert 0 < row["peak_bytes"] and row["peak_over_fsdp2"] == row["peak_bytes"] / row["fsdp2_peak_bytes"], row
    assert "wrote" in capsys.readouterr().out
