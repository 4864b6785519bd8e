"""Lesson 7, cheat (d): a DDP hook that averages each bucket with DDP's own flat all-reduce
(``dist.all_reduce(..., async_op=True)`` on the world) instead of the hierarchy, returning
its future without waiting. Its parameters are DDP's, bit for bit, so a grader that
compared only the parameters after training gave task 6 full marks. Tasks 1-5 are the
reference's.

The judge reads every collective the training made: an all-reduce over ranks of several
machines is a flat one.
"""

import torch.distributed as dist

from collectives.hierarchical import *  # noqa: F401,F403

LESSON = 7


def hierarchical_hook(state, bucket):
    flat = bucket.buffer()
    flat.div_(dist.get_world_size(state.group))
    return dist.all_reduce(flat, group=state.group, async_op=True).get_future().then(lambda fut: fut.value()[0])


if __name__ == "__main__":
    from collectives.course.grading.runner import run_tasks

    run_tasks(LESSON)
