"""The lighthouse: where replica groups get each step's quorum (``rallypoint lighthouse``).

It hosts a c10d TCPStore at ``bind`` (or, with ``store="etcd://..."``, works in an etcd
cluster) and runs the one decider of the quorums over it (``_decider_loop``): members
write their asks to the store and wait on their answer's key, the decider reads the
asks as they come and writes each round once. Killed and started again, the lighthouse
costs the groups a pause (they reconnect, say hello with their last quorum, and ask
again), never the job. It prints each new quorum:
``quorum 7: groups 0, 2 (group 1 left: rank 0 killed by SIGKILL)``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from rallypoint.ft._quorum.client import post
from rallypoint.ft._quorum.decider_loop import DeciderLoop
from rallypoint.ft._quorum.records import Ask, Rules
from rallypoint.rendezvous import KVError, connect_kv, is_etcd_address

__all__ = ["DEFAULT_BIND", "STORE_CONNECT_S", "LighthouseServer", "parse_bind"]

DEFAULT_BIND = "[::]:29510"
STORE_CONNECT_S = 30
"""Seconds the lighthouse waits for its store (an etcd cluster may still be starting)."""


def parse_bind(bind: str) -> tuple[str, int]:
    """``(host, port)`` of ``[::]:29510``, ``0.0.0.0:29510`` or ``host:port``."""
    if not isinstance(bind, str):
        raise TypeError(f"bind must be a str (HOST:PORT), got {bind!r}")
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--bind must be HOST:PORT (for example [::]:29510), got {bind!r}")
    return host.strip("[]") or "::", int(port)


class LighthouseServer:
    """torchft's ``LighthouseServer``: where replica groups get each step's quorum.

    Args:
        bind: ``HOST:PORT`` of the store it hosts (port 0: any free port).
        min_replicas: replica groups a quorum needs.
        join_timeout_ms: how long a first quorum waits for every known group (100).
        quorum_tick_ms: how often time alone is looked at: heartbeats, timeouts (100).
        heartbeat_timeout_ms: a member whose heartbeat stops this long is gone (5000).
        store: ``etcd://HOST:PORT,...``: keep the state in an etcd cluster instead.
        say: called with each line the lighthouse has to say (a new quorum, a record it
            ignored); by default nothing is printed.
    """

    def __init__(
        self,
        bind: str = DEFAULT_BIND,
        min_replicas: int = 1,
        join_timeout_ms: int | None = None,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
        *,
        store: str | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        join = 100 if join_timeout_ms is None else join_timeout_ms  # torchft's class default
        tick = 100 if quorum_tick_ms is None else quorum_tick_ms
        beat = 5000 if heartbeat_timeout_ms is None else heartbeat_timeout_ms
        self.rules = Rules(
            min_replicas=_positive("min_replicas", min_replicas),
            join_timeout_ms=_positive("join_timeout_ms", join, zero=True),
            quorum_tick_ms=_positive("quorum_tick_ms", tick),
            heartbeat_timeout_ms=_positive("heartbeat_timeout_ms", beat),
        )
        self._server: Any = None
        timeout = timedelta(seconds=STORE_CONNECT_S)
        if store is not None:
            if not is_etcd_address(store):
                raise ValueError(
                    f"--store must be an etcd cluster (etcd://HOST:PORT,...), got {store!r}"
                )
            kv, _ = connect_kv(store, timeout=timeout)
            self._address = store
        else:
            host, port = parse_bind(bind)
            kv, self._server = connect_kv(f"127.0.0.1:{port}", timeout=timeout, host=True)
            self._address = f"http://{_hostname(host)}:{int(self._server.port)}"
        self._stopped = threading.Event()
        # the loop blocks in the store's wait on this connection; the ticker writes
        # through the process's side connection
        self.loop = DeciderLoop(kv, self.rules, say or (lambda line: None))
        self._side = kv.clone()
        self._threads = self.loop.start(self._side)

    def address(self) -> str:
        """What ``TORCHFT_LIGHTHOUSE`` is set to for the groups."""
        return self._address

    def wait(self) -> None:
        """Block until :meth:`shutdown` (the command line's main thread)."""
        while not self._stopped.wait(1.0):
            pass

    def shutdown(self) -> None:
        """Stop deciding and close the store it hosts (groups see it as a lost lighthouse)."""
        self.loop.stop()
        self._stopped.set()
        with contextlib.suppress(KVError, RuntimeError, OSError):
            post(self._side, Ask("tick"))  # wakes the loop, which sees the stop
        for thread in self._threads:
            thread.join(timeout=2.0)
        self._server = None


def _positive(name: str, value: Any, zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):  # (a wrong type: as torchft's)
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < (0 if zero else 1):
        raise ValueError(f"--{name} must be an integer {'>= 0' if zero else '>= 1'}, got {value!r}")
    return value


def _hostname(bound: str) -> str:
    if bound in ("::", "0.0.0.0", ""):
        return socket.gethostname()
    return bound
