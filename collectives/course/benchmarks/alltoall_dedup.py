"""bench-alltoall dedup: the MoE dispatch + combine across machines, flat against deduplicated.

On the simulated cluster (``--machines`` × ``--per-machine`` ranks, each machine's link
shaped to ``--link``; root, network namespaces), every rank routes the same number of
tokens top-``k`` over ``--experts`` experts (a random router: nearly uniform, nothing
dropped) and times, with the expert compute left out (each expert returns its rows):

* ``flat`` -- :func:`collectives.alltoall.flat_dispatch` and ``flat_combine``: one row
  per (token, choice) to the expert's rank, and back, on the pairwise all-to-all (the
  layer's own); ``flat, linear`` the same with every message posted at once, so that the
  flat side is not held to one partner at a time;
* ``dedup`` -- :func:`collectives.alltoall.dedup.dedup_dispatch` and ``dedup_combine``:
  one row per (token, machine) across, rail-aligned, forwarded and summed inside, the
  rows streamed in ``--chunks`` pieces (:mod:`collectives.alltoall.dedup_stream`);
  ``dedup, stage by stage`` the same messages, each stage one all-to-all waiting for
  the last (``chunks=None``).

Each is verified first: the experts' batches equal row for row, the combined outputs to
fp32 rounding. The record holds per variant the median seconds (max over ranks), the
elements the rank sent across machines (from its trace), and the two-tier model's
prediction (:func:`collectives.alltoall.cost.moe_seconds`) beside it. Beside the run's
record (``bench-alltoall-dedup.json``) it writes the site's (``11-alltoall-dedup.json``,
:func:`site_record`): the table and the comparison lesson 11's page shows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...core import cost as core_cost
from ...core import launch, netns, timing, trace

QUEUE = "50ms"
# The shaper counts frames: 1448 bytes of TCP payload in a 1514-byte frame (MTU 1500,
# timestamps on). On the cluster, 2 × 16 MiB each way over one link: tc counted 1.047 ×
# the payload leaving a machine (its acknowledgements included).
FRAME = 1514 / 1448


def two_tier(link: str, D: int, M: int) -> core_cost.TwoTier:
    """The model's view of the simulated cluster: loopback inside (lesson 7's), the shaped
    link across (α 100 µs; β the link's rate, less the frames' headers: :data:`FRAME`)."""
    from collectives.hierarchical.cost import DEFAULT_TIERS
    across = core_cost.AlphaBeta(100e-6, FRAME / netns.rate_bytes_per_second(link))
    return core_cost.TwoTier(DEFAULT_TIERS.inside, across, M, D)


def _dedup_in_rank(tokens: int, hidden: int, k: int, experts: int, layout: tuple[int, int], iters: int,
                   chunks: int) -> dict:
    from collectives.alltoall import dedup, flat_combine, flat_dispatch, linear_all_to_all, make_router, route
    r, p = dist.get_rank(), dist.get_world_size()
    D = layout[0]
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(r))
    router = make_router(11, hidden, experts)
    with torch.no_grad():
        routing = route(x, router, k, tokens * k)                      # dropless: capacity T·k

        def flat(algorithm=None):
            rows, counts, state = flat_dispatch(x, routing, experts, None, algorithm)
            return rows, flat_combine(rows, routing, state, tokens, None, algorithm)

        def deduplicated(pieces):
            rows, counts, state = dedup.dedup_dispatch(x, routing, experts, layout, r, pieces)
            return rows, dedup.dedup_combine(rows, state)

        results, rows = {}, []
        for name, fn in (("flat", flat), ("flat, linear", lambda: flat(linear_all_to_all)),
                         ("dedup, stage by stage", lambda: deduplicated(None)),
                         ("dedup", lambda: deduplicated(chunks))):
            with trace.recording() as t:
                results[name] = fn()
            across = sum(e.numel for e in t if e.kind == "isend" and e.peer // D != r // D)
            times = timing.measure(fn, warmup=1, iters=iters)
            rows.append(dict(name=name, seconds=timing.median(times), times=times,
                             elements_across=int(timing.max_over_ranks(across))))
        others = [n for n in results if n != "flat"]
        batches = all(torch.equal(results["flat"][0], results[n][0]) for n in others)
        combined = all(torch.allclose(results["flat"][1], results[n][1], rtol=1e-5, atol=1e-5) for n in others)
        ok = timing.max_over_ranks(0.0 if batches and combined else 1.0) == 0.0
    for row in rows:
        row["verified"] = ok
    return {"rows": rows, "world_size": p, "dropped": routing.dropped}


def suite_dedup(args, argv) -> dict:
    from collectives.alltoall import cost

    from ...core.cluster import Cluster
    D, M = args.per_machine, args.machines
    with Cluster(M, D, link=args.link, latency=QUEUE) as made:
        result = launch.run(_dedup_in_rank, D * M, args=(args.tokens, args.hidden, args.k, args.experts, (D, M),
                                                         args.iters, args.chunks), cluster=made, timeout=900)[0]
    machine = two_tier(args.link, D, M)
    row_bytes = args.hidden * 4
    meta_bytes = args.k * 4 + 2 * args.k * 8                           # the gates, and expert and slot per choice
    for row in result["rows"]:
        row["model_seconds"] = cost.moe_seconds(args.tokens, row_bytes, args.k, args.experts, machine,
                                                row["name"].startswith("dedup"), meta_bytes,
                                                args.chunks if row["name"] == "dedup" else None)
    seconds = {row["name"]: row["seconds"] for row in result["rows"]}
    seconds["flat"] = min(seconds["flat"], seconds["flat, linear"])          # the faster flat one is the baseline
    flat_rows, dedup_rows = cost.dedup_rows(args.k, args.experts, M)
    model = {row["name"]: row["model_seconds"] for row in result["rows"]}
    result.update(layout=[D, M], link=args.link, latency=QUEUE, tokens=args.tokens, hidden=args.hidden, k=args.k,
                  experts=args.experts, chunks=args.chunks, speedup=seconds["flat"] / seconds["dedup"],
                  model_speedup=model["flat"] / model["dedup"],
                  rows_across_per_token={"flat": flat_rows, "dedup": dedup_rows})
    return result


def add_arguments(parser) -> None:
    parser.add_argument("--machines", type=int, default=2, help="dedup: machines")
    parser.add_argument("--per-machine", type=int, default=2, help="dedup: ranks per machine")
    parser.add_argument("--k", type=int, default=4, help="dedup: experts per token")
    parser.add_argument("--experts", type=int, default=8, help="dedup: experts in all")
    parser.add_argument("--chunks", type=int, default=4, help="dedup: pieces per peer of the streamed rows")


def print_rows(result: dict) -> None:
    for row in result["rows"]:
        print(f"{row['name']:<21} {timing.human_seconds(row['seconds']):>10} (model "
              f"{timing.human_seconds(row['model_seconds'])})  {row['elements_across']} elements across  "
              f"verified={row['verified']}")
    print(f"dedup {result['speedup']:.2f}x as fast as flat (model {result['model_speedup']:.2f}x)")


def site_record(raw: dict, folder) -> str:
    """The page's record of a run: one comparison (measured), the model's, and the table."""
    from pathlib import Path

    from ..site import claims
    names = {"flat": "the flat dispatch + combine", "flat, linear": "the flat one posted all at once",
             "dedup, stage by stage": "the deduplicated one stage by stage",
             "dedup": "the deduplicated dispatch + combine"}
    D, M = raw["layout"]
    record = claims.Record("11-alltoall-dedup", names=names, aliases={"dedup": ["deduplicated", "deduplication"]},
                           meta=raw["meta"], title="MoE dispatch + combine across machines: flat against deduplicated")
    rows = {r["name"]: r for r in raw["rows"]}
    where = (f"{raw['tokens']} tokens of {raw['hidden']} fp32 per rank, top-{raw['k']} of {raw['experts']} "
             f"experts, {M} machines × {D} ranks, {raw['link']} links, rows streamed in {raw['chunks']} pieces")
    faster_flat = min(("flat", "flat, linear"), key=lambda n: rows[n]["seconds"])
    record.times("measured", {n: rows[n]["seconds"] for n in names}, baseline=faster_flat, where=where)
    # the fact below compares the deduplicated one with the faster of the two flat ones
    record.fact("model", f"Against the faster flat one, the two-tier model predicts {raw['model_speedup']:.2f}× "
                f"for the deduplicated dispatch + combine; measured {raw['speedup']:.2f}×.",
                model=raw["model_speedup"], measured=raw["speedup"])
    record.table = {"head": ["dispatch + combine", "measured", "model", "elements sent across per rank"],
                    "rows": [[n, timing.human_seconds(rows[n]["seconds"]),
                              timing.human_seconds(rows[n]["model_seconds"]), str(rows[n]["elements_across"])]
                             for n in names]}
    record.caption = record.text()
    return str(record.save(Path(folder) / "11-alltoall-dedup"))
