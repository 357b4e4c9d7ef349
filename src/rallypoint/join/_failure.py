"""Failure safety: a rank that raises inside a Join context tells the others.

torch's ``Join.__exit__`` returns at once when the body raised, so the other ranks block
in their next collective until the process group times out. Here the failing rank
publishes its failure in the process group's store, the ranks agree on a join-mode
iteration to stop at, the failing rank shadows its missing iterations up to it with the
joinables' join hooks (``_shadow``), and every other rank raises
:class:`RankFailedError` when it would enter the next one: no collective is left half
matched. The protocol: :class:`FailureChannel`; what it covers (gloo cannot abort a
collective in flight): docs/join.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rallypoint._core.forking import fork_safe_lock
from rallypoint._core.store import Store
from rallypoint._core.torch_c import as_torch_store
from rallypoint.join._errors import EarlyTerminationError, RankFailedError

logger = logging.getLogger("rallypoint.join")

_T = TypeVar("_T")
_KEY_PREFIX = "rallypoint/join"
_TORCH_THROW_MESSAGE = (
    "Detected at least one rank that exhausted inputs. Throwing across all ranks."
)

# process group name -> number of Join instances built on it in this process
_join_counters: dict[str, int] = {}
_counter_lock = fork_safe_lock()


def _next_join_id(group: dist.ProcessGroup) -> int:
    name = dist.distributed_c10d._get_process_group_name(group)
    with _counter_lock:
        value = _join_counters.get(name, 0)
        _join_counters[name] = value + 1
    return value


def _group_store(group: dist.ProcessGroup) -> Store | None:
    try:
        return as_torch_store(dist.distributed_c10d._get_process_group_store(group))
    except (KeyError, RuntimeError, ValueError):
        pass
    try:
        return as_torch_store(dist.distributed_c10d._get_default_store())
    except (RuntimeError, ValueError):
        return None


def is_consequence(exc: BaseException) -> bool:
    """True for errors that follow another rank's action, which must not be republished."""
    if isinstance(exc, (RankFailedError, EarlyTerminationError)):
        return True
    return isinstance(exc, RuntimeError) and str(exc) == _TORCH_THROW_MESSAGE


