"""Where graded code runs, and what comes back: the two halves of every graded task.

**In each rank** a task's *probe* (a function of the task's module) runs the student's
functions on inputs drawn from the rank's secret, through a :class:`Probe`::

    def probe_ring(probe, cases):
        ring = probe.student("ring_all_reduce")      # imported only now, after the tap
        for case in cases:
            tensor, _ = verify.make_input(case, probe.rank, probe.secret)
            out = probe.call(case.name, ring, tensor, op=case.op)
            ...
        return records                                # plain data

**In the grading process** the task's *judge* starts the worlds (:meth:`Grading.world`),
draws nothing itself but knows every rank's secret, recomputes every input and every
expected result, and reads every message each rank made (:class:`Run`). Nothing the
student's code does inside a rank reaches the judge except through the records the
probe returns and the calls the tap streamed.

The same code runs in three places:

* ``make grade`` and ``make check`` -- :class:`Grading` starts one world per request
  (``launch.run_world(..., secrets=True, stream=True)``);
* a world that already exists (under ``torchrun``, on the simulated cluster) --
  :class:`InWorldGrading`: the probe runs here, the records meet on every rank through the
  rendezvous store, and every rank judges them with the same judge.
"""

from __future__ import annotations

import itertools
import os
import pickle
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ....core import channels, launch, trace
from ... import verify
from ...impl import resolve
from . import fence
from . import tap as _tap
from .tap import Call

CORE_DIR = os.sep + os.path.join("collectives", "core") + os.sep
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# ---- the rank's half -------------------------------------------------------------------

@dataclass
class Outcome:
    """One call of the student's code in a probe."""

    value: Any = None
    error: str = ""             # "raised ValueError: ... (exercise.py line 12, in f: ...)"
    not_written: str = ""       # the stub's message, when it raised NotImplementedError


class Probe:
    """What a probe uses in a rank: the student's code, this rank's secret, recorded calls."""

    def __init__(self, spec: str, secret: int, sink: Callable[[Any], None]):
        self.spec = spec
        self.secret = secret
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self._sink = sink
        self._names: dict[str, str] = {}

    def student(self, name: str):
        """The implementation's ``name`` (the tap is installed before anything is imported)."""
        return resolve(f"{self.spec}:{name}")

    def seed(self, key: str) -> int:
        """A seed for ``key`` drawn from this rank's secret; :meth:`Run.seed` gives the same."""
        return seed_of(self.secret, key)

    def note(self, item: Any) -> None:
        """Tell the judge ``item`` (plain data) before any of the student's code runs: what the
        probe drew for itself, so that no memory the student's code can read holds it then
        (notes sent after the first :meth:`call` are not read)."""
        self._sink(("note", item))

    def call(self, key: str, fn: Callable, *args, **kwargs) -> Outcome:
        """``fn(*args, **kwargs)`` with its calls recorded under ``key``; errors become an Outcome."""
        name = getattr(fn, "__name__", "the function")
        self._sink(("case", key))
        try:
            with trace.context(f"{name} ({key}, world of {self.size})"):
                return Outcome(fn(*args, **kwargs))
        except NotImplementedError as exc:
            return Outcome(None, f"raised NotImplementedError: {exc}", str(exc) or name)
        except Exception as exc:  # noqa: BLE001 - judged as a failed case
            if verify.is_timeout(exc):
                raise
            first = str(exc).splitlines()[0] if str(exc) else ""
            return Outcome(None, f"raised {type(exc).__name__}: {first}{verify.where_raised(exc)}")
        finally:
            fence.audit()
            self._sink(("end", key))


def seed_of(secret: int, key: str) -> int:
    return zlib.crc32(f"{secret}|{key}".encode()) | (secret & 0xFFFF_FFFF) << 32


def probe_rank(probe_target: str, spec: str, args: tuple, routes: frozenset | None = None) -> Any:
    """A graded world's rank: the signed recorder, the tap and the fence first (the routes
    the task offers), then the probe (``"module:function"``). The rank writes no bytecode:
    nothing it does may change the course's tree (:func:`tree_state`)."""
    import sys

    sys.dont_write_bytecode = True
    sys.pycache_prefix = os.path.join(os.sep, "nonexistent-collectives-bytecode")  # read none of the tree's
    send = channels.recorder()
    _tap.install(send)
    fence.configure(send, routes)
    probe = Probe(spec, channels.secret(), send)
    return resolve(probe_target)(probe, *args)


