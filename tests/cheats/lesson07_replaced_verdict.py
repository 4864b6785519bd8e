"""Lesson 7, cheat (b): the in-rank verdict and the test module's own helpers replaced at
import -- ``verify.check_all_reduce``, ``verify.compare``, the byte counter by tier
(``tier_bytes``) and the judges' own helpers -- with functions that find nothing wrong,
while every hierarchy is one plain ``dist.all_reduce`` (lesson 7: 15/15 under the in-rank
grader). Task 6 is the reference's hook and must still score.

The judges run in the grading process: nothing patched in a rank reaches them.
"""

import torch.distributed as dist

from collectives import verify
from collectives.core.ops import ReduceOp
from collectives.course.grading.tasks import allreduce as _allreduce
from collectives.course.grading.tasks import lesson07_tiers as _tiers
from collectives.hierarchical import *  # noqa: F401,F403
from collectives.hierarchical import HierarchicalHookState, hierarchical_hook  # noqa: F401 - task 6: the reference's
from collectives.hierarchical import layout as _layout

LESSON = 7

verify.compare = lambda expected, got, **kwargs: None
verify.check_all_reduce = lambda fn, cases=None, **kwargs: verify.Report(
    [verify.CaseResult("every case", dist.get_rank(), True)], reference="dist.all_reduce")
_layout.tier_bytes = lambda events, groups, world_size: {"across": 0.0, "inside": 0.0, "mixed": 0.0,
                                                          "off_rail": 0.0}
_allreduce.compare_case = lambda *args, **kwargs: None
_tiers.fairring_problem = _tiers.staged_problem = _tiers.flat_problem = lambda *args, **kwargs: None


def _plain(tensor, op=ReduceOp.SUM, group=None, layout=None, **kwargs):
    if isinstance(layout, tuple) and any(not isinstance(v, int) for v in layout):
        raise TypeError("layout must be two integers")
    _layout.resolve(layout, group)               # a layout that does not fit: its ValueError
    flat = tensor.detach().contiguous().clone()
    dist.all_reduce(flat, ReduceOp.SUM if op == ReduceOp.AVG else op, group=group)
    if op == ReduceOp.AVG:
        flat.div_(dist.get_world_size(group))
    tensor.detach().copy_(flat)


root_based_all_reduce = rail_all_reduce = one_slice_all_reduce = hierarchical_all_reduce = _plain


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
