"""The key-value interface over a c10d store: ``TCPStore`` (backend ``c10d``), ``FileStore``
(backend ``file``) or ``HashStore``.

A non-blocking ``get`` is ``check`` then ``get``: a ``compare_set`` probe would be one
round trip, but on the libuv TCPStore a ``compare_set`` of a missing key wakes every
client waiting on it. ``get_woken``, the read of a key a wait just saw, is that probe.
``wait`` is TCPStore's server-side blocking wait (``wait_woken``), re-checked after it
returns so that a spurious wake-up never passes for the key. A TCPStore server
drops the connection of a client that ``add``s to a non-integer value, so a failed
``add`` reconnects and looks at the value to tell corrupt state (:class:`KVStateError`)
from a lost server (:class:`KVConnectionError`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from rallypoint._core.blocking import call_in_thread
from rallypoint._core.forking import fork_safe_lock
from rallypoint.rendezvous._kv import KeyValueStore, KVConnectionError, KVStateError

if TYPE_CHECKING:
    from rallypoint._core.torch_c import TCPStore, TorchStore

_T = TypeVar("_T")
_ABSENT = b"\x00rallypoint: no such key\x00"
"""The expected value of :meth:`C10dKV.get_woken`'s probe: no record holds it."""
_SIDE: dict[tuple[int, str], C10dKV] = {}
_SIDE_LOCK = fork_safe_lock()


class _NoAnswer(RuntimeError):
    """A TCPStore connect that did not finish within its timeout."""


_PROBE_TIMEOUT = 0.2
"""Seconds spent finding out why a TCPStore did not answer, after its timeout."""


def _why_no_answer(host: str, port: int) -> str:
    """Why a connect to a TCPStore did not finish: one plain TCP connect tells."""

    def probe() -> str:
        try:
            with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT):
                return "it accepts connections but does not answer like a TCPStore"
        except ConnectionRefusedError:
            return "connection refused"
        except OSError as exc:
            return f"no answer ({exc.strerror or type(exc).__name__})"

    try:
        return call_in_thread(
            probe,
            timeout=_PROBE_TIMEOUT,
            name="rallypoint-tcpstore-probe",
            finishes_within=_PROBE_TIMEOUT + 1.0,
        )
    except TimeoutError:
        return "no answer"


def _is_timeout(exc: BaseException) -> bool:
    return "timeout" in str(exc).lower() and "connect" not in str(exc).lower()