class FailureChannel:
    """One Join instance's failure key in the process group's store, and the agreement on
    where every rank stops after a failure.

    The failing rank publishes ``"<rank>|<reason>"`` under a key that names the Join by a
    counter of the Joins built on this process group (the same on every rank). Then:

    1. every rank counts the join-mode iterations it enters (:meth:`enter_iteration`, from
       every first joinable's ``notify_join_context`` and each join-loop iteration);
    2. the first rank that sees the failure acknowledges it with that count and enters no
       further iteration until the stop point is known;
    3. the failing rank waits for every acknowledgement, publishes the largest count as the
       stop point ``K``, shadows its own missing iterations up to ``K`` with the joinables'
       join hooks, and marks the failure served;
    4. every other rank finishes iteration ``K`` and raises :class:`RankFailedError` when it
       would enter iteration ``K + 1``; a wait still pending once the failure is served
       will never complete and raises at once.

    The shadow starts at an iteration boundary: iterations past the failing rank's count are
    entered by another rank only after the failing rank completed all of its iteration.
    """

    __slots__ = (
        "_failure",
        "_iterations",
        "_last_check",
        "_lock",
        "_stop",
        "_store",
        "agreement_timeout",
        "key",
        "poll_interval",
        "prefix",
        "rank",
    )

    def __init__(self, store: Store, prefix: str, rank: int, poll_interval: timedelta) -> None:
        self._store = store
        self.prefix = prefix
        """The store key prefix of this Join instance (other protocols put keys under it)."""
        self.key = f"{prefix}/failed"
        self.rank = rank
        self.poll_interval = poll_interval.total_seconds()
        self.agreement_timeout = max(2.0, 20 * self.poll_interval)
        """How long the failing rank waits for the acknowledgements, and for its shadow."""
        self._failure: tuple[int, str] | None = None
        self._last_check = 0.0
        self._lock = threading.RLock()
        self._iterations = 0  # join-mode iterations entered in the current context
        self._stop: int | None = None  # the agreed stop point; -1: none came in time

    @classmethod
    def for_group(
        cls, group: dist.ProcessGroup, rank: int, poll_interval: timedelta
    ) -> FailureChannel | None:
        join_id = _next_join_id(group)
        store = _group_store(group)
        if store is None:
            return None
        return cls(store, f"{_KEY_PREFIX}/{join_id}", rank, poll_interval)

    @property
    def store(self) -> Store:
        """The process group's store that the channel writes to."""
        return self._store

    @property
    def iterations(self) -> int:
        """The join-mode iterations this rank has entered in the current context."""
        return self._iterations

    def begin(self) -> None:
        """A context starts: no join-mode iteration entered yet."""
        with self._lock:
            self._iterations = 0

    # -- every rank --------------------------------------------------------------------

    def failure(self, *, force: bool = False) -> tuple[int, str] | None:
        """The ``(rank, reason)`` another rank published, checking the store at most once per
        ``poll_interval`` unless ``force``. The first time it is seen, this rank
        acknowledges it with its iteration count."""
        if self._failure is not None:
            return self._failure
        now = time.monotonic()
        if not force and now - self._last_check < self.poll_interval:
            return None
        self._last_check = now
        try:
            if not self._store.check([self.key]):
                return None
            raw = self._store.get(self.key).decode("utf-8", "replace")
        except Exception:
            return None  # store unreachable: fall back to the collectives' own timeout
        rank_text, _, reason = raw.partition("|")
        failed_rank = int(rank_text)
        if failed_rank == self.rank:
            return None
        with self._lock:  # atomic with enter_iteration: the count is the one we stop at
            if self._failure is None:
                self._failure = (failed_rank, reason)
                self._set(f"{self.prefix}/ack/{self.rank}", str(self._iterations))
        return self._failure

    def raise_if_failed(self, *, force: bool = False) -> None:
        found = self.failure(force=force)
        if found is not None:
            raise RankFailedError(found[0], found[1], self.rank)

    def enter_iteration(self) -> None:
        """Count one join-mode iteration, or raise :class:`RankFailedError` if another rank
        failed and the agreed stop point is reached (waiting for it if needed)."""
        with self._lock:
            if self.failure() is None:
                self._iterations += 1
                return
        stop = self.stop_point()
        with self._lock:
            if self._iterations < stop:
                self._iterations += 1
                return
        self.raise_if_failed()

    def stop_point(self) -> int:
        """The last iteration every rank runs after a failure (-1 if none was published in
        time: stop now)."""
        if self._stop is None:
            found = self._wait_for(f"{self.prefix}/stop", self.agreement_timeout + 1.0)
            self._stop = -1 if found is None else int(found)
        return self._stop

    def served(self) -> bool:
        """Whether the failing rank has shadowed the iterations up to the stop point."""
        try:
            return bool(self._store.check([f"{self.prefix}/served"]))
        except Exception:
            return True  # store unreachable: nothing more will come

    # -- the failing rank --------------------------------------------------------------

    def publish(self, exc: BaseException) -> bool:
        """Tell the other ranks that this rank failed; ``False`` if another rank's failure
        was published first (the first one wins)."""
        value = f"{self.rank}|{type(exc).__name__}: {exc}".replace("\n", " ")[:2000]
        try:
            now = self._store.compare_set(self.key, "", value)
        except Exception:  # the store itself may be what failed
            logger.warning("rank %d could not publish its failure to the store", self.rank)
            return False
        return bytes(now) == value.encode()

    def agree_on_stop_point(self, world_size: int) -> int:
        """Wait (at most ``agreement_timeout``) until every other rank has acknowledged this
        rank's failure, then publish the largest acknowledged count as the stop point."""
        keys = {r: f"{self.prefix}/ack/{r}" for r in range(world_size) if r != self.rank}
        deadline = time.monotonic() + self.agreement_timeout
        counts: dict[int, int] = {}
        try:
            while time.monotonic() < deadline and not self._store.check(list(keys.values())):
                time.sleep(0.005)
            for r, key in keys.items():
                if self._store.check([key]):
                    counts[r] = int(self._store.get(key))
        except Exception:
            logger.debug("rank %d could not read the acknowledgements", self.rank)
        missing = sorted(set(keys) - set(counts))
        if missing:
            logger.warning(
                "rank(s) %s did not acknowledge rank %d's failure within %.1f s; they may stay "
                "blocked until the process group's timeout",
                missing,
                self.rank,
                self.agreement_timeout,
            )
        stop = max(counts.values(), default=self._iterations)
        self._set(f"{self.prefix}/stop", str(stop), first_wins=True)
        self._stop = None
        return self.stop_point()

    def mark_served(self) -> None:
        """The shadow is done: waits still pending on the other ranks will never complete."""
        self._set(f"{self.prefix}/served", "1")

    # -- store helpers -----------------------------------------------------------------

    def _set(self, key: str, value: str, *, first_wins: bool = False) -> None:
        try:
            if first_wins:
                self._store.compare_set(key, "", value)
            else:
                self._store.set(key, value)
        except Exception:
            logger.debug("rank %d could not set %s in the store", self.rank, key)

    def _wait_for(self, key: str, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        pause = 0.001
        try:
            while not self._store.check([key]):
                if time.monotonic() > deadline:
                    return None
                time.sleep(pause)
                pause = min(2 * pause, 0.02)
            return bytes(self._store.get(key)).decode()
        except Exception:
            return None


class BodyWatcher:
    """Watches the failure key while the ``with`` body runs, and logs a failure at once.

    The body's own collectives cannot be interrupted (what is covered: docs/join.md); this
    thread is how a rank blocked in such a collective acknowledges another rank's failure within
    about ``2 * poll_interval`` (so that the failing rank can shadow it), and it tells the
    user which rank failed while this rank sits in a collective that no hook shadows. One
    daemon thread per context, stopped when the context exits.
    """

    def __init__(self, channel: FailureChannel) -> None:
        self._channel = channel
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rallypoint-join-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)  # longer only if the store hangs; it is a daemon

    def _run(self) -> None:
        interval = 2 * self._channel.poll_interval
        while not self._stop.wait(interval):
            found = self._channel.failure(force=True)  # also acknowledges it
            if found is not None:
                if not self._stop.is_set():
                    logger.error(
                        "rank %d failed inside the Join context: %s; rank %d stops at the "
                        "iteration every rank agrees on and raises RankFailedError (a "
                        "collective that no join hook shadows, e.g. a plain dist.all_reduce "
                        "in the body, returns only at the process group's timeout)",
                        found[0],
                        found[1],
                        self._channel.rank,
                    )
                return


