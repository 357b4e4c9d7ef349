"""The threads that read connections, kept for the next reader when they are done.

A request that blocks hands its connection's reader role to another thread (see
:mod:`rallypoint.rpc._transport._connection`). A new thread has no torch intra-op (OpenMP)
team yet, so the first operators it runs build one: model-parallel programs, whose stage
forwards are handed over, would pay that on every call.

So a reader thread that finishes (its connection closed, or the request it kept after a
hand-over is done) parks here, and the next hand-over takes a parked thread before it
starts a new one. A thread parked for ``IDLE_SECONDS`` exits; at most ``max_parked``
wait at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeAlias

import torch

from rallypoint.rpc._transport._spin import WAITS

logger = logging.getLogger("rallypoint.rpc")

IDLE_SECONDS = 30.0

Task: TypeAlias = "tuple[str, Callable[..., None], tuple[Any, ...]]"
"""(thread name, function, arguments)."""


def adopt_torch_threads() -> None:
    """Give the calling (new) thread torch's intra-op thread settings.

    ``torch.set_num_threads`` sets OpenMP's and MKL's thread counts for the calling
    thread only (torch applies them to a new thread the first time that thread asks,
    e.g. in ``at::parallel_for``); a matmul run first on a fresh thread uses MKL's
    default team, one OpenMP thread per core: a worker that set one thread would run
    every ``Linear`` of its RPC functions on two OpenMP threads, the second woken
    through a futex for each call and spinning after it. Asking for the count applies
    the settings, as torch's own thread pools do when they start a thread."""
    torch.get_num_threads()


class ReaderPool:
    """Runs each task on a parked thread if there is one, else on a new thread."""

    def __init__(self, max_parked: int, idle_seconds: float = IDLE_SECONDS) -> None:
        self._max_parked = max_parked
        self._idle_seconds = idle_seconds
        self._parked: list[queue.SimpleQueue[Task | None]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0  # threads started so far (tests and debugging read it)

    def run(self, name: str, target: Callable[..., None], *args: Any) -> None:
        """Run ``target(*args)`` on a pool thread named ``name``."""
        task: Task = (name, target, args)
        with self._lock:
            inbox = self._parked.pop() if self._parked else None
            if inbox is None:
                self.started += 1
        if inbox is not None:
            inbox.put(task)
            return
        try:
            threading.Thread(target=self._main, args=(task,), name=name, daemon=True).start()
        except BaseException:  # Ctrl-C too: the count stays true
            with self._lock:
                self.started -= 1
            raise

    def _main(self, task: Task | None) -> None:
        adopt_torch_threads()
        inbox: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        while task is not None:
            name, target, args = task
            threading.current_thread().name = name
            try:
                target(*args)
            except BaseException:  # a pooled thread must survive anything a reader raises
                logger.exception("rallypoint.rpc: a reader thread failed")
            del task, target, args  # hold nothing of the last connection while parked
            task = self._park(inbox)

    def _park(self, inbox: queue.SimpleQueue[Task | None]) -> Task | None:
        """Wait for the next task; ``None``: exit (idle too long, too many, or closed)."""
        with self._lock:
            if self._closed or len(self._parked) >= self._max_parked:
                return None
            self._parked.append(inbox)
        threading.current_thread().name = "rpc-reader-parked"
        try:
            with WAITS.blocked(urgent=False):
                return inbox.get(timeout=self._idle_seconds)
        except queue.Empty:
            with self._lock:
                if inbox in self._parked:
                    self._parked.remove(inbox)
                    return None
            return inbox.get()  # taken just now: its task is on the way

    def parked(self) -> int:
        """How many threads wait for a task now."""
        with self._lock:
            return len(self._parked)

    def close(self) -> None:
        """Let every parked thread exit; threads finishing later exit too."""
        with self._lock:
            self._closed = True
            parked, self._parked = self._parked, []
        for inbox in parked:
            inbox.put(None)
