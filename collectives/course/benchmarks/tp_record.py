"""``bench-tp``'s records: what one block sends and keeps (counted), and the timed run.

* :func:`counts` -- one transformer block of :class:`~collectives.tensor_parallel.TPBlock`,
  forward and backward, in worlds of 1, 2, 4 and 8 ranks, plain TP and sequence parallel: the
  bytes each rank sends (from the trace) and the activation bytes autograd keeps (its saved
  tensors), each checked against :mod:`collectives.tensor_parallel.cost` -- counts, not
  times, the same on any machine;
* :func:`save_counts_record` -- their chart and record (``13-tp-vs-sp``);
* :func:`save_bench_record` -- the timed run's chart and record: every variant's time per
  shape, the sequential forward the baseline, and (on CPU) rank 0's timeline of one async
  forward: when each transfer and each matmul of a piece ran.
"""

from __future__ import annotations

from pathlib import Path

from ...core import launch, trace
from ...tensor_parallel import Config, TinyGPT, TPBlock, TPGroup, activation_bytes, comm_bytes_per_layer
from ...tensor_parallel.cost import saved_activation_bytes
from ..catalog import ROOT

NAMES = {"sequential": "the sequential forward", "async": "async TP", "dtensor": "torch's DTensor TP",
         "fused": "torch's fused symm_mem ops", "tp": "plain TP", "sp": "sequence parallelism"}
BLOCK = dict(b=4, s=64, h=64, heads=8, ffn=256)