def tree_state(root: str = PACKAGE_DIR) -> dict[str, tuple[int, ...]]:
    """Every file of the course's package: (inode, size, modification time, change time), by
    path -- the change time no process can set back -- and every folder by its inode. Taken
    before and after each graded world: a rank that wrote, moved or removed anything in the
    grader's own code is seen, whatever it wrote.

    Bytecode caches (``__pycache__``) are left out: any Python process on the machine may
    write them while a world runs (a second pytest worker importing the course, say). No
    graded process reads them instead: ranks and the judging process take their bytecode
    from a cache of their own (:func:`private_bytecode`), so a planted ``.pyc`` is never run."""
    state = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        try:
            state[folder] = (os.stat(folder).st_ino,)     # its mtime moves when a cache appears
        except OSError:
            continue
        for name in (os.path.join(folder, f) for f in files):
            try:
                st = os.stat(name)
            except OSError:
                continue
            state[name] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return state


def private_bytecode() -> None:
    """The judging process compiles the course from source into a fresh cache of its own
    (``sys.pycache_prefix``), never from the tree's ``__pycache__``, which a rank could fill."""
    import sys
    import tempfile

    if not getattr(private_bytecode, "done", False):
        sys.pycache_prefix = tempfile.mkdtemp(prefix="collectives-judge-bytecode-")
        private_bytecode.done = True


def tree_changes(before: dict, after: dict) -> list[str]:
    """What changed between two states of the tree (:func:`tree_state`), as paths from the
    repository root; a file that was not there before is removed again, so that nothing a
    rank wrote is run."""
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    for path in changed:
        if path not in before and os.path.isfile(path):
            os.remove(path)
    return [os.path.relpath(p, os.path.dirname(PACKAGE_DIR)) for p in changed]


# ---- the grading process's half -------------------------------------------------------

@dataclass
class Run:
    """One world's records: per rank its secret, what its probe returned, and its calls."""

    size: int
    secrets: list[int]
    results: list[Any]
    calls: list[dict[str, list[Call]]]          # per rank: case key -> its calls, in order
    loose: list[list[Call]]                      # per rank: calls outside every case
    complete: list[bool] = field(default_factory=list)
    check_traffic: bool = False                  # check mode's store calls are the course's own
    notes: list[list[Any]] = field(default_factory=list)   # per rank: the probe's notes (Probe.note)
    routes: frozenset | None = None              # what the task offers (fence.P2P, ...; None: every route)
    tampered: list[str] = field(default_factory=list)      # forged records, moved cases, files written

    def seed(self, rank: int, key: str) -> int:
        return seed_of(self.secrets[rank], key)

    def of(self, rank: int, key: str) -> list[Call]:
        return self.calls[rank].get(key, [])

    def problems(self) -> list[str]:
        """What no graded code may do, whatever the task: call outside the task's routes,
        reach the store or the backend under the process group, cut its record short, forge
        it, move a case's window, or write into the course's tree. :func:`~collectives.course.
        grading.tasks.run_task` adds these to every task's verdict."""
        out = list(self.tampered)
        for rank in range(self.size):
            every = [c for calls in self.calls[rank].values() for c in calls] + self.loose[rank]
            outside = fence.outside_routes([c.kind for c in every], self.routes)
            if outside:
                out.append(f"rank {rank}: called {', '.join(outside)}: this task allows "
                           f"{', '.join(sorted(self.routes or ()))} only")
            if self.complete and not self.complete[rank]:
                out.append(f"rank {rank}: its record of calls was cut short (the stream was closed or replaced)")
            for c in every:
                if c.kind.startswith("store."):
                    if self.check_traffic and CORE_DIR in c.caller:
                        continue
                    out.append(f"rank {rank}: used the rendezvous store ({c.kind[6:]} from "
                               f"{os.path.basename(c.caller)}): ranks exchange data through messages here")
                    break
                if c.kind.startswith("backend."):
                    out.append(f"rank {rank}: called the process group's backend directly ({c.kind[8:]})")
                    break
        return out


