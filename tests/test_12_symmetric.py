"""Lesson 12, all-reduce without messages: what the graded tasks do not cover, and the hazards.

The graded tasks (the flag barrier, the one-shot, the two-shot) are judged by
:mod:`collectives.course.grading.tasks.lesson12`, outside the ranks; ``tests/test_grader.py``
runs those judges on the reference, the stubs and every partial solution. Here: the
reference against ``dist.all_reduce`` on every case of the harness at 4 ranks and on
world sizes 1 to 8; no message in the data path; the same bits on every rank; clear
errors; and each hazard the guards exist for, shown failing when its guard is removed.
"""

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from collectives import launch, trace, verify
from collectives.course.catalog import world_timeout
from collectives.symmetric import (
    BarrierTimeout,
    SharedLink,
    SharedWorkspace,
    crossover,
    one_shot_all_reduce,
    one_shot_seconds,
    two_shot_all_reduce,
    two_shot_seconds,
    workspace,
)
from collectives.symmetric.cost import fit_shared

LESSON = 12
WORLD_TIMEOUT = world_timeout(60.0)
ALGORITHMS = (one_shot_all_reduce, two_shot_all_reduce)


# ---- equal to dist.all_reduce, with no message ---------------------------------------------

def _every_case_and_no_message():
    out = {}
    for fn in ALGORITHMS:
        report = verify.check_all_reduce(fn, verify.default_cases(dist.get_world_size(), large=False))
        out[fn.__name__] = (report.ok, report.summary())
    workspace(None, 1 << 20)                       # made ahead: the calls below send nothing
    rank = dist.get_rank()
    with trace.recording() as t:
        x = torch.arange(5001, dtype=torch.int64) * (rank + 1)       # 5001: not divisible by 4
        one_shot_all_reduce(x)
        y = torch.arange(5001, dtype=torch.int64) * (rank + 1)
        two_shot_all_reduce(y, op=dist.ReduceOp.MAX)
    out["events"] = len(t.to_dicts())
    out["values"] = (x.clone(), y.clone())
    with trace.recording() as t:                   # the tracer does see the set-up's messages
        SharedWorkspace(None, 4096)
    out["setup_kinds"] = sorted({e["kind"] for e in t.to_dicts()})
    return out


def test_one_and_two_shot_match_dist_all_reduce_on_every_case_and_send_no_message():
    p = 4
    results = launch.run(_every_case_and_no_message, p, timeout=WORLD_TIMEOUT)
    base = torch.arange(5001, dtype=torch.int64)
    for rank, out in enumerate(results):
        for name in ("one_shot_all_reduce", "two_shot_all_reduce"):
            ok, summary = out[name]
            assert ok, f"{name}, rank {rank}: {summary}"
        assert out["events"] == 0, f"rank {rank} made {out['events']} calls of torch.distributed in the data path"
        x, y = out["values"]
        assert torch.equal(x, base * (1 + 2 + 3 + 4)) and torch.equal(y, base * 4)
        assert "broadcast" in out["setup_kinds"], out["setup_kinds"]


def _few_cases_every_size():
    p = dist.get_world_size()
    cases = [verify.Case(1001, torch.int64, dist.ReduceOp.SUM), verify.Case(1001, torch.float32, dist.ReduceOp.AVG),
             verify.Case(max(p - 1, 1), torch.int32, dist.ReduceOp.PRODUCT),
             verify.Case(4099, torch.bfloat16, dist.ReduceOp.MIN),
             verify.Case(4099, torch.float32, dist.ReduceOp.SUM, values="random")]
    reports = [verify.check_all_reduce(fn, cases) for fn in ALGORITHMS]
    return [report.summary() for report in reports if not report.ok] + _at_home(cases)


def _at_home(cases) -> list[str]:
    """The two-shot of inputs that live in the segment (each rank's home): the same results
    as dist.all_reduce, no message, and the result where the input was."""
    rank = dist.get_rank()
    ws = SharedWorkspace(None, 1 << 15, home=True)
    failures = []
    for case in cases:
        home = ws.home(case.numel, case.dtype)
        g = torch.Generator().manual_seed(rank)
        values = (torch.randn(case.numel, generator=g) if case.values == "random"
                  else torch.randint(-3, 4, (case.numel,), generator=g)).to(case.dtype)
        if case.op == dist.ReduceOp.PRODUCT:
            values = torch.full((case.numel,), 1 + rank % 2, dtype=case.dtype)
        expected = verify.reference_all_reduce(values, case.op)
        home.copy_(values)
        with trace.recording() as t:
            two_shot_all_reduce(home, op=case.op, workspace=ws)
        exact = case.values != "random"            # random floats: gloo may add in another order
        wrong = verify.compare(expected, home, exact=exact, rtol=1e-5, atol=1e-5)
        if wrong or t.to_dicts():
            failures.append(f"at home, {case}: {wrong}, {len(t.to_dicts())} messages")
    return failures


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])      # 4 is the test above's; 8: more ranks than the cores
def test_world_sizes_one_to_eight(p):
    for rank, failures in enumerate(launch.run(_few_cases_every_size, p, timeout=WORLD_TIMEOUT)):
        assert not failures, f"world of {p}, rank {rank}: {failures}"


