"""Two private channels between the launcher and each rank, beside the result pipe.

* **a secret in** -- ``launch.run(..., secrets=True)`` draws a random 64-bit number per rank
  *after* every rank has been forked and sends each rank its own through a pipe of its
  own. A rank reads it with :func:`secret`. No rank can know another's without
  communicating: it was never in the memory they were forked from. The grader draws its
  inputs from these numbers, and knows them itself.
* **a stream out** -- the sender :func:`recorder` hands out, once, writes an object to the
  launcher as the rank goes, where the rank can no longer change or withdraw it: the
  grader's record of every message a rank makes travels this way. ``launch.run_world``
  returns each rank's stream. Each object is signed with a key that came in with the secret
  and that only the sender holds (a closure, not a module's name): :func:`opened` reads a
  stream back in the launcher and turns every object without the right signature, in the
  right order, into a :class:`Forged`. Code that reaches for the course's channel by its
  name finds no sender; what it writes on the pipe by other means is not evidence.

Both exist only in ranks started with them; elsewhere :func:`secret` and :func:`recorder`
raise ``RuntimeError``.

What comes back from such a rank -- its stream and its result -- is read with
:func:`sealed_loads`: plain data, tensors and the course's record types (:data:`COURSE_RECORDS`,
an explicit list) come back as they were sent; an object of any other class (the student's
own, ``unittest.mock.ANY``) comes back as a :class:`Foreign` that equals nothing, and no
code of the student's runs in the launcher.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import threading
from typing import Any, Callable

SECRET_BYTES, KEY_BYTES = 8, 16
_secret: int | None = None
_stream = None          # this rank's write end of its stream, until recorder() takes it
_key: bytes | None = None   # the stream's signing key, until recorder() takes it
_sent = 0               # objects sent on it so far
_lock = threading.Lock()  # calls come from several threads too (lesson 7's lanes): one object at a time


def secret() -> int:
    """This rank's secret, from the launcher (``launch.run(..., secrets=True)``)."""
    if _secret is None:
        raise RuntimeError("no secret: this rank was not started with launch.run(..., secrets=True)")
    return _secret


def has_stream() -> bool:
    return _stream is not None


def recorder() -> Callable[[Any], None]:
    """The sender of this rank's stream (``launch.run_world(..., stream=True)``), handed out
    once: the first caller holds it, and the module forgets the pipe and its key."""
    global _stream, _key
    if _stream is None:
        raise RuntimeError("no stream: this rank was not started with launch.run_world(..., stream=True), "
                           "or its sender was taken already")
    stream, key, seq = _stream, _key or b"", [0]
    _stream = _key = None

    def send(obj: Any) -> None:
        global _sent
        data = pickle.dumps(obj)
        with _lock:
            stream.send_bytes(_sign(key, seq[0], data) + data)
            seq[0] += 1
            _sent = seq[0]
    return send


def _sign(key: bytes, seq: int, data: bytes) -> bytes:
    return hmac.new(key, seq.to_bytes(8, "little") + data, hashlib.sha256).digest()[:16]


class Forged:
    """An object on a rank's stream without the sender's signature (or out of its order):
    written by something other than the course's recorder, and never read as a record."""

    def __init__(self, position: int):
        self.position = position

    def __repr__(self):
        return f"<a forged object at position {self.position} of the stream>"


def opened(raw: list[bytes], key: bytes) -> list[Any]:
    """A rank's stream as the launcher received it (``World.streams`` of a graded world) read
    back: each signed object, sealed (:func:`sealed_loads`); a :class:`Forged` for the rest."""
    out: list[Any] = []
    seq = 0
    for position, item in enumerate(raw):
        mac, data = (item[:16], item[16:]) if isinstance(item, bytes) else (b"", b"")
        if not mac or not hmac.compare_digest(mac, _sign(key, seq, data)):
            out.append(Forged(position))
            continue
        seq += 1
        try:
            out.append(sealed_loads(data))
        except pickle.UnpicklingError:
            out.append(Forged(position))
    return out


def sent() -> int:
    """How many objects this rank has sent on its stream."""
    return _sent


