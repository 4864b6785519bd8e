"""Faults to inject: small training loops, each with one bug, run on every rank of a world.

Each is the loop a student would write -- a few steps of all-reducing a gradient -- with
the bug real jobs have: a rank that skips a step, two collectives called in another order,
a send-before-receive deadlock, a tensor of the wrong size or dtype, a slow rank, a rank
that dies, a machine whose link goes down. :class:`Params` says which rank misbehaves, at
which step, on which group; :func:`draw` makes one from a seed, so every scenario can be
replayed exactly (:mod:`.scenarios` runs them, :mod:`.synth` writes the dumps they leave).

Every call a loop makes carries a ``# site: NAME`` comment: :data:`SITES` reads the line
numbers from this file, so the synthesised dumps point at the same lines as real ones.
"""

from __future__ import annotations

import datetime
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

KINDS = ("skip", "order", "deadlock", "size", "dtype", "straggler", "killed", "link")
HANGS = ("skip", "order", "deadlock", "link")          # the world hangs until the watchdog
SAME_SIZE_DTYPES = {"float32": "int32", "float64": "int64"}   # same bytes: gloo does not notice


@dataclass(frozen=True)
class Params:
    """One scenario: what the loop does and where it goes wrong."""

    kind: str
    world_size: int
    group: tuple[int, ...]        # the ranks the loop runs on: the world, or a subgroup
    culprit: int                  # the rank that misbehaves (deadlock: every rank of the group)
    step: int                     # the step (from 0) at which it does
    steps: int                    # steps in the loop
    numel: int                    # elements of the gradient
    dtype: str = "float32"
    wrong_numel: int = 0          # size: the culprit's element count at the bad step
    wrong_dtype: str = ""         # dtype: the culprit's dtype at the bad step
    delay: float = 0.0            # straggler: seconds the culprit sleeps before each step
    machines: int = 1             # link: the cluster's machines (ranks machine-major)
    machine: int = 0              # link: the machine whose link goes down

    @property
    def is_world(self) -> bool:
        return self.group == tuple(range(self.world_size))


def _group(p: Params, timeout: float | None):
    """The loop's process group; every rank of the world takes part in making a subgroup.
    ``timeout``: a group of its own with that timeout (to let torch's own checks fire)."""
    if p.is_world and timeout is None:
        return None
    kwargs = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}
    return dist.new_group(list(p.group), **kwargs)


def _gradient(p: Params, numel: int | None = None, dtype: str | None = None) -> torch.Tensor:
    return torch.ones(numel or p.numel, dtype=getattr(torch, dtype or p.dtype))


# -- the loops --------------------------------------------------------------------------------

def skipped_collective(p: Params, group) -> None:
    """The culprit skips the all-reduce of one step (a NaN check gone wrong, an uneven last
    batch): its next call pairs with the others' skipped one, and at the end they wait for it."""
    grad = _gradient(p)
    for step in range(p.steps):
        if dist.get_rank() == p.culprit and step == p.step:
            continue
        dist.all_reduce(grad, group=group)                       # site: skip-all-reduce


def swapped_order(p: Params, group) -> None:
    """Each step all-reduces the gradient, then broadcasts the learning rate; at one step the
    culprit does them the other way round."""
    grad, lr = _gradient(p), torch.zeros(1, dtype=getattr(torch, p.dtype))
    src = p.group[0] if p.group[0] != p.culprit else p.group[1]
    for step in range(p.steps):
        if dist.get_rank() == p.culprit and step == p.step:
            dist.broadcast(lr, src, group=group)                 # site: order-swapped-broadcast
            dist.all_reduce(grad, group=group)                   # site: order-swapped-all-reduce
        else:
            dist.all_reduce(grad, group=group)                   # site: order-all-reduce
            dist.broadcast(lr, src, group=group)                 # site: order-broadcast


def send_first_deadlock(p: Params, group) -> None:
    """Each step passes a halo to the right neighbour of a ring and receives one from the
    left, then all-reduces a loss. Even positions send first and odd ones receive first, so
    no cycle waits; at one step every rank sends first, and the sends wait on each other."""
    position, size = p.group.index(dist.get_rank()), len(p.group)
    right, left = p.group[(position + 1) % size], p.group[(position - 1) % size]
    halo_out, halo_in, loss = _gradient(p), _gradient(p), torch.ones(1)
    for step in range(p.steps):
        if position % 2 == 0 or step == p.step:
            dist.send(halo_out, right, group=group)              # site: deadlock-send-first
            dist.recv(halo_in, left, group=group)                # site: deadlock-recv-second
        else:
            dist.recv(halo_in, left, group=group)                # site: deadlock-recv-first
            dist.send(halo_out, right, group=group)              # site: deadlock-send-second
        dist.all_reduce(loss, group=group)                       # site: deadlock-all-reduce


