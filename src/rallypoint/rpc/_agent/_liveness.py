"""Liveness of the peers a graceful shutdown is waiting for.

A graceful shutdown without a timeout waits as long as the workers it waits for are alive
(as torch's does), so it must notice when one is not. A peer is *dead* when its
connection broke (the transport marks it in the :class:`PeerTable`), and *unreachable*
when it leaves a no-op call unanswered for the probe timeout (the RPC timeout, at least
:data:`MIN_PROBE_TIMEOUT`). :class:`Prober` sends those calls: one in flight per peer at a
time, the first after the peer has been awaited for :data:`PROBE_AFTER` seconds (a
shutdown where everyone arrives at once sends none), then one every
:data:`PROBE_INTERVAL`. A failed probe marks the peer dead with the reason, which the
shutdown error repeats.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from rallypoint.rpc._agent._peers import PeerTable
from rallypoint.rpc._backend import Caller
from rallypoint.rpc._errors import RpcError, RpcTimeoutError
from rallypoint.rpc.constants import DEFAULT_RPC_TIMEOUT_SEC

PROBE_AFTER = 0.5
PROBE_INTERVAL = 0.5
MIN_PROBE_TIMEOUT = 5.0


def _alive() -> bool:
    """The probe: runs on the probed worker."""
    return True


def probe_timeout(rpc_timeout: float) -> float:
    """How long a probe may go unanswered before its peer counts as unreachable."""
    return max(rpc_timeout if rpc_timeout > 0 else DEFAULT_RPC_TIMEOUT_SEC, MIN_PROBE_TIMEOUT)


class Prober:
    """Probes awaited peers; failures mark them dead in the peer table."""

    def __init__(self, caller: Caller, peers: PeerTable, timeout: float) -> None:
        self._caller = caller
        self._peers = peers
        self._timeout = timeout
        self._since: dict[str, float] = {}
        self._next: dict[str, float] = {}
        self._inflight: set[str] = set()

    def all_dead(self, names: Iterable[str]) -> bool:
        """Whether every one of ``names`` is dead; probes the ones that may be alive."""
        now = time.monotonic()
        alive = False
        for name in names:
            if self._peers.is_dead(name):
                continue
            alive = True
            since = self._since.setdefault(name, now)
            due = self._next.get(name, since + PROBE_AFTER)
            if name not in self._inflight and now >= due:
                self._next[name] = now + PROBE_INTERVAL
                self._probe(name)
        return not alive

    def _probe(self, name: str) -> None:
        self._inflight.add(name)
        try:
            future = self._caller.rpc_async(name, _alive, (), {}, self._timeout)
        except RpcError as exc:
            self._failed(name, exc)
            return
        future.add_done_callback(lambda fut: self._settle(name, fut))

    def _settle(self, name: str, future: Any) -> None:
        try:
            future.wait()
        except RpcTimeoutError:
            self._failed(name, None)
        except Exception as exc:
            self._failed(name, exc)
        else:
            self._inflight.discard(name)

    def _failed(self, name: str, exc: BaseException | None) -> None:
        if exc is None:
            reason = f"did not answer a liveness probe within {self._timeout:.1f} s"
        else:
            reason = f"did not answer a liveness probe: {exc}"
        self._peers.mark_dead(name, reason)
        self._inflight.discard(name)
