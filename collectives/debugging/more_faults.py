"""Faults beyond the graded eight: arguments the exercise's checks do not compare, and ends they do not see.

Each is a small loop run on every rank of a world (:func:`run_more`, as
:func:`.faults.run_fault` runs the others), with what the diagnosis must say first (:data:`FIRST`)::

    groups    a new_group of every rank beside the default group; at one step the culprit
              all-reduces on them in the other order        -> missing: the culprit (groups by name)
    root      at one step the culprit broadcasts from another root   -> mismatch in the root
    op        at one step the culprit all-reduces with MAX, the others SUM -> mismatch in the reduce op
    p2p       rank 0 sends 2n elements where rank 1 receives n       -> unpaired: ranks 0 and 1
    uneven    an all_to_all_single with uneven splits (healthy)      -> nothing
    waiting   the culprit is killed while it waits in an all-reduce the others have not
              reached yet (they compute)                             -> dead: the culprit, and no
                                                                        living rank blamed
    raises    the culprit raises ValueError at one step              -> raised, quoting it
    ddp       a DDP model; at one step the culprit skips its backward (an uneven last batch):
              the others wait in DDP's all-reduce, made by its C++ reducer -> missing: the culprit
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from .faults import Params

MORE = ("groups", "root", "op", "p2p", "uneven", "waiting", "raises", "ddp")
LAB_MORE = {
    "groups": Params("groups", 3, (0, 1, 2), culprit=1, step=2, steps=4, numel=100),
    "root": Params("root", 3, (0, 1, 2), culprit=2, step=1, steps=3, numel=100),
    "op": Params("op", 3, (0, 1, 2), culprit=0, step=1, steps=3, numel=100),
    "p2p": Params("p2p", 2, (0, 1), culprit=0, step=1, steps=3, numel=500, wrong_numel=1000),
    "uneven": Params("uneven", 3, (0, 1, 2), culprit=0, step=0, steps=2, numel=6),
    "waiting": Params("waiting", 3, (0, 1, 2), culprit=1, step=2, steps=4, numel=100),
    "raises": Params("raises", 3, (0, 1, 2), culprit=2, step=1, steps=3, numel=100),
    "ddp": Params("ddp", 3, (0, 1, 2), culprit=1, step=2, steps=4, numel=16),
}
# the first finding: (kind, ranks) from the parameters; None: no finding at all
FIRST = {
    "groups": lambda p: ("missing", (p.culprit,)),
    "root": lambda p: ("mismatch", (p.culprit,)),
    "op": lambda p: ("mismatch", (p.culprit,)),
    "p2p": lambda p: ("unpaired", (0, 1)),
    "uneven": lambda p: None,
    "waiting": lambda p: ("dead", (p.culprit,)),
    "raises": lambda p: ("raised", (p.culprit,)),
    "ddp": lambda p: ("missing", (p.culprit,)),
}
HANGS_MORE = ("groups", "root", "ddp")


def limit(kind: str) -> float:
    """Seconds a run of ``kind`` may take: a hang spends all of it (DDP's set-up takes a
    little longer), one that ends by itself ends before."""
    return 8.0 if kind not in HANGS_MORE else 5.0 if kind == "ddp" else 4.0


def same_ranks_groups(p: Params, group) -> None:
    everyone = dist.new_group(list(range(dist.get_world_size())))   # the same ranks as the default group
    grad = torch.ones(p.numel)
    for step in range(p.steps):
        pair = (everyone, None) if dist.get_rank() == p.culprit and step == p.step else (None, everyone)
        for g in pair:
            dist.all_reduce(grad, group=g)


def other_root(p: Params, group) -> None:
    lr = torch.zeros(p.numel)
    for step in range(p.steps):
        src = 1 if dist.get_rank() == p.culprit and step == p.step else 0
        dist.broadcast(lr, src)


def other_op(p: Params, group) -> None:
    grad = torch.ones(p.numel)
    for step in range(p.steps):
        op = dist.ReduceOp.MAX if dist.get_rank() == p.culprit and step == p.step else dist.ReduceOp.SUM
        dist.all_reduce(grad, op=op)


def p2p_sizes(p: Params, group) -> None:
    for step in range(p.steps):
        if dist.get_rank() == 0:
            dist.send(torch.ones(p.wrong_numel if step == p.step else p.numel), 1)
        else:
            dist.recv(torch.zeros(p.numel), 0)
        dist.barrier()


def uneven_all_to_all(p: Params, group) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    sends = [rank + peer + 1 for peer in range(size)]          # rank r sends r + peer + 1 to each peer
    receives = [peer + rank + 1 for peer in range(size)]
    for _ in range(p.steps):
        out = torch.zeros(sum(receives))
        dist.all_to_all_single(out, torch.ones(sum(sends)), receives, sends)   # site: uneven-all-to-all
        dist.all_reduce(torch.ones(p.numel))                                    # site: uneven-all-reduce


def killed_waiting(p: Params, group) -> None:
    grad = torch.ones(p.numel)
    for step in range(p.steps):
        if step == p.step:
            if dist.get_rank() == p.culprit:
                threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()
            else:
                time.sleep(30)                                  # computing when it dies
        dist.all_reduce(grad)


def raises(p: Params, group) -> None:
    grad = torch.ones(p.numel)
    for step in range(p.steps):
        if dist.get_rank() == p.culprit and step == p.step:
            raise ValueError(f"loss is NaN at step {step}")
        dist.all_reduce(grad)


def ddp_skipped_backward(p: Params, group) -> None:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(p.numel, 2))
    for step in range(p.steps):
        if dist.get_rank() == p.culprit and step == p.step:
            continue
        model(torch.ones(4, p.numel)).sum().backward()


LOOPS = {"ddp": ddp_skipped_backward, "groups": same_ranks_groups, "root": other_root, "op": other_op, "p2p": p2p_sizes,
         "uneven": uneven_all_to_all, "waiting": killed_waiting, "raises": raises}



def run_more(p: Params, cluster=None, group_timeout: float | None = None) -> str:
    """What every rank of one of these scenarios' worlds runs (as :func:`.faults.run_fault`)."""
    LOOPS[p.kind](p, None)
    return "finished"


__all__ = ["MORE", "LAB_MORE", "FIRST", "HANGS_MORE", "LOOPS", "run_more", "limit"]
