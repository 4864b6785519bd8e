"""Module-level functions run inside test worlds (a world runs module-level functions)."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from collectives import trace


def rank_and_env():
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")
    return dist.get_rank(), dist.get_world_size(), {k: os.environ.get(k) for k in keys}, os.getpid()


def sum_of_ranks():
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    return t.item()


def rank_two_raises_others_wait():
    """Rank 2 raises at once; every other rank blocks in a recv that will never be matched."""
    if dist.get_rank() == 2:
        raise ValueError("rank two cannot go on")
    dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())


def both_receive_first():
    """The classic deadlock: each of two ranks waits to receive before it sends."""
    buf = torch.zeros(4)
    dist.recv(buf, src=1 - dist.get_rank())
    dist.send(buf, dst=1 - dist.get_rank())


def rank_one_exits(code):
    if dist.get_rank() == 1:
        os._exit(code)
    time.sleep(30)


def rank_one_segfaults():
    if dist.get_rank() == 1:
        import faulthandler
        faulthandler.disable()  # the crash is the point; its stack dump is noise
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(30)


def sleepy_children_pids():
    return os.getpid()


def traced_messages():
    """Every kind of call the trace wraps, on a world of 3; returns this rank's events as dicts."""
    rank, p = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % p, (rank - 1) % p
    evens = dist.new_group([0, 2])
    with trace.recording() as t:
        with trace.label("blocking"):
            if rank == 0:
                dist.send(torch.ones(5), dst=1)
            elif rank == 1:
                dist.recv(torch.zeros(5), src=0)
        with trace.label("immediate"):
            recv = dist.irecv(torch.zeros(7, dtype=torch.float64), src=left)
            send = dist.isend(torch.ones(7, dtype=torch.float64), dst=right)
            send.wait()
            recv.wait()
        with trace.label("batched"):
            ops = [dist.P2POp(dist.isend, torch.ones(3), right),
                   dist.P2POp(dist.irecv, torch.zeros(3), left)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        with trace.label("collectives"):
            dist.all_reduce(torch.ones(11))
            dist.broadcast(torch.ones(2), src=1)
            work = dist.all_reduce(torch.ones(4), async_op=True)
            work.wait()
            if rank in (0, 2):
                # group rank 1 of the even group is global rank 2
                if rank == 0:
                    dist.send(torch.ones(2), group_dst=1, group=evens)
                else:
                    dist.recv(torch.zeros(2), group_src=0, group=evens)
        with trace.paused():
            dist.all_reduce(torch.ones(1))  # a reference computation: not recorded
    return t.to_dicts()


# --- all-reduce implementations for the harness's own tests ---------------------------

def ar_correct(tensor, op=dist.ReduceOp.SUM, group=None):
    """Right everywhere: checks, a contiguous work buffer, gloo, write back."""
    from collectives.core.ops import check_all_reduce_args, work_buffer, write_back
    check_all_reduce_args(tensor, op, group)
    flat = work_buffer(tensor)
    dist.all_reduce(flat, op=op, group=group)
    write_back(tensor, flat)


def ar_trusts_gloo_with_views(tensor, op=dist.ReduceOp.SUM, group=None):
    """Hands the tensor to gloo as it is: wrong on strided views (gloo's trap)."""
    dist.all_reduce(tensor, op=op, group=group)


def ar_aborts_on_expanded(tensor, op=dist.ReduceOp.SUM, group=None):
    """Like gloo at 4 ranks: the process aborts when handed an expanded tensor."""
    if tensor.numel() > 1 and tensor.stride(-1) == 0:
        import faulthandler
        faulthandler.disable()  # the crash is the point; its stack dump is noise
        os.abort()
    ar_correct(tensor, op, group)


def ar_forgets_to_average(tensor, op=dist.ReduceOp.SUM, group=None):
    from collectives.core.ops import work_buffer, write_back
    flat = work_buffer(tensor)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=group)
    write_back(tensor, flat)


def ar_scribbles_outside_the_view(tensor, op=dist.ReduceOp.SUM, group=None):
    ar_correct(tensor, op, group)
    if tensor.dim() == 1 and tensor.stride(0) == 2 and tensor.numel() > 1:
        base = tensor.as_strided((2 * tensor.numel(),), (1,))
        base[1] = 0  # an element between the view's elements


def ar_off_by_one_on_tiny_tensors(tensor, op=dist.ReduceOp.SUM, group=None):
    ar_correct(tensor, op, group)
    if 0 < tensor.numel() < dist.get_world_size(group):
        tensor.view(-1)[-1] += 1


def harness_catches(targets):
    """Run the quick cases on each target in this world; return {name: (ok, summary)}."""
    from collectives import verify
    out = {}
    for name in targets:
        report = verify.check_all_reduce(globals()[name])
        out[name] = (report.ok, report.summary(limit=50), [r.case for r in report.failures])
    return out


def gloo_view_trap():
    """What gloo itself does with a strided view, against the same data made contiguous."""
    base = torch.arange(16, dtype=torch.float32) * (dist.get_rank() + 1)
    view = base[::2]
    expected = view.contiguous().clone()
    dist.all_reduce(expected)
    dist.all_reduce(view)  # gloo handed the view itself
    return bool(torch.equal(view, expected))