def _bad_input():
    errors = []
    small = SharedWorkspace(None, 64)
    before = torch.arange(100, dtype=torch.float32)
    x = before.clone()
    for fn in ALGORITHMS:
        try:
            fn(x, workspace=small)                  # 400 bytes into slots of 64
        except ValueError as exc:
            errors.append(str(exc))
    try:
        one_shot_all_reduce(torch.ones(1).expand(8))
    except ValueError as exc:
        errors.append(str(exc))
    return errors, torch.equal(x, before), small.epoch


def test_a_tensor_too_large_for_the_slots_and_an_expanded_tensor_are_refused_before_anything_changes():
    for rank, (errors, unchanged, epoch) in enumerate(launch.run(_bad_input, 2, timeout=WORLD_TIMEOUT)):
        assert len(errors) == 3, errors
        assert all("does not fit this workspace's slots of 64 bytes" in e for e in errors[:2]), errors
        assert "share memory" in errors[2]
        assert unchanged and epoch == 0             # no barrier was entered, the tensor is as it was


# ---- the two hazards, each failing without its guard --------------------------------------

def _wait_for(condition, seconds: float = 20.0):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the test's pause waited too long")
        time.sleep(0.001)


def _slot_overwritten(two_buffers: bool, fn_name: str):
    """Rank 1 is held before its last reads of the first call (the one-shot's reduce, the
    two-shot's gather) until rank 0 has written its next input and posted its next barrier:
    with one buffer, it then reads rank 0's next input instead of this call's."""
    fn = one_shot_all_reduce if fn_name == "one_shot" else two_shot_all_reduce
    last_reads = "read" if fn_name == "one_shot" else "gather"
    ws = SharedWorkspace(None, 4096, two_buffers=two_buffers, timeout=20.0)
    rank = dist.get_rank()
    held = []

    def hold_rank_1(point, w):
        if point == last_reads and rank == 1 and not held:
            held.append(w.epoch)
            _wait_for(lambda: int(w.flags[0]) > held[0])       # rank 0 is in its next call
    ws.pause = hold_rank_1
    first = torch.full((64,), 1 + rank, dtype=torch.int64)      # 1 + 2 = 3
    second = torch.full((64,), 100 * (1 + rank), dtype=torch.int64)
    fn(first, workspace=ws)
    fn(second, workspace=ws)
    return first.tolist(), second.tolist()


@pytest.mark.parametrize("fn_name", ["one_shot", "two_shot"])
def test_a_slot_reused_at_once_is_overwritten_before_a_slow_peer_reads_it_and_two_buffers_prevent_it(fn_name):
    guarded = launch.run(_slot_overwritten, 2, args=(True, fn_name), timeout=WORLD_TIMEOUT)
    assert all(first == [3] * 64 and second == [300] * 64 for first, second in guarded)
    unguarded = launch.run(_slot_overwritten, 2, args=(False, fn_name), timeout=WORLD_TIMEOUT)
    first_on_1 = unguarded[1][0]
    if fn_name == "one_shot":                       # rank 1 summed rank 0's *second* input with its first
        assert first_on_1 == [100 + 2] * 64, first_on_1
    else:                                           # rank 1 gathered rank 0's second input as chunk 0
        assert first_on_1 == [100] * 32 + [3] * 32, first_on_1
    assert unguarded[0][0] == [3] * 64              # rank 0 read before anything was overwritten


def _flag_reset_too_soon(epochs: bool, marker: str):
    """Rank 1 raises its flag, then is held until rank 0 has passed the barrier (naive
    flags: rank 0 has then reset its flag to 0); only then does it look at the flags. Rank 0
    says it has passed by creating ``marker`` (a flag's 0 alone cannot tell "not raised yet"
    from "raised and reset")."""
    ws = SharedWorkspace(None, 4096, epochs=epochs, timeout=1.0)
    rank = dist.get_rank()

    def hold_rank_1(point, w):
        if point == "read" and rank == 0:
            Path(marker).touch()                    # past the barrier: its flag is reset (naive)
        if point == "posted" and rank == 1:
            if epochs:
                time.sleep(0.2)                     # whatever rank 0 does meanwhile, its flag stays up
            else:
                _wait_for(lambda: Path(marker).exists() and int(w.flags[0]) == 0)
    ws.pause = hold_rank_1
    x = torch.full((8,), 1 + rank, dtype=torch.int64)
    try:
        one_shot_all_reduce(x, workspace=ws)
    except BarrierTimeout as exc:
        return str(exc)
    return x.tolist()


def test_a_flag_reset_before_a_slow_peer_looked_hangs_it_and_epoch_flags_do_not(tmp_path):
    marker = str(tmp_path / "rank-0-passed")
    assert launch.run(_flag_reset_too_soon, 2, args=(True, marker), timeout=WORLD_TIMEOUT) == [[3] * 8, [3] * 8]
    Path(marker).unlink()
    rank_0, rank_1 = launch.run(_flag_reset_too_soon, 2, args=(False, marker), timeout=WORLD_TIMEOUT)
    assert rank_0 == [3] * 8                        # it passed, and reset its flag on the way out
    assert isinstance(rank_1, str) and "rank 1 waited" in rank_1 and "group rank(s) [0] never arrived" in rank_1, rank_1


