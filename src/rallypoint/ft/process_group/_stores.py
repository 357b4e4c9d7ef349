"""The store a process group's rendezvous runs on, from a Manager's store address
(``ADDRESS#PREFIX`` or ``HOST:PORT/PREFIX``)."""

from __future__ import annotations

from datetime import timedelta

from rallypoint._core.store import Store
from rallypoint.rendezvous import connect_kv

__all__ = ["store_from_address"]

_CONNECT_AT_LEAST = timedelta(seconds=10)


def store_from_address(store_addr: str, timeout: timedelta) -> Store:
    """A torch ``Store`` for ``store_addr`` (see the package's docstring)."""
    if "#" in store_addr:
        address, _, prefix = store_addr.partition("#")
    else:
        address, _, prefix = store_addr.partition("/")
    # the connect may take longer than a short timeout on a loaded machine; the waits keep it
    kv, _ = connect_kv(address, timeout=max(timeout, _CONNECT_AT_LEAST))
    store = kv.torch_store(prefix.strip("/") + "/")
    store.set_timeout(timeout)
    return store
