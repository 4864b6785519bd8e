"""Scenario dumps without a world: what every rank's flight recorder holds after a fault, in a millisecond.

A real scenario (:mod:`.scenarios`) costs a world and, when it hangs, its whole time limit.
:func:`scenario_dumps` writes the dumps the same scenario leaves -- the same calls, sequence
numbers, sizes, dtypes, peers, states and source lines (the ``# site:`` lines of
:mod:`.faults`), and times that tell the same story -- by playing each rank's loop on paper::

    scenario_dumps("skip", seed=7)      # -> [dump of rank 0, dump of rank 1, ...]

``tests/test_09_debugging.py`` holds them against real runs of the same parameters. What
they do not model: which rank gloo happens to abort on a size mismatch, and which peers
notice first that a rank died (real runs differ from one another there too).
"""

from __future__ import annotations

import random

from .faults import KINDS, SITES, Params, draw

_DTYPE_NAMES = {"float32": "Float", "float64": "Double", "int32": "Int", "int64": "Long"}
STEP_NS = 200_000          # a step's work between calls on a quiet rank (0.2 ms)
CALL_NS = 60_000           # a small collective, once every rank is in it
CLOSED = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
          "peer [127.0.0.1]:40000")


class _Rank:
    """One rank's recorder, written by hand: entries with torch's fields, counters per group."""

    def __init__(self, rank: int, clock: int):
        self.rank, self.clock = rank, clock
        self.entries: list[dict] = []
        self.counts: dict[str, list[int]] = {}

    def call(self, site: str, op: str, group: tuple[str, str, tuple[int, ...]], numel: int, dtype: str,
             peer: int | None = None, created: int | None = None) -> dict:
        name, desc, ranks = group
        counts = self.counts.setdefault(name, [0, 0])
        p2p = op in ("send", "recv")
        counts[p2p] += 1
        function, filename, line = SITES[site]
        profiling = f"gloo:{op}" + (f" {self.rank}->{peer}" if op == "send" else
                                    f" {self.rank}<-{peer}" if op == "recv" else "")
        created = self.clock if created is None else created
        sizes, dtypes = [[numel]], [_DTYPE_NAMES[dtype]]
        entry = {"record_id": len(self.entries), "pg_id": int(name), "collective_seq_id": counts[0],
                 "p2p_seq_id": counts[1], "op_id": len(self.entries), "profiling_name": profiling,
                 "process_group": [name, desc], "pg_ranks": list(ranks), "is_p2p": p2p, "peer": peer,
                 "input_sizes": sizes, "input_dtypes": dtypes, "output_sizes": sizes, "output_dtypes": dtypes,
                 "frames": [{"name": function, "filename": filename, "line": line}],
                 "state": "scheduled", "time_created_ns": created, "time_discovered_started_ns": None,
                 "time_discovered_completed_ns": None, "duration_ms": None, "retired": False, "error": None}
        self.entries.append(entry)
        self.clock = created
        return entry

    def start(self, entry: dict, at: int | None = None) -> dict:
        entry["state"] = "started"
        entry["time_discovered_started_ns"] = (at or entry["time_created_ns"]) + 5_000
        return entry

    def complete(self, entry: dict, at: int) -> None:
        started = entry["time_discovered_started_ns"] or entry["time_created_ns"]
        entry.update(state="completed", time_discovered_completed_ns=at, duration_ms=(at - started) / 1e6,
                     retired=True)
        self.clock = at


def _groups(p: Params) -> tuple[tuple[str, str, tuple[int, ...]], tuple[str, str, tuple[int, ...]]]:
    world = ("0", "default_pg", tuple(range(p.world_size)))
    return world, (world if p.is_world else ("1", "undefined", p.group))


def _collective(ranks: dict[int, _Rank], members, site: str, op: str, group, numel: int, dtype: str,
                rng: random.Random, late: dict[int, int] | None = None, complete: bool = True,
                sites: dict[int, tuple[str, str]] | None = None, sizes: dict[int, tuple[int, str]] | None = None,
                root: int | None = None):
    """Every member calls; the call completes (for all) once the last has entered."""
    entries = {}
    for r in members:
        created = ranks[r].clock + STEP_NS + rng.randrange(50_000) + (late or {}).get(r, 0)
        site_r, op_r = (sites or {}).get(r, (site, op))
        numel_r, dtype_r = (sizes or {}).get(r, (numel, dtype))
        peer = root if op_r == "broadcast" else None
        entries[r] = ranks[r].start(ranks[r].call(site_r, op_r, group, numel_r, dtype_r, peer, created=created))
    if complete:
        done = max(e["time_created_ns"] for e in entries.values()) + CALL_NS
        for r in members:
            ranks[r].complete(entries[r], done + rng.randrange(20_000))
    return entries