def _home_handed_back_early(closing: bool):
    """The two-shot at home, twice. Rank 1 is held before its gather until rank 0 is in its
    next call; meanwhile rank 0 has written its next input into its home. Without the
    closing barrier rank 0 got there: rank 1 gathers that next input as chunk 0."""
    ws = SharedWorkspace(None, 4096, home=True, closing=closing, timeout=20.0)
    rank = dist.get_rank()
    held = []

    def hold_rank_1(point, w):
        if point == "gather" and rank == 1 and not held:
            held.append(w.epoch)
            _wait_for(lambda: int(w.flags[0]) > held[0])       # rank 0 has raised its flag again
    ws.pause = hold_rank_1
    home = ws.home(64, torch.int64)
    home.fill_(1 + rank)                                        # 1 + 2 = 3
    two_shot_all_reduce(home, workspace=ws)
    first = home.tolist()
    home.fill_(100 * (1 + rank))                                # the next input, written at once
    two_shot_all_reduce(home, workspace=ws)
    return first, home.tolist()


def test_a_home_handed_back_before_a_slow_peer_read_it_is_overwritten_and_the_closing_barrier_prevents_it():
    guarded = launch.run(_home_handed_back_early, 2, args=(True,), timeout=WORLD_TIMEOUT)
    assert all(first == [3] * 64 and second == [300] * 64 for first, second in guarded), guarded
    unguarded = launch.run(_home_handed_back_early, 2, args=(False,), timeout=WORLD_TIMEOUT)
    assert unguarded[1][0] == [100] * 32 + [3] * 32, unguarded[1][0]    # rank 0's next input as chunk 0
    assert unguarded[0][0] == [3] * 64


def test_a_home_is_refused_where_there_is_none_or_it_would_not_fit():
    def refusals():
        errors = []
        for ws, numel in ((SharedWorkspace(None, 256), 8), (SharedWorkspace(None, 256, home=True), 65)):
            try:
                ws.home(numel, torch.float32)
            except ValueError as exc:
                errors.append(str(exc))
        return errors
    for errors in launch.run(refusals, 2, timeout=WORLD_TIMEOUT):
        assert "has no homes; make it with home=True" in errors[0], errors
        assert "does not fit this workspace's homes of 256 bytes" in errors[1], errors


# ---- the same bits on every rank, and the model --------------------------------------------

def _random_floats_in_rank_order():
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(10_001, generator=g) * 1e3
    inputs = [torch.randn(10_001, generator=torch.Generator().manual_seed(r)) * 1e3
              for r in range(dist.get_world_size())]
    by_order = inputs[0].clone()
    for other in inputs[1:]:
        by_order += other
    one, two = x.clone(), x.clone()
    one_shot_all_reduce(one)
    two_shot_all_reduce(two)
    return one.view(torch.int32), two.view(torch.int32), by_order.view(torch.int32)


def test_every_rank_adds_in_rank_order_and_ends_with_the_same_bits():
    results = launch.run(_random_floats_in_rank_order, 3, timeout=WORLD_TIMEOUT)
    for one, two, by_order in results:
        assert torch.equal(one, by_order) and torch.equal(two, by_order)


def test_the_model_puts_the_one_shot_first_for_small_tensors_and_the_two_shot_for_large():
    link = SharedLink(sigma=5e-6, rho=1e-10, omega=1e-10)
    sizes = [2 ** k for k in range(10, 31)]
    n = crossover(lambda s: one_shot_seconds(s, 4, link), lambda s: two_shot_seconds(s, 4, link), sizes)
    # σ = (p − 1)·n·ρ − 2(p − 1)/p·n·ρ = 1.5·n·ρ at p = 4: n = σ / (1.5 ρ) ≈ 33 kB -> 64 KiB
    assert n == 1 << 16
    assert crossover(lambda s: one_shot_seconds(s, 2, link), lambda s: two_shot_seconds(s, 2, link), sizes) is None
    sweep = [4 << 10 << 2 * k for k in range(8)]
    fitted = fit_shared(4, sweep, [one_shot_seconds(n, 4, link) for n in sweep],
                        [two_shot_seconds(n, 4, link) for n in sweep])
    assert fitted.sigma == pytest.approx(5e-6, rel=1e-3) and fitted.rho == pytest.approx(1e-10, rel=1e-3)
    assert fitted.omega == pytest.approx(1e-10, rel=1e-3)


# ---- the promises: a timeout that fires, nothing left behind, mismatches refused ----------

