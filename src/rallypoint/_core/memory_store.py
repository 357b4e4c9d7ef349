"""A :class:`~rallypoint._core.store.Store` in this process's memory, written in Python.

The store of a job that has one node: its restart loop keeps the round's claim, decision,
failure records and restart budget here, as a multi-node job keeps them on its rendezvous
backend, without importing torch or opening a socket. Threads share it; ``get`` and
``wait`` sleep on a condition until a key is set or the timeout passes (``LookupError``,
as torch's stores raise a timeout).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta

__all__ = ["MemoryStore"]


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class _Data:
    """The keys and the condition that every view of one store shares."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.changed = threading.Condition()


class MemoryStore:
    """Keys in a dict; :meth:`under` gives a view with every key under a prefix (what
    torch's ``PrefixStore`` does for its stores)."""

    def __init__(
        self, timeout: timedelta = timedelta(seconds=300), *, _data: _Data | None = None
    ) -> None:
        self._data = _data or _Data()
        self._prefix = ""
        self._timeout = timeout

    def under(self, prefix: str) -> MemoryStore:
        """A view of this store with every key under ``prefix/``."""
        view = MemoryStore(self._timeout, _data=self._data)
        view._prefix = f"{self._prefix}{prefix}/"
        return view

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: str | bytes, /) -> None:
        with self._data.changed:
            self._data.values[self._key(key)] = _as_bytes(value)
            self._data.changed.notify_all()

    def get(self, key: str, /) -> bytes:
        self.wait([key])
        with self._data.changed:
            return self._data.values[self._key(key)]

    def add(self, key: str, amount: int, /) -> int:
        with self._data.changed:
            full = self._key(key)
            count = int(self._data.values.get(full, b"0")) + amount
            self._data.values[full] = str(count).encode()
            self._data.changed.notify_all()
            return count

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes, /
    ) -> bytes:
        with self._data.changed:
            full = self._key(key)
            held = self._data.values.get(full)
            expected = _as_bytes(expected_value)
            if (held is None and not expected) or held == expected:
                held = self._data.values[full] = _as_bytes(desired_value)
                self._data.changed.notify_all()
            elif held is None:  # torch's stores answer the expected value then
                return expected
            return held

    def append(self, key: str, value: str | bytes, /) -> None:
        with self._data.changed:
            full = self._key(key)
            self._data.values[full] = self._data.values.get(full, b"") + _as_bytes(value)
            self._data.changed.notify_all()

    def check(self, keys: list[str], /) -> bool:
        with self._data.changed:
            return all(self._key(k) in self._data.values for k in keys)

    def clone(self) -> MemoryStore:
        raise RuntimeError("a store in this process's memory has no second connection")

    def delete_key(self, key: str, /) -> bool:
        with self._data.changed:
            return self._data.values.pop(self._key(key), None) is not None

    def multi_get(self, keys: list[str], /) -> list[bytes]:
        self.wait(keys)
        with self._data.changed:
            return [self._data.values[self._key(k)] for k in keys]

    def multi_set(self, keys: list[str], values: Sequence[str | bytes], /) -> None:
        with self._data.changed:
            for key, value in zip(keys, values, strict=True):
                self._data.values[self._key(key)] = _as_bytes(value)
            self._data.changed.notify_all()

    def num_keys(self) -> int:
        """Every key of the store, as torch's ``PrefixStore`` counts them."""
        with self._data.changed:
            return len(self._data.values)

    def set_timeout(self, timeout: timedelta, /) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def wait(self, keys: list[str], timeout: timedelta | None = None, /) -> None:
        limit = (self._timeout if timeout is None else timeout).total_seconds()
        deadline = time.monotonic() + limit
        with self._data.changed:
            while not all(self._key(k) in self._data.values for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LookupError(f"Timeout after {limit:g} s waiting for keys {keys}")
                self._data.changed.wait(left)
