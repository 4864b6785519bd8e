"""Lesson 5: fused buffers -- the reference's own extras, beyond the graded tasks.

The graded tasks (plan_layout, the copies, fused_all_reduce, FusedAllReducer) are judged
outside the student's process by :mod:`collectives.course.grading.tasks.lesson05`. Here: float16
on the wire and its error bound, ``bind``, the fast reducer's reuse of a known list, a
training loop, the stream checker catching a mis-ordered reducer, the host row copies;
everything that communicates runs in one world of 4 ranks (``reference_extras``).
"""

import math
import weakref

import pytest
import torch
import torch.distributed as dist

from collectives import launch, trace, verify
from collectives.core.ops import ReduceOp
from collectives.course.impl import resolve

LESSON = 5
WORLD = 4

# The settings most checks run with: a tensor of 4 KiB or more goes on its own; the others
# share buffers of 2 KiB (512 float32 elements).
THRESHOLD, BUFFER = 4096, 2048


def _values(shape, dtype, op, rank, seed):
    numel = math.prod(shape)
    return verify.make_values(verify.Case(numel, dtype, op), rank, seed).view(shape)


def _compare_all(expected, got, what):
    for i, (e, g) in enumerate(zip(expected, got)):
        problem = verify.compare(e, g)
        if problem:
            raise AssertionError(f"{what}, tensor {i} ({g.dtype}, shape {tuple(g.shape)}): {problem}")


def _check(results, name, fn):
    """Run one check; record "ok", or what went wrong, without stopping the others."""
    try:
        out = fn()
        results[name] = "ok" if out is None else out
    except NotImplementedError as exc:
        results[name] = f"not implemented: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported per check
        results[name] = f"{type(exc).__name__}: {exc}"


def _assert_ok(results, name):
    bad = {rank: r[name] for rank, r in enumerate(results) if r[name] != "ok"}
    assert not bad, f"{name}: " + "; ".join(f"rank {k}: {v}" for k, v in sorted(bad.items()))


# ---------------------------------------------------------------------------------------
# The reference's extras: float16 on the wire, bind(), the fast reducer. Not graded (the graded
# tasks are judged by collectives.course.grading.tasks.lesson05).

def _fp16_bound(p, abs_sum, avg=False):
    """The bound stated in collectives.fused: γ_k·Σ|x| (/p for AVG) + p·2⁻²⁵."""
    u = 2.0 ** -11
    k = p + 1 if avg else p
    gamma = k * u / (1 - k * u)
    return gamma * abs_sum / (p if avg else 1) + p * 2.0 ** -25


