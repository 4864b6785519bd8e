"""The equivalence harness: covers what it promises, and catches the mistakes it exists for."""

import pytest
import torch
import torch.distributed as dist

from collectives import launch, verify
from collectives.core.ops import ReduceOp

from . import workers


def test_the_cases_cover_sizes_dtypes_ops_views_and_groups():
    for p in (1, 2, 3, 4):
        cases = verify.default_cases(p)
        sizes = {c.numel for c in cases}
        assert {0, 1, verify.LARGE} <= sizes
        assert any(0 < n < p for n in sizes) or p == 1, "fewer elements than ranks"
        assert any(n % p for n in sizes if n) or p == 1, "a size not divisible by p"
        assert {c.dtype for c in cases} == set(verify.ALL_DTYPES)
        for dtype in verify.ALL_DTYPES:  # every dtype meets every op it supports
            ops = {c.op for c in cases if c.dtype == dtype}
            want = set(verify.ALL_OPS) - ({ReduceOp.AVG} if dtype in verify.INT_DTYPES else set())
            assert ops >= want, dtype
        assert {c.layout for c in cases} == {"contiguous", "strided", "transposed"}
        assert any(c.group is not None for c in cases)
        assert any(c.values == "random" for c in cases)


@pytest.mark.parametrize("dtype", verify.ALL_DTYPES)
def test_integer_valued_inputs_are_exact_in_every_dtype_and_order(dtype):
    # Any order of combining 8 ranks' values must be exactly representable: compare the
    # dtype's own arithmetic with float64's, forwards and backwards.
    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
        case = verify.Case(257, dtype, op)
        xs = [verify.make_values(case, r) for r in range(8)]
        for order in (xs, xs[::-1]):
            acc, exact = order[0].clone(), order[0].double()
            for x in order[1:]:
                if op == ReduceOp.SUM:
                    acc, exact = acc + x, exact + x.double()
                elif op == ReduceOp.PRODUCT:
                    acc, exact = acc * x, exact * x.double()
                elif op == ReduceOp.MIN:
                    acc, exact = torch.minimum(acc, x), torch.minimum(exact, x.double())
                else:
                    acc, exact = torch.maximum(acc, x), torch.maximum(exact, x.double())
                assert torch.equal(acc.double(), exact), (dtype, op)


def test_compare_names_the_first_differing_index_expected_and_got():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    b = torch.tensor([1.0, 2.0, 5.0, 6.0])
    assert verify.compare(a, a.clone()) is None
    assert verify.compare(a, b) == "2 of 4 elements differ; first at index 2: expected 3.0, got 5.0"
    assert "shape" in verify.compare(a, a[:3])
    assert "dtype" in verify.compare(a, a.double())
    assert verify.compare(a, a + 1e-7, exact=False, rtol=1e-6, atol=0) is None


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_correct_all_reduce_passes_every_case(world_size):
    report = verify.check_in_world("tests.workers:ar_correct", world_size)
    assert report.ok, report.summary()
    assert report.cases >= 50


@pytest.fixture(scope="module")
def caught():
    names = ["ar_trusts_gloo_with_views", "ar_forgets_to_average", "ar_scribbles_outside_the_view",
             "ar_off_by_one_on_tiny_tensors"]
    return launch.run(workers.harness_catches, world_size=4, args=(names,))[0]


def test_gloo_really_gets_strided_views_wrong_so_the_reference_never_uses_them():
    assert launch.run(workers.gloo_view_trap, world_size=2) == [False, False]


def test_the_harness_catches_an_implementation_that_trusts_gloo_with_views(caught):
    ok, summary, failed = caught["ar_trusts_gloo_with_views"]
    assert not ok
    assert any("strided" in c for c in failed)
    assert "rank 0" in summary and "first at index" in summary and "expected" in summary


def test_the_harness_catches_a_missing_average(caught):
    ok, _, failed = caught["ar_forgets_to_average"]
    assert not ok and failed and all("AVG" in c for c in failed)


def test_the_harness_catches_writes_between_a_views_elements(caught):
    ok, summary, failed = caught["ar_scribbles_outside_the_view"]
    assert not ok and all("strided" in c for c in failed)
    assert "wrote outside the view" in summary