class _Clock:
    """A clock that only moves when the barrier naps: a 30 s wait in a few milliseconds."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_a_barrier_whose_peer_never_comes_gives_up_at_its_timeout_naming_it_and_the_epochs(monkeypatch):
    from collectives.symmetric import shared

    clock = _Clock()
    monkeypatch.setattr(shared, "time", clock)
    monkeypatch.setattr(shared.os, "sched_yield", lambda: None)
    ws = SharedWorkspace.__new__(SharedWorkspace)          # one rank's view of a world of 3, no world needed
    ws.rank, ws.size, ws.epoch, ws.epochs, ws.timeout, ws.pause = 0, 3, 4, True, 30.0, None
    ws.flags = torch.tensor([4, 4, 3])                     # rank 2 sits one barrier behind
    with pytest.raises(BarrierTimeout) as caught:
        shared.flag_barrier(ws)                            # the naps grow, but never past 1 ms
    message = str(caught.value)
    assert 30.0 <= clock.now < 31.0, clock.now
    assert "rank 0 waited 30.0 s" in message and "group rank(s) [1, 2] never arrived" in message, message
    assert "the epochs the flags hold: rank 0: 5, rank 1: 4, rank 2: 3" in message, message


def _die_in_the_rendezvous(shm_dir: str, dying: int, marker: str):
    """Every rank makes a workspace in ``shm_dir``; rank ``dying`` is killed (SIGKILL) in the
    rendezvous's first message -- rank 1 only once rank 0 is in it too."""
    import os
    import signal

    module = sys.modules["collectives.symmetric.workspace"]     # the module, not the function it exports
    module.SHM_DIR = shm_dir
    original = dist.broadcast

    def broadcast(*args, **kwargs):
        if dist.get_rank() == dying:
            if dying == 1:
                _wait_for(lambda: Path(marker).exists())
            os.kill(os.getpid(), signal.SIGKILL)
        Path(marker).touch()
        return original(*args, **kwargs)
    dist.broadcast = broadcast
    SharedWorkspace(None, 4096)


@pytest.mark.parametrize("dying", [0, 1])
def test_a_rank_killed_in_the_rendezvous_leaves_nothing_in_shared_memory(tmp_path, dying):
    shm = tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(launch.RankError):
        launch.run(_die_in_the_rendezvous, 2, args=(str(shm), dying, str(tmp_path / "in")), timeout=WORLD_TIMEOUT)
    assert list(shm.iterdir()) == [], "a segment outlived its world"


def _disagreements():
    rank = dist.get_rank()
    errors = []
    ws = SharedWorkspace(None, 4096)
    for tensor in (torch.ones(8 if rank == 0 else 4), torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int32)):
        for fn in ALGORITHMS:
            try:
                fn(tensor, workspace=ws)
            except ValueError as exc:
                errors.append(str(exc))
    try:
        fn(torch.ones(4), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX, workspace=ws)
    except ValueError as exc:
        errors.append(str(exc))
    try:
        SharedWorkspace(None, 64 if rank == 0 else 128)
    except ValueError as exc:
        errors.append(str(exc))
    after = torch.full((5,), 1 + rank)                       # and the workspace still works
    one_shot_all_reduce(after, workspace=ws)
    return errors, after.tolist()


def test_ranks_that_pass_different_sizes_dtypes_ops_or_capacities_all_raise_instead_of_reducing_garbage():
    for rank, (errors, after) in enumerate(launch.run(_disagreements, 2, timeout=WORLD_TIMEOUT)):
        assert len(errors) == 6, errors
        assert all("the ranks passed different tensors or ops" in e for e in errors[:5]), errors
        assert "rank 0: 32 bytes of torch.float32" in errors[0] and "rank 1: 16 bytes" in errors[0], errors[0]
        assert ("rank 1: 16 bytes of another dtype" if rank == 0 else "rank 0: 16 bytes of another dtype") in errors[2]
        assert "another op or algorithm" in errors[4], errors[4]
        assert "same capacity" in errors[5] and "rank 1: slots of 128 bytes" in errors[5], errors[5]
        assert after == [3] * 5


def _two_worlds(store_path: str):
    """A world of 3, then -- in the same processes -- a world of ranks 0 and 1 alone."""
    rank = dist.get_rank()
    first = torch.full((4,), 10 ** rank, dtype=torch.int64)
    one_shot_all_reduce(first)                                 # the world's cached workspace
    dist.destroy_process_group()
    if rank == 2:
        return first.tolist(), None, None
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    size = workspace(None, 32).size                            # not the old world's, of 3 ranks
    second = torch.full((4,), 10 ** rank, dtype=torch.int64)
    two_shot_all_reduce(second)
    return first.tolist(), size, second.tolist()


def test_a_new_world_in_the_same_process_gets_a_new_workspace(tmp_path):
    results = launch.run(_two_worlds, 3, args=(str(tmp_path / "store"),), timeout=WORLD_TIMEOUT)
    assert [first for first, _, _ in results] == [[111] * 4] * 3
    assert [(size, second) for _, size, second in results] == [(2, [11] * 4), (2, [11] * 4), (None, None)]


