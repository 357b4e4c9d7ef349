"""Healing from a live peer: a group's state streamed over an authenticated connection.

Each rank of a replica group runs a :class:`HealServer`. While its group is the source of a
heal (between a quorum and the next commit: the model and optimizer do not change then),
it serves its state for that step; a lagging group's rank of the same group rank fetches
it (:func:`fetch_state`). The connection is authenticated first (the mutual HMAC challenge
of :mod:`rallypoint._core.handshake` over the job's secret), and nothing is unpickled: the
state travels as a typed JSON skeleton (dicts with any scalar keys, lists, tuples, numbers,
strings, dtypes, devices, tensor references) and then the tensors' raw bytes, streamed.

Errors: :class:`HealError` (no state for that step, a skeleton or tensor that does not fit,
the peer not of the job), with the source's address.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import socket
import struct
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from rallypoint._core.fatal import FatalError
from rallypoint._core.handshake import (
    HandshakeError,
    Scheme,
    client_handshake,
    recv_exact,
    recv_into,
    server_handshake,
)

__all__ = [
    "HealError",
    "HealServer",
    "IncompatibleStateError",
    "decode_skeleton",
    "encode_skeleton",
    "fetch_state",
    "mismatch",
]

SCHEME = Scheme(
    what="heal",
    magic=b"RPHEAL01",
    client_label=b"rallypoint-heal-client",
    server_label=b"rallypoint-heal-server",
    hello=True,
)
_LEN = struct.Struct("<Q")
_MAX_HEADER = 64 << 20
_CHUNK = 8 << 20
MAX_CONNECTIONS = 64
"""Connections a heal server serves at once (a heal takes one per healing group)."""
HANDSHAKE_TIMEOUT = 5.0
"""Seconds a connection has to authenticate before it is dropped."""


class HealError(RuntimeError):
    """A heal that cannot be done: what and from where."""


class IncompatibleStateError(HealError, FatalError):
    """A peer's state has other tensors than this group's (another model): the group's job
    ends, before it sends a byte of a collective that would not match."""


def mismatch(mine: Any, theirs: Any, path: str = "state") -> str:
    """Where two states' tensors differ, at the same place in both (``""``: they fit; a
    place only one has, an optimizer's moments before its first step say, is no misfit)."""
    if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
        if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            return (
                f"{path} is {theirs.dtype} {tuple(theirs.shape)} where this group's is "
                f"{mine.dtype} {tuple(mine.shape)}"
            )
        return ""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        pairs = [(k, mine[k], theirs[k], f"{path}[{k!r}]") for k in mine if k in theirs]
    elif isinstance(mine, list | tuple) and isinstance(theirs, list | tuple):
        pairs = [
            (i, a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(mine, theirs, strict=False))
        ]
    else:
        return ""
    for _, a, b, where in pairs:
        found = mismatch(a, b, where)
        if found:
            return found
    return ""