def test_the_harness_catches_mistakes_on_fewer_elements_than_ranks(caught):
    ok, _, failed = caught["ar_off_by_one_on_tiny_tensors"]
    assert not ok and "n=3 float32 SUM" in failed


def test_a_crash_on_an_expanded_tensor_costs_one_case_not_the_world():
    # gloo can abort on an expanded tensor; the harness isolates that check in its own world
    report = verify.check_in_world("tests.workers:ar_aborts_on_expanded", 2, quick=True)
    failed = {r.case: r.detail for r in report.failures}
    assert list(failed) == ["expanded tensor is rejected"], "the other results survive the crash"
    assert "crashed" in failed["expanded tensor is rejected"] and "signal 6" in failed["expanded tensor is rejected"]
    naive = verify.check_in_world("tests.workers:ar_trusts_gloo_with_views", 2, quick=True)
    assert "expanded tensor is rejected" in {r.case for r in naive.failures}
    good = verify.check_in_world("tests.workers:ar_correct", 2, quick=True)
    assert good.ok and "expanded tensor is rejected" in {r.case for r in good.results}


# ---- AVG as the contract states it, and the same bits on every rank -------------------------

def ar_nudges_one_rank(tensor, op=dist.ReduceOp.SUM, group=None):
    """Correct values, but rank 1 ends one ulp away at its first non-integer element (random
    floats only: integer-valued cases stay exact): within any tolerance, not the same bits."""
    first = tensor.reshape(-1)[0] if tensor.numel() else None
    random = tensor.is_floating_point() and tensor.numel() and bool(first != first.round())
    workers.ar_correct(tensor, op, group)
    if dist.get_rank() == 1 and random:
        flat = tensor.reshape(-1)
        flat[0] = torch.nextafter(flat[0], flat[0] + 1)


def _reference_avg_with_a_premultiplying_backend() -> dict:
    """Give this world a backend AVG that works as NCCL's does (every input times 1/p, then
    summed); the harness's reference must still be SUM followed by one division."""
    import torch.distributed as d
    real = d.all_reduce
    p = d.get_world_size()

    def premultiplying(tensor, op=d.ReduceOp.SUM, group=None, async_op=False):
        if op == d.ReduceOp.AVG:
            tensor.mul_(1.0 / p)
            op = d.ReduceOp.SUM
        return real(tensor, op=op, group=group, async_op=async_op)

    x = verify.make_values(verify.Case(4099, torch.float32, ReduceOp.AVG, values="random"), d.get_rank())
    summed = x.clone()
    real(summed)
    d.all_reduce = premultiplying
    try:
        got = verify.reference_all_reduce(x, ReduceOp.AVG)
        native = x.clone()
        d.all_reduce(native, op=ReduceOp.AVG)
    finally:
        d.all_reduce = real
    return dict(bits_from_sum_then_divide=bool(torch.equal(got, summed / p)),
                native_differs=int((native != summed / p).sum()))


def test_the_avg_reference_is_sum_then_one_division_whatever_the_backend_does():
    for res in launch.run(_reference_avg_with_a_premultiplying_backend, 3):
        assert res["native_differs"] > 0, "at p = 3 the pre-multiplied AVG rounds differently"
        assert res["bits_from_sum_then_divide"]


def test_the_harness_catches_ranks_that_end_with_different_bits():
    report = verify.check_in_world("tests.test_verify:ar_nudges_one_rank", 3, quick=True, expanded=False)
    assert not report.ok
    assert all(r.case.endswith("random") for r in report.failures), report.summary()
    assert "ranks disagree" in report.summary() and "rank 1" in report.summary()
    # the naive ring's documented exception: callers waive the rule
    assert all(r.ok for r in launch.run(_waived, 3))


def _waived():
    return verify.check_all_reduce(ar_nudges_one_rank, quick=True, identical_bits=False)


def test_every_case_has_a_name_of_its_own_at_every_world_size():
    """A judge keys each case's record by its name: two cases of one name would be judged as
    one (at p = 2, "fewer elements than ranks" is the one-element case)."""
    from collectives.course.cases import default_cases
    for p in range(1, 9):
        for quick in (False, True):
            names = [c.name for c in default_cases(p, quick=quick)]
            assert len(names) == len(set(names)), (p, quick, sorted(n for n in names if names.count(n) > 1))