def wait_work(work: dist.Work, channel: FailureChannel | None) -> None:
    """Wait for ``work`` like ``work.wait()``; once another rank has published a failure,
    wait only until the failing rank has shadowed what it agreed to, then raise
    :class:`RankFailedError` if ``work`` is still pending."""
    if channel is None:
        work.wait()
        return
    slice_ = timedelta(seconds=channel.poll_interval)
    while True:
        if work.is_completed():
            work.wait()  # raises the collective's own error, if any
            return
        if channel.failure() is not None:
            break
        if _wait_slice(work, slice_):
            return
        if channel.failure(force=True) is not None:
            break
    # the failing rank may still shadow this collective: wait until it completes or the
    # failing rank says it is done (bounded: it may have died)
    deadline = time.monotonic() + 2 * channel.agreement_timeout + 1.0
    while not work.is_completed() and not channel.served() and time.monotonic() < deadline:
        if _wait_slice(work, timedelta(milliseconds=20)):
            return
    if work.is_completed():
        work.wait()
        return
    channel.raise_if_failed()


def _wait_slice(work: dist.Work, timeout: timedelta) -> bool:
    """Wait up to ``timeout`` for ``work``: ``True`` once it completed, ``False`` if it is
    still pending; raises the collective's own error. A timed-out ``wait`` raises
    "Operation timed out!" and the work may complete just after it: then its own outcome
    is what counts, not the time slice running out."""
    try:
        work.wait(timeout=timeout)
        return True
    except RuntimeError:
        if not work.is_completed():
            return False
    work.wait()  # completed: returns, or raises the collective's own error
    return True


def run_watched(
    fn: Callable[[], _T], channel: FailureChannel | None, cancel: threading.Event
) -> _T:
    """Run ``fn`` on a helper thread while this thread watches ``channel``.

    Hooks block in ``work.wait()`` calls that cannot be interrupted; running them on a
    helper thread lets the calling thread raise :class:`RankFailedError` anyway. On a
    failure ``cancel`` is set so that ``fn`` stops at its next check; the helper thread
    itself stays blocked until the collective fails or the process exits (it is a daemon).
    """
    if channel is None:
        return fn()
    outcome: list[Any] = []
    done = threading.Event()
    grad_enabled = torch.is_grad_enabled()

    def target() -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                outcome.append(("ok", fn()))
        except BaseException as exc:  # SystemExit too: handed to the caller's thread
            outcome.append(("err", exc))
        finally:
            done.set()

    thread = threading.Thread(target=target, name="rallypoint-join-loop", daemon=True)
    thread.start()
    try:
        while not done.wait(channel.poll_interval):
            channel.raise_if_failed(force=True)
    except BaseException:  # Ctrl-C too: the worker thread is cancelled
        cancel.set()
        raise
    thread.join()
    kind, value = outcome[0]
    if kind == "err":
        raise value
    result: _T = value
    return result
