"""The key-value store every part of rallypoint talks to: one protocol, torch's signatures.

:class:`Store` lists what rallypoint calls on a store. torch's ``c10d`` stores (TCPStore,
FileStore, HashStore, PrefixStore) satisfy it, as does ``KeyValueStore.torch_store()``
(a torch ``Store`` over etcd or memory); tests use ``HashStore`` or that in-memory store.
Values go in as ``str`` or ``bytes`` and come out as ``bytes``. torch's own classes, and
the places where its type stubs are wrong, are in :mod:`rallypoint._core.torch_c`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol, overload

__all__ = ["Store"]


class Store(Protocol):
    """A torch ``c10d.Store``, as rallypoint uses it (parameters are positional)."""

    def set(self, key: str, value: str | bytes, /) -> None: ...
    def get(self, key: str, /) -> bytes:
        """The value of ``key``; waits for it up to :attr:`timeout`."""
        ...

    def add(self, key: str, amount: int, /) -> int:
        """Adds ``amount`` to the counter ``key`` (0 when absent); returns the new count."""
        ...

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes, /
    ) -> bytes:
        """Sets ``key`` to ``desired_value`` if it holds ``expected_value`` (``""``: if it
        is absent); returns the value it holds afterwards."""
        ...

    def append(self, key: str, value: str | bytes, /) -> None: ...
    def check(self, keys: list[str], /) -> bool:
        """Whether every key of ``keys`` is set (never waits)."""
        ...

    def clone(self) -> Store:
        """A new connection to the same store (``RuntimeError``: this store has none, as a
        store written in Python)."""
        ...

    def delete_key(self, key: str, /) -> bool: ...
    def multi_get(self, keys: list[str], /) -> list[bytes]: ...
    def multi_set(self, keys: list[str], values: Sequence[str | bytes], /) -> None: ...
    def num_keys(self) -> int: ...
    def set_timeout(self, timeout: timedelta, /) -> None: ...
    @property
    def timeout(self) -> timedelta:
        """How long ``get`` and ``wait`` without a timeout wait."""
        ...

    @overload
    def wait(self, keys: list[str], /) -> None: ...
    @overload
    def wait(self, keys: list[str], timeout: timedelta, /) -> None: ...
