"""Failure safety: a rank that raises inside a Join context tells the others.

torch's ``Join.__exit__`` returns at once when the body raised, so the other ranks block in
their next collective until the process group times out (30 minutes by default). Here the
failing rank publishes ``"<rank>|<reason>"`` under one key per Join instance in the process
group's store, and every wait that rallypoint controls is interruptible: the collective is
issued with ``async_op=True`` and waited for in slices of ``poll_interval``, checking the
key between slices (one cheap ``store.check``). The key names the Join instance by a
counter of the Joins built on this process group, which is the same on every rank because
every rank builds the same Joins in the same order.

What this covers and what it cannot (gloo cannot abort a collective in flight):

- covered: the join loop's own all-reduces, the joinables' main and post hooks (they run
  on a helper thread while the calling thread watches the store), the throw-mode check
  in :meth:`Join.notify_join_context`, and the collectives of
  :class:`~rallypoint.join.CollectiveJoinable`;
- DDP's backward all-reduce out of join mode (deferred join mode): the failed rank
  completes it, see :meth:`DeferredJoinMode.release_others
  <rallypoint.join._deferred.DeferredJoinMode.release_others>`;
- not covered: other collectives that user code or torch issues inside the ``with`` body
  on a rank that has not joined (DDP's backward all-reduce in join mode, torch's own
  blocking throw-mode check inside ``DistributedDataParallel.forward``).
  :class:`BodyWatcher` logs the failure at once, but such a rank stays blocked until
  the process group's timeout (or until the failed process exits), and then
  :class:`Join` turns the error into a :class:`RankFailedError` naming the failed rank.
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
from torch._C._distributed_c10d import Store

from rallypoint.join._errors import EarlyTerminationError, RankFailedError

logger = logging.getLogger("rallypoint.join")

_T = TypeVar("_T")
_KEY_PREFIX = "rallypoint/join"
_TORCH_THROW_MESSAGE = (
    "Detected at least one rank that exhausted inputs. Throwing across all ranks."
)

# process group name -> number of Join instances built on it in this process
_join_counters: dict[str, int] = {}
_counter_lock = threading.Lock()


def _next_join_id(group: dist.ProcessGroup) -> int:
    name = dist.distributed_c10d._get_process_group_name(group)
    with _counter_lock:
        value = _join_counters.get(name, 0)
        _join_counters[name] = value + 1
    return value


def _group_store(group: dist.ProcessGroup) -> Store | None:
    try:
        return dist.distributed_c10d._get_process_group_store(group)
    except (KeyError, RuntimeError, ValueError):
        pass
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def is_consequence(exc: BaseException) -> bool:
    """True for errors that follow another rank's action, which must not be republished."""
    if isinstance(exc, (RankFailedError, EarlyTerminationError)):
        return True
    return isinstance(exc, RuntimeError) and str(exc) == _TORCH_THROW_MESSAGE


class FailureChannel:
    """One Join instance's failure key in the process group's store."""

    __slots__ = ("_failure", "_last_check", "_store", "key", "poll_interval", "prefix", "rank")

    def __init__(self, store: Store, prefix: str, rank: int, poll_interval: timedelta) -> None:
        self._store = store
        self.prefix = prefix
        """The store key prefix of this Join instance (other protocols put keys under it)."""
        self.key = f"{prefix}/failed"
        self.rank = rank
        self.poll_interval = poll_interval.total_seconds()
        self._failure: tuple[int, str] | None = None
        self._last_check = 0.0

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

    def publish(self, exc: BaseException) -> None:
        """Tell the other ranks that this rank failed (first failure wins)."""
        reason = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:2000]
        try:
            self._store.compare_set(self.key, "", f"{self.rank}|{reason}")
        except Exception:  # the store itself may be what failed
            logger.warning("rank %d could not publish its failure to the store", self.rank)

    def failure(self, *, force: bool = False) -> tuple[int, str] | None:
        """The ``(rank, reason)`` another rank published, checking the store at most once per
        ``poll_interval`` unless ``force``."""
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
        self._failure = (failed_rank, reason)
        return self._failure

    def acknowledge(self) -> None:
        """Tell the failed rank that this rank has seen its failure (see
        :meth:`wait_for_acknowledgements`)."""
        try:
            self._store.set(f"{self.prefix}/ack/{self.rank}", "1")
        except Exception:
            logger.debug("rank %d could not acknowledge a failure", self.rank)

    def wait_for_acknowledgements(self, world_size: int, timeout: float) -> bool:
        """Wait until every other rank has seen this rank's failure (at most ``timeout``)."""
        keys = [f"{self.prefix}/ack/{r}" for r in range(world_size) if r != self.rank]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self._store.check(keys):
                    return True
            except Exception:
                return False
            time.sleep(0.01)
        return False

    def raise_if_failed(self, *, force: bool = False) -> None:
        found = self.failure(force=force)
        if found is not None:
            raise RankFailedError(found[0], found[1], self.rank)


class BodyWatcher:
    """Watches the failure key while the ``with`` body runs, and logs a failure at once.

    The body's own collectives cannot be interrupted (see the module docstring); this at
    least tells the user, within about ``5 * poll_interval``, which rank failed while this
    rank sits in a collective that will fail only at the process group's timeout. One
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
        interval = 5 * self._channel.poll_interval
        while not self._stop.wait(interval):
            found = self._channel.failure(force=True)
            if found is not None:
                self._channel.acknowledge()
                if not self._stop.is_set():
                    logger.error(
                        "rank %d failed inside the Join context: %s; rank %d raises "
                        "RankFailedError when its current collective returns (a collective "
                        "issued in the body, e.g. DDP's backward all-reduce, returns only "
                        "at the process group's timeout)",
                        found[0],
                        found[1],
                        self._channel.rank,
                    )
                return


def wait_work(work: dist.Work, channel: FailureChannel | None) -> None:
    """Wait for ``work`` like ``work.wait()``, raising :class:`RankFailedError` as soon as
    another rank publishes a failure."""
    if channel is None:
        work.wait()
        return
    slice_ = timedelta(seconds=channel.poll_interval)
    while True:
        if work.is_completed():
            work.wait()  # raises the collective's own error, if any
            return
        channel.raise_if_failed()
        try:
            work.wait(timeout=slice_)
            return
        except RuntimeError:
            if work.is_completed():
                raise  # a real error, not our time slice running out
        channel.raise_if_failed(force=True)


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
        except BaseException as exc:
            outcome.append(("err", exc))
        finally:
            done.set()

    thread = threading.Thread(target=target, name="rallypoint-join-loop", daemon=True)
    thread.start()
    try:
        while not done.wait(channel.poll_interval):
            channel.raise_if_failed(force=True)
    except BaseException:
        cancel.set()
        raise
    thread.join()
    kind, value = outcome[0]
    if kind == "err":
        raise value
    result: _T = value
    return result