def _reference_checks():
    from collectives import fused

    rank, p = dist.get_rank(), dist.get_world_size()
    results = {}
    sizes = (3, 700, 1, 2000, 129)      # 2000 float32 is over the threshold: direct, compressed too

    def random_inputs(r, op):
        return [verify.make_values(verify.Case(n, torch.float32, op, values="random"), r, 5)
                for n in sizes]

    def compressed_within_bound():
        worst = 0.0
        for op in (ReduceOp.SUM, ReduceOp.AVG):
            everyone = [random_inputs(r, op) for r in range(p)]
            tensors = [t.clone() for t in everyone[rank]]
            with trace.recording() as t:
                fused.fused_all_reduce(tensors, op=op, threshold_bytes=THRESHOLD, buffer_bytes=BUFFER,
                                       compress_fp16=True)
            wire = {e.dtype for e in t.collectives()}
            assert wire == {"float16"}, f"expected float16 on the wire, saw {wire}"
            for i, got in enumerate(tensors):
                exact = sum(e[i].double() for e in everyone)
                abs_sum = sum(e[i].double().abs() for e in everyone)
                if op == ReduceOp.AVG:
                    exact = exact / p
                err = (got.double() - exact).abs()
                bound = _fp16_bound(p, abs_sum, avg=op == ReduceOp.AVG)
                assert got.dtype == torch.float32
                assert bool((err <= bound).all()), f"{op} tensor {i}: error {err.max().item():.3g} over the bound"
                worst = max(worst, float((err / bound).max()))
        return worst

    def overflow_falls_back_to_float32():
        small = torch.full((10,), 40000.0)       # 4 ranks: 160000 > 65504, float16 overflows
        big = torch.full((1500,), 1e5)           # over float16's range before any sum (direct)
        fine = torch.full((10,), 1.0)
        with trace.recording() as t:
            fused.fused_all_reduce([small, fine, big], threshold_bytes=THRESHOLD, buffer_bytes=BUFFER,
                                   compress_fp16=True)
        assert bool((small == 40000.0 * p).all()) and bool((big == 1e5 * p).all())
        assert bool((fine == p).all())
        return [(e.dtype, e.numel) for e in t.collectives()]

    def bind_copies_nothing():
        reducer = fused.FastFusedAllReducer(THRESHOLD, BUFFER, torch.device("cpu"))
        tensors = [torch.zeros(n, dtype=d) for n, d in
                   [(200, torch.float32), (3000, torch.float32), (300, torch.float16), (200, torch.float32)]]
        for t in tensors:
            t.copy_(_values(t.shape, t.dtype, ReduceOp.SUM, rank, 9))
        before = [t.clone() for t in tensors]
        reducer.bind(tensors)
        _compare_all(before, tensors, "values kept by bind")
        fused_storages = {tensors[i].untyped_storage().data_ptr() for i in (0, 3)}
        assert len(fused_storages) == 1, "bound float32 tensors must share one buffer"
        for seed in (0, 1):
            for t in tensors:         # write new values the ordinary way: they land in the buffer
                t.copy_(_values(t.shape, t.dtype, ReduceOp.SUM, rank, seed))
            expected = [verify.reference_all_reduce(t) for t in tensors]
            with trace.recording() as t:
                reducer.all_reduce(tensors)
                reducer.wait()
            _compare_all(expected, tensors, f"bound, call {seed + 1}")
            calls = sorted(e.numel for e in t.collectives())
            assert calls == [300, 400, 3000], calls
        try:
            reducer.bind([torch.zeros(10)[::2]])
            raise AssertionError("bind accepted a strided view")
        except ValueError:
            pass

    def repeated_list_reuses_its_plan_until_its_memory_changes():
        reducer = fused.FastFusedAllReducer(threshold_bytes=1 << 20, buffer_bytes=1 << 16)
        ts = [torch.full((5,), float(rank + 1)), torch.ones(3)]
        reducer.all_reduce(ts).wait()
        planned = reducer._recent
        ts[0].fill_(rank + 1)
        ts[1].fill_(1.0)
        reducer.all_reduce(ts).wait()
        assert reducer._recent is planned, "the same list was planned again"
        ts[1].data = torch.full((7,), 2.0)        # same object, new memory and shape
        ts[0].fill_(rank + 1)
        reducer.all_reduce(ts).wait()
        assert reducer._recent is not planned, "a tensor in new memory was not noticed"
        assert ts[0].tolist() == [p * (p + 1) / 2] * 5 and ts[1].tolist() == [2.0 * p] * 7, \
            (ts[0].tolist(), ts[1].tolist())

    _check(results, "compressed bound", compressed_within_bound)
    _check(results, "overflow", overflow_falls_back_to_float32)
    _check(results, "bind", bind_copies_nothing)
    _check(results, "repeated list", repeated_list_reuses_its_plan_until_its_memory_changes)
    _check(results, "training loop", lambda: _training_loop(torch.device("cpu")))
    _check(results, "mis-ordered", lambda: _mis_ordered_reducers_are_caught(rank))
    _check(results, "bound handle", lambda: _bound_handle_is_recognised_without_looking_at_its_tensors(rank))
    return results