def wrong_size(p: Params, group) -> None:
    """At one step the culprit's gradient has another number of elements (a layer it built
    differently): gloo ends the rank that receives more than it expects (SIGABRT)."""
    for step in range(p.steps):
        wrong = dist.get_rank() == p.culprit and step == p.step
        grad = _gradient(p, p.wrong_numel if wrong else p.numel)
        dist.all_reduce(grad, group=group)                       # site: size-all-reduce


def wrong_dtype(p: Params, group) -> None:
    """At one step the culprit's gradient has another dtype of the same width (int32 for
    float32): the bytes add up, gloo sees nothing wrong, and every rank gets garbage."""
    for step in range(p.steps):
        wrong = dist.get_rank() == p.culprit and step == p.step
        grad = _gradient(p, dtype=p.wrong_dtype if wrong else p.dtype)
        dist.all_reduce(grad, group=group)                       # site: dtype-all-reduce


def straggler(p: Params, group) -> None:
    """The culprit does more work before every step (a slow disk, a busy core): everyone
    else waits for it in every all-reduce."""
    grad = _gradient(p)
    for _ in range(p.steps):
        if dist.get_rank() == p.culprit:
            time.sleep(p.delay)
        dist.all_reduce(grad, group=group)                       # site: straggler-all-reduce


def killed_rank(p: Params, group) -> None:
    """The culprit is killed (``kill -9``: the out-of-memory killer, a lost machine) just
    after it posts the all-reduce of one step. (Whether the others finish that all-reduce
    before they notice depends on how much of its part the culprit's gloo thread had sent:
    with a small tensor, sometimes all of it.)"""
    grad = _gradient(p)
    for step in range(p.steps):
        if dist.get_rank() == p.culprit and step == p.step:
            dist.all_reduce(grad, group=group, async_op=True)   # site: killed-all-reduce-posted
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(grad, group=group)                       # site: killed-all-reduce


LINK_DOWN_AFTER = 0.005    # seconds into the all-reduce the link goes down


