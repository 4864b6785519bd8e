"""Lesson 13: tensor and sequence parallelism, equal to one process and to torch's DTensor TP.

What is checked:

* **equal to one process** -- :class:`TinyGPT` trained three SGD steps whole, and split by
  :class:`TPGPT` over 2 and 4 ranks, plain TP and sequence parallel, lesson 4's ring and
  torch's collectives: losses and parameters agree to 1e-5 (the row layers' partial products
  and the cross-entropy's sums are added across ranks, in another order than one matmul's);
* **equal to torch** -- the same model split by ``parallelize_module`` (ColwiseParallel,
  RowwiseParallel, SequenceParallel, ``loss_parallel``) on a gloo ``DeviceMesh``, with torch's
  collectives: the loss bit for bit at p = 2 and to 1e-6 at 4 (gloo and DTensor sum four
  partial products in another order than our layers), every gradient to 1e-6 (torch's
  DTensor backward runs other kernels);
  2-D: lesson 10's FSDP across × TP inside on a 2 × 2 mesh, plain TP and sequence parallel,
  equal to ``fully_shard`` + ``parallelize_module`` on the same mesh to 1e-5;
* **dropout** -- with dropout on, the split model (plain TP and sequence parallel) drops what
  the whole one drops: the loss and gradients agree to 1e-5;
* **bytes from the trace** -- what one block sends per rank, forward and backward, equals
  :func:`comm_bytes_per_layer`, plain TP and sequence parallel;
* **activation memory** -- the bytes autograd keeps for one block per rank equal
  :func:`activation_bytes` at p = 1, 2, 4, both schemes;
* **the vocabulary** -- the embedding and the cross-entropy equal ``nn.Embedding`` and
  ``F.cross_entropy``, and the loss sends 3 numbers per token, never the logits;
* **async TP** -- the chunked all-gather → matmul and matmul → reduce-scatter equal the
  sequential ones bit for bit (the reduce-scatter's products made row block by row block:
  BLAS may round a block of a larger product otherwise), send only p2p pieces, and each piece's transfer runs while
  the matmul before it does;
* **bad input** -- a group that does not divide the heads, the width, the vocabulary or the
  sequence is refused before any message.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from collectives import launch, trace
from collectives.ring import ring_all_gather, ring_reduce_scatter
from collectives.tensor_parallel import (
    TPGPT,
    Config,
    TinyGPT,
    TPBlock,
    TPGroup,
    VocabParallelEmbedding,
    activation_bytes,
    all_gather_matmul,
    comm_bytes_per_layer,
    matmul_reduce_scatter,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)
from collectives.tensor_parallel.cost import saved_activation_bytes

LESSON = 13
CFG = Config(vocab=32, hidden=16, heads=4, ffn=32, layers=2)
B, S = 2, 8
STEPS = 3
TOL = 1e-5


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, CFG.vocab, (B, S), generator=g), torch.randint(0, CFG.vocab, (B, S), generator=g)


def _shard_of(full: torch.Tensor, name: str, p: int, r: int) -> torch.Tensor:
    """The part of one-process parameter ``name`` that rank r of p holds in TPGPT."""
    if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "wq.bias", "wk.bias", "wv.bias",
                      "w1.bias", "output.weight", "tok_embeddings.weight")):
        return full.chunk(p, 0)[r]
    if name.endswith(("wo.weight", "w2.weight")):
        return full.chunk(p, 1)[r]
    return full


def _tp_names(model: TinyGPT) -> list[str]:
    """The one-process names in TPGPT's parameter order."""
    names = ["tok_embeddings.weight"]
    for i in range(len(model.layers)):
        names += [f"layers.{i}.{n}" for n in ("attention_norm.weight", "attention_norm.bias", "ffn_norm.weight",
                                               "ffn_norm.bias", "attention.wq.weight", "attention.wq.bias",
                                               "attention.wk.weight", "attention.wk.bias", "attention.wv.weight",
                                               "attention.wv.bias", "attention.wo.weight", "attention.wo.bias",
                                               "feed_forward.w1.weight", "feed_forward.w1.bias",
                                               "feed_forward.w2.weight", "feed_forward.w2.bias")]
    return names + ["norm.weight", "norm.bias", "output.weight"]