class C10dKV(KeyValueStore):
    """Adapts a ``torch.distributed.Store`` to :class:`KeyValueStore`.

    Args:
        store: the store (a TCPStore client or server, a FileStore, a HashStore).
        endpoint: where it lives, for error messages (``host:port`` or a path).
        connect: makes a new independent client to the same data (for :meth:`clone` and
            reconnects); ``None`` shares ``store`` (fine for FileStore/HashStore).
        share_key: clones of KVs with the same key share one side connection per process.
    """

    native_append = True

    def __init__(
        self,
        store: TorchStore,
        *,
        endpoint: str,
        connect: Callable[[], TorchStore] | None = None,
        share_key: str | None = None,
    ) -> None:
        self._store = store
        self.endpoint = endpoint
        self._connect = connect
        self._share_key = share_key

    @property
    def store(self) -> TorchStore:
        """The underlying torch store."""
        return self._store

    def _fail(self, op: str, exc: BaseException) -> KVConnectionError:
        return KVConnectionError(
            f"The store at {self.endpoint} failed during {op}: {type(exc).__name__}: {exc}"
        )

    def _call(self, op: str, call: Callable[..., _T], *args: Any) -> _T:
        try:
            return call(*args)
        except (RuntimeError, ValueError) as exc:
            raise self._fail(op, exc) from exc

    def set(self, key: str, value: bytes) -> None:
        self._call("set", self._store.set, key, value)
        # a TCPStore client sends a set without waiting for the server, which serves a
        # connection's requests in order: a round trip after it returns once the write
        # is applied, so every other connection reads it from then on
        self._call("set", self._store.check, [key])

    def get(self, key: str) -> bytes | None:
        # check-then-get: never compare_set on a missing key, which (libuv TCPStore)
        # wakes every client waiting on that key.
        try:
            if not self._store.check([key]):
                return None
            return bytes(self._store.get(key))
        except (RuntimeError, ValueError) as exc:
            raise self._fail("get", exc) from exc

    def get_woken(self, key: str) -> bytes | None:
        # one round trip: a compare_set that never matches answers the value, or the
        # expected value where the key is missing (and then wakes that key's waiters,
        # which re-check or read: a wake-up is no value)
        value = bytes(self._call("get", self._store.compare_set, key, _ABSENT, _ABSENT))
        return None if value == _ABSENT else value

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        try:
            if self._store.check(list(keys)):
                return [bytes(v) for v in self._store.multi_get(list(keys))]
        except (RuntimeError, ValueError) as exc:
            raise self._fail("multi_get", exc) from exc
        return [self.get(key) for key in keys]

    def multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        if not items:
            return
        self._call("multi_set", self._store.multi_set, [k for k, _ in items], [v for _, v in items])
        self._call("multi_set", self._store.check, [items[0][0]])  # applied on return, as set()

    def add(self, key: str, amount: int) -> int:
        try:
            return int(self._store.add(key, amount))
        except (RuntimeError, ValueError) as exc:
            failure = exc
        # Either the value is not an integer or the store is gone: look with a fresh client
        # (unless nothing listens there any more: a TCPStore connect would retry that
        # refusal for its whole timeout)
        host, _, port = self.endpoint.rpartition(":")
        if self._connect is not None and port.isdigit():
            why = _why_no_answer(host.strip("[]"), int(port))
            if why == "connection refused":
                raise KVConnectionError(
                    f"The store at {self.endpoint} failed during add: {why}"
                ) from failure
        if self._connect is not None:
            try:
                self._store = self._connect()
            except (RuntimeError, ValueError) as exc:
                raise self._fail("add", exc) from exc
        value = self.get(key)
        if value is not None:
            try:
                int(value)
            except ValueError:
                raise KVStateError(
                    f"The key {key!r} in the store at {self.endpoint} holds {value[:40]!r}, "
                    "not an integer counter."
                ) from failure
        raise self._fail("add", failure) from failure

    def append(self, key: str, value: bytes) -> None:
        self._call("append", self._store.append, key, value)  # (it waits for no answer)

    def set_if_absent(self, key: str, value: bytes) -> bytes:
        if not value:
            raise ValueError("set_if_absent needs a non-empty value")
        return bytes(self._call("set_if_absent", self._store.compare_set, key, b"", value))

    def compare_and_swap(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return bytes(
            self._call("compare_and_swap", self._store.compare_set, key, expected, desired)
        )

    def wait(self, keys: Sequence[str], timeout: timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        while self.wait_woken(keys, timeout):
            if self.check(keys):
                return True
            timeout = timedelta(seconds=deadline - time.monotonic())
        return False

    def wait_woken(self, keys: Sequence[str], timeout: timedelta) -> bool:
        if timeout <= timedelta(0):
            return self.check(keys)
        try:
            self._store.wait(list(keys), timeout)
            return True
        except (RuntimeError, ValueError) as exc:
            if _is_timeout(exc):
                return False
            raise self._fail("wait", exc) from exc

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call("check", self._store.check, list(keys)))

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", self._store.delete_key, key))

    def clone(self) -> C10dKV:
        """A connection for background (non-blocking) operations, shared per process.

        A TCPStore client serialises its operations, so one side connection serves the
        heartbeats of every handler in a process without queueing behind their blocking
        waits, and N threads do not open N more connections.
        """
        if self._connect is None:
            return self
        if self._share_key is None:
            return C10dKV(self._new_client(), endpoint=self.endpoint, connect=self._connect)
        key = (os.getpid(), self._share_key)
        with _SIDE_LOCK:
            side = _SIDE.get(key)
            if side is None:
                side = C10dKV(self._new_client(), endpoint=self.endpoint, connect=self._connect)
                _SIDE[key] = side
        return side

    def _new_client(self) -> TorchStore:
        assert self._connect is not None
        return self._call("connect", self._connect)

    def torch_store(self, prefix: str) -> TorchStore:
        from rallypoint._core.torch_c import PrefixStore

        return PrefixStore(prefix, self._store)


def tcp_kv(
    host: str, port: int, *, is_server: bool, timeout: timedelta
) -> tuple[C10dKV, TCPStore | None]:
    """Connect to (or host, if ``is_server``) a TCPStore; return the KV and the server.

    ``port`` 0 with ``is_server`` picks a free port. Raises :class:`KVConnectionError`
    naming ``host:port`` when the store cannot be reached or hosted.
    """
    from rallypoint._core.torch_c import TCPStore

    server: TCPStore | None = None
    try:
        if is_server:
            server = TCPStore(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                multi_tenant=True,
                timeout=timeout,
            )
            port = server.port
    except (RuntimeError, ValueError) as exc:
        raise KVConnectionError(
            f"Cannot host the TCPStore at {host}:{port}: {type(exc).__name__}: {exc}"
        ) from exc

    seconds = timeout.total_seconds()

    def connect() -> TCPStore:
        # torch's connect can take twice its timeout (a retry after the first one ran
        # out), and its ping blocks in recv for good on a server that accepted and never
        # answers; a thread bounds both (see rallypoint._core.blocking)
        try:
            return call_in_thread(
                lambda: TCPStore(host, port, is_master=False, timeout=timeout),
                timeout=seconds,
                name="rallypoint-tcpstore-connect",
                finishes_within=2 * seconds + 1.0,
            )
        except TimeoutError:
            raise _NoAnswer(_why_no_answer(host, port)) from None

    try:
        client = connect()
    except (RuntimeError, ValueError) as exc:
        why = str(exc) if isinstance(exc, _NoAnswer) else f"{type(exc).__name__}: {str(exc)[:200]}"
        raise KVConnectionError(
            f"Cannot reach the TCPStore at {host}:{port} within {seconds:g} s: {why}"
        ) from exc
    endpoint = f"{host}:{port}"
    kv = C10dKV(client, endpoint=endpoint, connect=connect, share_key=f"tcp://{endpoint}")
    return kv, server


def file_kv(path: str) -> C10dKV:
    """A KV over a ``FileStore`` at ``path`` (a file every node can reach)."""
    from rallypoint._core.torch_c import FileStore

    try:
        store = FileStore(path, -1)
    except (RuntimeError, ValueError) as exc:
        raise KVConnectionError(
            f"Cannot open the FileStore at {path}: {type(exc).__name__}: {exc}"
        ) from exc
    return C10dKV(store, endpoint=path, connect=lambda: FileStore(path, -1))
