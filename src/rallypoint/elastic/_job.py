"""What one node's elastic coordinator keeps across rounds: the handler and the run store."""

from __future__ import annotations

import secrets
import signal
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rallypoint.elastic._options import RestartOptions
from rallypoint.elastic._rendezvous import open_run_store
from rallypoint.elastic._stores import RunStore, prefixed
from rallypoint.observe._observer import Observer
from rallypoint.observe._stacks_exchange import answer_stacks_request, latest_stacks_request
from rallypoint.supervise._errors import LaunchInterruptedError, RendezvousFailedError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    from rallypoint.rendezvous import RendezvousHandler

__all__ = ["Job"]


class Job:
    """The run-level state of one node: handler, run store, stack requests answered."""

    def __init__(
        self,
        handler: RendezvousHandler,
        *,
        run_id: str,
        endpoint: str,
        observer: Observer,
        restarts: RestartOptions,
        poll_every: float,
        next_signal: Callable[[], int | None],
    ) -> None:
        self.handler = handler
        self.run_id = run_id
        self.endpoint = endpoint
        self.observer = observer
        self.restarts = restarts
        self.poll_every = poll_every
        self._next_signal = next_signal
        self._run: RunStore | None = None
        self.stacks_store: Any = None  # a second connection, for a blocking stacks request
        self.answered = 0
        self._rpc_secret = ""

    def open(self) -> None:
        """Open the run store through the handler (the ``static`` backend has none yet)."""
        store = open_run_store(self.handler, self.run_id, self.endpoint)
        if store is not None:
            self._adopt(store, open_run_store(self.handler, self.run_id, self.endpoint))

    def adopt_round_store(self, store: Store) -> None:
        """Without a run store of its own, the backend's round store plays that role."""
        if self._run is None:
            run = prefixed("rallypoint/job", store)
            self._adopt(run, run)

    def _adopt(self, store: Store, second: Store | None) -> None:
        try:
            self.answered = latest_stacks_request(store)
        except RuntimeError as exc:
            raise RendezvousFailedError(f"rendezvous {self.endpoint!r}: {exc}") from None
        self._run = RunStore(store)
        self.stacks_store = second

    @property
    def run(self) -> RunStore:
        assert self._run is not None, "no run store before the first round"
        return self._run

    @property
    def has_run_store(self) -> bool:
        return self._run is not None

    def rpc_secret(self) -> str:
        """The job's RPC secret: the first agent's random candidate, set once in the run
        store (so every node's workers authenticate each other); read once per node."""
        if not self._rpc_secret:
            self._rpc_secret = self.run.rpc_secret(secrets.token_hex(32))
        return self._rpc_secret

    def answer_stacks(self, running: Mapping[int, int], node_rank: int) -> None:
        """Answer another agent's (or ``rallypoint stacks``') request for stacks, if any."""
        self.answered = answer_stacks_request(
            self.run.store,
            node_rank=node_rank,
            answered=self.answered,
            collect=lambda: self.observer.collect(running),
        )

    def nodes_waiting(self) -> int:
        """Nodes waiting to join, or members that missed their heartbeats (> 0: re-round)."""
        return int(self.handler.num_nodes_waiting())

    def check_signals(self) -> None:
        """Between attempts: a signal to the launcher stops this node."""
        signum = self._next_signal()
        if signum is not None:
            name = signal.Signals(signum).name
            raise LaunchInterruptedError(
                f"received {name} while waiting for the other nodes; stopped", signum=signum
            )
