"""The relay (collectives.core.relay): a graded world's messages carried by the launching
process, each written down there, with gloo's semantics -- matched by sender, tag and group
in order, any source, sends to self, every dtype bit for bit, a send that waits for its
receive (two ranks that both send first deadlock and the watchdog names both), and a size
mismatch that fails naming both ranks."""

import pytest
import torch
import torch.distributed as dist

from collectives.core import launch
from collectives.course.grading.tasks import fence, tap


class _Planted:
    """Unpickled, it would make a folder: in the launcher, if the relay unpickled what ranks write."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os
        return os.mkdir, (self.path,)


def _messages(planted: str):
    r, p = dist.get_rank(), dist.get_world_size()
    out = {}
    x = torch.arange(5, dtype=torch.int64) + 100 * r
    y = torch.empty(5, dtype=torch.int64)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (r + 1) % p),
                                     dist.P2POp(dist.irecv, y, (r - 1) % p)]):
        w.wait()
    out["ring"] = y.tolist()
    odd = torch.tensor([1.5, -0.0, float("inf"), float("nan")], dtype=torch.bfloat16)
    flags = torch.tensor([True, False, True])
    if r == 1:                                   # two tags, sent in the opposite order to their receives
        works = [dist.isend(odd, 0, tag=7), dist.isend(flags, 0, tag=3)]
        dist.send(torch.tensor([11.0]), 0)
        for w in works:
            w.wait()
    if r == 2:
        dist.send(torch.tensor([22.0]), 0)
    if r == 0:
        got_flags, got_odd = torch.empty(3, dtype=torch.bool), torch.empty(4, dtype=torch.bfloat16)
        dist.recv(got_flags, 1, tag=3)
        dist.recv(got_odd, 1, tag=7)
        out["bits"] = (got_odd.view(torch.int16).tolist() == odd.view(torch.int16).tolist(),
                       got_flags.tolist())
        anyone = []
        for _ in range(2):
            src = dist.recv(t := torch.empty(1))
            anyone.append((src, t.item()))
        out["any"] = sorted(anyone)
    me = torch.tensor([float(r)])
    back = torch.empty(1)
    works = [dist.isend(me, r), dist.irecv(back, r)]    # to itself
    for w in works:
        w.wait()
    out["self"] = back.item()
    g = dist.new_group([1, 2])
    dist.new_group([1, 2])                       # a second group of the same ranks: its own channel
    if r in (1, 2):
        v = torch.tensor([float(r)])
        if r == 1:
            dist.send(v, 2, group=g, tag=5)
        else:
            dist.recv(v, 1, group=g, tag=5)
        out["group"] = v.item()
    if r == 2:                                   # a pickle written straight into the relay's pipe
        import pickle
        import struct

        from collectives.core import relay
        head = pickle.dumps({"k": "m", "dst": 0, "x": _Planted(planted)})
        relay._conn.send_bytes(struct.pack("<I", len(head)) + head)
    return out


def _mismatch():
    if dist.get_rank() == 0:
        dist.send(torch.ones(3), 1)
    else:
        dist.recv(torch.ones(4), 0)


def _both_send_first():
    r = dist.get_rank()
    dist.send(torch.ones(2), 1 - r)
    dist.recv(torch.ones(2), 1 - r)


def test_messages_cross_as_under_gloo_and_the_launcher_writes_each_down(tmp_path):
    planted = tmp_path / "planted"
    world = launch.run_world(_messages, 3, args=(str(planted),), backend=fence.BACKEND, relay=tap.digest,
                             timeout=60)
    res = world.results
    assert [r["ring"] for r in res] == [[200 + i for i in range(5)], [i for i in range(5)], [100 + i for i in range(5)]]
    assert res[0]["bits"] == (True, [True, False, True])
    assert res[0]["any"] == [(1, 11.0), (2, 22.0)]
    assert [r["self"] for r in res] == [0.0, 1.0, 2.0]
    assert res[2]["group"] == 1.0
    # the launcher's record: rank 1 sent, in order, the ring's message, bf16, bool, one float, the group's
    sent = [(dst, dtype, n) for dst, dtype, n, _ in world.relayed[1]]
    assert sent == [(2, "int64", 5), (0, "bfloat16", 4), (0, "bool", 3), (0, "float32", 1), (1, "float32", 1),
                    (2, "float32", 1)]
    assert world.relayed[1][0][3] == tap.digest(torch.arange(5, dtype=torch.int64) + 100)
    # what a rank writes into its pipe is read as data, never run: the launcher read no pickle
    assert not planted.exists()
    assert len(world.relay_problems) == 1 and world.relay_problems[0].startswith("rank 2: wrote a frame the relay "
                                                                                 "cannot read"), world.relay_problems


def test_a_size_mismatch_fails_naming_both_ranks_and_two_first_sends_deadlock_as_under_gloo():
    with pytest.raises(launch.RankError, match="rank 0 sent 3 elements of float32; the receive on rank 1 "
                                               "expects 4 of float32"):
        launch.run_world(_mismatch, 2, backend=fence.BACKEND, relay=tap.digest, timeout=30)
    with pytest.raises(launch.WorldTimeout) as hung:
        launch.run_world(_both_send_first, 2, backend=fence.BACKEND, relay=tap.digest, timeout=3)
    assert "rank 0 waiting in send to rank 1" in str(hung.value)
    assert "rank 1 waiting in send to rank 0" in str(hung.value)