def _two_threads():
    import threading

    rank = dist.get_rank()
    results = {0: [], 1: []}

    def calls(thread):
        for k in range(40):
            x = torch.full((999,), 1 if thread == 0 else 1000, dtype=torch.int64)
            two_shot_all_reduce(x)              # calls pair in the order each rank takes them
            results[thread].append(sorted(set(x.tolist())))
    threads = [threading.Thread(target=calls, args=(t,)) for t in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rank, results


def test_two_threads_of_one_rank_take_turns_and_never_tear_a_result():
    for rank, results in launch.run(_two_threads, 2, timeout=WORLD_TIMEOUT):
        for thread, got in results.items():
            assert len(got) == 40
            torn = [values for values in got if values not in ([2], [1001], [2000])]
            assert not torn, f"rank {rank}, thread {thread}: {len(torn)} torn results, e.g. {torn[0]}"


def test_a_workspace_refuses_a_processor_that_may_reorder_stores(monkeypatch):
    module = sys.modules["collectives.symmetric.workspace"]
    monkeypatch.setattr(module.platform, "machine", lambda: "aarch64")
    with pytest.raises(RuntimeError, match=r"aarch64.*x86-64 keeping them in order \(TSO\)"):
        SharedWorkspace(None, 64)                         # refused before any message: no world needed


def _five_ranks_agree():
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(10_001, generator=g) * 1e3
    one, two = x.clone(), x.clone()
    one_shot_all_reduce(one)
    two_shot_all_reduce(two)
    return one.view(torch.int32), two.view(torch.int32)


def test_from_five_ranks_every_rank_still_agrees_bit_for_bit_and_the_page_says_exactly_that():
    results = launch.run(_five_ranks_agree, 5, timeout=WORLD_TIMEOUT)
    for one, two in results:
        assert torch.equal(one, results[0][0]) and torch.equal(two, results[0][1])   # each algorithm: one answer
    page = (Path(__file__).parents[1] / "docs" / "lessons" / "12-symmetric.md").read_text()
    assert "Every rank reduces in rank order" not in page
    assert "never from one rank to another" in page


# ---- the benchmark, and the GPU half's import safety ----------------------------------------

def test_a_tiny_cpu_benchmark_checks_every_algorithm_and_writes_its_times_and_record(tmp_path, capsys):
    from collectives.course.benchmarks import symmetric as bench

    code = bench.main(["--world", "2", "--sizes", "4K,64K", "--iters", "3", "--json", str(tmp_path / "cpu.json"),
                       "--record", "12-tiny", "--img", str(tmp_path)])
    assert code == 0
    saved = json.loads((tmp_path / "cpu.json").read_text())
    assert saved["checked"] == {"ring": True, "one_shot": True, "two_shot": True, "two_shot_home": True}
    assert set(saved["runs"]["float32"]) == {"gloo", "ring", "one_shot", "two_shot", "two_shot_home"}
    assert all(len(v) == 2 and min(v) > 0 for v in saved["runs"]["float32"].values())
    assert {"command", "date", "device", "torch", "commit"} <= set(saved["meta"])
    record = json.loads((tmp_path / "12-tiny.json").read_text())
    assert {c["id"] for c in record["comparisons"]} >= {"measured", "one-to-two-model", "model"}
    assert (tmp_path / "12-tiny.svg").exists()


def test_the_gpu_half_imports_without_cuda_or_triton_and_never_names_multicast():
    code = ("import sys, collectives.symmetric, collectives.symmetric.gpu as g; "
            "assert 'triton' not in sys.modules; print(g.triton_available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from pathlib import Path

    import collectives.symmetric as package
    for path in Path(package.__file__).parent.glob("*.py"):
        text = path.read_text()
        forbidden = ("multimem" + "_", "cuMulticast" + "Create")     # spelled apart: this file is searched too
        assert not any(word in text for word in forbidden), path


class _FakeKernel:
    """A Triton kernel as the launcher sees it: ``kernel[grid](...)`` compiles (here: counts)
    and launches, returning a compiled kernel whose ``run`` launches directly."""

    def __init__(self, run_raises=False):
        self.jit_calls, self.direct_calls, self.run_raises = [], [], run_raises
        kernel = self

        class Compiled:
            function, packed_metadata = "function", "metadata"

            def run(self, *args):
                if kernel.run_raises:
                    raise TypeError("function takes exactly 14 arguments (12 given)")
                kernel.direct_calls.append(args)
        self.compiled = Compiled()

    def __getitem__(self, grid):
        def launch(*args, num_warps, **constexprs):
            self.jit_calls.append((grid, args, constexprs, num_warps))
            return self.compiled
        return launch


def test_the_triton_launcher_dispatches_once_per_shape_then_launches_the_compiled_kernel(monkeypatch):
    from collectives.symmetric.triton_launch import Launcher, int_shape
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 7})())
    kernel = _FakeKernel()
    launcher = Launcher(kernel)
    constexprs = {"RANK": 0, "WORLD": 2, "BLOCK": 8192}
    for numel in (4096, 4096, 8192):
        launcher.launch((3,), ("bf16", int_shape(numel)), ("ptrs", numel), constexprs, 16)
    launcher.launch((3,), ("bf16", int_shape(17)), ("ptrs", 17), constexprs, 16)     # another shape: the JIT
    assert len(kernel.jit_calls) == 2
    assert kernel.jit_calls[0] == ((3,), ("ptrs", 4096), constexprs, 16)
    # the grid, the stream, then every argument in the signature's order, constexprs last
    assert kernel.direct_calls == [(3, 1, 1, 7, "function", "metadata", None, None, None, "ptrs", n, 0, 2, 8192)
                                   for n in (4096, 8192)]
    assert int_shape(1) == (True, False, True) and int_shape(1 << 31) == (False, True, False)


def test_the_triton_launcher_goes_back_to_the_jit_when_the_compiled_kernel_refuses_its_arguments(monkeypatch):
    from collectives.symmetric.triton_launch import Launcher
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 7})())
    kernel = _FakeKernel(run_raises=True)
    launcher = Launcher(kernel)
    for _ in range(3):
        launcher.launch((1,), ("k",), ("ptrs", 16), {"RANK": 0}, 8)
    assert len(kernel.jit_calls) == 3 and not launcher.direct and not launcher.compiled
    assert launcher.why.startswith("the compiled kernel refused its arguments: TypeError"), launcher.why


