"""Run a fault for real: a world with the flight recorder on, ended by the fault, then its dumps.

::

    outcome = run_scenario(faults.LAB["skip"], "dumps/skip", timeout=1.0)
    outcome.ended          # "timed out after 1 s" -- the watchdog stopped the world
    outcome.dumps          # one dict per rank, as rank<r>.json holds it
    diagnose(outcome.dumps)  # -> "rank 2 never entered all_reduce #5 of the world ..."

Every scenario ends within its time limit, however it goes wrong: a hang is stopped by the
launcher's watchdog (``timeout``), a rank that dies or raises ends the world at once, a
loop that finishes with garbage ends as usual -- and in every case each rank has dumped
its flight recorder first (``launch.run(..., flight_recorder=DIR)``), or, for a rank that
died, its ring has been recovered. With ``detail=True`` the same loop runs under torch's
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` instead, for :func:`collectives.debugging.detail`.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import multiprocessing.connection
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core import launch
from ..core.cluster import Cluster
from .faults import KINDS, Params, run_fault
from .more_faults import run_more


@dataclass
class Outcome:
    """How one run of a scenario ended, and what it left."""

    params: Params
    ended: str                    # "finished", "failed: ...", "timed out after 1 s"
    seconds: float                # from the start of the world to its end (dumps included)
    error: str = ""               # the launcher's error, in full ("" when the world finished)
    errors: dict[int, str] = field(default_factory=dict)   # each failed rank's one-line error
    dumps: list[dict] = field(default_factory=list)     # one per rank, rank order
    world: dict | None = None     # the launcher's world.json


def run_scenario(params: Params, directory: str | Path | None = None, *, timeout: float = 1.0,
                 cluster: Cluster | None = None, machines: int | None = None, env: dict | None = None,
                 group_timeout: float | None = None, record: bool = True) -> Outcome:
    """Run ``params``' loop on a world of its size; stop it after ``timeout`` seconds at the
    latest; read the dumps.

    ``cluster``: a running simulated cluster to run on; ``machines``: make one of that many
    machines for this run (a link going down needs one: ``params.machines`` by default).
    ``record=False`` runs without the flight recorder (torch's own checks, in ``env``);
    ``group_timeout`` gives the loop a process group with that timeout, so that gloo's and
    torch's own timeouts can fire before the watchdog does.
    """
    if cluster is None and (machines or (params.kind == "link" and params.machines > 1)):
        with Cluster(machines or params.machines, params.world_size // (machines or params.machines)) as made:
            return run_scenario(params, directory, timeout=timeout, cluster=made, env=env,
                                group_timeout=group_timeout, record=record)
    if params.kind == "link" and cluster is None:
        raise ValueError("a link can only go down on a simulated cluster: give machines= or cluster=")
    if cluster is not None and params.world_size % cluster.n_machines:
        raise ValueError(f"a world of {params.world_size} does not fit {cluster.n_machines} machines")
    directory = Path(directory or tempfile.mkdtemp(prefix=f"collectives-{params.kind}-"))
    if params.kind == "ddp":
        import torch._dynamo  # noqa: F401 - DDP imports it on every rank: once here, before the fork
    start = time.perf_counter()
    error, ended, errors = "", "finished", {}
    try:
        launch.run(run_fault if params.kind in KINDS else run_more, params.world_size,
                   args=(params, cluster, group_timeout), timeout=timeout,
                   check=False, env=env, cluster=cluster, flight_recorder=directory if record else None)
    except launch.WorldTimeout as exc:
        error, ended = str(exc), f"timed out after {timeout:g} s"
    except launch.RankError as exc:
        error, ended = str(exc), "failed: " + str(exc).splitlines()[0]
        errors = {exc.rank: exc.summary, **{r: s for r, s in exc.others.items() if not s.startswith("stopped")}}
    finally:
        if params.kind == "link" and cluster is not None:
            cluster.set_link(params.machine, True)      # the cable back in, for the next world
    seconds = time.perf_counter() - start
    if not record:
        return Outcome(params, ended, seconds, error, errors)
    dumps, world = load_dumps(directory)
    return Outcome(params, ended, seconds, error, errors, dumps, world)


def run_scenarios(jobs: list[tuple[Params, dict]], parallel: int = 4) -> list[Outcome]:
    """``run_scenario(params, **kwargs)`` for each job, several at once, each in a process of
    its own: a scenario that hangs spends its time limit waiting, not computing. Outcomes in
    the order of ``jobs``. Scenarios sharing a ``cluster=`` must not take a link down."""
    ctx = mp.get_context("fork")
    outcomes: list[Outcome | None] = [None] * len(jobs)
    todo, running = list(enumerate(jobs)), {}
    while todo or running:
        while todo and len(running) < parallel:
            index, (params, kwargs) = todo.pop(0)
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_job, args=(send, params, kwargs), name=f"scenario-{params.kind}")
            proc.start()
            send.close()
            running[receive] = (index, params, proc)
        for conn in mp.connection.wait(list(running)):
            index, params, proc = running.pop(conn)
            try:
                outcomes[index] = conn.recv()
            except EOFError:
                outcomes[index] = Outcome(params, f"the scenario's process died (exit code {proc.exitcode})", 0.0)
            conn.close()
            proc.join()
    return outcomes


def _job(conn, params: Params, kwargs: dict) -> None:
    from ..core import netns

    netns.die_with_parent()
    sys.stdout = sys.stderr = io.StringIO()     # not the parent's streams (a notebook's, say)
    try:
        outcome = run_scenario(params, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported as the outcome
        outcome = Outcome(params, f"could not run: {type(exc).__name__}: {exc}", 0.0)
    conn.send(outcome)
    conn.close()


def load_dumps(directory: str | Path) -> tuple[list[dict], dict | None]:
    """Every usable ``rank<r>.json`` of ``directory`` (rank order) and its ``world.json`` (or
    None); a rank's ring whose dump is missing is read from ``rank<r>.ring``. What cannot be
    used is left out: :func:`.reading.read_dumps` says what."""
    from .reading import read_dumps

    found = read_dumps(directory)
    return found.dumps, found.world