def link_down(p: Params, group, cluster=None) -> None:
    """On a simulated cluster, ``machine``'s link is taken down (``ip link set eth0 down`` in
    its namespace) a few milliseconds into the all-reduce of one step: a cable pulled."""
    grad = _gradient(p)
    first_rank = p.machine * (p.world_size // p.machines)
    for step in range(p.steps):
        if step == p.step and dist.get_rank() == first_rank and cluster is not None:
            threading.Timer(LINK_DOWN_AFTER, cluster.set_link, (p.machine, False)).start()
        dist.all_reduce(grad, group=group)                       # site: link-all-reduce


LOOPS = {"skip": skipped_collective, "order": swapped_order, "deadlock": send_first_deadlock,
         "size": wrong_size, "dtype": wrong_dtype, "straggler": straggler, "killed": killed_rank,
         "link": link_down}


def run_fault(p: Params, cluster=None, group_timeout: float | None = None) -> str:
    """What every rank of the scenario's world runs (``launch.run(run_fault, ...)``)."""
    group = _group(p, group_timeout)
    if dist.get_rank() in p.group:
        if p.kind == "link":
            link_down(p, group, cluster)
        else:
            LOOPS[p.kind](p, group)
    return "finished"


# What the analyzer should say of each fault (the kind of its first finding), and whom it blames.
FINDING = {"skip": "missing", "order": "mismatch", "deadlock": "cycle", "size": "mismatch", "dtype": "mismatch",
           "straggler": "straggler", "killed": "dead", "link": "link"}


_DTYPE_NAMES = {"float32": "Float", "float64": "Double", "int32": "Int", "int64": "Long"}


def expected(p: Params) -> dict:
    """What each of the analyzer's four checks must report for this scenario, worked out from
    its parameters alone (not from any dump): ``missing`` and ``mismatch`` as lists of
    tuples, ``cycle`` as a tuple of ranks or None, ``stragglers`` as a list of tuples::

        missing:    (group, seq, op, missing ranks, waiting ranks)
        mismatch:   (group, seq, field, ranks that differ, ((rank, its value), ...) for every rank)
        cycle:      the ranks, from the smallest, each waiting for the next
        stragglers: (group, rank)

    A rank that skips one of ``steps`` calls leaves the others waiting in call #steps
    (its k-th call meets their k-th, whichever step it skipped); swapping the two calls of
    step k makes collective #2k+1 differ; a bad tensor at step k makes #k+1 differ."""
    found = {"missing": [], "mismatch": [], "cycle": None, "stragglers": []}
    others = tuple(r for r in p.group if r != p.culprit)

    def values(mine, theirs):
        return tuple((r, mine if r == p.culprit else theirs) for r in p.group)
    if p.kind == "skip":
        found["missing"] = [(p.group, p.steps, "all_reduce", (p.culprit,), others)]
    elif p.kind == "order":
        found["mismatch"] = [(p.group, 2 * p.step + 1, "operation", (p.culprit,), values("broadcast", "all_reduce"))]
    elif p.kind == "size":
        found["mismatch"] = [(p.group, p.step + 1, "sizes", (p.culprit,),
                              values(str([p.wrong_numel]), str([p.numel])))]
    elif p.kind == "dtype":
        found["mismatch"] = [(p.group, p.step + 1, "dtype", (p.culprit,),
                              values(_DTYPE_NAMES[p.wrong_dtype], _DTYPE_NAMES[p.dtype]))]
    elif p.kind == "deadlock":
        found["cycle"] = p.group
    elif p.kind == "straggler":
        found["stragglers"] = [(p.group, p.culprit)]
    return found


def blame(p: Params) -> tuple[int, ...]:
    """The ranks the fault was put into: the culprit; every rank of a deadlocked group; the
    ranks on the machine whose link went down."""
    if p.kind == "deadlock":
        return p.group
    if p.kind == "link":
        per_machine = p.world_size // p.machines
        return tuple(range(p.machine * per_machine, (p.machine + 1) * per_machine))
    return (p.culprit,)


# -- where each call is made, read from this file -----------------------------------------------

def _sites() -> dict[str, tuple[str, str, int]]:
    """``{site: (function, file, line)}`` for every ``# site:`` comment above (and in
    more_faults.py, beside this file: the further faults whose dumps are synthesised too)."""
    found = {}
    for path in (__file__, os.path.join(os.path.dirname(__file__), "more_faults.py")):
        function = "?"
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.startswith("def "):
                    function = line[4:].split("(")[0]
                match = re.search(r"# site: ([\w-]+)", line)
                if match and "re.search" not in line:
                    found[match.group(1)] = (function, path, number)
    return found


SITES = _sites()


# -- scenarios from a seed ---------------------------------------------------------------------

# The lab's scenarios (real runs, shown on the lab's page). draw() never returns one of these,
# so the scenarios a grader draws from its own seeds are never the ones the lab shows.
LAB = {
    "skip": Params("skip", 4, (0, 1, 2, 3), culprit=2, step=3, steps=5, numel=1000),
    "order": Params("order", 4, (0, 1, 2, 3), culprit=1, step=2, steps=4, numel=1000),
    "deadlock": Params("deadlock", 4, (0, 1, 2, 3), culprit=0, step=2, steps=4, numel=16),
    "size": Params("size", 4, (0, 1, 2, 3), culprit=3, step=1, steps=3, numel=1000, wrong_numel=1024),
    "dtype": Params("dtype", 4, (0, 1, 2, 3), culprit=1, step=2, steps=4, numel=1000, wrong_dtype="int32"),
    "straggler": Params("straggler", 4, (0, 1, 2, 3), culprit=3, step=0, steps=5, numel=1000, delay=0.05),
    "killed": Params("killed", 4, (0, 1, 2, 3), culprit=2, step=2, steps=4, numel=1 << 18),
    "link": Params("link", 4, (0, 1, 2, 3), culprit=2, step=1, steps=3, numel=2 << 20, machines=2, machine=1),
}


def draw(kind: str, seed: int, max_world: int = 8) -> Params:
    """A scenario of ``kind`` from ``seed``: the world, the group, the culprit, the step and
    the sizes all come from it (the same seed, the same scenario). Never one of :data:`LAB`."""
    if kind not in KINDS:
        raise ValueError(f"unknown fault {kind!r}; the faults are {', '.join(KINDS)}")
    rng = random.Random(f"{kind}:{seed}")
    while True:
        params = _draw(kind, rng, max_world)
        if params != LAB[kind]:
            return params


def _draw(kind: str, rng: random.Random, max_world: int) -> Params:
    smallest = 2 if kind in ("deadlock", "killed") else 3    # a majority needs three ranks
    if kind == "link":
        machines = rng.randint(2, max(2, min(3, max_world)))
        per_machine = rng.randint(1, max(1, min(2, max_world // machines)))
        p = machines * per_machine
        group = tuple(range(p))
    else:
        p = rng.randint(smallest, max(smallest, max_world))
        size = p if rng.random() < 0.5 else rng.randint(smallest, p)
        group = tuple(sorted(rng.sample(range(p), size)))
        machines = 1
    steps = rng.randint(2, 6)
    dtype = rng.choice(("float32", "float64"))
    params = Params(kind, p, group, culprit=rng.choice(group), step=rng.randrange(steps), steps=steps,
                    numel=rng.choice((1, 7, 100, 1000, 4096)), dtype=dtype)
    if kind == "size":
        params = replace(params, wrong_numel=params.numel + rng.choice((-1, 1, 16, params.numel)) or 2)
    elif kind == "dtype":
        params = replace(params, wrong_dtype=SAME_SIZE_DTYPES[dtype])
    elif kind == "straggler":
        params = replace(params, steps=max(steps, 4), step=0, delay=rng.choice((0.03, 0.05, 0.08)))
    elif kind == "link":
        params = replace(params, machines=machines, machine=rng.randrange(1, machines),
                         numel=rng.choice((1 << 20, 2 << 20)), step=rng.randrange(min(steps, 2)))
        params = replace(params, culprit=params.machine * per_machine)
    elif kind == "deadlock":
        params = replace(params, culprit=group[0])
    return params