def _bound_handle_is_recognised_without_looking_at_its_tensors(rank):
    """bind() returns the list as an immutable handle: passed back, no tensor is looked at
    (KnownList.matches is never called); another list, or a handle of an earlier bind, is
    checked tensor by tensor; under check mode a bound tensor moved out of the buffer is refused."""
    from collectives import fused
    from collectives.core import checkmode
    from collectives.fused import reuse

    looked = []
    matches = reuse.KnownList.matches
    reuse.KnownList.matches = lambda self, tensors: looked.append(len(tensors)) or matches(self, tensors)
    try:
        reducer = fused.FastFusedAllReducer(THRESHOLD, BUFFER, torch.device("cpu"))
        tensors = [torch.zeros(n) for n in (200, 3000, 100, 7)] + [torch.zeros(3) for _ in range(500)]
        bound = reducer.bind(tensors)
        assert isinstance(bound, tuple) and list(bound) == tensors and bound[0] is tensors[0], type(bound)
        for seed in range(3):
            for t in bound:
                t.copy_(_values(t.shape, t.dtype, ReduceOp.SUM, rank, seed))
            expected = [verify.reference_all_reduce(t) for t in bound]
            reducer.all_reduce(bound).wait()
            _compare_all(expected, bound, f"the bound handle, call {seed + 1}")
        assert looked == [], f"the bound handle's tensors were looked at: {looked}"
        reducer.all_reduce(list(bound)).wait()            # another list of the same tensors: checked
        assert looked == [len(tensors)], looked
        again = reducer.bind([torch.zeros(5), torch.zeros(6)])
        for t in bound:                                   # the old handle: an ordinary list now, still right
            t.copy_(_values(t.shape, t.dtype, ReduceOp.SUM, rank, 7))
        expected = [verify.reference_all_reduce(t) for t in bound]
        reducer.all_reduce(bound).wait()
        _compare_all(expected, bound, "an earlier bind's handle")
        again[1].data = torch.zeros(6)                    # moved out of the buffer behind the reducer's back
        checkmode._enabled = True
        try:
            reducer.all_reduce(again).wait()
            raise AssertionError("a bound tensor moved out of its buffer was not refused in check mode")
        except ValueError as exc:
            assert "bound tensor(s) [1] no longer live where bind() put them" in str(exc), exc
        finally:
            checkmode._forget()
    finally:
        reuse.KnownList.matches = matches


def _training_loop(device):
    """A standard loop: zero_grad() (set_to_none=True, the default), backward, all-reduce,
    step. Returns, per step, whether the bound reducer recognised the list. (The model's
    zero_grad() does what the optimizer's does; the update is SGD written out, because
    constructing a torch.optim optimizer imports the compiler: seconds per rank.)"""
    from collectives import fused

    rank, p = dist.get_rank(), dist.get_world_size()
    rtol, atol = verify.tolerance(torch.float32, p)
    data = torch.Generator().manual_seed(rank)

    def make_model():
        torch.manual_seed(0)                      # the same model on every rank
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)).to(device)

    def step(model, reducer, what):
        loss = model(torch.randn(4, 8, generator=data).to(device)).square().mean()
        loss.backward()
        grads = [q.grad for q in model.parameters()]
        expected = [verify.reference_all_reduce(g) for g in grads]
        reducer.all_reduce(grads).wait()
        for i, (e, g) in enumerate(zip(expected, grads)):
            problem = verify.compare(e, g, exact=False, rtol=rtol, atol=atol)
            assert problem is None, f"{what}, gradient {i}: {problem}"
        with torch.no_grad():
            for q in model.parameters():
                q -= 0.1 * q.grad
        return [weakref.ref(g) for g in grads]

    # Passing the gradients as they come: the reducer keeps none of them alive.
    model = make_model()
    reducer = fused.FastFusedAllReducer(THRESHOLD, BUFFER, device)
    last = []
    for k in range(4):
        model.zero_grad()
        held = sum(r() is not None for r in last)
        assert held == 0, f"step {k + 1}: {held} gradients freed by zero_grad() are still alive"
        last = step(model, reducer, f"as they come, step {k + 1}")

    # Bound: the list is recognised, and autograd's own gradients are freed at once.
    model = make_model()
    made = []                                     # registered first: sees autograd's tensor
    for q in model.parameters():
        q.register_post_accumulate_grad_hook(lambda q: made.append(weakref.ref(q.grad)))
    reducer = fused.FastFusedAllReducer(THRESHOLD, BUFFER, device)
    reducer.bind_grads(model.parameters())
    recognised = []
    for k in range(4):
        model.zero_grad()
        step(model, reducer, f"bound, step {k + 1}")
        recognised.append(reducer._known is not None and reducer._known is reducer._bound)
        held = sum(r() is not None for r in made)
        assert held == 0, f"bound, step {k + 1}: {held} of autograd's gradients still alive"
        made.clear()
    return recognised


