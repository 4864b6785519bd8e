"""The barrier of lesson 12's Triton kernels: signal pads and atomics, block by block.

torch's symmetric memory gives every rank, besides its buffer, a small *signal pad*
(zeroed ``uint32`` words, :func:`torch.distributed._symmetric_memory.get_signal_pad_size`
bytes) that its peers can reach. ``handle.signal_pad_ptrs_dev`` is a device array of the p
pads' addresses. Block b of rank r and block b of every peer meet at these words::

    pad of rank q, word  (b + 2)·p + r      rank r writes 1 there: "block b of rank r is here"
    pad of rank r, word  (b + 2)·p + q      rank r waits for the 1 from q, and puts the 0 back

The first 2·p words are left to torch's own ``handle.barrier(channel)`` (channel c uses
words c·p .. c·p + p − 1; the lesson's plain-torch version uses channels 0 and 1), so a
kernel of this module and a torch barrier never share a word.

A handshake, not a counter: ``atomic_cas(word, 0, 1)`` arrives (retrying while the word is
still 1 from a previous barrier the peer has not consumed yet), ``atomic_cas(word, 1, 0)``
consumes. Every word is 0 again once both sides are past, so the same words serve every
barrier of every call: the epochs of the CPU version are not needed, because no side can
arrive twice before the other has consumed the first arrival.

Each ``atomic_cas`` here takes a scalar pointer: Triton issues a scalar atomic from one
thread of the program and hands its result to all, so a block arrives once per peer. The
block meets (``tl.debug_barrier()``) before the first arrival, so that the arriving
thread's release covers what every thread of the block wrote, and again after the last
wait, so that no thread goes on before the handshake is done.

The arrive is a *release* and the wait an *acquire*, at system scope: what this block
wrote before arriving (its slot, its reduced chunk) is visible to a peer's block that has
seen the arrival -- the fences the CPU version got for free from x86's store order.

Two ways to run the handshake (``PARALLEL``, a compile-time switch of every kernel):

* serial (``PARALLEL=False``): one thread arrives at each peer in turn, then consumes each
  peer's arrival in turn -- 2(p − 1) round trips one after another, each a system-scope
  atomic that waits for its answer (over NVLink when the word is a peer's);
* parallel (``PARALLEL=True``): thread t of the block handles peer t -- arrives at t's pad,
  then consumes t's arrival -- so the p − 1 handshakes overlap and a barrier costs about
  one round trip whatever p is. Written as a few lines of PTX, because a Triton atomic on a
  tensor of p pointers runs in as many threads as hold a copy of each pointer (a layout
  question), and a handshake must run exactly once per peer. The block meets first
  (``bar.sync``), so the arriving thread's release covers what every thread of the block
  wrote, and again after, so no thread goes on before the handshakes are done.

Not every barrier needs the release and the acquire (``ORDERED``, a compile-time switch
too), as torch's own symmetric-memory kernels sort them:

* a barrier that only says "every peer has *started*" -- the first of every kernel, whose
  buffers were filled by earlier kernels (the end of a kernel already makes its writes
  visible) -- and one that only says "nobody reads your buffer any more" -- the last, after
  which peers may overwrite what was read -- need no ordering: relaxed atomics (``False``);
* a barrier that hands peers what *this kernel* wrote (a reduced chunk to be gathered, sums
  stored into a peer's buffer) must release before it arrives and acquire after it waits
  (``True``).

Each ordered atomic at system scope is a fence across NVLink; dropping the ones no peer
needs is what the small calls gain (``tools/gpu_probe.py barrier`` times both). The relaxed
barriers rest on one assumption, stated here because nothing checks it: the writes of a
kernel that has *ended* (the caller's copy into the buffer, the previous call's stores into
a peer's buffer) are visible over NVLink to a kernel that starts after it on any GPU of the
machine. CUDA promises this at the end of a kernel for the kernel's own device and, through
the system-scope fences the driver issues at kernel boundaries, to its peers; torch's own
symmetric-memory kernels make the same assumption for their first and last barriers.

A barrier whose peer never comes does not spin for ever: every handshake counts its tries,
and past ``spin_limit`` the block gives up, writes a record (this rank, the barrier, the
peer, the word it expected and the word it saw) into the error buffer of
:mod:`.triton_errors` -- pinned host memory the host reads without synchronising -- and
the barrier returns 1, on which the kernel returns at once. While every peer comes, the
bound costs a count and a compare per try, nothing else. The serial handshake is written
with Triton's atomics; the parallel one is PTX: there the failing thread writes its record, and the block agrees
on the outcome with ``bar.red.or`` (a block barrier that also ORs one bit of every thread).

After the structure of symm-mem-recipes' blockwise barrier (one word per block and peer in
the signal pad, one thread per peer); written for this course. Import it only where Triton
is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_errors import RECORD_WORDS

__all__ = ["blockwise_barrier", "RESERVED"]

RESERVED = 2      # torch's handle.barrier channels 0 and 1: their 2·p words are not ours
_RECORD = tl.constexpr(RECORD_WORDS)   # int32 words per record of the error buffer


@triton.jit
def _flip(word, old, new, spin_limit, SEM: tl.constexpr):
    """Once ``word`` holds ``old``, make it ``new`` (spinning on a compare-and-swap): arriving
    raises a peer's word from 0 to 1, waiting while it is still 1 from the last barrier;
    consuming waits for our own word to be 1 and puts the 0 back. At most ``spin_limit``
    tries more: returns what the word held at the last try (``old`` when it flipped)."""
    seen = tl.atomic_cas(word, old, new, sem=SEM, scope="sys")
    spins = spin_limit * 0
    while (seen != old) & (spins < spin_limit):     # the one branch the bound adds to a try
        seen = tl.atomic_cas(word, old, new, sem=SEM, scope="sys")
        spins += 1
    return seen


@triton.jit
def _record(errors, block, peer, seen, RANK: tl.constexpr, WORLD: tl.constexpr, BARRIER: tl.constexpr,
            PHASE: tl.constexpr, EXPECTED: tl.constexpr):
    """Block ``block`` gave up on ``peer``: its record (:data:`.triton_errors.FIELDS`), then
    ``valid`` and the header, each with a release, so a host that sees the header sees it."""
    base = errors.to(tl.pointer_type(tl.int32))
    record = base + (1 + block * WORLD + peer) * _RECORD
    tl.store(record + 1, block * 0 + RANK)
    tl.store(record + 2, block * 0 + BARRIER)
    tl.store(record + 3, block * 0 + peer)
    tl.store(record + 4, block * 0 + PHASE)
    tl.store(record + 5, block * 0 + EXPECTED)
    tl.store(record + 6, seen.to(tl.int32))
    tl.store(record + 7, block)
    tl.atomic_xchg(record, 1, sem="release", scope="sys")
    tl.atomic_xchg(base, 1, sem="release", scope="sys")


# Thread t < p (t ≠ RANK) of the block: arrive at peer t's word w·p + RANK, then consume our
# word w·p + t, each at most $6 tries more; a thread that gives up writes its record
# (:mod:`.triton_errors`) at $5 + 4·16·(1 + $7·p + t). Operands: $0 (out: 1 if any thread of
# the block gave up, else 0), $1 the address of the pads' address array, $2 the row w
# (block b + RESERVED), $3 p, $4 RANK, $5 the error buffer's address, $6 the spin limit,
# $7 the block b, $8 the barrier's number. Labels get LLVM's per-asm unique id, as the
# barrier is inlined several times into one kernel. ARRIVE_SEM and CONSUME_SEM: the
# atomics' ordering. Every thread ends at ``bar.red.or``: a block barrier that also ORs
# every thread's "gave up", so the block leaves with one answer.
_HANDSHAKE_TEMPLATE = """{
.reg .pred %go, %again, %failed, %any;
.reg .u32 %t, %word, %old, %phase, %want;
.reg .u64 %off, %at, %theirs, %own, %spins, %rec;
mov.pred %failed, 0;
mov.u32 %t, %tid.x;
setp.lt.u32 %go, %t, $3;
setp.ne.and.u32 %go, %t, $4, %go;
@!%go bra DONE_${:uid};
mul.wide.u32 %off, %t, 8;
add.u64 %at, $1, %off;
ld.global.u64 %theirs, [%at];
mul.wide.u32 %off, $4, 8;
add.u64 %at, $1, %off;
ld.global.u64 %own, [%at];
mad.lo.u32 %word, $2, $3, $4;
mul.wide.u32 %off, %word, 4;
add.u64 %theirs, %theirs, %off;
mad.lo.u32 %word, $2, $3, %t;
mul.wide.u32 %off, %word, 4;
add.u64 %own, %own, %off;
mov.u64 %spins, 0;
ARRIVE_${:uid}:
atom.global.ARRIVE_SEM.sys.cas.b32 %old, [%theirs], 0, 1;
setp.eq.u32 %again, %old, 0;
@%again bra ARRIVED_${:uid};
add.u64 %spins, %spins, 1;
setp.lt.u64 %again, %spins, $6;
@%again bra ARRIVE_${:uid};
mov.u32 %phase, 0;
mov.u32 %want, 0;
bra.uni FAIL_${:uid};
ARRIVED_${:uid}:
mov.u64 %spins, 0;
CONSUME_${:uid}:
atom.global.CONSUME_SEM.sys.cas.b32 %old, [%own], 1, 0;
setp.eq.u32 %again, %old, 1;
@%again bra DONE_${:uid};
add.u64 %spins, %spins, 1;
setp.lt.u64 %again, %spins, $6;
@%again bra CONSUME_${:uid};
mov.u32 %phase, 1;
mov.u32 %want, 1;
FAIL_${:uid}:
mad.lo.u32 %word, $7, $3, %t;
add.u32 %word, %word, 1;
mul.wide.u32 %off, %word, 64;
add.u64 %rec, $5, %off;
st.global.u32 [%rec+4], $4;
st.global.u32 [%rec+8], $8;
st.global.u32 [%rec+12], %t;
st.global.u32 [%rec+16], %phase;
st.global.u32 [%rec+20], %want;
st.global.u32 [%rec+24], %old;
st.global.u32 [%rec+28], $7;
mov.u32 %word, 1;
fence.sc.sys;
st.global.u32 [%rec], %word;
fence.sc.sys;
st.global.u32 [$5], %word;
mov.pred %failed, 1;
DONE_${:uid}:
bar.red.or.pred %any, 0, %failed;
selp.u32 $0, 1, 0, %any;
}"""
_HANDSHAKE_ORDERED = tl.constexpr(_HANDSHAKE_TEMPLATE.replace("ARRIVE_SEM", "release")
                                  .replace("CONSUME_SEM", "acquire"))
_HANDSHAKE_RELAXED = tl.constexpr(_HANDSHAKE_TEMPLATE.replace("ARRIVE_SEM", "relaxed")
                                  .replace("CONSUME_SEM", "relaxed"))


@triton.jit
def blockwise_barrier(signal_pad_ptrs, block, errors, spin_limit, RANK: tl.constexpr, WORLD: tl.constexpr,
                      PARALLEL: tl.constexpr, ORDERED: tl.constexpr = True, BARRIER: tl.constexpr = 0):
    """Block ``block`` of every rank waits here until block ``block`` of every rank has
    arrived: returns 0, or 1 if it gave up on a peer after ``spin_limit`` tries of one
    handshake (a record is then in the error buffer at ``errors``, and the caller returns).

    ``signal_pad_ptrs``: the address of the device array of the p signal pads' addresses
    (``handle.signal_pad_ptrs_dev``, an integer). ``block`` must be below the pad's words ÷ p
    less :data:`RESERVED`. ``errors``: the address of the error buffer
    (:class:`.triton_errors.ErrorBuffer`), mapped host memory.
    ``PARALLEL``: one thread per peer (True) or one thread for every peer in turn (False).
    ``ORDERED``: release on arrival and acquire on the wait (True, the default: always
    correct), or relaxed (False): the module docstring says which barrier may be.
    ``BARRIER``: which barrier this is, for the record (:data:`.triton_errors.BARRIERS`).
    """
    tl.debug_barrier()           # what every thread wrote is ordered before the arriving thread's release
    word = block + 2             # RESERVED (2) rows of p words first: torch's barrier channels 0 and 1
    failed = block * 0
    if PARALLEL:
        args = [signal_pad_ptrs.to(tl.int64), word, block * 0 + WORLD, block * 0 + RANK, errors.to(tl.int64),
                spin_limit.to(tl.int64), block, block * 0 + BARRIER]
        if ORDERED:
            failed = tl.inline_asm_elementwise(_HANDSHAKE_ORDERED, "=r,l,r,r,r,l,l,r,r", args, dtype=tl.int32,
                                               is_pure=False, pack=1)
        else:
            failed = tl.inline_asm_elementwise(_HANDSHAKE_RELAXED, "=r,l,r,r,r,l,l,r,r", args, dtype=tl.int32,
                                               is_pure=False, pack=1)
    else:
        pads = signal_pad_ptrs.to(tl.pointer_type(tl.uint64))
        own = tl.load(pads + RANK).to(tl.pointer_type(tl.uint32))
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                if failed == 0:
                    theirs = tl.load(pads + peer).to(tl.pointer_type(tl.uint32))
                    seen = _flip(theirs + word * WORLD + RANK, 0, 1, spin_limit, "release" if ORDERED else "relaxed")
                    if seen != 0:                                                            # arrive
                        _record(errors, block, peer, seen, RANK, WORLD, BARRIER, 0, 0)
                        failed = block * 0 + 1
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                if failed == 0:
                    seen = _flip(own + word * WORLD + peer, 1, 0, spin_limit, "acquire" if ORDERED else "relaxed")
                    if seen != 1:                                                            # consume
                        _record(errors, block, peer, seen, RANK, WORLD, BARRIER, 1, 1)
                        failed = block * 0 + 1
        tl.debug_barrier()       # every thread of the block waits for the block's handshake
    return failed                # (the parallel handshake ends at its own block barrier, bar.red)
