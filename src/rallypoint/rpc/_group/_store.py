"""The rendezvous store behind ``init_method``, and waiting for keys in it.

``env://`` and ``tcp://`` give a c10d ``TCPStore``, made as torch's
``_create_c10d_store`` makes it: rank 0 hosts a *multi-tenant* server, so a process group
and RPC on the same ``MASTER_PORT`` share one server whichever starts first; under a
launcher that hosts the store itself (``TORCHELASTIC_USE_AGENT_STORE=True``, set by
torchrun and ``rallypoint run``) every rank, rank 0 included, is a client of the
launcher's store at ``MASTER_PORT``. ``file://`` gives a ``FileStore``. One ``TCPStore``
per endpoint and process is kept across ``init_rpc``/``shutdown`` cycles (each cycle uses
its own key prefix, as in torch): re-creating it would race with peers that still talk
to the previous one.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING
from urllib.parse import ParseResult, urlparse

from rallypoint._core.envvars import USE_AGENT_STORE
from rallypoint._core.torch_c import FileStore, TCPStore
from rallypoint.rpc._transport._spin import WAITS

if TYPE_CHECKING:
    from rallypoint._core.store import Store

_STORES: dict[tuple[str, int, bool], TCPStore] = {}
_POLL_MAX = 0.002
# after _SLOW_AFTER seconds of waiting: workers that wait in shutdown() while another trains
# would otherwise wake themselves and the store's host (the trainer, rank 0) hundreds of
# times a second, and each wake-up competes with the training step's own hops for a CPU
# (benchmarks/rpc.py's training loop ran its first ~400 steps beside that); workers that
# arrive together still leave within milliseconds
_POLL_SLOW = 0.1
_SLOW_AFTER = 0.05
_NO_TIMEOUT = 1800.0


def store_host(init_method: str) -> str:
    """The host of the store (where this worker's RPC address should route to)."""
    url = urlparse(init_method)
    if url.scheme == "env":
        return os.environ.get("MASTER_ADDR", "127.0.0.1")
    if url.scheme == "tcp":
        return init_method[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return "127.0.0.1"


def hosts_store(init_method: str, rank: int) -> bool:
    """Whether ``rank`` hosts the store (rank 0 with a TCPStore): it must exit last."""
    url = urlparse(init_method)
    if rank != 0 or url.scheme not in ("env", "tcp"):
        return False
    port = os.environ.get("MASTER_PORT") if url.scheme == "env" else url.port
    return not _launcher_hosts_store(str(port))


def _launcher_hosts_store(port: str | None) -> bool:
    """Whether a launcher hosts the store at ``port`` (torch's agent-store rule).

    torch applies ``TORCHELASTIC_USE_AGENT_STORE`` to any ``tcp://`` address; here only to
    the launcher's own port (``MASTER_PORT``), so a ``tcp://`` store on another port is
    still hosted by rank 0 instead of by nobody.
    """
    if os.environ.get(USE_AGENT_STORE) != str(True):
        return False
    return port is not None and port == os.environ.get("MASTER_PORT")


def create_store(
    init_method: str,
    rank: int,
    world_size: int | None,
    timeout: float,
    before_store: Callable[[], None] = lambda: None,
) -> tuple[TCPStore | FileStore, int, str]:
    """A c10d store for ``init_method``; returns (store, rank, store host).

    ``before_store`` runs once ``init_method`` is known to be valid, before any store is
    created or joined: a check that would fail every worker anyway fails them all there."""
    url = urlparse(init_method)
    if url.scheme == "file":
        if rank < 0:
            raise ValueError("init_rpc with file://: rank parameter missing; pass rank=")
        if not url.path:
            raise ValueError(f"init_method {init_method!r} must look like file:///path")
        before_store()
        return FileStore(url.path, world_size if world_size else -1), rank, "127.0.0.1"
    host, port, rank = _tcp_endpoint(url, init_method, rank)
    before_store()
    return _tcp_store(host, port, rank, world_size, timeout), rank, host


def _tcp_endpoint(url: ParseResult, init_method: str, rank: int) -> tuple[str, int, int]:
    """(host, port, rank) of an ``env://`` or ``tcp://`` init method."""
    if url.scheme == "env":  # torch's order: RANK first, then MASTER_ADDR, MASTER_PORT
        if rank < 0:
            env_rank = os.environ.get("RANK")
            if env_rank is None:
                raise ValueError(
                    "init_rpc with env://: environment variable RANK expected, but not set; "
                    "pass rank= or set RANK"
                )
            rank = int(env_rank)
        addr = os.environ.get("MASTER_ADDR")
        port = os.environ.get("MASTER_PORT")
        if not addr or not port:
            missing = "MASTER_ADDR" if not addr else "MASTER_PORT"
            raise ValueError(
                f"init_rpc with env://: environment variable {missing} expected, but not "
                "set; set MASTER_ADDR and MASTER_PORT, or pass tcp://host:port or "
                "file:///path"
            )
        return addr, int(port), rank
    if url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise ValueError(f"init_method {init_method!r} must look like tcp://host:port")
        if rank < 0:
            raise ValueError("init_rpc with tcp://: rank parameter missing; pass rank=")
        return url.hostname, url.port, rank
    raise ValueError(f"init_method must start with env://, tcp:// or file://, got {init_method!r}")


def _tcp_store(host: str, port: int, rank: int, world_size: int | None, timeout: float) -> TCPStore:
    key = (host, port, rank == 0)
    cached = _STORES.get(key)
    if cached is not None:
        try:
            cached.check(["rallypoint/ping"])
            return cached
        except RuntimeError:
            del _STORES[key]
    seconds = timedelta(seconds=timeout if timeout > 0 else _NO_TIMEOUT)
    if _launcher_hosts_store(str(port)):
        store = TCPStore(host, port, world_size, False, timeout=seconds)
    else:
        store = TCPStore(
            host,
            port,
            world_size,
            rank == 0,
            timeout=seconds,
            wait_for_workers=False,
            multi_tenant=True,
        )
    _STORES[key] = store
    return store


def wait_for_keys(
    store: Store,
    keys: Sequence[str],
    deadline: float,
    *,
    dead: Callable[[list[str]], bool] | None = None,
) -> list[str]:
    """Wait until every key exists or the deadline passes; return the missing keys.

    ``dead`` (a callable that says whether all the missing keys belong to workers known
    to have died) ends the wait early. Without it the store wakes the wait as soon as the
    last key is set (``deadline`` must then be finite); with it, the keys are polled every
    0.25 to 2 ms, and every 100 ms after the first second (a ``store.wait`` that times out
    makes c10d log a warning, so it cannot be sliced to check ``dead``). A key once seen
    stays set: only the ones still missing are checked again.
    """
    keys = list(keys)
    if dead is None:
        remaining = deadline - time.monotonic()
        if remaining > 0:
            with contextlib.suppress(RuntimeError):  # timed out (c10d's DistStoreError)
                store.wait(keys, timedelta(seconds=remaining))
                return []
        return [k for k in keys if not store.check([k])]
    delay = 0.00025
    slow_after = time.monotonic() + _SLOW_AFTER
    missing = keys
    while True:
        if store.check(missing):
            return []
        missing = [k for k in missing if not store.check([k])]
        if not missing:
            return []
        if time.monotonic() >= deadline or dead(missing):
            # a worker may have set its key and exited (closed its connections) between
            # the check above and ``dead``: only keys still missing now count
            return [k for k in missing if not store.check([k])]
        WAITS.sleep(delay)
        delay = min(delay * 2, _POLL_MAX if time.monotonic() < slow_after else _POLL_SLOW)


def wait_for_names(
    store: Store,
    prefix: str,
    names: Sequence[str],
    deadline: float,
    *,
    all_dead: Callable[[list[str]], bool],
) -> list[str]:
    """Wait for the keys ``prefix/name``; the names still missing at the deadline.

    Ends early when ``all_dead(missing names)`` says every missing name is dead.
    """
    by_key = {f"{prefix}/{name}": name for name in names}
    missing = wait_for_keys(
        store, list(by_key), deadline, dead=lambda keys: all_dead([by_key[k] for k in keys])
    )
    return [by_key[k] for k in missing]