def _mis_ordered_reducers_are_caught(rank):
    """The reference reducer with one wait taken out, under streams.checking(): what is reported."""
    from collectives import streams
    from collectives.fused import FusedAllReducer

    def without(stream_name):
        with streams.checking(raise_errors=False) as checker:
            reducer = FusedAllReducer(THRESHOLD, BUFFER, torch.device("cpu"))
            stream = {"copy-in": reducer._copy_in, "comm": reducer._comm}[stream_name]
            stream.wait_event = lambda event: None          # the mistake: this stream waits on nothing
            tensors = [_values((400,), torch.float32, ReduceOp.SUM, rank, k) for k in range(6)]
            expected = [verify.reference_all_reduce(t) for t in tensors]
            reducer.all_reduce(tensors)
            reducer.wait()
            _compare_all(expected, tensors, "on CPU the values still come out right")
        return checker.violations

    def never_recorded():
        with streams.checking(raise_errors=False) as checker:
            side = streams.new_stream(torch.device("cpu"), name="side")
            side.wait_event(streams.new_event(torch.device("cpu"), name="done"))
        return checker.violations

    return {"free": without("copy-in"), "filled": without("comm"), "never recorded": never_recorded()}


@pytest.fixture(scope="module")
def reference_extras():
    return launch.run(_reference_checks, WORLD, timeout=60)


def test_a_mis_ordered_reducer_fails_on_cpu(reference_extras):
    for rank, r in enumerate(reference_extras):
        found = r["mis-ordered"]
        assert isinstance(found, dict), f"rank {rank}: {found}"
        # copy-in not waiting for "buffer free": the third flush packs buffer A while the
        # copy-back of the first may still read it
        assert any(v.startswith("cat on copy-in writes memory that _foreach_copy_ on copy-back read")
                   for v in found["free"]), found["free"]
        # comm not waiting for "filled": the all-reduce reads the buffer before the copy is done
        assert any("(issued on comm) reduces memory that cat on copy-in wrote" in v
                   for v in found["filled"]), found["filled"]
        assert found["never recorded"] == [
            "side waits on event done, which was never recorded: the wait orders nothing"]


def test_checking_raises_at_the_end_of_the_block_and_leaves_the_stand_ins_as_they_were():
    from collectives import streams

    cpu = torch.device("cpu")
    with pytest.raises(streams.OrderingError, match="never recorded"):
        with streams.checking():
            streams.new_stream(cpu).wait_event(streams.new_event(cpu))
    assert type(streams.new_stream(cpu)) is streams.NullStream
    assert type(streams.current_stream(cpu)) is streams.NullStream


def test_float16_on_the_wire_stays_within_the_stated_error_bound(reference_extras):
    for rank, r in enumerate(reference_extras):
        worst = r["compressed bound"]
        assert isinstance(worst, float), f"rank {rank}: {worst}"
        assert 0 < worst <= 1, f"rank {rank}: error / bound = {worst}"


def test_float16_overflow_is_all_reduced_again_in_float32(reference_extras):
    for rank, r in enumerate(reference_extras):
        calls = r["overflow"]
        assert isinstance(calls, list), f"rank {rank}: {calls}"
        # the direct tensor (1500 elements, issued first: it comes before the end of the list)
        # and the flush (20) both overflow and are sent again in float32: every rank saw the
        # same inf, so every rank did the same
        assert calls == [("float16", 1500), ("float16", 20), ("float32", 1500), ("float32", 20)], calls


