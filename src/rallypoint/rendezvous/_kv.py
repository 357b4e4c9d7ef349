"""The small key-value interface every rendezvous backend implements.

The dynamic handler (``_dynamic``) speaks only :class:`KeyValueStore`; a backend is one
file that maps it onto a real store (``_kv_c10d`` for TCPStore/FileStore, ``_etcd.kv`` for
etcd v3, ``_kv_memory`` for an in-process fake), and every backend passes the same
contract suite (``rallypoint.testing._rendezvous_contract``). Each method says the
semantics every implementation keeps. Errors: :class:`KVConnectionError` and
:class:`KVStateError`, which the handler translates to ``RendezvousConnectionError`` and
``RendezvousStateError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rallypoint._core.torch_c import TorchStore


class KVError(Exception):
    """Base of the key-value errors (translated by the handler at its boundary)."""


class KVConnectionError(KVError):
    """The store cannot be reached (names the endpoint)."""


class KVStateError(KVError):
    """A key holds a value the operation cannot use."""


class KeyValueStore(ABC):
    """A shared key-value store as the dynamic rendezvous needs it.

    Keys are ``str``, values ``bytes``. :meth:`add` on a missing key counts from 0; the
    caller of :meth:`set_if_absent` won iff the value returned equals what it wrote;
    :meth:`wait` blocks server-side where the store allows it (no client polling);
    :meth:`clone` exists because a TCPStore client serialises its operations, so a
    blocking wait would stall a heartbeat sent through the same client.
    """

    #: a short human description of where the data lives, for error messages
    endpoint: str = ""
    native_append: bool = False  # append is one send of the store's (c10d), not a swap loop

    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Write ``value`` under ``key``; once it returns, every client reads it."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` if it is missing (never blocks)."""

    def get_woken(self, key: str) -> bytes | None:
        """As :meth:`get`, for a key that a wait just saw written (it is rarely missing: it
        was deleted since). Where a read of a missing key has a cost, it may be higher here
        (the c10d stores read in one round trip, and a missing key wakes its waiters)."""
        return self.get(key)

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` (``None`` where missing), ideally in one round trip."""
        return [self.get(key) for key in keys]

    def multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Write several keys, ideally in one round trip (not necessarily atomically)."""
        for key, value in items:
            self.set(key, value)

    @abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer under ``key``; return the new value."""

    def enroll(self, counter: str, member: str) -> int:
        """Take the next arrival number (1, 2, ...) at ``counter`` for ``member``: ``add``,
        unless a backend whose ``add`` retries under contention (etcd) has better."""
        return self.add(counter, 1)

    def enrolled(self, counter: str) -> int:
        """How many arrivals ``counter`` has had (0 if none)."""
        raw = self.get(counter)
        if raw is None:
            return 0
        try:
            return int(raw)
        except ValueError:
            raise KVStateError(
                f"The key {counter!r} at {self.endpoint} holds {raw[:40]!r}, not a counter."
            ) from None

    def append(self, key: str, value: bytes) -> None:
        """Append ``value`` to ``key``'s value atomically (this connection's next call sees it)."""
        old = b""
        while (now := self.compare_and_swap(key, old, old + value)) != old + value:
            old = now if now != old else b""  # (a missing key answers with ``old``)

    @abstractmethod
    def set_if_absent(self, key: str, value: bytes) -> bytes:
        """Write ``value`` only if ``key`` is missing; return the value now stored."""

    @abstractmethod
    def compare_and_swap(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Write ``desired`` if the value equals ``expected``; return the value now stored.
        A missing key matches an empty ``expected``; a missing key with a non-empty
        ``expected`` is left missing and ``expected`` is returned (c10d's semantics)."""

    @abstractmethod
    def wait(self, keys: Sequence[str], timeout: timedelta) -> bool:
        """Block until every key exists (``True``) or ``timeout`` passes (``False``)."""

    def wait_woken(self, keys: Sequence[str], timeout: timedelta) -> bool:
        """As :meth:`wait`, without a round trip to check the keys once woken (a caller that
        reads them next, and takes a missing one in its stride)."""
        return self.wait(keys, timeout)

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""

    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete several keys (missing ones are fine), ideally in few round trips."""
        for key in keys:
            self.delete(key)

    @abstractmethod
    def clone(self) -> KeyValueStore:
        """An independent connection to the same data (for another thread)."""

    @abstractmethod
    def torch_store(self, prefix: str) -> TorchStore:
        """A ``torch.distributed.Store`` over the same data whose keys live under ``prefix``."""

    def compact(self, keep: int = 10_000) -> None:  # noqa: B027 - optional hook
        """Drop all but the newest ``keep`` revisions of history (etcd's quota counts them)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections (the data stays)."""
