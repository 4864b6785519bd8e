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

A barrier whose peer never arrives spins for ever: nothing here times out. A bounded spin
would need a flag in device memory the host reads after every call -- a synchronisation per
call, what these kernels exist to avoid -- so the timeout is the host's: the caller waits for
the stream with a deadline (``tools/gpu_lesson12.py`` runs every call under one), and a hung
kernel shows up as a call that does not finish.

After the structure of symm-mem-recipes' blockwise barrier (one word per block and peer in
the signal pad, one thread per peer); written for this course. Import it only where Triton
is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["blockwise_barrier", "RESERVED"]

RESERVED = 2      # torch's handle.barrier channels 0 and 1: their 2·p words are not ours


@triton.jit
def _flip(word, old, new, SEM: tl.constexpr):
    """Once ``word`` holds ``old``, make it ``new`` (spinning on a compare-and-swap): arriving
    raises a peer's word from 0 to 1, waiting while it is still 1 from the last barrier;
    consuming waits for our own word to be 1 and puts the 0 back."""
    while tl.atomic_cas(word, old, new, sem=SEM, scope="sys") != old:
        pass


# Thread t < p (t ≠ RANK) of the block: arrive at peer t's word w·p + RANK, then consume our
# word w·p + t. Operands: $0 (out, unused), $1 the address of the pads' address array, $2 the
# row w (block b + RESERVED), $3 p, $4 RANK. Labels get LLVM's per-asm unique id, as the barrier is inlined
# several times into one kernel. ARRIVE_SEM and CONSUME_SEM: the atomics' ordering.
_HANDSHAKE_TEMPLATE = """{
.reg .pred %go, %again;
.reg .u32 %t, %word, %old;
.reg .u64 %off, %at, %theirs, %own;
mov.u32 $0, 0;
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
ARRIVE_${:uid}:
atom.global.ARRIVE_SEM.sys.cas.b32 %old, [%theirs], 0, 1;
setp.ne.u32 %again, %old, 0;
@%again bra ARRIVE_${:uid};
CONSUME_${:uid}:
atom.global.CONSUME_SEM.sys.cas.b32 %old, [%own], 1, 0;
setp.ne.u32 %again, %old, 1;
@%again bra CONSUME_${:uid};
DONE_${:uid}:
}"""
_HANDSHAKE_ORDERED = tl.constexpr(_HANDSHAKE_TEMPLATE.replace("ARRIVE_SEM", "release")
                                  .replace("CONSUME_SEM", "acquire"))
_HANDSHAKE_RELAXED = tl.constexpr(_HANDSHAKE_TEMPLATE.replace("ARRIVE_SEM", "relaxed")
                                  .replace("CONSUME_SEM", "relaxed"))


@triton.jit
def blockwise_barrier(signal_pad_ptrs, block, RANK: tl.constexpr, WORLD: tl.constexpr, PARALLEL: tl.constexpr,
                      ORDERED: tl.constexpr = True):
    """Block ``block`` of every rank waits here until block ``block`` of every rank has arrived.

    ``signal_pad_ptrs``: the address of the device array of the p signal pads' addresses
    (``handle.signal_pad_ptrs_dev``, an integer). ``block`` must be below the pad's words ÷ p
    less :data:`RESERVED`.
    ``PARALLEL``: one thread per peer (True) or one thread for every peer in turn (False).
    ``ORDERED``: release on arrival and acquire on the wait (True, the default: always
    correct), or relaxed (False): the module docstring says which barrier may be.
    """
    tl.debug_barrier()           # what every thread wrote is ordered before the arriving thread's release
    word = block + 2             # RESERVED (2) rows of p words first: torch's barrier channels 0 and 1
    if PARALLEL:
        args = [signal_pad_ptrs.to(tl.int64), word, block * 0 + WORLD, block * 0 + RANK]
        if ORDERED:
            tl.inline_asm_elementwise(_HANDSHAKE_ORDERED, "=r,l,r,r,r", args, dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_HANDSHAKE_RELAXED, "=r,l,r,r,r", args, dtype=tl.int32, is_pure=False, pack=1)
    else:
        pads = signal_pad_ptrs.to(tl.pointer_type(tl.uint64))
        own = tl.load(pads + RANK).to(tl.pointer_type(tl.uint32))
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                theirs = tl.load(pads + peer).to(tl.pointer_type(tl.uint32))
                _flip(theirs + word * WORLD + RANK, 0, 1, "release" if ORDERED else "relaxed")   # arrive
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                _flip(own + word * WORLD + peer, 1, 0, "acquire" if ORDERED else "relaxed")      # consume
    tl.debug_barrier()           # every thread of the block waits for the block's handshake