def test_bound_tensors_are_reduced_in_place_without_copies(reference_extras):
    _assert_ok(reference_extras, "bind")


def test_the_handle_bind_returns_is_recognised_without_a_pass_over_its_tensors(reference_extras):
    _assert_ok(reference_extras, "bound handle")


def test_a_repeated_list_reuses_its_plan_and_is_replanned_when_its_memory_changes(reference_extras):
    _assert_ok(reference_extras, "repeated list")


def test_a_training_loop_with_default_zero_grad_gets_the_fast_path_and_frees_its_gradients(
        reference_extras):
    # zero_grad() sets every .grad to None: the reducer must not keep the old ones alive,
    # and with bind_grads the list is the bound one on every step from the second on
    for rank, r in enumerate(reference_extras):
        recognised = r["training loop"]
        assert isinstance(recognised, list), f"rank {rank}: {recognised}"
        assert recognised[1:] == [True, True, True], f"rank {rank}: recognised per step {recognised}"


def _host_rows_round_trip(shapes, dtype):
    """HostRows.of over tensors with guard elements on both sides: gather, then scatter,
    each checked, and nothing beside the tensors written."""
    from collectives.fused.layout import slot_views
    from collectives.fused.reuse import HostRows

    bases = [torch.full((math.prod(s) + 2,), -7).to(dtype) for s in shapes]
    tensors = [b[1:-1].view(s) for b, s in zip(bases, shapes)]    # contiguous, guarded
    for i, t in enumerate(tensors):
        t.copy_(torch.arange(t.numel()).view(t.shape) + 1000 * i)
    numel = sum(t.numel() for t in tensors)
    region = torch.zeros(numel + 5).to(dtype)[2: 2 + numel]
    rows = HostRows.of(tensors, region, slot_views(region, [t.shape for t in tensors]))
    assert rows is not None
    rows.gather()
    assert torch.equal(region, torch.cat([t.reshape(-1) for t in tensors]))
    region.copy_(-torch.arange(numel))
    expected = list(torch.split(region.clone(), [t.numel() for t in tensors]))
    rows.scatter()
    for i, (t, e, b) in enumerate(zip(tensors, expected, bases)):
        assert torch.equal(t.reshape(-1), e), f"tensor {i} not written back"
        assert b[0].item() == -7 and b[-1].item() == -7, f"tensor {i}: bytes beside it were written"


def test_host_rows_copy_mixed_interleaved_sizes_in_and_back_touching_nothing_else():
    # sizes that repeat apart (copied through scratch), 2-D, empty, and one of 1.2 MB that
    # the allocator maps far from the small ones: the rows span both
    shapes = [(10,), (3, 4), (0,), (300_000,), (10,), (7,), (3, 4), (1,)] * 5
    _host_rows_round_trip(shapes, torch.float32)
    _host_rows_round_trip([(1000,)] * 300, torch.float32)      # one length, slots in order
    _host_rows_round_trip([(5,), (2, 3)] * 20, torch.bfloat16)  # no NumPy dtype: bytes all the same
    _host_rows_round_trip([(5,), (2, 3)] * 20, torch.complex64)


def test_host_rows_refuse_what_is_not_a_plain_byte_copy():
    from collectives.fused.layout import slot_views
    from collectives.fused.reuse import HostRows

    for what, ts, region in [
            ("a cast", [torch.ones(4, dtype=torch.float64)], torch.zeros(64)),
            ("a transposed view", [torch.ones(2, 3).t()], torch.zeros(64)),
            ("a conjugate view", [torch.ones(4, dtype=torch.complex64).conj()],
             torch.zeros(8, dtype=torch.complex64))]:
        assert HostRows.of(ts, region, slot_views(region, [t.shape for t in ts])) is None, what


