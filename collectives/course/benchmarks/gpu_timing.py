"""The course's rule for fair GPU comparisons, as code every GPU benchmark shares.

The rule is written on the benchmarks page (``docs/benchmarks.md``, :data:`RULE`); each
point has its piece here:

1. **Both sides launched the same way** -- :data:`LAUNCHES` and :func:`check_launch`: a run
   is ``"eager"`` (every contender issued from Python) or ``"graph"`` (every contender, NCCL
   included, captured in a CUDA graph and replayed: :class:`Replayed`, :func:`launched`);
2. **No trace wrapper on either side** -- NCCL called directly (:func:`nccl_all_reduce`,
   :func:`nccl_all_to_all_single`: ``distributed_c10d``'s functions, not the public
   ``dist.*`` the course's trace wraps), and :func:`untrace_rank` for a rank whose own code
   calls ``dist.*`` (the fused reducer, the hand-written all-to-alls);
3. **The same bytes and the same work** -- :data:`INPUTS` and :func:`check_inputs`: every
   contender takes the caller's ordinary tensor (``"copied"``: whatever works in memory of
   its own copies in and out inside the timed call), or every one finds its input where it
   reads it (``"resident"``);
4. **CUDA events, median and spread over interleaved rounds** -- :func:`rounds` times each
   contender once per round, in turn, with
   :func:`~collectives.core.timing.measure_back_to_back` (events around runs issued back to
   back, the slowest rank's); :func:`summary` keeps the median and (lowest, highest);
   :func:`both_launches` gives a probe both columns, eager and replayed, each in rounds of its own;
5. **NCCL's symmetric kernels where torch exposes them** -- :func:`nccl_window`, else a line
   under ``skipped``;
6. **Say what is off** -- :func:`fields`, the record's words for all of the above.

Importing this module needs no GPU: the pieces that do are called only in a GPU's rank.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
from torch.distributed import distributed_c10d as c10d

from ...core import timing, trace
from ...symmetric.gpu import NO_MULTICAST

RULE = "docs/benchmarks.md#the-rule-for-fair-gpu-comparisons"
LAUNCHES = ("eager", "graph")
INPUTS = ("copied", "resident")
ROUNDS = 5          # batches per contender, interleaved across the contenders
MULTICAST = "off: NVLink multicast and with it NCCL's NVLS algorithms are disabled in every rank"


def first_line(exc: BaseException) -> str:
    """An error's first line, or its type where it says nothing: what a skipped contender's line says."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def said(exc: BaseException) -> str:
    """``"Type: first line"`` (the type alone where it says nothing): a failed check's words."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0]}" if str(exc) else type(exc).__name__


def check_launch(launch: str) -> str:
    """``launch`` if it is one of :data:`LAUNCHES`; else a ValueError saying which are."""
    if launch not in LAUNCHES:
        raise ValueError(f"launch must be one of {LAUNCHES}, got {launch!r}")
    return launch


def check_inputs(inputs: str) -> str:
    """``inputs`` if it is one of :data:`INPUTS`; else a ValueError saying which are."""
    if inputs not in INPUTS:
        raise ValueError(f"inputs must be one of {INPUTS}, got {inputs!r}")
    return inputs


def rank_env(launch: str) -> dict[str, str]:
    """The environment of a GPU comparison's ranks, set before NCCL starts: NVLink multicast
    off (point 6); for ``launch="graph"``, NCCL's registration of captured buffers off too
    (:func:`collectives.core.timing.graph_env`)."""
    return dict(NO_MULTICAST, **(timing.graph_env() if check_launch(launch) == "graph" else {}))


def nccl_all_reduce(tensor: torch.Tensor, group=None):
    """NCCL's all-reduce (sum, in place), called directly: not through the course's trace."""
    return c10d.all_reduce(tensor, group=group)


def nccl_all_to_all_single(output: torch.Tensor, input: torch.Tensor, group=None):
    """NCCL's all-to-all of equal blocks, called directly: not through the course's trace."""
    return c10d.all_to_all_single(output, input, group=group)


def untrace_rank() -> None:
    """From here on this rank calls ``torch.distributed``'s own functions: the course's trace
    wrappers are taken off (:func:`collectives.core.trace.uninstall`), for the contenders
    whose code calls ``dist.*`` as much as for NCCL. A later ``trace.recording()`` puts
    them back (counting messages, say), so call this again before timing."""
    trace.uninstall()


def nccl_window(capacity: int, dtype: torch.dtype, group) -> tuple[torch.Tensor | None, str | None]:
    """A tensor of ``capacity`` elements in memory NCCL registered as a symmetric window on
    every rank (torch's NCCL memory pool, registered with ``symm=True``): NCCL's collectives
    on it may run NCCL's symmetric kernels. ``(None, why)`` where this torch does not offer it."""
    try:
        backend = group._get_backend(torch.device("cuda"))    # the NCCL process group behind ``group``
        allocator, register = getattr(backend, "mem_allocator", None), getattr(backend, "register_mem_pool", None)
        if allocator is None or register is None or not hasattr(torch.cuda, "MemPool"):
            return None, "NCCL window registration (no mem_allocator / register_mem_pool in this torch)"
        pool = torch.cuda.MemPool(allocator)
        with torch.cuda.use_mem_pool(pool):
            tensor = torch.zeros(capacity, dtype=dtype, device="cuda")
        try:
            register(pool, symm=True)
        except TypeError:
            return None, "NCCL window registration (register_mem_pool takes no symm= in this torch)"
        tensor._collectives_pool = pool      # the pool lives as long as the tensor
        return tensor, None
    except (AttributeError, RuntimeError) as exc:
        return None, f"NCCL window registration ({said(exc)})"


class Replayed:
    """``run(*args)`` captured in a CUDA graph once per ``args``
    (:func:`~collectives.core.timing.capture_graph`) and replayed: with ``launch="graph"``
    every contender is timed this way."""

    def __init__(self, run: Callable):
        self.run, self.graphs = run, {}

    def __call__(self, *args):
        graph = self.graphs.get(args)
        if graph is None:
            graph = self.graphs[args] = timing.capture_graph(lambda: self.run(*args), device=torch.device("cuda"))
        graph.replay()


def launched(runs: dict[str, Callable], launch: str, own_graphs: tuple[str, ...] = ()) -> dict[str, Callable]:
    """``runs`` as a run of ``launch`` issues them: unchanged when eager; each wrapped in
    :class:`Replayed` for ``"graph"``, but for the names in ``own_graphs`` -- contenders that
    replay a CUDA graph of their own on every call (the fused reducer's), timed as a caller
    calls them."""
    if check_launch(launch) == "eager":
        return dict(runs)
    return {name: run if name in own_graphs else Replayed(run) for name, run in runs.items()}


def rounds(runs: dict[str, Callable[[], object]], *, iters: int | dict[str, int], skipped: list[str],
           where: str = "", count: int = ROUNDS, device: torch.device | None = None) -> dict[str, list[float]]:
    """Each contender timed once per round, in turn, for ``count`` rounds: a drift of the
    machine's pace falls on all of them alike. Each time is
    :func:`~collectives.core.timing.measure_back_to_back` (CUDA events around ``iters`` runs
    issued back to back, the slowest rank's; ``iters`` may name a count per contender).
    Returns name -> the rounds' times. A contender that raises (the same on every rank: it
    depends on the size, say) is dropped whole, with a line ``"{name}{where}: {error}"``
    under ``skipped``."""
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    samples: dict[str, list[float]] = {name: [] for name in runs}
    live = dict(runs)
    for _ in range(count):
        for name, run in list(live.items()):
            n = iters[name] if isinstance(iters, dict) else iters
            try:
                samples[name].append(timing.measure_back_to_back(run, iters=n, device=device))
            except RuntimeError as exc:
                skipped.append(f"{name}{where}: {first_line(exc)}")
                del live[name], samples[name]
    return samples


def both_launches(eager: dict[str, Callable[[], object]], replays: dict[str, Callable[[], object]] | None = None,
                  *, iters: int, skipped: list[str], count: int = ROUNDS,
                  device: torch.device | None = None) -> dict[str, dict[str, object]]:
    """Every contender timed under each launch in turn (a probe's two columns): all of
    ``eager`` issued from Python in interleaved :func:`rounds`, then all of ``replays``
    (default: ``eager`` wrapped in :class:`Replayed`) replayed from CUDA graphs in
    interleaved rounds. Returns name -> ``{"b2b_s", "b2b_spread", "graph_s",
    "graph_spread"}``, a launch it could not be timed under left out (why: under
    ``skipped``). Set eager against eager and graph against graph, never across."""
    replays = launched(eager, "graph") if replays is None else replays
    out: dict[str, dict[str, object]] = {}
    for column, runs in (("b2b", eager), ("graph", replays)):
        samples = rounds(runs, iters=iters, skipped=skipped, where=f" ({column})", count=count, device=device)
        for name, times in samples.items():
            middle, spread = summary(times)
            out.setdefault(name, {}).update({f"{column}_s": middle, f"{column}_spread": spread})
    return out


def columns(timed: dict[str, dict], names: tuple[str, ...]) -> dict[str, object]:
    """:func:`both_launches`' times flattened for a record: ``gpu_<name>_eager_s`` and
    ``gpu_<name>_graph_s`` with their spreads, and each later name's speed over the first
    (NCCL's) launched alike -- ``<name>_speed_vs_nccl_eager`` and ``..._replayed`` -- never across."""
    out: dict[str, object] = {}
    for name in names:
        for column, launch in (("b2b", "eager"), ("graph", "graph")):
            if f"{column}_s" in timed.get(name, {}):
                out[f"gpu_{name}_{launch}_s"] = timed[name][f"{column}_s"]
                out[f"gpu_{name}_{launch}_spread"] = timed[name][f"{column}_spread"]
    for name in names[1:]:
        for launch, said in (("eager", "eager"), ("graph", "replayed")):
            mine, theirs = out.get(f"gpu_{name}_{launch}_s"), out.get(f"gpu_{names[0]}_{launch}_s")
            if mine and theirs:
                out[f"{name}_speed_vs_nccl_{said}"] = theirs / mine
    return out


def summary(samples: list[float]) -> tuple[float, list[float]]:
    """The median of the rounds' times and their spread, ``[lowest, highest]``."""
    return statistics.median(samples), [min(samples), max(samples)]


BOTH = "both, in rounds of their own: eager against eager (b2b_s), replayed against replayed (graph_s)"


def fields(launch: str, inputs: str | dict[str, str], skipped: list[str]) -> dict:
    """What a record of a GPU comparison says about the rule: how every contender was
    launched (one of :data:`LAUNCHES`, or :data:`BOTH` for :func:`both_launches`' two
    columns), what was counted (one of :data:`INPUTS` for the run, or one per contender
    where the comparison sets them apart on purpose), that nothing was traced, what was
    skipped and what is off."""
    if isinstance(inputs, dict):
        inputs = {name: check_inputs(what) for name, what in inputs.items()}
    else:
        inputs = check_inputs(inputs)
    return {"launch": launch if launch == BOTH else check_launch(launch), "inputs": inputs, "rule": RULE,
            "untraced": True, "multicast": MULTICAST, "skipped": list(skipped)}


def fields_of_rows(launch: str | None, inputs: str, rows: list[dict]) -> dict:
    """``{"rule": ...}`` for a record of rows (:func:`fields`), every contender dropped at a
    size (a row with ``skipped``) under ``skipped``; ``{}`` for a run outside the rule (CPUs)."""
    if launch is None:
        return {}
    skipped = [f"{r['algo']} at {r['nbytes']} B: {r['missing']}" for r in rows if r.get("skipped")]
    return {"rule": fields(launch, inputs, skipped)}


NO_COMPARISON = "nothing: it checks values and times no contender against another"


def compares_nothing() -> dict:
    """What a record that times nothing says beside the rule's records (a GPU script's checks
    against NCCL): the GPU lane's record leaves it out of the rule's account."""
    return {"compares": NO_COMPARISON}
