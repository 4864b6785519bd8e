"""Run by ``torchrun`` in tests/test_09_debugging.py: the page's recipe under torchrun.

Each rank starts the flight recorder itself (nothing else wraps ``torch.distributed`` here),
gathers an object (whose all-gathers torch makes below its public functions: only torch's own
Flight Recorder sees them), waits on two all-reduces through their futures, and ends: rank 0
returns, rank 1 raises. (DDP's calls, made the same way from C++, are the fault "ddp" of
``collectives.debugging.more_faults``.)
"""

import sys
import time

import torch
import torch.distributed as dist

from collectives.core import flight_recorder


def main(directory: str) -> None:
    flight_recorder.start(directory)          # before init_process_group: torch's own recorder too
    dist.init_process_group("gloo")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": dist.get_rank()})
    x = torch.ones(3)
    dist.all_reduce(x)
    dist.all_reduce(x, async_op=True).get_future().wait()
    dist.all_reduce(x, async_op=True).get_future().then(lambda fut: fut.value()).wait()
    dist.barrier()
    rank = dist.get_rank()
    # Closed on both ranks before either ends: a gloo connection still open when its peer's
    # process exits can abort this one (SIGABRT from gloo's own thread) before it dumps.
    dist.destroy_process_group()
    if rank == 1:
        time.sleep(0.5)                       # rank 0 has written its exit dump by then
        raise ValueError("rank one gives up after its last step")


if __name__ == "__main__":
    main(sys.argv[1])
