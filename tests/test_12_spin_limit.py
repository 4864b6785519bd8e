"""Lesson 12's GPU kernels give up on a peer that never comes, and the host names it.

Without Triton: the host's side of :mod:`collectives.symmetric.triton_errors` -- a record in
the error buffer makes the next call raise, naming the rank, the barrier and the peer, before
anything is launched; every later call on those signal pads is refused; the deadline wait
reads the buffer while it waits. On one GPU: both barriers of the compiled kernels against a
peer's word that nobody writes.
"""

import time
import types

import pytest
import torch

from collectives.symmetric import triton_errors
from collectives.symmetric.triton_errors import RECORD_WORDS, ErrorBuffer, SpinTimeout

from .test_12_symmetric import fake_kernels

LESSON = 12


def _write_record(errors: ErrorBuffer, program: int, peer: int, world: int, **fields) -> None:
    """What a kernel that gave up writes: the record's fields, then ``valid``, then the header."""
    row = dict(valid=1, rank=errors.rank, barrier=10, peer=peer, phase=1, expected=1, seen=0, program=program)
    row.update(fields)
    at = (1 + program * world + peer) * RECORD_WORDS
    errors.words[at:at + len(row)] = list(row.values())
    errors.words[0] = 1


def test_a_record_raises_naming_rank_barrier_and_peer_before_any_launch_and_later_calls_are_refused(monkeypatch):
    with fake_kernels(monkeypatch) as (ta, _):
        handle = types.SimpleNamespace(buffer_ptrs_dev=3000, signal_pad_ptrs_dev=4000, rank=1, world_size=2)
        other = types.SimpleNamespace(buffer_ptrs_dev=3000, signal_pad_ptrs_dev=5000, rank=1, world_size=2)
        out = torch.zeros(64)
        ta.one_shot(handle, 64, torch.float32, out, spin_limit=100)
        errors = ta.errors_of(handle)
        assert ta._ONE_SHOT.kernel.jit_calls[-1][1][4:] == (errors.address, 100)     # the bound is the caller's
        assert errors is not ta.errors_of(other) and errors.found() == []
        for bad in (0, -5, 2.5):                  # a bound that is no count of tries: refused before a launch
            with pytest.raises(ValueError, match="spin_limit"):
                ta.two_shot(handle, 64, torch.float32, spin_limit=bad)
        launched = len(ta._TWO_SHOT_STORE.kernel.jit_calls) + len(ta._TWO_SHOT_STORE.kernel.direct_calls)

        _write_record(errors, program=3, peer=0, world=2, barrier=21)      # program 3 waited for peer 0 in vain
        with pytest.raises(SpinTimeout, match=r"rank 1 gave up at the two-shot's middle barrier .*, program 3: "
                                              r"peer 0 never arrived: the word in rank 1's signal pad held 0 where "
                                              r"1 was expected; 1 record\(s\), peers waited for: \[0\]"):
            ta.two_shot(handle, 64, torch.float32)
        for call in (lambda: ta.two_shot(handle, 64, torch.float32),     # state unknown: refused from now on
                     lambda: ta.one_shot(handle, 64, torch.float32, out, spin_limit=100)):
            with pytest.raises(SpinTimeout, match="rank 1 refuses this call: .*peer 0 never arrived.*new one"):
                call()
        assert len(ta._TWO_SHOT_STORE.kernel.jit_calls) + len(ta._TWO_SHOT_STORE.kernel.direct_calls) == launched
        ta.two_shot(other, 64, torch.float32)     # other signal pads are not touched by it