def _loop(p: Params, ranks: dict[int, _Rank], rng: random.Random) -> dict[int, str]:
    """Play the scenario's loop; return each rank's reason for its dump."""
    _, group = _groups(p)
    members = list(p.group)
    dtype, numel = p.dtype, p.numel
    reasons = {r: "timeout" for r in ranks}
    if p.kind == "skip":
        # The culprit makes one call fewer, and its k-th call meets the others' k-th, whichever
        # step it skipped: all complete but the others' last, which waits for a call never made.
        for _ in range(p.steps - 1):
            _collective(ranks, members, "skip-all-reduce", "all_reduce", group, numel, dtype, rng)
        others = [r for r in members if r != p.culprit]
        _collective(ranks, others, "skip-all-reduce", "all_reduce", group, numel, dtype, rng, complete=False)
    elif p.kind == "order":
        src = p.group[0] if p.group[0] != p.culprit else p.group[1]     # the learning rate's root
        for step in range(p.steps):
            if step < p.step:
                _collective(ranks, members, "order-all-reduce", "all_reduce", group, numel, dtype, rng)
                _collective(ranks, members, "order-broadcast", "broadcast", group, 1, dtype, rng, root=src)
            else:
                _collective(ranks, members, "order-all-reduce", "all_reduce", group, numel, dtype, rng, complete=False,
                            sites={p.culprit: ("order-swapped-broadcast", "broadcast")},
                            sizes={p.culprit: (1, dtype)}, root=src)
                break
    elif p.kind == "deadlock":
        size = len(members)
        for step in range(p.steps):
            for position, r in enumerate(members):
                right, left = members[(position + 1) % size], members[(position - 1) % size]
                me = ranks[r]
                if step == p.step:
                    me.start(me.call("deadlock-send-first", "send", group, numel, dtype, peer=right,
                                     created=me.clock + STEP_NS))
                    continue
                first = ("deadlock-send-first", "send", right) if position % 2 == 0 else \
                    ("deadlock-recv-first", "recv", left)
                second = ("deadlock-recv-second", "recv", left) if position % 2 == 0 else \
                    ("deadlock-send-second", "send", right)
                for site, op, peer in (first, second):
                    e = me.start(me.call(site, op, group, numel, dtype, peer=peer, created=me.clock + STEP_NS))
                    me.complete(e, e["time_created_ns"] + CALL_NS + rng.randrange(20_000))
            if step == p.step:
                break
            _collective(ranks, members, "deadlock-all-reduce", "all_reduce", group, 1, "float32", rng)
    elif p.kind in ("size", "dtype"):
        wrong = (p.wrong_numel, dtype) if p.kind == "size" else (numel, p.wrong_dtype)
        site = f"{p.kind}-all-reduce"
        for step in range(p.steps):
            bad = step == p.step
            entries = _collective(ranks, members, site, "all_reduce", group, numel, dtype, rng,
                                  complete=not (bad and p.kind == "size"), sizes={p.culprit: wrong} if bad else None)
            if bad and p.kind == "size":
                _abort(p, ranks, members, entries, reasons)
                break
        if p.kind == "dtype":
            reasons = {r: "exit" for r in ranks}
    elif p.kind == "straggler":
        late = {p.culprit: int(p.delay * 1e9)}
        for _ in range(p.steps):
            _collective(ranks, members, "straggler-all-reduce", "all_reduce", group, numel, dtype, rng, late=late)
        reasons = {r: "exit" for r in ranks}
    elif p.kind == "killed":
        for step in range(p.steps):
            if step == p.step:
                entries = {}
                for r in members:
                    site = "killed-all-reduce-posted" if r == p.culprit else "killed-all-reduce"
                    e = ranks[r].call(site, "all_reduce", group, numel, dtype, created=ranks[r].clock + STEP_NS)
                    entries[r] = e if r == p.culprit else ranks[r].start(e)
                reasons = {r: "failure" for r in ranks}
                reasons[p.culprit] = "recovered from its ring: killed by SIGKILL"
                for r in members:
                    if r != p.culprit and rng.random() < 0.5:
                        entries[r]["error"] = CLOSED
                break
            _collective(ranks, members, "killed-all-reduce", "all_reduce", group, numel, dtype, rng)
    elif p.kind == HEALTHY:
        size = len(members)
        for _ in range(p.steps):
            _collective(ranks, members, "uneven-all-to-all", "all_to_all_single", group, 1, dtype, rng,
                        sizes={r: (sum(r + peer + 1 for peer in range(size)), dtype) for r in members})
            _collective(ranks, members, "uneven-all-reduce", "all_reduce", group, p.numel, dtype, rng)
        reasons = {r: "exit" for r in ranks}
    elif p.kind == "link":
        for step in range(p.step + 1):
            _collective(ranks, members, "link-all-reduce", "all_reduce", group, numel, dtype, rng,
                        complete=step < p.step)
    return reasons


