"""Lesson 8, cheat (c): the verdict and the test module's own helpers replaced at import.
The old graded checks ran in the ranks and asked ``verify.compare``,
``verify.check_all_reduce`` and the tests' ``_close``/``_ok`` whether the result was right;
this file makes every one of them say yes, and then does no work at all: the transports
return at once, the tensor and the residual untouched (16 points under the old grader).
The judge compares in the grading process: tasks 2 to 5 score nothing (task 1, the
reference's selection, still does).
"""

import sys

import torch

from collectives.course import verify
from collectives.sparse import *  # noqa: F401,F403
from collectives.sparse import SparseHookState as _ReferenceState
from collectives.sparse.all_reduce import SparseInfo, SparseWork, _completed

LESSON = 8

verify.compare = lambda *args, **kwargs: None
verify.check_all_reduce = lambda *args, **kwargs: verify.Report([])
for _name in ("tests.test_08_sparse", "test_08_sparse"):
    _tests = sys.modules.get(_name)
    if _tests is not None:
        _tests._close = lambda *args, **kwargs: None
        _tests._ok = lambda per_rank, name: [[] for _ in per_rank]


def pack_pairs(indices, values, width):
    return torch.zeros(width * (4 + values.element_size()), dtype=torch.uint8)


def allgather_sum_(out, indices, values, *, counts=None, group=None):
    return out


def split_sum_(out, indices, values, *, group=None, densify=True):
    return None


def sparse_all_reduce(tensor, residual=None, **kwargs):
    return SparseInfo(kwargs.get("transport", "allgather"), 0)


def sparse_all_reduce_async(tensor, residual=None, **kwargs):
    return SparseWork(sparse_all_reduce(tensor, residual, **kwargs), _completed(tensor))


def sparse_hook_async(state, bucket):
    return _completed(bucket.buffer())


sparse_hook_async.__annotations__ = {"state": _ReferenceState, "bucket": torch.distributed.GradBucket,
                                     "return": torch.futures.Future[torch.Tensor]}