def test_an_empty_hook_chain_is_no_hook_and_a_set_hook_sends_every_launch_to_the_jit(monkeypatch):
    import types

    from collectives.symmetric import triton_launch
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 7})())

    class Chain:         # Triton 3.4 and later: an empty chain of hooks where there used to be None
        def __init__(self):
            self.calls = []
    runtime = types.SimpleNamespace(launch_enter_hook=Chain(), launch_exit_hook=Chain())
    monkeypatch.setattr(triton_launch, "_runtime", lambda: runtime)       # triton.knobs.runtime
    kernel = _FakeKernel()
    launcher = triton_launch.Launcher(kernel)
    for _ in range(3):
        launcher.launch((1,), ("k",), ("ptrs", 16), {"RANK": 0}, 8)
    assert launcher.counts == {"direct": 2, "jit": 1} and launcher.why is None
    runtime.launch_enter_hook.calls.append(print)          # a profiler's hook: the JIT must call it
    launcher.launch((1,), ("k",), ("ptrs", 16), {"RANK": 0}, 8)
    assert launcher.counts == {"direct": 2, "jit": 2} and "hook" in launcher.why
    runtime.launch_enter_hook = None                        # Triton before 3.4: None, or a function
    runtime.launch_exit_hook = print
    launcher.launch((1,), ("k",), ("ptrs", 16), {"RANK": 0}, 8)
    assert launcher.counts["jit"] == 3


class _StandIn:
    """torch's symmetric memory as the GPU code sees it (a buffer per rank, every peer's as a
    tensor, a barrier), played by the CPU workspace: the GPU algorithms' index arithmetic
    and phases, checked where there is no GPU."""

    def __init__(self, numel: int):
        from collectives.symmetric import flag_barrier
        self.ws = SharedWorkspace(None, numel * 8)
        self.rank, self.size = self.ws.rank, self.ws.size
        self.peers = [self.ws.slot(0, q, torch.int64, numel) for q in range(self.size)]
        self.buffer = self.peers[self.rank]
        self.handle = type("Handle", (), {"barrier": lambda _, channel=0: flag_barrier(self.ws)})()


def _gpu_algorithms_on_a_cpu_stand_in():
    from collectives.symmetric.gpu import torch_one_shot, torch_two_shot
    rank, wrong = dist.get_rank(), []
    for n in (1, 2, 1001, 4099):
        buf = _StandIn(n)
        values = (torch.arange(n) * (rank + 3)) % 7 + rank
        expected = values.clone()
        dist.all_reduce(expected)
        out = torch.zeros(n, dtype=torch.int64)
        buf.buffer.copy_(values)
        torch_one_shot(buf, n, out)
        buf.buffer.copy_(values)
        torch_two_shot(buf, n)
        wrong += [f"one-shot n={n}"] * (not torch.equal(out, expected))
        wrong += [f"two-shot n={n}"] * (not torch.equal(buf.buffer, expected))
    try:
        torch_one_shot(buf, 8, buf.buffer[4:])          # out in the own buffer, which peers read: refused
        wrong.append("out aliasing the own buffer was not refused")
    except ValueError as exc:
        wrong += [] if "out overlaps this rank's own symmetric buffer" in str(exc) else [str(exc)]
    return wrong


def test_the_plain_torch_gpu_algorithms_are_right_on_a_cpu_stand_in_for_symmetric_memory():
    assert launch.run(_gpu_algorithms_on_a_cpu_stand_in, 3, timeout=WORLD_TIMEOUT) == [[], [], []]


def _gpu_checks():
    from collectives.course.benchmarks.symmetric_gpu import check_rank
    return check_rank(["bfloat16", "float32"])


@pytest.mark.gpu
def test_on_gpus_every_algorithm_matches_nccl_bit_for_bit():
    from collectives.symmetric.gpu import NO_MULTICAST
    results = launch.run(_gpu_checks, 2, backend="nccl", timeout=300, env=dict(NO_MULTICAST))
    for rank, result in enumerate(results):
        for dtype, per in result["checked"].items():
            mine = {k: v for k, v in per.items() if not k.startswith("symm_")}   # torch's may refuse a size
            assert mine and all(v is True for v in mine.values()), f"rank {rank}, {dtype}: {per}"
            assert all(v is not False for v in per.values()), f"rank {rank}, {dtype}: a wrong value: {per}"
            assert "nccl_symmetric" in per or any("NCCL window" in s for s in result["skipped"]), result


