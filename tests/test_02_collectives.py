"""Lesson 2, the collectives: the tour of torch.distributed's own, the cost model, and the
hand-built ones on GPUs.

The graded tasks (broadcast, reduce, scatter, gather, all_gather, reduce + broadcast, the
binomial tree) are judged by collectives/course/grading/tasks/lesson02.py, outside the ranks, on
the reference as on a student's exercise: values against the twins' results, every
message against the algorithm's pattern, bad input.
"""

import pytest
import torch
import torch.distributed as dist

from collectives import basics, cost, launch, verify  # basics registers its cost model
from collectives.core.ops import ReduceOp
from collectives.course.catalog import world_timeout

LESSON = 2
P = 4
WORLD_TIMEOUT = world_timeout(20)       # seconds; every world here finishes in a few


# --------------------------------------------------------------------------- the tour and the cost model

def test_tour_of_collectives_shows_each_collective_on_every_rank():
    rows = launch.run(basics.tour_of_collectives, P, timeout=WORLD_TIMEOUT)
    by_name = [{row["collective"]: row for row in rank_rows} for rank_rows in rows]
    names = {"broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather",
             "reduce_scatter", "all_to_all", "barrier", "subgroups", "async_op"}
    assert names <= set(by_name[0])
    assert all(r["broadcast"]["after"] == [0, 0] for r in by_name)
    assert by_name[0]["reduce"]["after"] == [10, 10]
    # chunk j of rank i lands as chunk i of rank j: rank j's chunk 1 is rank 1's chunk j = 10 + j
    assert [r["all_to_all"]["after"][1] for r in by_name] == [[10, 10], [11, 11], [12, 12], [13, 13]]
    assert [r["subgroups"]["after"] for r in by_name] == [[4, 4], [6, 6], [4, 4], [6, 6]]


def test_reduce_broadcast_cost_model_is_registered_for_the_tour():
    c = cost.cost("reduce_broadcast", 1000, 4)
    assert (c.steps, c.bytes_on_path, c.bytes_per_rank) == (6, 6000, 3000)
    assert cost.cost("reduce_broadcast", 1000, 1).steps == 0
    from collectives.course.tour import entries
    assert [e.model for e in entries() if e.lesson == 2] == ["reduce_broadcast"]
    linear, tree = basics.broadcast_cost(1000, 8), basics.broadcast_cost(1000, 8, tree=True)
    assert (linear.steps, tree.steps) == (7, 3)


# --------------------------------------------------------------------------- on GPUs (NCCL)

def _nccl_world():
    me, p = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    problems = []

    def same(name, ours, theirs):
        if not torch.equal(ours, theirs):
            problems.append(f"rank {me} {name}: {ours.tolist()} != {theirs.tolist()}")

    for root in range(p):
        for dtype in (torch.float32, torch.int64):
            x = (torch.arange(5, device=device) + 10 * me).to(dtype)
            for name, ours in (("broadcast", basics.broadcast), ("tree_broadcast", basics.tree_broadcast)):
                a, b = x.clone(), x.clone()
                ours(a, root)
                dist.broadcast(b, root)
                same(name, a, b)
            a, b = x.clone(), x.clone()
            basics.reduce(a, root, ReduceOp.MAX)
            dist.reduce(b, root, op=ReduceOp.MAX)
            if me == root:
                same("reduce", a, b)
            pieces = [torch.full((5,), 100 * i + root, dtype=dtype, device=device) for i in range(p)]
            a, b = torch.zeros_like(x), torch.zeros_like(x)
            basics.scatter(a, pieces if me == root else None, root)
            dist.scatter(b, [t.clone() for t in pieces] if me == root else None, src=root)
            same("scatter", a, b)
            outs = [[torch.zeros_like(x) for _ in range(p)] for _ in range(2)]
            basics.gather(x, outs[0] if me == root else None, root)
            dist.gather(x.clone(), outs[1] if me == root else None, dst=root)
            if me == root:
                same("gather", torch.stack(outs[0]), torch.stack(outs[1]))
            outs = [[torch.zeros_like(x) for _ in range(p)] for _ in range(2)]
            basics.all_gather(outs[0], x)
            dist.all_gather(outs[1], x.clone())
            same("all_gather", torch.stack(outs[0]), torch.stack(outs[1]))
    report = verify.check_all_reduce(basics.all_reduce_via_reduce_broadcast, quick=True)
    problems += [f"rank {me} reduce+broadcast [{r.case}] {r.detail}" for r in report.failures]
    rows = basics.tour_of_collectives()
    return problems, [row["collective"] for row in rows]


@pytest.mark.gpu
def test_hand_built_collectives_match_their_twins_on_nccl():
    results = launch.run(_nccl_world, 2, backend="nccl", timeout=150)
    problems = [p for rank_problems, _ in results for p in rank_problems]
    assert not problems, "\n".join(problems[:10])
    assert "all_to_all" in results[0][1]
