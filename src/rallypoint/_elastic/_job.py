"""What one node's coordinator keeps across rounds: the handler and the run store.

Every store call the coordinator makes goes through :meth:`Job.blocking` (or, before the
job exists, :func:`interruptible`): a daemon thread runs it while the main thread checks
for SIGINT/SIGTERM every 50 ms, because a TCPStore call blocked in C++ ``recv`` would not
return for Python's signal handlers (``rallypoint._core.blocking``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from rallypoint._core.blocking import call_in_thread
from rallypoint._elastic._errors import RendezvousFailedError
from rallypoint._elastic._options import RestartOptions
from rallypoint._elastic._rendezvous import open_run_store, run_store_namespace
from rallypoint._elastic._stores import RunStore, prefixed
from rallypoint._supervise._errors import LaunchInterruptedError
from rallypoint._supervise._output import write_console
from rallypoint._watch._observer import Observer
from rallypoint._watch._stacks_exchange import (
    MalformedRequestCounter,
    StacksAnswers,
    answer_stacks_request,
    latest_stacks_request,
)

if TYPE_CHECKING:
    from rallypoint._core.store import Store
    from rallypoint.rendezvous import RendezvousHandler

__all__ = ["Job", "interruptible", "stop_on_signal"]

T = TypeVar("T")


def stop_on_signal(signum: int | None, waiting_for: str = "the other nodes") -> None:
    """Raise :class:`LaunchInterruptedError` if the launcher received ``signum``."""
    if signum is not None:
        name = signal.Signals(signum).name
        raise LaunchInterruptedError(
            f"received {name} while waiting for {waiting_for}; stopped", signum=signum
        )


def interruptible(
    fn: Callable[[], T],
    next_signal: Callable[[], int | None],
    waiting_for: str = "the other nodes",
) -> T:
    """``fn()`` (store calls) in a thread; a signal to the launcher meanwhile raises
    :class:`LaunchInterruptedError` at once, leaving the call behind."""
    return call_in_thread(
        fn, poll=lambda: stop_on_signal(next_signal(), waiting_for), name="rallypoint-store"
    )


class Job:
    """The run-level state of one node: handler, run store, stack requests answered."""

    def __init__(
        self,
        handler: RendezvousHandler | None,
        *,
        run_id: str,
        endpoint: str,
        observer: Observer,
        restarts: RestartOptions,
        poll_every: float,
        next_signal: Callable[[], int | None],
        signal_pending: Callable[[], bool] = lambda: False,
        store_timeout: float = 60.0,
        min_nodes: int = 1,
    ) -> None:
        self._handler = handler
        """``None``: a job of one node, with no rendezvous (its run store is in memory)."""
        self.node = (handler and handler.node_id) or f"{os.uname().nodename}_{os.getpid()}"
        """This agent's identity in the rendezvous, its name in exclusion records (a backend
        that names no nodes, or no rendezvous: host and process id)."""
        self.min_nodes = min_nodes
        self.run_id = run_id
        self.endpoint = endpoint
        self.observer = observer
        self.restarts = restarts
        self.poll_every = poll_every
        self._next_signal = next_signal
        self.signal_pending = signal_pending
        """Whether a signal waits for the supervisor (peeks; the supervisor takes it)."""
        self.store_timeout = store_timeout
        """Seconds a store call may take (``read_timeout``) before the store counts as lost."""
        self._run: RunStore | None = None
        self.stacks_store: Store | None = None  # a second connection, for a blocking stacks request
        self.stacks_answers = StacksAnswers()
        # the store checks' thread and a hang report's loop both answer: one at a time
        self._answering = threading.Lock()
        self._bad_counter: bytes | None = None  # a malformed stacks request counter, said once
        self._rpc_secret = ""
        self._left = False

    @property
    def handler(self) -> RendezvousHandler:
        assert self._handler is not None, "a job of one node has no rendezvous"
        return self._handler

    def open(self) -> None:
        """Open the run store through the handler (the ``static`` backend has none yet)."""
        store = open_run_store(self.handler, self.run_id, self.endpoint)
        if store is not None:
            second = open_run_store(self.handler, self.run_id, self.endpoint)
            self._adopt(store, second, run_store_namespace(self.run_id))

    def open_store(self) -> Store:
        """A connection of its own to the run store, for a thread that blocks in it (the
        clock responder of straggler detection): torch's ``clone()`` of a TCPStore or
        FileStore; for stores that have none (etcd's), the handler's ``open_run_store``
        (a c10d handler's shares one side connection with the heartbeats: not that)."""
        try:
            clone: Store = self.run.store.clone()
            return clone
        except RuntimeError:  # "pure virtual function": a store written in Python
            store = open_run_store(self.handler, self.run_id, self.endpoint)
            if store is None:
                raise
            return store

    def adopt_round_store(self, store: Store) -> None:
        """Without a run store of its own, the backend's round store plays that role."""
        if self._run is None:
            run = prefixed("rallypoint/job", store)
            self._adopt(run, run, "rallypoint/job")

    def _adopt(self, store: Store, second: Store | None, where: str) -> None:
        self._run = RunStore(store, where)
        try:
            self.stacks_answers = StacksAnswers(answered=latest_stacks_request(store))
        except MalformedRequestCounter as exc:
            self._malformed_counter(exc)  # answered from 0 once someone sets a count
        except Exception as exc:
            from rallypoint.rendezvous import KVError  # not before: one node never needs it

            if not isinstance(exc, (RuntimeError, KVError)):
                raise
            raise RendezvousFailedError(f"rendezvous {self.endpoint!r}: {exc}") from None
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
        """Answer another agent's (or ``rallypoint stacks``') request for stacks, if any.
        A request counter that any store client overwrote with something else is said
        once, and no request is answered while it holds that: the job goes on."""
        with self._answering:
            try:
                answer_stacks_request(
                    self.run.store,
                    node_rank=node_rank,
                    answers=self.stacks_answers,
                    collect=lambda: self.observer.collect(running),
                )
                self._bad_counter = None
            except MalformedRequestCounter as exc:
                self._malformed_counter(exc)

    def _malformed_counter(self, exc: MalformedRequestCounter) -> None:
        if exc.value != self._bad_counter:
            self._bad_counter = exc.value
            write_console(
                2,
                f"rallypoint: warning: {exc.message(self.run.where)}; requests for stacks "
                "are not answered while it does, the job goes on\n".encode(),
            )

    def leave(self) -> None:
        """Leave the rendezvous for good, once (it counts this node gone in its round)."""
        if not self._left and self._handler is not None:
            self._left = True
            with contextlib.suppress(Exception):
                self._handler.leave()

    def nodes_waiting(self) -> int:
        """Nodes waiting to join, or members that missed their heartbeats (> 0: re-round)."""
        if self._handler is None:
            return 0
        return int(self._handler.num_nodes_waiting())

    def check_signals(self) -> None:
        """Between attempts: a signal to the launcher stops this node."""
        stop_on_signal(self._next_signal())

    def blocking(self, fn: Callable[[], T]) -> T:
        """``fn()`` (store calls) in a thread, stopped by a signal (:func:`interruptible`)."""
        return interruptible(fn, self._next_signal)