def test_the_record_says_which_handshake_failed_and_the_deadline_wait_reads_it(monkeypatch):
    errors = ErrorBuffer(64, rank=2)
    _write_record(errors, program=5, peer=3, world=4, barrier=30, phase=0, expected=0, seen=1)
    _write_record(errors, program=6, peer=1, world=4, barrier=30)
    message = errors.describe()
    assert message.startswith("rank 2 gave up at the store two-shot's first barrier (every input in place), "
                              "program 5: it could not arrive at peer 3: the word in peer 3's signal pad held 1 "
                              "where 0 was expected")
    assert "2 record(s), peers waited for: [1, 3]" in message

    class Stream:        # the current stream as the wait sees it: still busy, until ``finish`` is called
        busy, polls = True, 0

    class Event:
        def record(self):
            pass

        def query(self):
            Stream.polls += 1
            if Stream.polls == 3 and hasattr(Stream, "on_third_poll"):
                Stream.on_third_poll()
            return not Stream.busy
    monkeypatch.setattr(torch.cuda, "Event", Event)
    quiet = ErrorBuffer(64, rank=0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 0: the stream did not finish within 0.05 s and no kernel"):
        triton_errors.wait(quiet, timeout=0.05)          # no record: the host's own deadline, generic
    assert 0.05 <= time.monotonic() - start < 5
    Stream.polls, Stream.on_third_poll = 0, lambda: _write_record(quiet, program=0, peer=1, world=2)
    with pytest.raises(SpinTimeout, match="rank 0 gave up at the one-shot's first barrier.*peer 1 never arrived"):
        triton_errors.wait(quiet, timeout=60)            # a kernel gave up meanwhile: named long before 60 s
    assert Stream.polls == 3
    Stream.busy = False                                  # a stream that finishes: the record still raises
    with pytest.raises(SpinTimeout, match="refuses this call"):
        triton_errors.wait(quiet, timeout=60)
    triton_errors.wait(ErrorBuffer(64, rank=0), timeout=60)   # finished, no record: returns


# ---- on one GPU ----------------------------------------------------------------------------------

def _local_world(world: int, preset: tuple = ()) -> tuple:
    """On one GPU: ``world`` signal pads and buffers, all local; rank 0's kernel runs, the
    others' never do. ``preset``: (pad, word) pairs already set to 1."""
    pads = [torch.zeros(2048, dtype=torch.int32, device="cuda") for _ in range(world)]
    for pad, word in preset:
        pads[pad][word] = 1
    buffers = [torch.arange(3 * 4096, dtype=torch.float32, device="cuda") * (q + 1) for q in range(world)]
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device="cuda") for ts in (buffers, pads)]
    handle = types.SimpleNamespace(buffer_ptrs_dev=ptrs[0].data_ptr(), signal_pad_ptrs_dev=ptrs[1].data_ptr(),
                                   rank=0, world_size=world)
    return handle, (pads, buffers, ptrs)


@pytest.mark.gpu(1)
def test_on_one_gpu_both_barriers_give_up_within_the_bound_and_the_host_names_the_peer():
    from collectives.symmetric import triton_allreduce as ta
    n = 3 * 4096                                         # 3 programs of 4096 float32
    alive = []       # every world's tensors live to the end: a new world at a dead one's addresses would be its twin
    handle, kept = _local_world(1)                       # world 1: the kernel runs through, nothing recorded
    alive.append(kept)
    out = torch.full((n,), -1.0, device="cuda")
    ta.one_shot(handle, n, torch.float32, out, spin_limit=1000)
    triton_errors.wait(ta.errors_of(handle), timeout=60)
    assert torch.equal(out, kept[1][0]) and ta.errors_of(handle).tensor.is_pinned()
    for barrier in ta.BARRIERS:
        handle, kept = _local_world(2)                   # peer 1's word in rank 0's pad: never written
        alive.append(kept)
        out = torch.full((n,), -1.0, device="cuda")
        start = time.monotonic()
        ta.one_shot(handle, n, torch.float32, out, spin_limit=1000, barrier=barrier)
        with pytest.raises(SpinTimeout, match="rank 0 gave up at the one-shot's first barrier.*peer 1 never arrived"):
            triton_errors.wait(ta.errors_of(handle), timeout=60)
        assert time.monotonic() - start < 30, f"{barrier}: the kernel did not give up within its bound"
        records = ta.errors_of(handle).found()
        assert sorted(r["program"] for r in records) == [0, 1, 2] and {r["peer"] for r in records} == {1}
        assert torch.equal(out, torch.full_like(out, -1.0)), f"{barrier}: the kernel went on past the barrier"
        with pytest.raises(SpinTimeout, match="refuses this call"):
            ta.one_shot(handle, n, torch.float32, out, spin_limit=1000, barrier=barrier)
        # the peer never consumed rank 0's last arrival (word (b + 2)·2 + 0 of its pad): rank 0 cannot arrive
        handle, kept = _local_world(2, preset=[(1, (b + 2) * 2) for b in range(3)])
        alive.append(kept)
        ta.two_shot(handle, n, torch.float32, spin_limit=1000, barrier=barrier)
        with pytest.raises(SpinTimeout, match="store two-shot's first barrier.*could not arrive at peer 1"):
            triton_errors.wait(ta.errors_of(handle), timeout=60)