def _train_one_process():
    model = TinyGPT(CFG, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for s in range(STEPS):
        loss = model.loss(*batch(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, dict(model.named_parameters())


def _train_split(sp: bool, use_torch: bool):
    tp = TPGroup(use_torch=use_torch)
    model = TPGPT(TinyGPT(CFG, seed=1), tp, sp=sp)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for s in range(STEPS):
        loss = model.loss(*batch(s))
        loss.backward()
        sync_sequence_parallel_grads(model, tp)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, [q.detach().clone() for q in model.parameters()]


def _train_torch(sp: bool):
    from torch.distributed.device_mesh import init_device_mesh

    from collectives.tensor_parallel import torch_tp

    model = TinyGPT(CFG, seed=1)
    torch_tp.tp_plan(model, init_device_mesh("cpu", (dist.get_world_size(),)), sp)
    loss = torch_tp.torch_loss(model, *batch(0))
    torch_tp.backward(loss)
    tp = TPGroup(use_torch=True)               # the same collectives as DTensor's
    ours = TPGPT(TinyGPT(CFG, seed=1), tp, sp=sp)
    mine = ours.loss(*batch(0))
    mine.backward()
    sync_sequence_parallel_grads(ours, tp)
    grads = [float((torch_tp.local_grad(a) - b.grad).abs().max())
             for a, b in zip(model.parameters(), ours.parameters())]
    return float(loss.full_tensor()), float(mine), grads


DROP = Config(vocab=32, hidden=16, heads=4, ffn=32, layers=2, dropout=0.2)


def _dropout_loss(sp: bool | None):
    """One loss and the wq gradient with dropout on: whole (``sp`` None) or split; the masks
    are drawn whole from one seed, so the split model drops what the whole one drops."""
    model = TinyGPT(DROP, seed=1)
    if sp is not None:
        model = TPGPT(model, TPGroup(), sp=sp)
    torch.manual_seed(42)
    loss = model.loss(*batch(0))
    loss.backward()
    grad = (model.layers[0].wq.weight.grad if sp is not None else model.layers[0].attention.wq.weight.grad)
    return loss.item(), grad


def _equal_world(reference):
    out = {"dropout": [_dropout_loss(sp) for sp in (False, True)]}
    for sp in (False, True):
        for use_torch in (False, True):
            out[(sp, use_torch)] = _train_split(sp, use_torch)
        out[("torch", sp)] = _train_torch(sp)
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_training_equals_one_process_and_torchs_dtensor_tp(p):
    want_losses, want = _train_one_process()
    names = _tp_names(TinyGPT(CFG, seed=1))
    results = launch.run(_equal_world, p, args=(None,), timeout=120)
    drop_loss, drop_grad = _dropout_loss(None)
    for r, got in enumerate(results):
        for sp, (loss, grad) in zip((False, True), got["dropout"]):
            assert abs(loss - drop_loss) <= TOL, f"rank {r}, dropout, {'SP' if sp else 'TP'}: {loss} vs {drop_loss}"
            torch.testing.assert_close(grad, drop_grad.chunk(p, 0)[r], rtol=0, atol=TOL)
        for sp in (False, True):
            for use_torch in (False, True):
                losses, params = got[(sp, use_torch)]
                where = f"rank {r} of {p}, {'SP' if sp else 'TP'}, {'torch' if use_torch else 'ring'}"
                assert losses == pytest.approx(want_losses, abs=TOL), where
                assert len(params) == len(names)
                for name, q in zip(names, params):
                    torch.testing.assert_close(q, _shard_of(want[name].detach(), name, p, r), rtol=0, atol=TOL,
                                               msg=lambda m, n=name: f"{where}, {n}: {m}")
            theirs, ours, grads = got[("torch", sp)]
            if p == 2:                               # two addends: one order, the same bits
                assert theirs == ours, f"rank {r}: torch's loss {theirs} and ours {ours} differ"
            assert abs(theirs - ours) <= 1e-6, f"rank {r}: torch's loss {theirs} and ours {ours} differ"
            assert max(grads) < 1e-6, f"rank {r}, {'SP' if sp else 'TP'}: gradients differ from torch's by {grads}"


def _block_world(b, s, sp):
    tp = TPGroup()
    p = tp.size
    block = TPBlock(TinyGPT(Config(vocab=32, hidden=16, heads=4, ffn=32, layers=1), seed=2).layers[0], tp, sp)
    x = torch.randn(b, s // p if sp else s, 16, generator=torch.Generator().manual_seed(tp.rank if sp else 0),
                    requires_grad=True)
    saved = saved_activation_bytes(block, x, exclude=list(block.parameters()))
    with trace.recording() as t:
        block(x).square().sum().backward()
    kinds = sorted({e.kind for e in t.events if e.kind not in ("send", "recv", "isend", "irecv")})
    return saved, sum(e.nbytes for e in t.sends()), kinds


def test_bytes_from_the_trace_and_activation_memory_equal_the_formulas():
    b, s, h = 2, 8, 16
    for p in (1, 2, 4):
        for sp in (False, True):
            got = launch.run(_block_world, p, args=(b, s, sp))
            for r, (saved, sent, kinds) in enumerate(got):
                where = f"rank {r} of {p}, {'SP' if sp else 'TP'}"
                assert sent == comm_bytes_per_layer(b, s, h, p, sp=sp)["bytes"], where
                assert saved == activation_bytes(b, s, h, 4, 32, p, sp=sp)["total"], where
                assert kinds == [], f"{where}: the ring sends messages, not {kinds}"
    tp_mem = activation_bytes(b, s, h, 4, 32, 4, sp=False)["total"]
    sp_mem = activation_bytes(b, s, h, 4, 32, 4, sp=True)["total"]
    assert sp_mem < tp_mem


def _vocab_world(seed):
    tp = TPGroup()
    g = torch.Generator().manual_seed(seed)
    emb = torch.nn.Embedding(24, 5)
    logits = torch.randn(3, 7, 24, generator=g)
    targets = torch.randint(0, 24, (3, 7), generator=g)
    ids = torch.randint(0, 24, (3, 8), generator=g)
    mine = tp.split(logits, -1).requires_grad_()
    with trace.recording() as t:
        loss = vocab_parallel_cross_entropy(mine, targets, tp)
    largest = max((e.numel for e in t.sends()), default=0)
    loss.mean().backward()
    looked = VocabParallelEmbedding(emb, tp)(ids)
    return loss.detach(), mine.grad, largest, looked.detach(), emb.weight.detach(), logits, targets, ids


def test_vocabulary_parallel_embedding_and_cross_entropy_equal_torchs_and_send_3_numbers_a_token():
    for p in (2, 3):
        for r, (loss, grad, largest, looked, weight, logits, targets, ids) in enumerate(launch.run(_vocab_world, p,
                                                                                                  args=(7,))):
            full = logits.clone().requires_grad_()
            want = torch.nn.functional.cross_entropy(full.flatten(0, 1), targets.flatten(), reduction="none")
            want.mean().backward()
            torch.testing.assert_close(loss.flatten(), want.detach(), rtol=0, atol=1e-6)
            torch.testing.assert_close(grad, full.grad.chunk(p, -1)[r], rtol=0, atol=1e-7)
            assert largest <= -(-2 * 21 // p), f"a message of {largest} elements: the logits were sent"
            assert torch.equal(looked, torch.nn.functional.embedding(ids, weight))


def _async_world(slow):
    tp = TPGroup()
    p, r = tp.size, tp.rank
    g = torch.Generator().manual_seed(r)
    x = torch.randint(-4, 5, (6, 8), generator=g).float()
    w = torch.randint(-4, 5, (8, 5), generator=torch.Generator().manual_seed(99)).float()
    gathered = x.new_empty(p * 6, 8)
    ring_all_gather(gathered, x)
    timeline = []

    def matmul(a, b):
        if slow:
            import time
            time.sleep(0.05)
        return a @ b

    with trace.recording() as t:
        y = all_gather_matmul(x, w, tp, timeline=timeline, matmul=matmul)
    kinds = {e.kind for e in t.events}
    xr = torch.randn(p * 6, 8, generator=g)
    wr = torch.randn(8, 5, generator=g)
    want = torch.empty(6, 5)              # the products row block by row block, as the chunks are made
    ring_reduce_scatter(want, torch.cat([xr[k * 6:(k + 1) * 6] @ wr for k in range(p)]))
    got = matmul_reduce_scatter(xr, wr, tp)
    return torch.equal(y, gathered @ w), torch.equal(got, want), kinds, timeline


def test_async_tp_equals_the_sequential_collectives_bit_for_bit_and_overlaps():
    for p in (2, 4):
        for r, (ag, rs, kinds, timeline) in enumerate(launch.run(_async_world, p, args=(True,))):
            assert ag and rs, f"rank {r} of {p}: all-gather-matmul {ag}, matmul-reduce-scatter {rs}"
            assert kinds <= {"send", "recv", "isend", "irecv"}, kinds
            transfers = [e for e in timeline if e["what"] == "transfer"]
            matmuls = [e for e in timeline if e["what"] == "matmul"]
            assert len(transfers) == p - 1 and len(matmuls) == p
            for k, tr in enumerate(transfers):     # transfer k started before matmul k ended
                assert tr["start"] < matmuls[k]["end"], f"rank {r}: transfer {k} waited for matmul {k}"


def _bad_world():
    out = []
    for cfg, sp, seq in ((Config(heads=3, hidden=15), False, 8), (Config(vocab=30), False, 8), (CFG, True, 6)):
        try:
            with trace.recording() as t:
                model = TPGPT(TinyGPT(cfg, seed=0), TPGroup(), sp=sp)
                model.loss(torch.zeros(1, seq, dtype=torch.int64), torch.zeros(1, seq, dtype=torch.int64))
            out.append(("no error", 0))
        except ValueError as exc:
            out.append((str(exc), len(t.events)))
    return out


def test_a_group_that_does_not_divide_the_model_is_refused_before_any_message():
    for r, got in enumerate(launch.run(_bad_world, 4)):
        (heads, n1), (vocab, n2), (seq, n3) = got
        assert "heads = 3 does not split over 4 ranks" in heads
        assert "vocab = 30 does not split over 4 ranks" in vocab
        assert "sequence length = 6 does not split over 4 ranks" in seq
        assert n1 == n2 == n3 == 0, f"rank {r} sent messages before refusing"


def _two_d_world(sp):
    from torch.distributed.device_mesh import init_device_mesh

    from collectives.sharded import FSDP
    from collectives.tensor_parallel import torch_tp

    rank = dist.get_rank()
    dp, tpr = divmod(rank, 2)                         # the mesh (dp, tp) = (2, 2), row-major as torch's
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp = TPGroup(tp_groups[dp])
    model = TPGPT(TinyGPT(CFG, seed=1), tp, sp=sp)
    fsdp = FSDP(model, units=[model.tok_embeddings, *model.layers, model.norm, model.output], group=dp_groups[tpr])
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.5)
    theirs = TinyGPT(CFG, seed=1)
    torch_tp.torch_2d(theirs, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), sp)
    their_opt = torch.optim.SGD(theirs.parameters(), lr=0.5)
    losses = []
    for s in range(STEPS):
        ids, targets = batch(10 * s + dp)             # each data-parallel half its own batch
        loss = model.loss(ids, targets)
        loss.backward()
        sync_sequence_parallel_grads(fsdp, tp)       # LayerNorms' rows: summed over the TP group too
        opt.step()
        opt.zero_grad()
        their = torch_tp.torch_loss(theirs, ids, targets)
        torch_tp.backward(their)
        their_opt.step()
        their_opt.zero_grad()
        losses.append((float(loss), float(their.full_tensor())))
    mine = [q.detach().clone() for q in fsdp.full_parameters()]
    full = dict((n, q.full_tensor().detach()) for n, q in theirs.named_parameters())
    fsdp.close()
    names = _tp_names(TinyGPT(CFG, seed=1))
    diffs = [float((a - _shard_of(full[n], n, 2, tpr)).abs().max()) for n, a in zip(names, mine)]
    return losses, diffs


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_fsdp_across_and_tp_inside_on_a_2x2_mesh_equal_fully_shard_and_parallelize_module(sp):
    for r, (losses, diffs) in enumerate(launch.run(_two_d_world, 4, args=(sp,), timeout=120)):
        for s, (mine, theirs) in enumerate(losses):
            assert abs(mine - theirs) <= 1e-6, f"rank {r}, step {s}: loss {mine} against torch's {theirs}"
        assert len(diffs) == len(_tp_names(TinyGPT(CFG, seed=1))) and max(diffs) < TOL, f"rank {r}: {diffs}"


def test_a_tiny_benchmark_checks_every_variant_and_writes_its_times_and_meta(tmp_path, capsys):
    import json

    from collectives.course.benchmarks import tp as bench

    path = tmp_path / "tp.json"
    assert bench.main(["--world", "2", "--shapes", "32x16x32", "--iters", "1", "--rounds", "2",
                       "--json", str(path), "--record", "13-bench-test", "--img", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "13-bench-test.json").read_text())
    assert [c["id"] for c in saved["comparisons"]] == ["at-32x16x32"] and (tmp_path / "13-bench-test.svg").exists()
    record = json.loads(path.read_text())
    assert set(record["times"]) == {"sequential", "async", "dtensor"} and all(record["checked"].values())
    assert all(len(v) == 1 and v[0] > 0 for v in record["times"].values())
    whats = [e["what"] for e in record["timeline"]]           # one async forward, p = 2: 2 + 2 matmuls
    assert whats.count("matmul") == 4 and whats.count("transfer") == 2, whats
    for key in ("device", "torch", "date", "command", "commit", "cpus", "load_average"):
        assert key in record["meta"], key
    assert "async × sequential" in capsys.readouterr().out
    with pytest.raises(ValueError, match="s x h x f"):
        bench.parse_shapes("32x16")


def _gpu_variants():
    from collectives.course.benchmarks import tp as bench
    return bench.bench_rank([(256, 256, 512)], bench.GPU_VARIANTS, "bfloat16", 1, 1)["checked"]


@pytest.mark.gpu
def test_on_gpus_async_tp_and_torchs_fused_ops_equal_the_sequential_forward():
    from collectives.symmetric.gpu import NO_MULTICAST
    for rank, checked in enumerate(launch.run(_gpu_variants, 2, backend="nccl", timeout=300, env=dict(NO_MULTICAST))):
        assert checked and all(checked.values()), f"rank {rank}: {checked}"
