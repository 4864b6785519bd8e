"""Lesson 8, cheat (d): every function the reference's but the hook, which selects and keeps
its residuals honestly (the reference's state) and then sends the masked bucket -- all of
it -- in one asynchronous dense all-reduce. Its values are the sparse hook's to the last
bit, and its future is pending when it returns: a grader comparing training results scored
task 5 (5/5). The tap sees an all-reduce of the bucket each step where the hook's one
all-gather of p·k packed pairs must be.
"""

import torch
import torch.distributed as dist

from collectives.sparse import *  # noqa: F401,F403
from collectives.sparse import SparseHookState
from collectives.sparse.all_reduce import _begin, _finish

LESSON = 8


def sparse_hook_async(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    flat = bucket.buffer()
    p = dist.get_world_size(state.group)
    flat.div_(p)
    args = state._arguments(bucket.parameters(), flat)
    begun = _begin(flat, state.residual_for(bucket.parameters(), flat), args["density"], args["threshold"],
                   args["transport"], args["selection"], dist.ReduceOp.SUM, state.group, args["state"],
                   args["segments"], None)
    flat, values, info = begun
    if values is not None:
        flat.zero_().index_copy_(0, info.indices, values)
    work = dist.all_reduce(flat, group=state.group, async_op=True)
    return work.get_future().then(lambda _: _finish(flat, flat, dist.ReduceOp.SUM, p))
