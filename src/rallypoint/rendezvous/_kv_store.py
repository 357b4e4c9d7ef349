"""A ``torch.distributed.Store`` over any :class:`KeyValueStore` (used for etcd and memory).

Workers and agents get a real ``torch.distributed.Store`` (a Python subclass of torch's
pybind ``Store``), so ``init_process_group(store=...)``, gloo and ``PrefixStore`` accept
it. Key ``k`` lives at ``<prefix>/k``, as with torch's ``PrefixStore``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from rallypoint._core.torch_c import TorchStore
from rallypoint.rendezvous._kv import KeyValueStore


def _as_bytes(value: str | bytes) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class KVTorchStore(TorchStore):
    """torch ``Store`` API mapped onto a :class:`KeyValueStore` under ``prefix``."""

    def __init__(
        self, kv: KeyValueStore, prefix: str, timeout: timedelta = timedelta(seconds=300)
    ) -> None:
        super().__init__()
        self._kv = kv
        self._prefix = prefix
        self.set_timeout(timeout)

    def _limit(self) -> timedelta:
        limit: timedelta = TorchStore.timeout.fget(self)  # type: ignore[attr-defined]  # pybind property
        return limit

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}"  # the same mapping as torch's PrefixStore

    def set(self, key: str, value: str | bytes) -> None:
        self._kv.set(self._key(key), _as_bytes(value))

    def get(self, key: str) -> bytes:
        full = self._key(key)
        value = self._kv.get(full)
        if value is None:
            if not self._kv.wait([full], self._limit()):
                raise LookupError(f"Key {key!r} not found in the store within {self._limit()}")
            value = self._kv.get(full)
            if value is None:
                raise LookupError(f"Key {key!r} was deleted while waiting for it")
        return value

    def add(self, key: str, amount: int) -> int:
        return self._kv.add(self._key(key), amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._kv.compare_and_swap(self._key(key), _as_bytes(expected), _as_bytes(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self._limit() if timeout is None else timeout
        if not self._kv.wait([self._key(k) for k in keys], limit):
            raise LookupError(f"Timeout after {limit} waiting for keys {keys}")

    def check(self, keys: list[str]) -> bool:
        return all(v is not None for v in self._kv.multi_get([self._key(k) for k in keys]))

    def delete_key(self, key: str) -> bool:
        return self._kv.delete(self._key(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: Sequence[str | bytes]) -> None:
        self._kv.multi_set(
            [(self._key(k), _as_bytes(v)) for k, v in zip(keys, values, strict=True)]
        )

    def num_keys(self) -> int:
        count = getattr(self._kv, "count_prefix", None)
        if count is None:
            raise NotImplementedError("num_keys is not supported by this backend")
        return int(count(self._prefix))
