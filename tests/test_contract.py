"""Every all-reduce of the course keeps ``dist.all_reduce``'s contract at its edges.

The harness (``verify``) checks values; these check what happens around them, for every
all-reduce of the tour and for ``fused_all_reduce`` (one tensor through the multi-tensor
path):

* a rank outside ``group`` returns at once and leaves its tensor alone, as
  ``dist.all_reduce`` does (it must not raise, and must not send anything);
* a leaf that requires a gradient (an ``nn.Parameter``) is reduced through its data, as
  ``dist.all_reduce`` does, and stays a leaf;
* arguments no rank can honour (MIN/MAX on complex numbers) raise the same error on every
  rank before any message is sent, so nobody is left waiting for a peer that gave up;
* a tensor whose size differs across ranks ends in an error naming a rank, not a hang.

All but the last run in one world of 3 ranks (3: not a power of two, so the fold of the
doubling algorithms and an odd ring are both exercised; a subgroup of 2 leaves one rank out).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from collectives import launch, trace
from collectives.course.impl import resolve
from collectives.course.tour import TOUR
from collectives.core.ops import ReduceOp

ALL_REDUCES = {e.name: e.target for e in TOUR if e.runner is None}
ALL_REDUCES["fused"] = "tests.test_contract:fused_one"
ALL_REDUCES["hierarchical"] = "tests.test_contract:hierarchical_one_machine"
WORLD = 3


def fused_one(tensor, op=ReduceOp.SUM, group=None):
    """``fused_all_reduce`` of a one-tensor list, with ``dist.all_reduce``'s signature."""
    from collectives.fused import fused_all_reduce
    fused_all_reduce([tensor], op=op, group=group)


def hierarchical_one_machine(tensor, op=ReduceOp.SUM, group=None):
    """``hierarchical_all_reduce`` with the group as one machine (the layout must match it)."""
    from collectives import ops
    from collectives.hierarchical import hierarchical_all_reduce
    size = dist.get_world_size(group) if ops.is_member(group) else 1
    hierarchical_all_reduce(tensor, op=op, group=group, layout=(size, 1))


def _edges() -> dict:
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])              # rank 2 is outside: it gets a placeholder
    out = {}
    for name, target in ALL_REDUCES.items():
        fn = resolve(target)
        res = out[name] = {}
        # 1. outside the group: nothing happens, nothing is sent
        t = torch.full((7,), float(rank + 1))
        with trace.recording() as rec:
            try:
                fn(t, op=ReduceOp.SUM, group=pair)
                res["group"] = t.tolist()
            except Exception as exc:  # noqa: BLE001 - reported per algorithm
                res["group"] = f"{type(exc).__name__}: {exc}"
        res["group_messages"] = len(rec.events)
        # 2. a leaf that requires a gradient
        leaf = torch.nn.Parameter(torch.arange(5.0) + rank)
        try:
            fn(leaf, op=ReduceOp.SUM)
            res["leaf"] = dict(values=leaf.detach().tolist(), is_leaf=leaf.is_leaf,
                               requires_grad=leaf.requires_grad, grad=leaf.grad)
        except Exception as exc:  # noqa: BLE001
            res["leaf"] = f"{type(exc).__name__}: {exc}"
        # 3. complex MIN/MAX: the same ValueError everywhere, before any message
        for op in (ReduceOp.MIN, ReduceOp.MAX):
            z = torch.ones(6, dtype=torch.complex64)
            with trace.recording() as rec:
                try:
                    fn(z, op=op)
                    res[f"complex {op}"] = "accepted"
                except Exception as exc:  # noqa: BLE001
                    res[f"complex {op}"] = type(exc).__name__
            res[f"complex {op} messages"] = len(rec.events)
    return out


@pytest.fixture(scope="module")
def edges():
    return launch.run(_edges, WORLD, timeout=60)


@pytest.mark.parametrize("name", sorted(ALL_REDUCES))
def test_a_rank_outside_the_group_returns_at_once_and_sends_nothing(edges, name):
    for rank, per_rank in enumerate(edges):
        res = per_rank[name]
        if rank == 2:
            assert res["group"] == [3.0] * 7, f"rank 2 is outside the group: {res['group']}"
            assert res["group_messages"] == 0
        else:
            assert res["group"] == [3.0] * 7, f"rank {rank}: 1 + 2 expected, got {res['group']}"


