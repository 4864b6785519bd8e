"""Lesson 13's yardstick: the same :class:`~.model.TinyGPT` split by torch's own tensor parallelism.

``parallelize_module`` with ``ColwiseParallel``, ``RowwiseParallel`` and ``SequenceParallel``
on a ``DeviceMesh`` (DTensor; gloo on CPU, NCCL on GPUs), in TorchTitan's plan for Llama:
the embedding row-wise over the vocabulary, q, k, v and w1 column-wise, wo and w2
row-wise, the head column-wise with its logits left sharded for ``loss_parallel``. Under
sequence parallelism the LayerNorms are ``SequenceParallel`` and every layout between
blocks is ``Shard(1)``. :func:`torch_2d` adds ``fully_shard`` across a second mesh dimension.
"""

from __future__ import annotations

import torch.nn.functional as F


def tp_plan(model, mesh, sp: bool) -> None:
    """Split ``model`` (a TinyGPT) in place over the 1-D ``mesh``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sp else Replicate()
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "norm": SequenceParallel() if sp else None,
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    } if sp else {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        plan = {
            "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, mesh, plan)


def torch_loss(model, ids, targets):
    """The mean cross-entropy of the split ``model``, the logits never gathered (``loss_parallel``)."""
    from torch.distributed.tensor.parallel import loss_parallel

    logits = model(ids)
    with loss_parallel():
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def backward(loss) -> None:
    """``loss.backward()`` inside ``loss_parallel``, as torch asks."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss.backward()


def torch_2d(model, mesh, sp: bool = False) -> None:
    """TP over ``mesh["tp"]`` inside, ``fully_shard`` over ``mesh["dp"]`` across (FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    tp_plan(model, mesh["tp"], sp)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def local(t):
    """The local tensor of a DTensor, else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_grad(param):
    """``param``'s gradient laid out as ``param`` is (torch may leave a replicated
    parameter's gradient as partial sums, or a sharded one's replicated), this rank's part."""
    grad = param.grad
    if hasattr(grad, "redistribute"):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local(grad)