def _split(stream: list[Any], tampered: list[str] | None = None,
           rank: int = 0) -> tuple[dict[str, list[Call]], list[Call], list[Any]]:
    """The calls by case, the calls outside every case, and the probe's notes: ``("note", x)``
    items sent before the first case (before any of the student's code ran). What is not
    the course's record -- a forged object, a malformed call, a case opened twice or closed
    out of turn (its window moved) -- goes to ``tampered``, named."""
    tampered = [] if tampered is None else tampered
    calls: dict[str, list[Call]] = {}
    loose: list[Call] = []
    notes: list[Any] = []
    key, cases, seen, outside = None, False, set(), 0

    def bad(what: str) -> None:
        if len(tampered) < 5:
            tampered.append(f"rank {rank}: {what}: the record is not evidence")

    for item in stream:
        if isinstance(item, channels.Forged):
            bad(f"an object on its record stream was not written by the course's recorder ({item!r})")
        elif isinstance(item, tuple) and len(item) == 2 and item[0] in ("case", "end"):
            marker, name = item
            if marker == "case" and key is not None:
                bad(f"case {name!r} was opened inside case {key!r}")
            elif marker == "case" and name in seen and outside:
                bad(f"case {name!r} was opened again after calls outside every case (its window moved)")
            elif marker == "end" and key != name:
                bad(f"case {name!r} was closed out of turn")
            key = name if marker == "case" else None
            seen.add(name)
            outside = 0
            cases = True
            if key is not None:
                calls.setdefault(key, [])
        elif isinstance(item, Call):
            if not _well_formed(item):
                bad("a malformed call record")
                continue
            (calls[key] if key is not None else loose).append(item)
            outside += key is None
        elif isinstance(item, tuple) and len(item) == 2 and item[0] == "note" and not cases:
            notes.append(item[1])
    return calls, loose, notes


def _well_formed(c: Call) -> bool:
    return (isinstance(c.kind, str) and (c.peer is None or type(c.peer) is int) and type(c.numel) is int
            and isinstance(c.dtype, str) and type(c.weight) in (float, int) and type(c.fingerprint) in (float, int)
            and isinstance(c.ranks, tuple) and all(type(r) is int for r in c.ranks)
            and isinstance(c.caller, str) and type(c.t) in (float, int))


class Grading:
    """Starts graded worlds for one implementation (``spec``) and hands the judge a :class:`Run`.

    ``check`` turns check mode on in the worlds (the exercise runner does; the grader does
    not, so that no honest call touches the store). ``world_size`` forces one size on every
    task that lets it choose (``--world``). ``gpus`` (``--backend nccl``): the worlds run on
    GPUs, where the cases the probes draw on the rank's device (``ops.rank_device()``) hold
    GPU tensors. Either way the world's groups are the fence (:mod:`.fence`): messages cross
    through this process, GPU tensors through host memory, and the collectives a task allows
    run on NCCL for GPU tensors, on gloo for CPU ones.
    """

    def __init__(self, spec: str, *, timeout: float = 30.0, check: bool = False,
                 world_size: int | None = None, gpus: bool = False):
        private_bytecode()
        self.spec = spec
        self.timeout = timeout
        self.check = check
        self.world_size = world_size
        self.gpus = gpus
        self.routes: frozenset | None = None    # the task's (run_task sets them)
        self.runs: list[Run] = []               # every world of the task being judged

    def sizes(self, *preferred: int) -> list[int]:
        """The world sizes a task runs: its own, or the one ``--world`` asked for."""
        return [self.world_size] if self.world_size else list(preferred)

    def world(self, probe_target: str, world_size: int, *args, machines: int | None = None,
              timeout: float | None = None) -> Run:
        # the world's groups are the fence, on CPUs or GPUs (ranks may share GPUs: see fence)
        backend = fence.GPU_BACKEND if self.gpus else fence.BACKEND
        before = tree_state()
        try:     # the fence's messages go through this process, which writes each down (relay_problems)
            world = launch.run_world(probe_rank, world_size, args=(probe_target, self.spec, args, self.routes),
                                     timeout=timeout or self.timeout, check=self.check, secrets=True,
                                     stream=True, machines=machines, backend=backend, relay=_tap.digest)
        finally:
            wrote = tree_changes(before, tree_state())
        tampered = [f"a rank changed the course's own code ({', '.join(wrote[:3])}"
                    f"{', ...' if len(wrote) > 3 else ''}): a graded rank writes nothing there"] if wrote else []
        opened = [channels.opened(raw, key) for raw, key in zip(world.streams, world.keys)]
        tampered += world.relay_problems
        for rank, stream in enumerate(opened):
            tampered += fence.relay_problems(stream, world.relayed[rank], rank)
        split = [_split(stream, tampered, rank) for rank, stream in enumerate(opened)]
        run = Run(world_size, world.secrets, world.results, [c for c, _, _ in split], [lo for _, lo, _ in split],
                  world.complete, check_traffic=self.check, notes=[n for _, _, n in split], routes=self.routes,
                  tampered=tampered)
        self.runs.append(run)
        return run