@pytest.mark.parametrize("name", sorted(ALL_REDUCES))
def test_a_leaf_that_requires_grad_is_reduced_through_its_data(edges, name):
    expected = [float(3 * i + 3) for i in range(5)]      # (i + 0) + (i + 1) + (i + 2)
    for rank, per_rank in enumerate(edges):
        res = per_rank[name]["leaf"]
        assert isinstance(res, dict), f"rank {rank}: {res}"
        assert res == dict(values=expected, is_leaf=True, requires_grad=True, grad=None)


@pytest.mark.parametrize("name", sorted(ALL_REDUCES))
def test_complex_min_max_raise_on_every_rank_before_any_message(edges, name):
    for rank, per_rank in enumerate(edges):
        res = per_rank[name]
        for op in (ReduceOp.MIN, ReduceOp.MAX):
            assert res[f"complex {op}"] == "ValueError", f"rank {rank}, {op}: {res[f'complex {op}']}"
            assert res[f"complex {op} messages"] == 0, f"rank {rank} sent before refusing {op}"


# ---- sizes that differ across ranks: an error at once, not a hang -------------------------

def _mismatched(target: str, other_numel: int) -> str:
    """Rank 2 holds ``other_numel`` elements, the others 12; then every rank carries on
    with something else (sleeps), as a training loop would, so a rank that returned early
    does not end the world by exiting."""
    fn = resolve(target)
    fn(torch.ones(other_numel if dist.get_rank() == 2 else 12))
    import time
    time.sleep(30)
    return "returned"


@pytest.mark.parametrize("other_numel", [1, 10])
@pytest.mark.parametrize("name", ["pipelined ring", "multi-ring (2 channels)"])
def test_sizes_that_differ_across_ranks_end_in_an_error_not_a_hang(name, other_numel):
    # A message longer than the receive posted for it aborts gloo (as it aborts
    # dist.all_reduce); the number of messages must therefore not depend on the size, or
    # a shorter message lands silently and everyone waits for the ones in between.
    with pytest.raises(launch.RankError) as err:
        launch.run(_mismatched, WORLD, args=(ALL_REDUCES[name], other_numel), timeout=15)
    assert "rank" in str(err.value)


# ---- registered memory: no temporary of ordinary memory once registered ----------------------

def test_temporaries_come_from_the_pool_once_registered_on_a_gpu(monkeypatch):
    from collectives import nccl_memory
    assert not nccl_memory.pool_allocates("cuda"), "before register(): ordinary memory"
    monkeypatch.setattr(nccl_memory, "_registered", True)
    assert nccl_memory.pool_allocates("cuda") and nccl_memory.pool_allocates("cuda:1")
    assert not nccl_memory.pool_allocates("cpu"), "gloo on CPU has no registered memory"


def test_scratch_is_kept_apart_per_group():
    from collectives import nccl_memory
    a, b = object(), object()            # stand-ins for two process groups
    keys = {nccl_memory.scratch_key(torch.float32, "cpu", g) for g in (None, a, b)}
    assert len(keys) == 3
    assert nccl_memory.scratch_key(torch.float32, "cpu", a) == nccl_memory.scratch_key(torch.float32, "cpu", a)


def _temporaries_of_the_library() -> dict:
    """Which of the library's copies go through nccl_memory.temporary (and so come from the
    registered pool once registered), recorded per operation."""
    from collectives import basics, nccl_memory, ops, p2p, ring
    made = []
    real = nccl_memory.temporary

    def recording(numel, dtype, device):
        made.append(numel)
        return real(numel, dtype, device)

    nccl_memory.temporary = recording
    rank, p = dist.get_rank(), dist.get_world_size()
    out = {}
    try:
        view = torch.arange(12.0).view(3, 4).t()                 # not contiguous: copied
        made.clear(); ops.work_buffer(view); out["work_buffer"] = list(made)
        made.clear(); ring.ring_reduce_scatter(torch.empty(4), torch.ones(4 * p)); out["reduce_scatter"] = list(made)
        made.clear()
        p2p.exchange(torch.ones(3, 4).t(), torch.empty(4, 3).t(), (rank + 1) % p, (rank - 1) % p)
        out["exchange"] = list(made)
        made.clear(); basics.reduce(torch.ones(5), dst=0); out["reduce"] = list(made)
    finally:
        nccl_memory.temporary = real
    return out


