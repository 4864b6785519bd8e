"""Lesson 3, the naive ring: what the lesson page says of the tutorial's version.

The graded tasks (the loop, every op and dtype, the rest of the contract) are judged by
collectives/course/grading/tasks/lesson03.py, outside the ranks, on the reference as on a
student's exercise: values against the reduction of the inputs on worlds of 1 to 4
ranks, and every call's messages against the ring's pattern.
"""

import pytest
import torch
import torch.distributed as dist

from collectives import cost, launch
from collectives.course.catalog import world_timeout

LESSON = 3
WORLD_TIMEOUT = world_timeout(60)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_cost_model_sends_p_minus_1_whole_tensors_per_rank(p):
    # what the judge holds every call to: p − 1 messages of n bytes, one per step
    c = cost.cost("naive_ring", 4000, p)
    assert (c.steps, c.bytes_per_rank, c.bytes_on_path) == (p - 1, (p - 1) * 4000, (p - 1) * 4000)


# ---- the tutorial's version, kept in collectives.naive_ring: what the lesson page says of it

def _tutorial_behaviour():
    from collectives.naive_ring import tutorial_all_reduce
    rank = dist.get_rank()
    out = {}
    x = torch.arange(6.0) + rank
    result = torch.empty(6)
    tutorial_all_reduce(x, result)
    out["contiguous sum"] = torch.equal(result, 2 * torch.arange(6.0) + 1)
    out["input untouched"] = torch.equal(x, torch.arange(6.0) + rank)
    try:
        view = (torch.arange(6.0).view(2, 3) + rank).t()
        tutorial_all_reduce(view, torch.empty(3, 2))
        out["transposed view"] = "ran"
    except RuntimeError as exc:
        out["transposed view"] = str(exc)
    return out


def test_the_tutorial_version_sums_out_of_place_and_rejects_a_transposed_view():
    for out in launch.run(_tutorial_behaviour, 2, timeout=WORLD_TIMEOUT):
        assert out["contiguous sum"] and out["input untouched"]
        assert "contiguous" in out["transposed view"], out["transposed view"]
