"""The lighthouse: where replica groups agree on each step's quorum (``rallypoint lighthouse``).

It holds no quorum logic: it makes the store the groups agree through and writes its
rules there (``_quorum``). Without ``store`` it hosts a c10d TCPStore at ``bind``: killed
and started again, it costs the groups a pause while their requests retry, never the job.
With ``store="etcd://..."`` the rules go into the etcd cluster and the state lives there:
no process of ours can be lost, and this object only watches. Either way it prints each
new quorum: ``quorum 7: groups 0, 2 (group 1 left: rank 0 killed by SIGKILL)``.
"""

from __future__ import annotations

import secrets
import socket
import threading
from datetime import timedelta
from typing import Any

from rallypoint._core.quorum_line import quorum_line
from rallypoint.ft._quorum import Quorum, Rules, changes, gone_notices
from rallypoint.rendezvous import KVError, connect_kv, is_etcd_address

__all__ = ["LighthouseServer", "parse_bind"]

DEFAULT_BIND = "[::]:29510"


def parse_bind(bind: str) -> tuple[str, int]:
    """``(host, port)`` of ``[::]:29510``, ``0.0.0.0:29510`` or ``host:port``."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--bind must be HOST:PORT (for example [::]:29510), got {bind!r}")
    return host.strip("[]") or "::", int(port)


class LighthouseServer:
    """torchft's ``LighthouseServer(bind, min_replicas, join_timeout_ms, quorum_tick_ms,
    heartbeat_timeout_ms)``; ``store``: an etcd cluster to hold the state instead."""

    def __init__(
        self,
        bind: str = DEFAULT_BIND,
        min_replicas: int = 1,
        join_timeout_ms: int | None = None,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
        store: str | None = None,
    ) -> None:
        join = 100 if join_timeout_ms is None else join_timeout_ms  # torchft's class default
        tick = 100 if quorum_tick_ms is None else quorum_tick_ms
        beat = 5000 if heartbeat_timeout_ms is None else heartbeat_timeout_ms
        rules = Rules(
            min_replicas=_positive("min_replicas", min_replicas),
            join_timeout_ms=_positive("join_timeout_ms", join, zero=True),
            quorum_tick_ms=_positive("quorum_tick_ms", tick),
            heartbeat_timeout_ms=_positive("heartbeat_timeout_ms", beat),
        )
        self.rules = rules
        self._server: Any = None
        if store is not None:
            if not is_etcd_address(store):
                raise ValueError(
                    f"--store must be an etcd cluster (etcd://HOST:PORT,...), got {store!r}"
                )
            self.kv, _ = connect_kv(store, timeout=timedelta(seconds=30))
            self._address = store
            self.kv.set("config", rules.to_bytes())
            self.kv.set_if_absent("gen", secrets.token_hex(8).encode())
        else:
            host, port = parse_bind(bind)
            self.kv, self._server = connect_kv(
                f"127.0.0.1:{port}", timeout=timedelta(seconds=30), host=True
            )
            port = int(self._server.port)
            self._address = f"http://{_hostname(host)}:{port}"
            self.kv.set("config", rules.to_bytes())
            self.kv.set("gen", secrets.token_hex(8).encode())
        self._stop = threading.Event()

    def address(self) -> str:
        """What ``TORCHFT_LIGHTHOUSE`` is set to for the groups."""
        return self._address

    def shutdown(self) -> None:
        self._stop.set()
        self._server = None

    def watch(self, say: Any, tick: float = 0.1) -> None:
        """Print each new quorum with ``say`` until :meth:`shutdown`."""
        shown = int(self.kv.get("round") or b"0")
        last: Quorum | None = None
        while not self._stop.wait(tick):
            try:
                now = int(self.kv.get("round") or b"0")
                while shown < now:
                    raw = self.kv.get(f"r/{shown}/q")
                    shown += 1
                    if raw is None:
                        continue
                    quorum = Quorum.from_bytes(raw)
                    if last is None or quorum.quorum_id != last.quorum_id:
                        say(describe(quorum, last, gone_notices(self.kv)))
                    last = quorum
            except (KVError, RuntimeError, OSError, ValueError):
                continue


def describe(quorum: Quorum, previous: Quorum | None, gone: dict[str, str]) -> str:
    """``quorum 7: groups 0, 2 (group 1 left: rank 0 killed by SIGKILL)``."""
    left, joined = changes(quorum, previous, gone)
    return quorum_line(quorum.quorum_id, [m.replica_id for m in quorum.members], left, joined)


def _positive(name: str, value: Any, zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise ValueError(f"--{name} must be an integer {'>= 0' if zero else '>= 1'}, got {value!r}")
    return value


def _hostname(bound: str) -> str:
    if bound in ("::", "0.0.0.0", ""):
        return socket.gethostname()
    return bound