def test_the_librarys_own_copies_go_through_the_registered_allocator():
    for rank, res in enumerate(launch.run(_temporaries_of_the_library, 2, timeout=30)):
        assert res["work_buffer"] == [12], "the copy of a view"
        assert res["reduce_scatter"] == [8], "the reduce-scatter's working copy"
        assert sorted(res["exchange"]) == [12, 12], "the landing buffer and the outgoing copy of views"
        assert res["reduce"] == ([5] if rank == 0 else []), "the root's landing buffer"


def _mixed_memory_after_register() -> list:
    """On NCCL, after register(): a view of registered memory (its copy is a temporary) in
    every all-reduce, the reduce-scatter, and exchange: each must complete and be exact."""
    from collectives import nccl_memory, p2p, ring
    rank, p = dist.get_rank(), dist.get_world_size()
    base = nccl_memory.empty(4096, dtype=torch.float32)
    landing = nccl_memory.empty(4096, dtype=torch.float32)
    # lesson 7's hierarchical all-reduce keeps buffers of its own: not this test's subject
    flat_ones = {name: target for name, target in ALL_REDUCES.items() if name != "hierarchical"}
    for target in flat_ones.values():                        # warm-up: every scratch exists
        resolve(target)(base[::2][:1000])
    torch.cuda.synchronize()
    nccl_memory.register()                                  # from here temporaries come from the pool
    problems = []
    for name, target in flat_ones.items():
        view = base[::2][:1000]                                # strided: work_buffer copies it
        view.fill_(rank + 1)
        resolve(target)(view)
        if not bool((view == p * (p + 1) / 2).all()):
            problems.append(name)
    ring.ring_reduce_scatter(landing[:10], base[: 10 * p].fill_(1))
    if not bool((landing[:10] == p).all()):
        problems.append("ring_reduce_scatter")
    p2p.exchange(base[::2][:100].fill_(rank), landing[::2][:100], (rank + 1) % p, (rank - 1) % p)
    if not bool((landing[::2][:100] == (rank - 1) % p).all()):
        problems.append("exchange")
    torch.cuda.synchronize()
    return problems


@pytest.mark.gpu
def test_views_of_registered_memory_complete_after_register():
    results = launch.run(_mixed_memory_after_register, 2, backend="nccl", timeout=150)
    assert results == [[], []]


# ---- what the code and the pages claim -----------------------------------------------------

REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def test_point_to_point_posting_uses_only_public_torch_distributed_calls():
    # ops.sendrecv posts through batch_isend_irecv; the process group's private coalescing
    # calls (never run on the pinned torch, a gain of -0.002 to +0.02) are gone
    source = (REPO / "collectives" / "core" / "ops.py").read_text()
    for private in ("_start_coalescing", "_end_coalescing", "_get_default_group"):
        assert private not in source, private


@pytest.mark.parametrize("path, corrected", [
    # gloo deadlocks at every size, not only for large messages
    ("lessons/03_naive_ring/exercise.py", "large messages\n              would deadlock"),
    # NCCL does not buffer small messages: send-then-recv hangs at 4 KiB too
    ("collectives/p2p.py", "MPI and NCCL buffer small messages"),
    # on NCCL one process group's operations are serialised, whatever the peer
    ("collectives/topologies.py", "receives posted at once"),
    ("docs/lessons/04-ring.md", "both receives posted at once"),
    ("docs/lessons/04-ring.md", "one pair's operations in order"),
    # no idle left link behind NVSwitch: the 2x model is for direct links
    ("collectives/ring.py", "On GPUs connected all to all (NVLink), the\n    link to the left neighbour idles"),
    ("docs/lessons/04-ring.md", "On GPUs connected all to all (NVLink, NVSwitch)\nthe other links idle"),
])
def test_corrected_claims_stay_corrected(path, corrected):
    assert corrected not in (REPO / path).read_text()


def test_the_bounds_say_when_they_hold():
    page = (REPO / "docs" / "lessons" / "04-ring.md").read_text()
    assert "in-network reduction" in page, "no all-reduce sends less -- without in-network reduction"
    from collectives.core import timing
    assert "bandwidth-optimal algorithms" in timing.busbw.__doc__, "busbw is a link rate only for those"