def _block_rank(b, s, h, heads, ffn, sp):
    import torch

    tp = TPGroup()
    p = tp.size
    block = TPBlock(TinyGPT(Config(vocab=8 * 8, hidden=h, heads=heads, ffn=ffn, layers=1), seed=3).layers[0], tp, sp)
    x = torch.randn(b, s // p if sp else s, h, requires_grad=True)
    saved = saved_activation_bytes(block, x, exclude=list(block.parameters()))
    with trace.recording() as t:
        block(x).square().sum().backward()
    return saved, sum(e.nbytes for e in t.sends()), len(t.sends())


def counts(ps=(1, 2, 4, 8), block: dict | None = None) -> dict:
    """Bytes sent and activation bytes kept per rank by one block, each against its formula."""
    block = dict(block or BLOCK)
    out = {"ps": list(ps), "block": block, "sent": {"tp": [], "sp": []}, "saved": {"tp": [], "sp": []}}
    for p in ps:
        for key, sp in (("tp", False), ("sp", True)):
            saved, sent, _ = launch.run(_block_rank, p, kwargs=dict(block, sp=sp))[0]
            b, s, h, heads, ffn = (block[k] for k in ("b", "s", "h", "heads", "ffn"))
            want_sent = comm_bytes_per_layer(b, s, h, p, sp=sp)["bytes"]
            want_saved = activation_bytes(b, s, h, heads, ffn, p, sp=sp)["total"]
            if (sent, saved) != (want_sent, want_saved):
                raise AssertionError(f"p = {p}, {key}: sent {sent} (formula {want_sent}), "
                                     f"kept {saved} (formula {want_saved})")
            out["sent"][key].append(sent)
            out["saved"][key].append(saved)
    return out


def _kib(n: float) -> str:
    return f"{n / 1024:.0f} KiB"


def save_counts_record(result: dict, name: str = "13-tp-vs-sp", img: Path | None = None) -> Path:
    from ..site import claims, plots

    ps, blk = result["ps"], result["block"]
    fig = plots._figure(8.0, 3.2)
    axes = fig.subplots(1, 2, sharex=True)
    for ax, what, title in ((axes[0], "sent", "bytes sent per rank, one block"),
                            (axes[1], "saved", "activations kept per rank, one block")):
        for key, style in (("tp", "o-"), ("sp", "s--")):
            ax.plot(ps, [v / 1024 for v in result[what][key]], style, label=NAMES[key])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ranks p", fontsize=10)
        ax.set_ylabel("KiB", fontsize=10)
        ax.set_xticks(ps)
        ax.tick_params(labelsize=9)
        ax.legend(fontsize=9)
    shape = f"b = {blk['b']}, s = {blk['s']}, h = {blk['h']}, {blk['heads']} heads, MLP width {blk['ffn']}, fp32"
    meta = claims.environment(command=".venv/bin/python -m collectives bench-tp --counts")
    record = claims.Record(name, names={"tp": NAMES["tp"], "sp": NAMES["sp"]}, meta=meta,
                           aliases={"sp": ["SP", "sequence parallel"], "tp": ["TP"]},
                           title="What one block sends and keeps per rank, TP against SP",
                           alt="Two panels against the number of ranks: bytes sent per rank and activation bytes "
                               "kept per rank, for plain TP and for sequence parallelism.")
    i = len(ps) - 1
    p = ps[i]
    record.fact("sent", f"Counted from the trace ({shape}): at p = {p} one block's forward and backward send "
                        f"{_kib(result['sent']['tp'][i])} per rank in plain TP and {_kib(result['sent']['sp'][i])} "
                        "with sequence parallelism (its column layers gather their input again in the backward).",
                p=p, tp=result["sent"]["tp"][i], sp=result["sent"]["sp"][i])
    record.fact("saved", f"Counted from autograd's saved tensors: at p = {p} the block keeps "
                         f"{_kib(result['saved']['tp'][i])} of activations per rank in plain TP and "
                         f"{_kib(result['saved']['sp'][i])} with sequence parallelism.",
                p=p, tp=result["saved"]["tp"][i], sp=result["saved"]["sp"][i])
    record.fact("formulas", "Every count equals the formula of collectives.tensor_parallel.cost, at every p.")
    record.table = {"head": ["p", "sent, TP", "sent, SP", "kept, TP", "kept, SP"],
                    "rows": [[str(q), _kib(result["sent"]["tp"][k]), _kib(result["sent"]["sp"][k]),
                              _kib(result["saved"]["tp"][k]), _kib(result["saved"]["sp"][k])]
                             for k, q in enumerate(ps)]}
    return plots.save(fig, Path(img or ROOT / "docs" / "img") / name, record)


def save_bench_record(result: dict, name: str, img: Path | None = None) -> Path:
    from ..site import claims, plots

    names = list(result["times"])
    shapes = ["x".join(map(str, s)) for s in result["shapes"]]
    timeline = result.get("timeline")
    fig = plots._figure(10.0 if timeline else 7.0, 3.2)
    axes = fig.subplots(1, 2 if timeline else 1, squeeze=False)[0]
    ax = axes[0]
    width = 0.8 / len(names)
    for k, n in enumerate(names):
        xs = [i + k * width for i in range(len(shapes))]
        ax.bar(xs, [t * 1e3 for t in result["times"][n]], width, label=NAMES[n])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], shapes)
    ax.set_xlabel("tokens s x hidden h x MLP width f", fontsize=10)
    ax.set_ylabel("forward, ms (median)", fontsize=10)
    ax.tick_params(labelsize=9)
    ax.legend(fontsize=9)
    if timeline:
        _draw_timeline(axes[1], timeline, shapes[-1])
    meta = result.get("meta") or claims.environment(backend=result["backend"])
    record = claims.Record(name, names={n: NAMES[n] for n in names}, meta=meta,
                           aliases={"async": ["the overlapped forward"], "sequential": ["sequential TP"]},
                           title=f"The sequence-parallel MLP's forward on {result['world']} ranks",
                           alt="Bars of the forward's median time for each variant at each shape.")
    for i, shape in enumerate(shapes):
        record.times(f"at-{shape}", {n: result["times"][n][i] for n in names}, baseline="sequential",
                     where=f"{shape}, {result['world']} ranks, {result['dtype']}")
    record.table = {"head": ["s x h x f"] + [NAMES[n] for n in names],
                    "rows": [[shape] + [claims.human(result["times"][n][i]) for n in names]
                             for i, shape in enumerate(shapes)]}
    return plots.save(fig, Path(img or ROOT / "docs" / "img") / name, record)


def _draw_timeline(ax, timeline: list[dict], shape: str) -> None:
    """Rank 0's async forward: each matmul of a piece (below) and each transfer (above) in time."""
    for e in timeline:
        row = 1 if e["what"] == "transfer" else 0
        ax.barh(row, (e["end"] - e["start"]) * 1e3, left=e["start"] * 1e3, height=0.6,
                color="tab:orange" if row else "tab:blue", edgecolor="white")
    ax.set_yticks([0, 1], ["matmuls", "transfers"])
    ax.set_xlabel(f"ms into one async forward, rank 0, {shape}", fontsize=10)
    ax.set_title("one async forward: transfers and matmuls in time", fontsize=10)
    ax.tick_params(labelsize=9)
