"""An in-process :class:`KeyValueStore`: the fake for fast handler tests.

Threads in one process share one :class:`MemoryKV`; every handler is still its own node.
``fail_after`` turns the store into a dead one after N more operations (fault injection:
every later call raises :class:`KVConnectionError`, as a lost TCPStore would).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from rallypoint.rendezvous._kv import KeyValueStore, KVConnectionError, KVStateError

if TYPE_CHECKING:
    from rallypoint._core.torch_c import TorchStore


class MemoryKV(KeyValueStore):
    """A dict guarded by a condition variable; ``wait`` sleeps on the condition."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._ops_left: int | None = None
        self.endpoint = "memory"
        self.ops = 0

    def fail_after(self, operations: int | None) -> None:
        """Fail every operation after ``operations`` more (``None`` heals the store)."""
        with self._cond:
            self._ops_left = operations

    def _tick(self) -> None:
        self.ops += 1
        if self._ops_left is not None:
            if self._ops_left <= 0:
                raise KVConnectionError("The store at memory is unreachable (injected fault)")
            self._ops_left -= 1

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._tick()
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes | None:
        with self._cond:
            self._tick()
            return self._data.get(key)

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._cond:
            self._tick()
            return [self._data.get(k) for k in keys]

    def multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        with self._cond:
            self._tick()
            for key, value in items:
                self._data[key] = bytes(value)
            self._cond.notify_all()

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            self._tick()
            raw = self._data.get(key, b"0")
            try:
                value = int(raw) + amount
            except ValueError:
                raise KVStateError(
                    f"The key {key!r} in the store at memory holds {raw[:40]!r}, "
                    "not an integer counter."
                ) from None
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def set_if_absent(self, key: str, value: bytes) -> bytes:
        if not value:
            raise ValueError("set_if_absent needs a non-empty value")
        return self.compare_and_swap(key, b"", value)

    def compare_and_swap(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._cond:
            self._tick()
            current = self._data.get(key)
            if current is None:
                if expected:
                    return bytes(expected)
                self._data[key] = bytes(desired)
                self._cond.notify_all()
                return bytes(desired)
            if current == expected:
                self._data[key] = bytes(desired)
                self._cond.notify_all()
                return bytes(desired)
            return current

    def wait(self, keys: Sequence[str], timeout: timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            self._tick()
            while not all(k in self._data for k in keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
                if self._ops_left is not None and self._ops_left <= 0:
                    raise KVConnectionError("The store at memory is unreachable (injected fault)")
            return True

    def delete(self, key: str) -> bool:
        with self._cond:
            self._tick()
            return self._data.pop(key, None) is not None

    def count_prefix(self, prefix: str) -> int:
        with self._cond:
            return sum(1 for k in self._data if k.startswith(prefix))

    def snapshot(self) -> list[str]:
        """A snapshot of every key (for tests)."""
        with self._cond:
            return sorted(self._data)

    def clone(self) -> MemoryKV:
        return self

    def torch_store(self, prefix: str) -> TorchStore:
        from rallypoint.rendezvous._kv_store import KVTorchStore

        return KVTorchStore(self, prefix)