def check_targets(targets, quick):
    """Check several all-reduce targets in this one world; {target: (ok, summary)}."""
    from collectives import verify
    from collectives.course.impl import resolve
    from collectives.course.tour import TOUR
    identical = {e.target: e.identical_bits for e in TOUR}
    out = {}
    for target in targets:
        report = verify.check_all_reduce(resolve(target), quick=quick,
                                         identical_bits=identical.get(target, True))
        out[target] = (report.ok, report.summary())
    return out


def ring_in_registered_memory(nbytes):
    """The ring on buffers from the NCCL-registered pool, against dist.all_reduce."""
    from collectives import nccl_memory, verify
    from collectives.ring import ring_all_reduce
    n = nbytes // 4
    x = nccl_memory.empty(n, dtype=torch.float32)
    x.copy_(torch.randint(-8, 9, (n,), device=x.device).float() * (dist.get_rank() + 1))
    expected = verify.reference_all_reduce(x)
    nccl_memory.register()
    ring_all_reduce(x)
    return verify.compare(expected, x)


def two_ranks_stuck_inside_a_context():
    """Ranks 0 and 1 wait for each other's message, inside trace.context; rank 2 returns."""
    import torch
    import torch.distributed as dist

    from collectives import trace

    with trace.context("my_all_reduce (case n=3 float32 SUM, world of 2)"):
        if dist.get_rank() < 2:
            dist.recv(torch.empty(1), 1 - dist.get_rank())
    return "done"


# --- back-to-back worlds, ranks that disagree ------------------------------------------

def returns_at_once():
    return dist.get_rank()


def writes_to_stderr():
    """Writes through Python and through the file descriptor, as C++ logging does."""
    print(f"python stderr of rank {dist.get_rank()}", file=sys.stderr)
    os.write(2, f"fd-2 stderr of rank {dist.get_rank()}\n".encode())
    return dist.get_rank()


def ring_with_sizes_by_rank():
    """Rank r passes 8 + 4r elements to the course's ring: the commonest student bug.
    Some rank then receives a chunk larger than it posted for, and gloo aborts it."""
    from collectives.ring import ring_all_reduce
    ring_all_reduce(torch.ones(8 + 4 * dist.get_rank()))


def ring_mismatch_caught_everywhere():
    """In check mode: every rank gets the same ArgumentMismatch; a matching call then runs
    and leaves the same trace as without the check. Returns (message, kinds traced)."""
    from collectives.core.ops import ArgumentMismatch
    from collectives.ring import ring_all_reduce
    rank = dist.get_rank()
    numel = 6 if rank == 1 else 8
    dtype = torch.float64 if rank == 3 else torch.float32
    try:
        ring_all_reduce(torch.ones(numel, dtype=dtype))
        message = "no error"
    except ArgumentMismatch as exc:
        message = str(exc)
    with trace.recording() as t:
        x = torch.ones(8)
        ring_all_reduce(x)
    return message, sorted({e.kind for e in t}), len(t), x.tolist()


def run_named_checks(checks, impl: str, names: list[str]) -> dict:
    """Run the checks among ``checks`` named in ``names``, each on a process group of its own,
    on this rank; a check that raises gives its error and the end of its traceback, and the
    others still run."""
    import datetime
    import traceback

    chosen = [fn for fn in checks if fn.__name__ in names]
    groups = [dist.new_group(timeout=datetime.timedelta(seconds=30)) for _ in chosen]
    results = {}
    for fn, group in zip(chosen, groups):
        try:
            results[fn.__name__] = fn(impl, group)
        except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others
            tb = traceback.format_exc(limit=-3)
            results[fn.__name__] = dict(error=f"{type(exc).__name__}: {exc}\n{tb}")
    return results


def checked_calls_that_disagree_or_skip():
    """Check mode beyond sizes: an ``agree=`` entry that differs, and a rank that skips a
    checked call (the others wait and name it). Returns (agree message, skip message)."""
    from collectives import ops
    from collectives.core.checkmode import compare_across_ranks
    rank = dist.get_rank()
    x = torch.ones(4)
    try:
        ops.check_all_reduce_args(x, what="layout_demo", agree={"layout": (2, 2) if rank else (4, 1)})
        agree = "no error"
    except ops.ArgumentMismatch as exc:
        agree = str(exc)
    try:
        if rank != 2:
            compare_across_ranks("skipped_demo", x, timeout=1.0)
        skip = "no error"
    except ops.ArgumentMismatch as exc:
        skip = str(exc)
    return agree, skip


def rank_one_is_killed():
    """Rank 1 is sent SIGKILL from outside the launcher (here: by itself)."""
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return os.environ.get("COLLECTIVES_LAUNCHER", "")


def launcher_tag():
    return os.environ.get("COLLECTIVES_LAUNCHER", "")


class EqualToEverything:
    """A rank's answer that says it equals anything (a cheat a judge must not be fooled by)."""

    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


def answers_equal_to_anything():
    from unittest import mock

    import torch
    return {"any": mock.ANY, "mine": EqualToEverything(), "data": [1, "two", (3.0, None)],
            "tensor": torch.arange(6).reshape(2, 3)[:, 1], "dtype": torch.bfloat16}