class InWorldGrading(Grading):
    """The world exists already (torchrun, the simulated cluster): run the probe here, meet
    the other ranks' records through the store, judge on every rank."""

    def __init__(self, spec: str, **kwargs):
        super().__init__(spec, check=True, **kwargs)
        self.probe_seconds = 0.0    # this rank's time in probes (the student's code), since reset
        self.probe_link_bytes = 0   # bytes this rank's link to other machines sent in them

    def reset_costs(self) -> None:
        self.probe_seconds, self.probe_link_bytes = 0.0, 0

    def sizes(self, *preferred: int) -> list[int]:
        return [dist.get_world_size()]

    def world(self, probe_target: str, world_size: int, *args, machines=None, timeout=None) -> Run:
        mine: list[Any] = []
        _tap.install(mine.append)
        secret = int.from_bytes(os.urandom(8), "little")
        probe = Probe(self.spec, secret, mine.append)
        before, started = link_bytes_sent(), time.perf_counter()
        result = resolve(probe_target)(probe, *args)
        after = link_bytes_sent()
        self.probe_seconds += time.perf_counter() - started
        self.probe_link_bytes += after - before if before is not None and after is not None else 0
        _tap.install(lambda item: None)       # the exchange below is the course's own
        store = dist.distributed_c10d._get_default_store()
        # one count for the process, not per grading: every lesson of ``runner --all`` grades in
        # the same store, and a key of an earlier lesson's round would hand back its records
        base = f"collectives/tasks/{next(_ROUNDS)}/"
        rank, size = dist.get_rank(), dist.get_world_size()
        store.set(base + str(rank), pickle.dumps((secret, result, mine)))
        keys = [base + str(r) for r in range(size)]
        store.wait(keys)
        gathered = [pickle.loads(v) for v in store.multi_get(keys)]
        split = [_split(calls) for _, _, calls in gathered]
        run = Run(size, [g[0] for g in gathered], [g[1] for g in gathered], [c for c, _, _ in split],
                  [lo for _, lo, _ in split], [], check_traffic=True, notes=[n for _, _, n in split],
                  routes=self.routes)
        self.runs.append(run)
        return run


_ROUNDS = itertools.count(1)     # the store keys of in-world rounds (the same on every rank)


def link_bytes_sent() -> int | None:
    """Bytes this rank's link to other machines has sent (``GLOO_SOCKET_IFNAME``, read from
    /proc/net/dev: this process's network namespace); None on one machine."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if not iface or iface == "lo":
        return None
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, fields = line.partition(":")
                if name.strip() == iface:
                    return int(fields.split()[8])
    except OSError:
        pass
    return None


# ---- verdicts ---------------------------------------------------------------------------

@dataclass
class Verdict:
    """A task's result: the problems found (none: it passes), or the stub that stopped it."""

    problems: list[str] = field(default_factory=list)
    not_written: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems and not self.not_written

    def add(self, problem: str | None) -> None:
        if problem:
            self.problems.append(problem)

    def first_line(self) -> str:
        if self.not_written:
            return f"not written yet ({self.not_written})"
        if not self.problems:
            return "PASS"
        more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return self.problems[0] + more


def outcome_problem(where: str, outcome: Outcome, verdict: Verdict) -> bool:
    """Record ``outcome``'s failure in ``verdict``; True when there was one."""
    if outcome.not_written:
        verdict.not_written = verdict.not_written or outcome.not_written
        return True
    if outcome.error:
        verdict.add(f"{where}: {outcome.error}")
        return True
    return False


def same(expected: torch.Tensor, got: Any, *, exact: bool = True, rtol: float = 0.0,
         atol: float = 0.0) -> str | None:
    """:func:`collectives.course.verify.compare`, also for a result that is not a tensor."""
    if not isinstance(got, torch.Tensor):
        return f"returned {type(got).__name__}, expected a tensor"
    return verify.compare(expected, got, exact=exact, rtol=rtol, atol=atol)
