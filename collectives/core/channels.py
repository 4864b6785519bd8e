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

What comes back from such a rank -- its stream and its result -- is read with
:func:`sealed_loads`: plain data, tensors and the course's own types come back as they were
sent; an object of any other class (the student's own, ``unittest.mock.ANY``) comes back as a
:class:`Foreign` that equals nothing, and no code of the student's runs in the launcher.
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
        if module == "torch" or module.startswith("collectives."):
            found = super().find_class(module, name)
            # torch's dtypes and devices, and the course's own classes -- never a function to call
            if module == "torch" and not callable(found) or isinstance(found, type) and module != "torch":
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
    """A fresh secret, in the launcher."""
    return os.urandom(8)


def drain(conn, into: list) -> bool:
    """Read every object waiting on ``conn`` into ``into``; False once the writer has gone."""
    try:
        while conn.poll():
            into.append(sealed_loads(conn.recv_bytes()))
    except (EOFError, OSError):
        return False
    return True
