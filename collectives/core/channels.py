"""Two private channels between the launcher and each rank, beside the result pipe.

* **a secret in** -- ``launch.run(..., secrets=True)`` draws a random 64-bit number per rank
  *after* every rank has been forked and sends each rank its own through a pipe of its
  own. A rank reads it with :func:`secret`. No rank can know another's without
  communicating: it was never in the memory they were forked from. The grader draws its
  inputs from these numbers, and knows them itself.
* **a stream out** -- :func:`send` writes an object to the launcher as the rank goes,
  where the rank can no longer change or withdraw it: the grader's record of every
  message a rank makes travels this way. ``launch.run_world`` returns each rank's stream.

Both exist only in ranks started with them; elsewhere :func:`secret` and :func:`send`
raise ``RuntimeError``.
"""

from __future__ import annotations

import os
import pickle
import threading
from typing import Any

_secret: int | None = None
_stream = None          # this rank's write end of its stream (a multiprocessing Connection)
_sent = 0               # objects sent on it so far
_lock = threading.Lock()  # calls come from several threads too (lesson 7's lanes): one object at a time


def secret() -> int:
    """This rank's secret, from the launcher (``launch.run(..., secrets=True)``)."""
    if _secret is None:
        raise RuntimeError("no secret: this rank was not started with launch.run(..., secrets=True)")
    return _secret


def has_stream() -> bool:
    return _stream is not None


def send(obj: Any) -> None:
    """Send ``obj`` to the launcher on this rank's stream (``launch.run_world(..., stream=True)``)."""
    global _sent
    if _stream is None:
        raise RuntimeError("no stream: this rank was not started with launch.run_world(..., stream=True)")
    data = pickle.dumps(obj)
    with _lock:
        _stream.send_bytes(data)
        _sent += 1


def sent() -> int:
    """How many objects this rank has sent on its stream."""
    return _sent


def _install(secret_conn, stream_conn) -> None:
    """In a new rank: read the secret (blocks until the launcher sends it), keep the stream."""
    global _secret, _stream, _sent
    _sent = 0
    if secret_conn is not None:
        _secret = int.from_bytes(secret_conn.recv_bytes(), "little")
        secret_conn.close()
    _stream = stream_conn


def _reset() -> None:
    global _secret, _stream, _sent
    _secret, _stream, _sent = None, None, 0


os.register_at_fork(after_in_child=_reset)


def draw() -> bytes:
    """A fresh secret, in the launcher."""
    return os.urandom(8)


def drain(conn, into: list) -> bool:
    """Read every object waiting on ``conn`` into ``into``; False once the writer has gone."""
    try:
        while conn.poll():
            into.append(pickle.loads(conn.recv_bytes()))
    except (EOFError, OSError):
        return False
    return True
