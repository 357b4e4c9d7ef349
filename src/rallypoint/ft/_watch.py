"""The cross-group process group's guard: which quorum it is configured for, and a watcher
thread that aborts it the moment that quorum is broken — a member gone (its agent said so,
or its heartbeat stopped) or a participant that voted to abort the step — so that no
collective waits on a dead group or on a step that cannot commit."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from rallypoint.ft._commit import ABORT
from rallypoint.ft._plan import Plan
from rallypoint.ft._quorum import Liveness
from rallypoint.rendezvous import KeyValueStore, KVError

__all__ = ["GroupGuard"]

Key = tuple[str, int]
"""A configuration: the store life and the quorum id."""


class GroupGuard:
    """A configuration and an abort never interleave; an abort names the configuration it
    ended, so an error it reports concerns that group and not a newer one."""

    def __init__(
        self,
        pg: Any,
        live: Liveness,
        kv: KeyValueStore,
        connect: Callable[[], KeyValueStore],
        report: Callable[[Exception], None],
    ) -> None:
        self._pg, self._live, self._connect, self._report = pg, live, connect, report
        self._lock = threading.Lock()
        self.configured: Key | None = None
        self.left: Exception | None = None
        """The error of the last abort, until a new configuration replaces the group."""
        self.kv = kv
        """The watcher's own connection to the lighthouse (``connect`` makes a new one)."""

    def configure(self, key: Key, make: Callable[[], None]) -> bool:
        """Run ``make`` (configure the process group) unless ``key`` is configured already;
        whether it ran."""
        with self._lock:
            if self.configured == key:
                return False
            make()
            self.configured = key
            return True

    def watch(self, stop: threading.Event, plan: Callable[[], Plan | None], me: str) -> None:
        """Look every 20 ms until ``stop``: abort the group of the current plan when broken."""
        aborted: Key | None = None
        while not stop.wait(0.02):
            done, key = plan(), self.configured
            if done is None or key is None or key == aborted:
                continue
            others = [m for m in done.members if m != me]
            try:
                self._live.refresh(self.kv, others)
            except (KVError, RuntimeError, OSError):  # the lighthouse is away: look again
                with contextlib.suppress(KVError, RuntimeError, OSError):  # on a new link
                    self.kv = self._connect()
                continue
            dead = [m for m in others if not self._live.alive(m)]
            if dead:
                why = "; ".join(
                    f"group {m.split(':')[0]}: {self._live.gone.get(m, 'no heartbeat')}"
                    for m in dead
                )
                self._abort(key, RuntimeError(f"replica group(s) left the quorum ({why})"))
                aborted = key
            elif self._voted_abort(done):
                self._abort(key, RuntimeError("a replica group could not finish this step"))
                aborted = key

    def _voted_abort(self, done: Plan) -> bool:
        """Whether this step's commit is already lost (a participant voted abort): whoever
        still waits in its collectives is freed now, not at the timeout."""
        try:
            return bool(self.kv.get(f"outcome/{done.round}") == ABORT.encode())
        except (KVError, RuntimeError, OSError):
            return False

    def _abort(self, key: Key, error: Exception) -> None:
        with self._lock:
            if self.configured != key:  # a newer group replaced it meanwhile
                return
            self.left = error
            self._report(error)
            self.configured = None  # the next quorum makes a new group, same id or not
            with contextlib.suppress(Exception):
                self._pg.abort()
