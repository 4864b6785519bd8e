"""Lesson 12, cheats: answers kept per shape, and records that hold ``unittest.mock.ANY``.

The one-shot reduces a shape correctly the first time it sees it and hands back that answer
whenever the shape comes again (inputs drawn afresh for every call make it wrong). The
two-shot is the reference's, but leaves ``mock.ANY`` -- equal to everything -- in the
workspace's counters, where a judge that compared them would be fooled and one that did
arithmetic on them would crash. Both must get a verdict, and score nothing.
"""

from unittest import mock

from collectives.symmetric import (
    flag_barrier,  # noqa: F401 - task 1: the reference's
    shared,
)

LESSON = 12
_ANSWERS = {}


def one_shot_all_reduce(tensor, op=None, group=None, *, workspace=None):
    key = (tuple(tensor.shape), tensor.dtype, str(op), id(group))
    if key in _ANSWERS:
        tensor.copy_(_ANSWERS[key])
        return
    shared.one_shot_all_reduce(tensor, op if op is not None else shared.ReduceOp.SUM, group, workspace=workspace)
    _ANSWERS[key] = tensor.clone()


def two_shot_all_reduce(tensor, op=None, group=None, *, workspace=None):
    shared.two_shot_all_reduce(tensor, op if op is not None else shared.ReduceOp.SUM, group, workspace=workspace)
    ws = workspace if workspace is not None else shared.workspace(group, tensor.numel() * tensor.element_size())
    ws.epoch, ws.calls = mock.ANY, mock.ANY
