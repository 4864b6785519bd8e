"""Lesson 11 exercise: all-to-all, uneven splits, and a mixture-of-experts dispatch.

Seven functions, seven tasks. Every all-to-all has ``dist.all_to_all_single``'s contract:
blocks are cut along dim 0 (equal, or ``*_split_sizes`` rows each), rank r's output block s
is rank s's input block r, any dtype, any world size (graded on 1 to 6 ranks: 3, 5 and 6
are not powers of two), empty blocks allowed.

Check your work:

    make check LESSON=11                                          # one PASS/FAIL line per task
    .venv/bin/python lessons/11_alltoall/exercise.py --task 1 --verbose    # one task, every problem
    .venv/bin/torchrun --nproc-per-node 4 lessons/11_alltoall/exercise.py  # the same, under torchrun
    make grade LESSON=11                                          # the same verdicts, as points

The checks are the grader's own judges, run outside your ranks, on inputs drawn at random
on every run; every message you send is recorded where your code cannot reach it. A
library collective (``dist.all_to_all_single``, ``dist.all_gather``...) does not pass:
build everything from ``send``/``recv``.

Course functions you may call (the sheet is checked against the code):

    ops.group_rank_and_size(group=None) -> tuple[int, int]
        This rank's index in ``group`` and the group's size (the world when ``group`` is
        None).
    ops.global_rank(group, group_rank) -> int
        The global rank of ``group_rank`` in ``group``: what ``send``/``recv`` take.
    ops.sendrecv(send_buf, dst, recv_buf, src, group=None, *, post_empty=False)
        Post a receive of ``recv_buf`` from ``src`` and a send of ``send_buf`` to ``dst``;
        return the ``(receive, send)`` handles. ``dst``/``src`` are global ranks.
    ops.rank_device() -> torch.device
        The device this rank's tensors belong on: its GPU when the world runs on GPUs, else
        the CPU.

The reference is ``collectives/alltoall/``; the lesson page is docs/lessons/11-alltoall.md.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from collectives import ops, trace
from collectives.course.grading.runner import run_tasks

LESSON = 11


def blocks(tensor: torch.Tensor, split_sizes, p: int) -> list[torch.Tensor]:
    """Given: ``tensor`` (contiguous) cut along dim 0 into p blocks -- ``split_sizes[i]`` rows
    each, or equal blocks when ``split_sizes`` is None -- each block a flat, contiguous view."""
    rows = [tensor.shape[0] // p] * p if split_sizes is None else list(split_sizes)
    row = math.prod(tensor.shape[1:])
    flat, out, at = tensor.reshape(-1), [], 0
    for r in rows:
        out.append(flat[at * row:(at + r) * row])
        at += r
    return out


def pairwise_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                        input_split_sizes=None, group=None) -> None:
    """Lesson 11, task 1: all-to-all in p − 1 rounds, one partner each way per round.

    TODO:     copy your own block (block ``rank`` of input into block ``rank`` of output),
              then for k = 1 .. p − 1: send input block ``to`` and receive output block
              ``frm`` -- with p a power of two to = frm = rank XOR k; otherwise to = rank + k,
              frm = rank − k (mod p). Finish a round (both messages) before the next: the
              grader starts one rank late and reads when each round was posted.
    APPROACH: work on contiguous buffers: ``input.contiguous()``, and for a non-contiguous
              output a contiguous temporary copied back at the end. ``blocks(...)`` gives
              the flat views. Skip empty blocks (both ends know their size).
    EXAMPLE:  p = 4, rank 1: rounds exchange with ranks 0, 3, 2. p = 3, rank 1: round 1
              sends to 2 and receives from 0, round 2 sends to 0 and receives from 2.
    HINT:     ``ops.sendrecv`` posts the receive and the send together; wait for both.
              The peers it takes are global ranks (``ops.global_rank``).
    CALLS:    ops.group_rank_and_size, ops.global_rank, ops.sendrecv
    """
    raise NotImplementedError("Lesson 11, task 1: pairwise_all_to_all")


def bruck_all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                     input_split_sizes=None, group=None) -> None:
    """Lesson 11, task 2: Bruck's all-to-all in ⌈log2 p⌉ rounds (equal blocks are enough).

    TODO:     slot i starts with input block (rank + i) mod p. For d = 1, 2, 4, ... < p:
              pack every slot i with ``i & d`` into one message, send it to rank + d,
              receive the same slots' contents from rank − d and unpack them into those
              slots. At the end output block s is slot (rank − s) mod p.
    APPROACH: keep the slots as a list of tensors; ``torch.cat`` packs, ``torch.split``
              unpacks. Every slot holds one block of b = input.numel() / p elements.
    EXAMPLE:  p = 4: round d = 1 moves slots 1, 3 to rank + 1; round d = 2 moves slots 2, 3
              to rank + 2. Slot 3 travels 1 + 2 = 3 ranks: to its destination.
    HINT:     2 messages instead of 3 at p = 4 -- but 4 blocks sent instead of 3: Bruck is
              for small messages.
    CALLS:    ops.group_rank_and_size, ops.global_rank, ops.sendrecv
    """
    raise NotImplementedError("Lesson 11, task 2: bruck_all_to_all")


def exchange_splits(input_split_sizes, group=None) -> list[int]:
    """Lesson 11, task 3: the output_split_sizes that match every rank's input_split_sizes.

    TODO:     rank r's result[s] is rank s's ``input_split_sizes[r]``: an all-to-all of one
              integer per pair. Return a list of p ints.
    APPROACH: put the counts in an int64 tensor of p and call your pairwise all-to-all.
    EXAMPLE:  ranks 0, 1 send [2, 0] and [5, 1]: rank 0 receives [2, 5], rank 1 [0, 1].
    HINT:     make the counts' tensor on ``ops.rank_device()``: the CPU here, the GPU
              under NCCL.
    CALLS:    ops.group_rank_and_size, ops.rank_device
    """
    raise NotImplementedError("Lesson 11, task 3: exchange_splits")


def all_to_all_uneven(input: torch.Tensor, input_split_sizes, group=None):
    """Lesson 11, task 4: send ``input_split_sizes[d]`` rows to rank d; return
    ``(output, output_split_sizes)``.

    TODO:     exchange the sizes first (task 3), allocate the output (its rows: the sum of
              what arrives, its other dimensions: input's), then move the rows with your
              pairwise all-to-all and the two split lists.
    APPROACH: three lines once tasks 1 and 3 work.
    EXAMPLE:  rank 0 sends [0, 3] rows of width 4, rank 1 sends [2, 0]: rank 0 gets a
              [2, 4] output and [0, 2]; rank 1 a [3, 4] output and [3, 0].
    HINT:     a block of zero rows is no message at all.
    CALLS:    none
    """
    raise NotImplementedError("Lesson 11, task 4: all_to_all_uneven")


def moe_dispatch_combine(x: torch.Tensor, expert_of: torch.Tensor, num_experts: int, expert_fn,
                         group=None) -> torch.Tensor:
    """Lesson 11, task 5: top-1 MoE dispatch and combine.

    TODO:     token t (row t of x) belongs to expert ``expert_of[t]``, which lives on rank
              ``expert_of[t] // (num_experts // p)``. Send every token to its expert's rank;
              there call ``expert_fn(e, rows)`` ONCE per local expert e, on its rows from
              every source rank concatenated in source order (token order within a source);
              send the results back and put each one in its token's row.
    APPROACH: order = argsort(expert_of, stable=True); counts per expert (``torch.bincount``);
              swap the counts with your pairwise all-to-all (E/p per pair) so each rank knows
              how many rows of each source belong to each of its experts; the rows go with
              ``all_to_all_uneven``-style splits; the results come back with the splits
              swapped; un-permute with argsort(order).
    EXAMPLE:  p = 2, 4 experts (0, 1 on rank 0; 2, 3 on rank 1); rank 0's tokens go to
              experts [3, 0, 3]: token 1 stays (expert 0), tokens 0 and 2 go to rank 1,
              where expert 3 sees rank 0's two rows first, then rank 1's own.
    HINT:     the expert's batch for expert e on rank q: for s in 0..p−1, the rows source s
              sent for e. Call expert_fn even for an expert with no rows, or skip it: both pass.
    CALLS:    ops.group_rank_and_size
    """
    raise NotImplementedError("Lesson 11, task 5: moe_dispatch_combine")


def topk_dispatch_combine(x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor, num_experts: int,
                          capacity: int, expert_fn, group=None):
    """Lesson 11, task 6: top-k dispatch and combine with a capacity; return ``(out, dropped)``.

    TODO:     choice j of token t goes to expert ``experts[t, j]`` with weight ``gates[t, j]``.
              Each expert takes at most ``capacity`` rows from this rank: every token's first
              choice, in token order, takes its slot before any second choice, and so on;
              choices past the capacity are dropped (count them). Dispatch the kept rows as in
              task 5 (each expert's rows from every source in source order, slot order within
              a source; ``expert_fn(e, rows)`` once per local expert), bring the results back
              and return out[t] = Σ_j gates[t, j] · (result of choice j), kept choices only.
    APPROACH: slots: for j in 0..k−1, for each token in order, slot = how many the expert
              already took; then sort the kept (t, j) by (expert, slot) and go on as task 5.
    EXAMPLE:  capacity 1, two tokens both choosing experts [0, 1] and [1, 0]: token 0's first
              choice takes expert 0's slot, token 1's first choice expert 1's; both second
              choices are dropped: dropped = 2.
    HINT:     a dropped choice adds nothing to out[t]; ``index_add_`` sums by token.
    CALLS:    ops.group_rank_and_size
    """
    raise NotImplementedError("Lesson 11, task 6: topk_dispatch_combine")


def balance_experts(bias: torch.Tensor, expert: torch.Tensor, probs: torch.Tensor, gamma: float,
                    group=None) -> torch.Tensor:
    """Lesson 11, task 7: balance the experts, with a loss and with a bias.

    TODO:     ``expert`` [T, k]: this rank's chosen experts; ``probs`` [T, E]: its router's
              probabilities. Return the load-balancing loss of this rank's tokens,
              E · Σ_e f_e · P_e, f_e the share of the T·k choices that went to expert e and
              P_e the mean of ``probs[:, e]`` (a 0-d tensor). Then move ``bias`` in place:
              bias[e] += gamma · sign(mean load − load[e]), where load[e] counts the choices
              of expert e on EVERY rank of the group.
    APPROACH: count with ``torch.bincount``; the loads of every rank arrive by messages
              (your pairwise all-to-all can send each rank the same E counts).
    EXAMPLE:  E = 4, loads [6, 2, 2, 2] over all ranks (mean 3): the bias moves by
              [−γ, +γ, +γ, +γ]: the busy expert is chosen less next time.
    HINT:     the loss is smallest, 1, when choices and probabilities are both uniform.
    CALLS:    ops.group_rank_and_size, ops.rank_device
    """
    raise NotImplementedError("Lesson 11, task 7: balance_experts")


if __name__ == "__main__":
    run_tasks(LESSON)