def _abort(p: Params, ranks, members, entries, reasons) -> None:
    """gloo on a size mismatch: the rank that receives more than it expects aborts (its left
    neighbour in the ring, when the culprit's tensor is the larger; the culprit itself when it
    is the smaller); the others see the connection close, or still wait."""
    position = members.index(p.culprit)
    dead = members[(position - 1) % len(members)] if p.wrong_numel > p.numel else p.culprit
    reasons.update({r: "failure" for r in ranks})
    reasons[dead] = "recovered from its ring: killed by SIGABRT"
    for r in members:
        if r not in (dead, p.culprit):
            entries[r]["error"] = CLOSED


def scenario_dumps(kind: str, seed: int, max_world: int = 8) -> list[dict]:
    """Every rank's dump (rank order) after the scenario :func:`~.faults.draw` makes from
    ``seed``: the flight recorder's format, as ``launch.run(..., flight_recorder=DIR)``
    leaves it. Takes about a millisecond."""
    if kind == HEALTHY:
        return healthy_dumps(seed, max_world)
    if kind not in KINDS:
        raise ValueError(f"unknown fault {kind!r}; the faults are {', '.join(KINDS)} (and {HEALTHY!r})")
    return dumps_for(draw(kind, seed, max_world), seed)


HEALTHY = "uneven"      # a run with nothing wrong in it, whose all-to-alls have uneven splits


def healthy_dumps(seed: int, max_world: int = 8) -> list[dict]:
    """The dumps of a healthy run (``more_faults``' "uneven"): every step an
    ``all_to_all_single`` whose splits differ from rank to rank -- rank r sends r + peer + 1
    elements to each peer -- then an all-reduce; the world of 2 to ``max_world`` ranks and
    the number of steps drawn from ``seed``. Every check must find nothing in it."""
    rng = random.Random(f"{HEALTHY}:{seed}")
    world = rng.randint(2, max(2, max_world))
    return dumps_for(Params(HEALTHY, world, tuple(range(world)), culprit=0, step=0, steps=rng.randint(3, 6),
                            numel=rng.choice((1, 7, 100))), seed)


def dumps_for(p: Params, seed: int = 0) -> list[dict]:
    """The dumps of the scenario ``p`` (any parameters, the lab's included)."""
    rng = random.Random(f"dumps:{p}:{seed}")
    start = 1_700_000_000_000_000_000 + rng.randrange(10**15)
    ranks = {r: _Rank(r, start + rng.randrange(2_000_000)) for r in range(p.world_size)}
    reasons = _loop(p, ranks, rng)
    dumped = max(r.clock for r in ranks.values()) + 1_000_000_000
    per_machine = p.world_size // p.machines
    dumps = []
    for r, me in sorted(ranks.items()):
        dead = reasons[r].startswith("recovered")
        network = None
        if p.kind == "link" and not dead:
            down = r // per_machine == p.machine
            network = {"interface": "eth0", "up": not down, "running": not down and p.machines > 2}
        dumps.append({
            "version": "collectives-fr-1", "rank": r, "world_size": p.world_size, "pid": 10_000 + 97 * r + seed % 89,
            "hostname": None if dead else "synthetic", "machine": None if dead or p.machines == 1 else r // per_machine,
            "reason": reasons[r], "time_dumped_ns": dumped, "buffer_size": 2000,
            "entries_recorded": len(me.entries), "network": network, "entries": me.entries,
            "pg_config": {e["process_group"][0]: {"name": e["process_group"][0], "desc": e["process_group"][1],
                                                  "ranks": e["pg_ranks"]} for e in me.entries}})
    return dumps


_NAMES = ("train_step", "sync_gradients", "exchange_halo", "update", "run_epoch", "reduce_loss", "step",
          "backward_hook", "shard_sync", "loop_body")


def handmade_dumps(kind: str, seed: int, max_world: int = 8) -> list[dict]:
    """The same scenario's dumps as if another program had made them: every function and file
    name of the frames replaced (consistently) by others drawn from ``seed``, the lines moved,
    and the dumps in another order. What the checks must find is unchanged: they read calls,
    not names."""
    dumps = scenario_dumps(kind, seed, max_world)
    rng = random.Random(f"handmade:{kind}:{seed}")
    names: dict[str, str] = {}
    files: dict[str, str] = {}
    shift = rng.randrange(1, 400)
    for dump in dumps:
        for entry in dump["entries"]:
            frames = []
            for frame in entry["frames"]:
                name = names.setdefault(frame["name"], f"{rng.choice(_NAMES)}_{rng.randrange(10**4)}")
                path = files.setdefault(frame["filename"], f"/srv/job{rng.randrange(10**6)}/{rng.choice(_NAMES)}.py")
                frames.append({"name": name, "filename": path, "line": frame["line"] + shift})
            entry["frames"] = frames
    rng.shuffle(dumps)
    return dumps
