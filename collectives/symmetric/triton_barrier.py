"""The barrier of lesson 12's Triton kernels: signal pads and atomics, block by block.

torch's symmetric memory gives every rank, besides its buffer, a small *signal pad*
(zeroed ``uint32`` words, :func:`torch.distributed._symmetric_memory.get_signal_pad_size`
bytes) that its peers can reach. ``handle.signal_pad_ptrs_dev`` is a device array of the p
pads' addresses. Block b of rank r and block b of every peer meet at these words::

    pad of rank q, word  b·p + r        rank r writes 1 there: "block b of rank r is here"
    pad of rank r, word  b·p + q        rank r waits for the 1 from q, and puts the 0 back

A handshake, not a counter: ``atomic_cas(word, 0, 1)`` arrives (retrying while the word is
still 1 from a previous barrier the peer has not consumed yet), ``atomic_cas(word, 1, 0)``
consumes. Every word is 0 again once both sides are past, so the same words serve every
barrier of every call: the epochs of the CPU version are not needed, because no side can
arrive twice before the other has consumed the first arrival.

Each ``atomic_cas`` here takes a scalar pointer: Triton issues a scalar atomic from one
thread of the program and hands its result to all, so a block arrives once per peer; the
block's other threads wait at ``tl.debug_barrier()`` for the handshake to finish.

The arrive is a *release* and the wait an *acquire*, at system scope: what this block
wrote before arriving (its slot, its reduced chunk) is visible to a peer's block that has
seen the arrival -- the fences the CPU version got for free from x86's store order.

After the structure of symm-mem-recipes' blockwise barrier (one word per block and peer in
the signal pad); written for this course. Import it only where Triton is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["blockwise_barrier"]


@triton.jit
def _arrive(word):
    """Raise ``word`` (a peer's) from 0 to 1; wait while it is still 1 from the last barrier."""
    while tl.atomic_cas(word, 0, 1, sem="release", scope="sys") != 0:
        pass


@triton.jit
def _consume(word):
    """Wait for ``word`` (our own) to be 1, and put it back to 0."""
    while tl.atomic_cas(word, 1, 0, sem="acquire", scope="sys") != 1:
        pass


@triton.jit
def blockwise_barrier(signal_pad_ptrs, block, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Block ``block`` of every rank waits here until block ``block`` of every rank has arrived.

    ``signal_pad_ptrs``: the address of the device array of the p signal pads' addresses
    (``handle.signal_pad_ptrs_dev``, an integer). ``block`` must be below the pad's words ÷ p.
    """
    pads = signal_pad_ptrs.to(tl.pointer_type(tl.uint64))
    own = tl.load(pads + RANK).to(tl.pointer_type(tl.uint32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            theirs = tl.load(pads + peer).to(tl.pointer_type(tl.uint32))
            _arrive(theirs + block * WORLD + RANK)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _consume(own + block * WORLD + peer)
    tl.debug_barrier()           # every thread of the block waits for the block's handshake