def _fake_triton():
    """``triton`` and ``triton.language`` as the lesson's kernel modules use them at import:
    ``@triton.jit`` (here: a :class:`_FakeKernel` per kernel), ``cdiv`` and the element types."""
    import types

    triton = types.ModuleType("triton")
    triton.jit = lambda fn=None, **options: _FakeKernel() if fn is not None else (lambda fn: _FakeKernel())
    triton.cdiv = lambda a, b: -(-a // b)
    tl = types.ModuleType("triton.language")
    for name in ("float32", "bfloat16", "float16", "int32", "int64", "uint64"):
        setattr(tl, name, name)
    tl.constexpr = str        # an annotation, and the barrier's PTX text wrapped as a compile-time constant
    triton.language = tl
    return triton, tl


@contextlib.contextmanager
def fake_kernels(monkeypatch):
    """Lesson 12's kernel modules imported over a fake Triton (no GPU, no compiler): yields
    ``(triton_allreduce, triton_launch)``, and forgets both modules afterwards."""
    triton, tl = _fake_triton()
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.language", tl)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    names = ["collectives.symmetric.triton_barrier", "collectives.symmetric.triton_allreduce"]
    try:
        from collectives.symmetric import triton_allreduce as ta
        from collectives.symmetric import triton_launch
        monkeypatch.setattr(triton_launch, "_runtime", lambda: None)       # no launch hooks
        monkeypatch.setattr(ta, "_pad_words", lambda: 2048)
        ta._PLANS.clear()
        yield ta, triton_launch
    finally:
        for name in names:
            sys.modules.pop(name, None)
        import collectives.symmetric as package
        for name in names:
            if hasattr(package, name.rsplit(".", 1)[1]):
                delattr(package, name.rsplit(".", 1)[1])


def test_the_triton_kernels_build_each_launch_once_and_keep_no_tensor_of_the_caller(monkeypatch):
    import gc
    import types
    import weakref

    with fake_kernels(monkeypatch) as (ta, _):
        handle = types.SimpleNamespace(buffer_ptrs_dev=1000, signal_pad_ptrs_dev=2000, rank=1, world_size=2)
        one, two = ta._ONE_SHOT.kernel, ta._TWO_SHOT.kernel
        out = torch.zeros(64)
        for _ in range(3):
            ta.one_shot(handle, 64, torch.float32, out)
            ta.two_shot(handle, 64, torch.float32, gather="load")
        assert len(one.jit_calls) == len(two.jit_calls) == 1          # the dispatch once, then direct
        assert len(one.direct_calls) == len(two.direct_calls) == 2
        grid, args, constexprs, warps = one.jit_calls[0]
        errors = ta.errors_of(handle)                  # the error buffer's address and the bound follow the data
        assert args == (1000, 2000, out, 64, errors.address, ta.SPIN_LIMIT) and constexprs["RANK"] == 1
        assert warps == ta.WARPS
        assert constexprs["BLOCK"] == ta.BLOCK_BYTES // 4              # a block is so many bytes of float32
        # the grid, the stream, the kernel, then its arguments in order and the constexprs
        assert one.direct_calls[0][3] == 7 and one.direct_calls[0][9:15] == (1000, 2000, out, 64, errors.address,
                                                                             ta.SPIN_LIMIT)
        assert two.direct_calls[0][9:15] == (1000, 2000, 64, 32, errors.address, ta.SPIN_LIMIT)   # numel, chunk
        store = ta._TWO_SHOT_STORE.kernel                                  # the gather by stores:
        ta.two_shot(handle, 64, torch.float32, gather="store")             # its own kernel and plan
        ta.two_shot(handle, 64, torch.float32)                             # the default: the same plan
        assert len(store.jit_calls) == 1 and len(store.direct_calls) == 1
        assert len(store.jit_calls) == 1 and len(two.jit_calls) == 1 and len(two.direct_calls) == 2
        with pytest.raises(ValueError, match="gather"):
            ta.two_shot(handle, 64, torch.float32, gather="pull")
        # the barrier is a compile-time switch: one thread per peer unless asked, the serial its own compile
        assert two.jit_calls[0][2]["PARALLEL"] is True
        ta.two_shot(handle, 64, torch.float32, gather="load", barrier="serial")
        assert len(two.jit_calls) == 2 and two.jit_calls[1][2]["PARALLEL"] is False
        # only the barriers that hand over data are ordered, unless every one is asked for
        assert two.jit_calls[0][2]["ORDER_ALL"] is False and one.jit_calls[0][2]["ORDER_ALL"] is False
        ta.two_shot(handle, 64, torch.float32, gather="load", fences="all")
        assert len(two.jit_calls) == 3 and two.jit_calls[2][2]["ORDER_ALL"] is True
        # the plan bakes in the rank and the world size: a handle of the same pointers on another rank
        # (or world) gets its own plan, never this one's
        for other in (types.SimpleNamespace(buffer_ptrs_dev=1000, signal_pad_ptrs_dev=2000, rank=0, world_size=2),
                      types.SimpleNamespace(buffer_ptrs_dev=1000, signal_pad_ptrs_dev=2000, rank=1, world_size=4)):
            ta.two_shot(other, 64, torch.float32, gather="load", fences="all")
            assert (two.jit_calls[-1][2]["RANK"], two.jit_calls[-1][2]["WORLD"]) == (other.rank, other.world_size)
        assert len(two.jit_calls) == 5
        # the kernel's words start after torch's barrier channels 0 and 1: 2 · p words fewer for programs
        with pytest.raises(ValueError, match="after torch's barrier channels 0 and 1"):
            ta.one_shot(handle, 64, torch.float32, torch.zeros(64), programs=1023)
        # out inside this rank's own symmetric buffer (its peers read it meanwhile) is refused
        own = torch.zeros(64)
        placed = types.SimpleNamespace(buffer_ptrs_dev=1000, signal_pad_ptrs_dev=2000, rank=1, world_size=2,
                                       buffer_ptrs=[0, own.data_ptr()], buffer_size=256)
        with pytest.raises(ValueError, match="out overlaps this rank's own symmetric buffer"):
            ta.one_shot(placed, 64, torch.float32, own[8:])
        ta.one_shot(placed, 64, torch.float32, torch.zeros(64))     # elsewhere: launched
        for name, value in (("barrier", "spin"), ("fences", "some")):     # both switches refuse what they lack
            for bad in (lambda: ta.two_shot(handle, 64, torch.float32, **{name: value}),
                        lambda: ta.one_shot(handle, 64, torch.float32, torch.zeros(64), **{name: value})):
                with pytest.raises(ValueError, match=name):
                    bad()
        # the caller's output is passed on every call, never kept by the cached plan
        kept = weakref.ref(out)
        del out, grid, args
        one.direct_calls.clear()
        one.jit_calls.clear()
        gc.collect()
        assert kept() is None, "a cached launch plan keeps the caller's output tensor alive"
        with pytest.raises(ValueError, match="power of two"):
            ta.one_shot(handle, 64, torch.float32, torch.zeros(64), block=100)


# ---- the GPU benchmark's rule, where no GPU is needed ----------------------------------------

def test_the_gpu_benchmark_refuses_what_the_rule_lacks_and_degrades_clearly_without_nccl_windows(tmp_path):
    import types

    from collectives.course.benchmarks import symmetric_gpu as bench
    from collectives.course.benchmarks import symmetric_record

    with pytest.raises(ValueError, match="launch must be one of"):
        bench.gpu_rank([4096], ["float32"], 3, "replayed-for-one-side")
    with pytest.raises(ValueError, match="inputs must be one of"):
        bench.contenders(16, torch.float32, "untimed")
    # NCCL's symmetric kernels: where torch cannot register a window the contender is skipped, with why
    lacking = types.SimpleNamespace(_get_backend=lambda device: types.SimpleNamespace())
    assert bench.nccl_window(16, torch.float32, lacking) == (None, "NCCL window registration (no mem_allocator / "
                                                             "register_mem_pool in this torch)")

    class Refusing:               # torch 2.11 built against an NCCL without the allocator raises on the lookup
        @property
        def mem_allocator(self):
            raise RuntimeError("NCCL mem allocator is not supported in this NCCL version")
    tensor, why = bench.nccl_window(16, torch.float32, types.SimpleNamespace(_get_backend=lambda device: Refusing()))
    assert tensor is None and "not supported in this NCCL version" in why
    # copied inputs: a contender in symmetric memory copies the caller's tensor in and the result out, timed
    buffer, src = torch.zeros(8), torch.arange(8.0)
    bench._copied(buffer, src, lambda n: buffer[:n].mul_(2), False)(5)
    assert src.tolist() == [0, 2, 4, 6, 8, 5, 6, 7] and buffer[:5].tolist() == [0, 2, 4, 6, 8]
    # the record says how every contender was launched and what was counted, and sets no aims
    result = {"backend": "nccl", "world": 2, "sizes": [4096, 1 << 20], "iters": 3, "launch": "graph",
              "inputs": "copied", "rule": "docs/benchmarks.md#the-rule-for-fair-gpu-comparisons", "checked": {},
              "skipped": ["NCCL window registration (...)"], "meta": {"command": "test"},
              "runs": {"bfloat16": {"nccl": [2e-5, 4e-5], "triton_two_shot_store": [1e-5, 3e-5],
                                    "symm_two_shot": [1e-5, 3e-5]}},
              "spread": {"bfloat16": {"nccl": [[1e-5, 3e-5], [3e-5, 5e-5]]}}}
    saved = json.loads(symmetric_record.save_record(result, "12-rule", tmp_path).with_suffix(".json").read_text())
    text = json.dumps(saved)
    assert '"launch": "graph"' in text and '"inputs": "copied"' in text and "the-rule-for-fair" in text
    assert "aim" not in text.lower(), "a record of measurements names no aims"


def _no_proc_for_peers():
    """Rank 1 cannot open rank 0's /proc path (as in another process namespace): the
    rendezvous is made again by name, and works; no name is left afterwards."""
    import os

    module = sys.modules["collectives.symmetric.workspace"]
    made = []
    mkstemp = module.tempfile.mkstemp

    def recorded(*args, **kwargs):
        fd, path = mkstemp(*args, **kwargs)
        made.append(path)
        return fd, path
    module.tempfile.mkstemp = recorded
    if dist.get_rank() == 1:
        real = module.SharedWorkspace._open
        module.SharedWorkspace._open = staticmethod(
            lambda path, device, inode: -1 if path.startswith("/proc/") else real(path, device, inode))
    ws = SharedWorkspace(None, 4096)
    x = torch.full((8,), 1 + dist.get_rank(), dtype=torch.int64)
    one_shot_all_reduce(x, workspace=ws)
    return x.tolist(), len(made), [p for p in made if os.path.exists(p)]


def test_a_peer_that_cannot_reach_rank_0s_proc_gets_the_segment_by_name():
    (values_0, made, left), (values_1, _, _) = launch.run(_no_proc_for_peers, 2, timeout=WORLD_TIMEOUT)
    assert values_0 == values_1 == [3] * 8
    assert made == 2 and left == [], (made, left)        # the /proc attempt, then the named one: both gone