# ---------------------------------------------------------------------- the skeleton
def encode_skeleton(obj: Any, tensors: list[torch.Tensor], path: str = "state") -> Any:
    """``obj`` as JSON that says every type; tensors go to ``tensors`` (by reference)."""
    if obj is None or isinstance(obj, bool | str):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"f": repr(obj)}
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"T": len(tensors) - 1}
    if isinstance(obj, dict):
        return {
            "d": [
                [
                    encode_skeleton(k, tensors, f"{path} key"),
                    encode_skeleton(v, tensors, f"{path}[{k!r}]"),
                ]
                for k, v in obj.items()
            ]
        }
    if isinstance(obj, list):
        return {"l": [encode_skeleton(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, torch.Size):
        return {"sz": list(obj)}
    if isinstance(obj, tuple):
        return {"t": [encode_skeleton(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, torch.dtype):
        return {"dt": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"dev": str(obj)}
    if isinstance(obj, bytes):
        return {"b": base64.b64encode(obj).decode()}
    raise HealError(
        f"{path}: a {type(obj).__name__} cannot be sent to a healing group (a state dict "
        "holds tensors, numbers, strings and containers of them)"
    )


def decode_skeleton(node: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`encode_skeleton`; ``ValueError`` for anything else."""
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"not a heal skeleton node: {str(node)[:80]}")
    ((kind, value),) = node.items()
    if kind == "T":
        return tensors[int(value)]
    if kind == "d":
        return OrderedDict(
            (_hashable(decode_skeleton(k, tensors)), decode_skeleton(v, tensors)) for k, v in value
        )
    if kind == "l":
        return [decode_skeleton(v, tensors) for v in value]
    if kind == "t":
        return tuple(decode_skeleton(v, tensors) for v in value)
    if kind == "sz":
        return torch.Size(int(v) for v in value)
    if kind == "f":
        return float(str(value))
    if kind == "dt":
        dtype = getattr(torch, str(value), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {value!r}")
        return dtype
    if kind == "dev":
        return torch.device(str(value))
    if kind == "b":
        return base64.b64decode(str(value))
    raise ValueError(f"unknown heal skeleton kind {kind!r}")


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        raise ValueError("a dict key cannot be a list")
    return key


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


# ---------------------------------------------------------------------- the server
class HealServer:
    """Serves this rank's state for one step at a time, to authenticated peers."""

    def __init__(self, secret: bytes, host: str = "", timeout: float = 60.0) -> None:
        self.secret = secret
        self.timeout = timeout
        self._lock = threading.Condition()
        self._step: int | None = None
        self._state: Any = None
        self._serving = 0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        threading.Thread(target=self._accept, name="rallypoint-ft-heal", daemon=True).start()

    def allow(self, step: int, state: Any) -> None:
        """Serve ``state`` (a callable, read once per request, or the object) for ``step``."""
        with self._lock:
            self._step, self._state = step, state
            self._lock.notify_all()

    def disallow(self) -> None:
        """Stop serving; waits for the transfers under way (the state may change after)."""
        with self._lock:
            self._step, self._state = None, None
            while self._serving:
                self._lock.wait()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # more connections than any heal needs: a flood, dropped
                continue
            threading.Thread(target=self._serve_slot, args=(conn,), daemon=True).start()

    def _serve_slot(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            self._slots.release()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            # a stranger that does not authenticate within HANDSHAKE_TIMEOUT is dropped
            deadline = time.monotonic() + min(self.timeout, HANDSHAKE_TIMEOUT)
            try:
                hello = server_handshake(conn, self.secret, SCHEME, deadline)
            except (HandshakeError, OSError, TimeoutError):
                return  # not of the job, or gone: dropped
            deadline = time.monotonic() + self.timeout
            try:
                step = int(hello.get("step", -1))
            except (TypeError, ValueError):
                return
            state = self._wait_for(step, deadline)
            if state is None:
                _send_header(conn, {"error": f"no state for step {step} here"})
                return
            try:
                self._send_state(conn, state() if callable(state) else state)
            except (OSError, HealError) as exc:
                with contextlib.suppress(OSError):
                    _send_header(conn, {"error": str(exc)})
            finally:
                with self._lock:
                    self._serving -= 1
                    self._lock.notify_all()

    def _wait_for(self, step: int, deadline: float) -> Any:
        with self._lock:
            while self._step != step:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._lock.wait(min(left, 0.5))
            self._serving += 1
            return self._state

    @staticmethod
    def _send_state(conn: socket.socket, state: Any) -> None:
        tensors: list[torch.Tensor] = []
        skeleton = encode_skeleton(state, tensors)
        flat = [t.detach().to("cpu").contiguous() for t in tensors]
        meta = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in flat]
        _send_header(conn, {"skeleton": skeleton, "tensors": meta})
        for t in flat:
            view = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
            for start in range(0, len(view), _CHUNK):
                conn.sendall(view[start : start + _CHUNK])


def _send_header(conn: socket.socket, header: dict[str, Any]) -> None:
    body = json.dumps(header).encode()
    conn.sendall(_LEN.pack(len(body)) + body)


# ---------------------------------------------------------------------- the client
def fetch_state(address: str, secret: bytes, step: int, timeout: float) -> tuple[Any, int]:
    """The state ``address`` serves for ``step``, and how many tensor bytes came."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            client_handshake(sock, secret, SCHEME, deadline, hello={"step": step})
            (length,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
            if length > _MAX_HEADER:
                raise HealError(f"{address}: a heal header of {length} bytes")
            header = json.loads(recv_exact(sock, length, deadline))
            if "error" in header:
                raise HealError(f"{address}: {header['error']}")
            tensors = []
            total = 0
            for dtype, shape in header["tensors"]:
                t = torch.empty([int(s) for s in shape], dtype=_dtype(str(dtype)))
                if t.numel():
                    recv_into(sock, t.reshape(-1).view(torch.uint8).numpy().data, deadline)
                total += t.numel() * t.element_size()
                tensors.append(t)
            return decode_skeleton(header["skeleton"], tensors), total
    except HandshakeError as exc:
        raise HealError(f"{address}: {exc}") from exc
    except (OSError, TimeoutError, ValueError, KeyError) as exc:
        raise HealError(f"{address}: the heal failed: {type(exc).__name__}: {exc}") from exc
