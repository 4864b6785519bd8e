"""Probe: which ring layout gets closest to NCCL's all_reduce on this machine's GPUs?

Run with torchrun (one process per GPU):
    .venv/bin/torchrun --nproc-per-node 4 tools/gpu_ring_probe.py --sizes 64M,256M --out results.json

Variants: one ring; a bidirectional ring (half the tensor each way); several rings over
different Hamiltonian cycles of a fully connected node, both directions. Every step of
every channel is posted in one batch_isend_irecv, so NCCL runs the channels together.
"""

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def chunk_bounds(n, parts):
    base, extra = divmod(n, parts)
    out, s = [], 0
    for i in range(parts):
        e = s + base + (1 if i < extra else 0)
        out.append((s, e))
        s = e
    return out


def cycles(p):
    """Hamiltonian cycles of the complete graph on p nodes, used as ring orders."""
    if p == 4:
        return [[0, 1, 2, 3], [0, 2, 3, 1], [0, 3, 1, 2]]
    return [list(range(p))]


def make_channels(p, kind):
    if kind == "ring":
        return [list(range(p))]
    if kind == "bidir":
        return [list(range(p)), list(reversed(range(p)))]
    if kind.startswith("cycles"):  # every cycle, both directions
        out = []
        for c in cycles(p):
            out += [c, list(reversed(c))]
        return out
    if kind.startswith("x"):  # kN: the same ring order N times
        return [list(range(p))] * int(kind[1:])
    raise ValueError(kind)


class MultiRing:
    def __init__(self, x, orders):
        self.p, self.rank = dist.get_world_size(), dist.get_rank()
        self.orders = orders
        self.slices = [x[s:e] for s, e in chunk_bounds(x.numel(), len(orders))]
        self.plans = []
        for order, sl in zip(orders, self.slices):
            pos = order.index(self.rank)
            right, left = order[(pos + 1) % self.p], order[(pos - 1) % self.p]
            chunks = [sl[s:e] for s, e in chunk_bounds(sl.numel(), self.p)]
            buf = torch.empty(max(c.numel() for c in chunks), dtype=x.dtype, device=x.device)
            self.plans.append((pos, right, left, chunks, buf))

    def pipelined(self, k):
        """Reduce-scatter in k pieces per step: piece j+1's transfer is queued on NCCL's
        stream before piece j's add is queued on ours, so the add hides under the transfer."""
        p = self.p
        for step in range(p - 1):
            pending = None
            for j in range(k):
                ops, adds = [], []
                for pos, right, left, chunks, buf in self.plans:
                    send = chunks[(pos - step) % p]
                    dst = chunks[(pos - step - 1) % p]
                    sb = chunk_bounds(send.numel(), k)[j]
                    rb = chunk_bounds(dst.numel(), k)[j]
                    r = buf[rb[0]:rb[1]]
                    ops.append(dist.P2POp(dist.isend, send[sb[0]:sb[1]], right))
                    ops.append(dist.P2POp(dist.irecv, r, left))
                    adds.append((dst[rb[0]:rb[1]], r))
                works = dist.batch_isend_irecv(ops)
                if pending:
                    for w in pending[0]:
                        w.wait()
                    for d, r in pending[1]:
                        d.add_(r)
                pending = (works, adds)
            for w in pending[0]:
                w.wait()
            for d, r in pending[1]:
                d.add_(r)
        self.all_gather()

    def all_gather(self):
        """Every channel's finished chunks once round its ring, all channels in one group per step."""
        p = self.p
        for step in range(p - 1):
            ops = []
            for pos, right, left, chunks, buf in self.plans:
                ops.append(dist.P2POp(dist.isend, chunks[(pos - step + 1) % p], right))
                ops.append(dist.P2POp(dist.irecv, chunks[(pos - step) % p], left))
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    def __call__(self):
        p = self.p
        for step in range(p - 1):
            ops, adds = [], []
            for pos, right, left, chunks, buf in self.plans:
                send = chunks[(pos - step) % p]
                recv_idx = (pos - step - 1) % p
                r = buf[: chunks[recv_idx].numel()]
                ops.append(dist.P2POp(dist.isend, send, right))
                ops.append(dist.P2POp(dist.irecv, r, left))
                adds.append((chunks[recv_idx], r))
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            for dst, r in adds:
                dst.add_(r)
        self.all_gather()


def timeit(fn, warmup=5, iters=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    t = torch.tensor(ts, device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64M,256M")
    ap.add_argument("--variants", default="ring,bidir,x2,x4,cycles")
    ap.add_argument("--out", default="")
    ap.add_argument("--register", action="store_true",
                    help="allocate every buffer from a MemPool registered with NCCL (zero-copy p2p)")
    args = ap.parse_args()
    if args.register and "," in args.sizes:
        ap.error("--register takes one size per run: registering NCCL memory again in the same "
                 "process is unsafe (see collectives.core.nccl_memory.register)")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    p, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    import contextlib
    pool_ctx = contextlib.nullcontext
    if args.register:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
        pool = torch.cuda.MemPool(backend.mem_allocator)
        def pool_ctx():
            return torch.cuda.use_mem_pool(pool)
    for size in args.sizes.split(","):
        nbytes = int(size[:-1]) << (20 if size.endswith("M") else 10)
        n = nbytes // 4
        def bus(t):
            return nbytes / t * 2 * (p - 1) / p / 1e9
        variants = [v for v in args.variants.split(",") if not (v.startswith("cycles") and p != 4)]
        oks = {}
        for v in variants:  # correctness on integer data first, in ordinary memory
            kind, _, pieces = v.partition("/")
            y = torch.randint(-8, 9, (n,), device="cuda").float() * (rank + 1)
            ref = y.clone()
            dist.all_reduce(ref)
            m = MultiRing(y, make_channels(p, kind))
            m.pipelined(int(pieces)) if pieces else m()
            oks[v] = bool(torch.equal(y, ref))
            del y, ref, m
        with pool_ctx():  # everything timed lives in the same kind of memory
            x = torch.randn(n, device="cuda")
            runners = {}
            for v in variants:
                kind, _, pieces = v.partition("/")
                mz = MultiRing(torch.randn(n, device="cuda"), make_channels(p, kind))
                runners[v] = (lambda mz=mz, k=int(pieces or 0): mz.pipelined(k)) if pieces else mz
        if args.register:
            backend.register_mem_pool(pool)
        t_ref = timeit(lambda: dist.all_reduce(x))
        rows.append(dict(p=p, size=size, variant="nccl", seconds=t_ref, busbw=bus(t_ref), ratio=1.0,
                         register=args.register))
        for v in variants:
            t = timeit(runners[v])
            rows.append(dict(p=p, size=size, variant=v, ok=oks[v], seconds=t, busbw=bus(t),
                             ratio=t_ref / t, register=args.register))
        if rank == 0:
            for r in rows[-(len(variants) + 1):]:
                print(json.dumps(r), flush=True)
        runners.clear()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if args.register:   # the registered pool must not be freed after its communicator: leave now
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