def _install(secret_conn, stream_conn) -> None:
    """In a new rank: read the secret (blocks until the launcher sends it), keep the stream."""
    global _secret, _stream, _sent, _key
    _sent = 0
    if secret_conn is not None:
        drawn = secret_conn.recv_bytes()
        _secret = int.from_bytes(drawn[:SECRET_BYTES], "little")
        _key = drawn[SECRET_BYTES:]
        secret_conn.close()
    _stream = stream_conn


def _reset() -> None:
    global _secret, _stream, _sent, _key
    _secret, _stream, _sent, _key = None, None, 0, None


os.register_at_fork(after_in_child=_reset)


class Foreign:
    """What a graded rank sent of a class that is neither plain data, torch's nor the course's:
    it equals nothing (not even another Foreign) and says what it was."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    __hash__ = object.__hash__

    def __setstate__(self, state):
        pass

    def __repr__(self):
        return f"<an object of {getattr(type(self), 'origin', 'a foreign class')}: not plain data, judged as wrong>"


_BUILTINS = {"list", "dict", "set", "frozenset", "tuple", "int", "float", "complex", "bool", "str", "bytes",
             "bytearray", "slice", "range", "NoneType", "object"}
# what a tensor, a numpy array and the course's records are rebuilt from: nothing else is called
_REBUILD = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
            ("torch._utils", "_rebuild_parameter_with_state"), ("torch._tensor", "_rebuild_from_type_v2"),
            ("collections", "OrderedDict"), ("copyreg", "_reconstructor"), ("torch", "Size"), ("torch", "device"),
            ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"), ("numpy", "ndarray"),
            ("numpy", "dtype")}


COURSE_RECORDS = {
    ("collectives.course.grading.tasks.tap", "Call"),
    ("collectives.course.grading.tasks.world", "Outcome"),
    ("collectives.course.grading.tasks.allreduce", "CaseRecord"),
    ("collectives.course.verify", "Case"),
    ("collectives.sparse.all_reduce", "SparseInfo"),
    ("collectives.sparse.split", "SplitInfo"),
}
"""The course's own classes a graded rank may send back, by name: nothing else under
``collectives`` is rebuilt (a module a rank wrote into the tree is never imported here)."""


def _storage_from_bytes(data: bytes):
    """A tensor's storage as ``pickle`` sends it, read by torch's own loader for plain data."""
    import io

    import torch
    return torch.load(io.BytesIO(data), weights_only=True)


class _Sealed(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module == "builtins" and name in _BUILTINS) or (module, name) in _REBUILD:
            return super().find_class(module, name)
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if (module, name) in COURSE_RECORDS:
            return super().find_class(module, name)
        if module == "torch":
            found = super().find_class(module, name)
            if not callable(found):           # torch's dtypes and layouts -- never a function to call
                return found
        return _foreign(module, name)


def _foreign(module: str, name: str) -> type:
    return type("Foreign", (Foreign,), {"origin": f"{module}.{name}"})


def sealed_loads(data: bytes) -> Any:
    """``pickle.loads`` for what a graded rank sent (see the module doc): foreign classes become
    :class:`Foreign`; data that cannot be read that way raises ``pickle.UnpicklingError``."""
    import io
    try:
        return _Sealed(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as exc:  # noqa: BLE001 - a foreign object's reconstruction failing: unreadable
        raise pickle.UnpicklingError(f"the rank sent an object that is not plain data ({type(exc).__name__}: {exc})")


def draw() -> bytes:
    """A fresh secret and the key that signs the rank's stream, in the launcher."""
    return os.urandom(SECRET_BYTES + KEY_BYTES)


def secret_of(drawn: bytes) -> int:
    return int.from_bytes(drawn[:SECRET_BYTES], "little")


def key_of(drawn: bytes) -> bytes:
    return drawn[SECRET_BYTES:]


def drain(conn, into: list) -> bool:
    """Read every item waiting on ``conn`` into ``into``, as bytes (read back with
    :func:`opened`); False once the writer has gone."""
    try:
        while conn.poll():
            into.append(conn.recv_bytes())
    except (EOFError, OSError):
        return False
    return True