def test_compression_cannot_be_combined_with_bind():
    from collectives.fused import FastFusedAllReducer

    with pytest.raises(ValueError, match="compress"):
        FastFusedAllReducer(compress_fp16=True).bind([torch.zeros(3)])


def test_tour_entry_names_the_runner():
    from collectives.course.tour import entries

    assert [(e.name, e.runner) for e in entries() if e.lesson == 5] == [
        ("fused", "collectives.course.benchmarks.fused:tour_runner")]


# ---------------------------------------------------------------------------------------
# GPU: the streams really order the work.

def _gpu_producer_is_waited_for(spec):
    mod = resolve(spec)
    problems = []
    # the plain reducer, and the reference's fast one (graphs) where there is one
    for name in ("FusedAllReducer", "FastFusedAllReducer"):
        if hasattr(mod, name):
            problems += [f"{name}: {p}" for p in _gpu_steps(getattr(mod, name))]
    return problems


def _gpu_steps(Reducer):
    rank, p = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    reducer = Reducer(64 << 10, 256 << 10, device)
    # 300 small tensors (several flushes, both buffers) and two over the threshold
    sizes = [257 + (i * 37) % 1000 for i in range(300)] + [40_000, 70_001]
    grads = [torch.zeros(n, device=device) for n in sizes]
    others = [torch.zeros(n, device=device) for n in sizes[::-1]]   # another list, same buffers
    problems = []

    def step(tensors, value, what):
        # The producer: a long kernel, then the gradients written, all on the current stream.
        # A copy-in that did not wait for this stream would read the old values.
        torch.cuda._sleep(200_000_000)
        # Each tensor gets a value of its own, so a copy to the wrong place shows.
        torch._foreach_zero_(tensors)
        torch._foreach_add_(tensors, [float(value * (rank + 1) + i) for i in range(len(tensors))])
        reducer.all_reduce(tensors)
        reducer.wait()
        # Read on the current stream right after wait(): it must see the reduced values.
        seen = torch.cat([g.reshape(-1) for g in tensors])
        want = torch.cat([torch.full((g.numel(),), value * p * (p + 1) / 2 + p * i, device=device)
                          for i, g in enumerate(tensors)])
        torch.cuda.synchronize()
        if not torch.equal(seen, want):
            bad = int((seen != want).sum())
            problems.append(f"{what}: {bad} elements differ from what dist.all_reduce gives")

    # The reference's fast reducer records the list's second call as a CUDA graph and replays it
    # from then on: steps 2-4 replay; then a different list reuses the same buffers right
    # behind a replay; then the first list again (planned, recorded and replayed anew).
    for k in range(1, 5):
        step(grads, k, f"step {k}")
    step(others, 5, "another list after a replay")
    for k in range(6, 9):
        step(grads, k, f"first list again, step {k}")
    grads[7].data = torch.zeros_like(grads[7])     # same objects, one in new memory: re-planned
    step(grads, 10, "after one tensor was given new memory")
    step(grads, 11, "after one tensor was given new memory, again")
    with trace.recording() as t:                   # watched: issued for real, not replayed
        step(grads, 9, "while a trace records")
    if not any(e.kind == "all_reduce" for e in t.collectives()):
        problems.append("no all_reduce recorded while tracing a known list")
    return problems


@pytest.mark.gpu
def test_streams_wait_for_the_producer_and_the_caller_waits_for_the_results(impl):
    results = launch.run(_gpu_producer_is_waited_for, 2, args=(impl,), backend="nccl", timeout=120)
    assert results == [[], []], results


def _gpu_training_loop():
    # the same loop on a GPU: the bound list is known from its first call, recorded as a
    # CUDA graph then and replayed on steps 2-4, while the hook copies autograd's gradients in
    return _training_loop(torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.gpu
def test_a_training_loop_with_default_zero_grad_on_gpus():
    results = launch.run(_gpu_training_loop, 2, backend="nccl", timeout=120)
    assert results == [[True] * 4, [True] * 4], results
