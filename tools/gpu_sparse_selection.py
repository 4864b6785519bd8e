"""Time lesson 8's selection methods on one GPU (and the CPU, for comparison).

    .venv/bin/python tools/gpu_sparse_selection.py --size 64M --density 0.01

Prints the median time of torch.topk, a sort, kthvalue, Ok-Topk's reused threshold, the
sampled threshold and a plain threshold for k = density·n of n float32 values: the part of a
sparse all-reduce that does not shrink with the bytes sent, and what decides at which link
speed sparse wins. Each top-k method's indices are also checked against torch.topk's.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from collectives import timing  # noqa: E402
from collectives.sparse import SELECTIONS, keep_count, time_selection, topk_indices  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="64M")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    n = timing.parse_size(args.size) // 4
    k = keep_count(n, args.density)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        x = torch.randn(n, device=device)
        threshold = float(torch.quantile(x[: 1 << 24].abs().float(), 1 - args.density))
        print(f"{device}: k = {k} of n = {n} ({timing.human_bytes(n * 4)})")
        # Compared as magnitudes, not index sets: 16 Mi random floats have equal magnitudes, and
        # at the k-th one either of two equal elements is a correct choice.
        truth = torch.sort(torch.topk(x.abs(), k).values).values
        for row in time_selection(x, k, repeats=args.repeats, threshold=threshold):
            same = ""
            if row.method in SELECTIONS:
                state: dict = {}
                picked = [topk_indices(x, k, row.method, state) for _ in range(2)][-1]   # reuse: warm
                if row.method == "sample":     # a threshold from a sample: about k, not the exact top-k
                    same = f"  (picked {picked.numel()} for k = {k}: an estimate)"
                else:
                    exact = picked.unique().numel() == k and torch.equal(torch.sort(x.abs()[picked]).values, truth)
                    same = "  (the top-k: " + ("yes" if exact else "NO") + ")"
            print(f"  {row.method:>9}: {timing.human_seconds(row.seconds)}{same}")


if __name__ == "__main__":
    main()
