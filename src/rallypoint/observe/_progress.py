"""Progress heartbeats: ``rallypoint.progress()`` and the agent's board.

A worker calls :func:`progress` in its training loop; each call stores
``time.monotonic()`` into this worker's slot and adds one to its step counter, in a small
shared file the agent created and mapped: no syscall, no lock, no allocation. The agent's
:class:`ProgressBoard` reads the slots for ``--hang-timeout`` and straggler detection.
The worker finds its slot through ``RALLYPOINT_PROGRESS_FILE`` and
``RALLYPOINT_PROGRESS_SLOT``; without them :func:`progress` is a no-op, and a file that is
not a board gives one ``RuntimeWarning``: progress reporting never breaks training.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from datetime import timedelta

from rallypoint._core import envvars
from rallypoint._core.checks import check_int
from rallypoint._core.closing import Closing

__all__ = [
    "PROGRESS_FILE_ENV",
    "PROGRESS_SLOT_ENV",
    "ProgressBoard",
    "progress",
]

PROGRESS_FILE_ENV = envvars.PROGRESS_FILE
PROGRESS_SLOT_ENV = envvars.PROGRESS_SLOT

_MAGIC = b"RPPROG\x00\x02"
_HEADER = struct.Struct("<8sII")
_SLOT_SIZE = 8
_MAX_SLOTS = 1 << 16
_PREFIX = "rallypoint-progress-"
_SWEEP_AFTER = 60.0
"""Seconds a board's file may exist unlocked: its agent locks it right after making it."""

# worker-side state: _view is the mapped slot array once initialised, _disabled once we
# know this process was not started with a board.
_view: memoryview[float] | None = None
_slot = 0
_count_slot = 0
_disabled = False
_keep_alive: mmap.mmap | None = None
_fork_hook_installed = False
_monotonic = time.monotonic


def progress() -> None:
    """Report that this worker made progress (cheap enough to call every step).

    Call it once per training step: the agent's hang detection and straggler detection
    read it. A no-op when the process was not started by a rallypoint agent.
    """
    view = _view
    if view is not None:
        view[_slot] = _monotonic()
        view[_count_slot] += 1.0
    elif not _disabled:
        _init_worker()


def _forget_after_fork() -> None:
    # a child forked from a process that looked at the variables (a warm process, a
    # DataLoader worker) decides again from its own environment on its first call
    global _view, _disabled, _keep_alive
    _view = None
    _disabled = False
    _keep_alive = None


def _init_worker() -> None:
    global _view, _slot, _count_slot, _disabled, _keep_alive, _fork_hook_installed
    if not _fork_hook_installed:
        os.register_at_fork(after_in_child=_forget_after_fork)
        _fork_hook_installed = True
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        _disabled = True
        return
    env = os.environ
    slot_text = (
        env.get(PROGRESS_SLOT_ENV) or env.get(envvars.LOCAL_RANK) or env.get("LOCAL_RANK", "")
    )
    try:
        slot = int(slot_text)
        mm = _map(path)
    except (OSError, ValueError) as exc:
        _disabled = True
        warnings.warn(
            f"rallypoint.progress() is disabled: {exc} ({PROGRESS_FILE_ENV}={path!r}, "
            f"slot {slot_text!r}); hang detection will not see this worker's progress",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    view = memoryview(mm)[_HEADER.size :].cast("d")
    nslots = len(view) // 2
    if not 0 <= slot < nslots:
        view.release()
        mm.close()
        _disabled = True
        warnings.warn(
            f"rallypoint.progress() is disabled: slot {slot} is outside the board's "
            f"{nslots} slots ({PROGRESS_FILE_ENV}={path!r})",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    _keep_alive, _slot, _count_slot = mm, slot, nslots + slot
    _view = view
    view[slot] = _monotonic()
    view[_count_slot] += 1.0


def _map(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < _HEADER.size:
            raise ValueError("file is too small to be a progress board")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    magic, nslots, _ = _HEADER.unpack_from(mm, 0)
    if magic != _MAGIC or size != _HEADER.size + 2 * nslots * _SLOT_SIZE:
        mm.close()
        raise ValueError("file is not a rallypoint progress board")
    return mm


def _unlink_if_owner(path: str, owner: int, lock: int) -> None:
    if os.getpid() == owner:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.close(lock)


def _sweep_orphans(directory: str) -> None:
    """Delete the boards in ``directory`` whose agent is gone.

    An agent holds an ``flock`` on its board for its life (so do processes forked from it
    that kept the descriptor); the kernel drops it when they exit, SIGKILL included, which
    would otherwise leave the file behind for good (a killed process unlinks nothing). A
    board nobody locks, older than ``_SWEEP_AFTER`` (one just made may not be locked yet),
    is an orphan. Boards of other users cannot be opened and are left alone."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(_PREFIX)]
    except OSError:
        return
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < _SWEEP_AFTER:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its agent is alive
            os.unlink(path)
        except OSError:
            continue
        finally:
            os.close(fd)


def _default_directory() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


class ProgressBoard(Closing):
    """The agent's side: a shared file with one progress slot per local worker.

    File layout: ``b"RPPROG\\x00\\x02"`` magic, ``uint32`` slot count ``n``, ``uint32``
    padding, then ``n`` ``float64`` times (``0.0``: no progress since the last
    :meth:`reset`), then ``n`` ``float64`` step counters (exact up to 2**53).
    ``CLOCK_MONOTONIC`` is shared by all processes of a machine, so the agent compares the
    slots with its own ``time.monotonic()``. The two stores of one call are not atomic
    together: a reader can see the new time with the old count, which moves one step
    across the edge of a measuring window (straggler detection averages over several).

    Create it before starting workers, pass :meth:`env` into each worker's environment,
    call :meth:`reset` at the start of each attempt (after the previous attempt's workers
    are gone), and poll :meth:`seconds_since_progress` from the monitor loop.
    ``clock`` must be ``time.monotonic`` outside tests (the workers write that clock).
    """

    def __init__(
        self,
        nslots: int,
        *,
        directory: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_int(nslots, "nslots")
        if not 1 <= nslots <= _MAX_SLOTS:
            raise ValueError(f"nslots must be between 1 and {_MAX_SLOTS}, got {nslots}")
        self.nslots = nslots
        self._clock = clock
        where = os.fspath(directory) if directory is not None else _default_directory()
        _sweep_orphans(where)
        fd, self.path = tempfile.mkstemp(prefix=_PREFIX, dir=where)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # for this process's life
            size = _HEADER.size + 2 * nslots * _SLOT_SIZE
            os.ftruncate(fd, size)
            self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED)
        except BaseException:  # Ctrl-C too: fd and file go
            os.close(fd)
            os.unlink(self.path)
            raise
        # a board that is never closed still disappears when this process exits (but not
        # when a process forked from it exits); one whose process is killed is deleted by
        # the next board made in its directory (_sweep_orphans), the lock on ``fd`` gone
        self._finalizer = weakref.finalize(self, _unlink_if_owner, self.path, os.getpid(), fd)
        _HEADER.pack_into(self._mm, 0, _MAGIC, nslots, 0)
        both = memoryview(self._mm)[_HEADER.size :].cast("d")
        self._slots: memoryview[float] = both[:nslots]
        self._counts: memoryview[float] = both[nslots:]
        both.release()
        self._reset_at = clock()

    def env(self, local_rank: int) -> dict[str, str]:
        """The variables that point the worker with ``local_rank`` at its slot."""
        self._check_rank(local_rank)
        return {PROGRESS_FILE_ENV: self.path, PROGRESS_SLOT_ENV: str(local_rank)}

    def reset(self) -> None:
        """Forget all progress; idle time counts from now (call once per attempt)."""
        self._require_open()
        for i in range(self.nslots):
            self._slots[i] = 0.0
            self._counts[i] = 0.0
        self._reset_at = self._clock()

    def last_progress(self, local_rank: int) -> float | None:
        """``time.monotonic()`` of this worker's last report since :meth:`reset`, or ``None``."""
        self._check_rank(local_rank)
        value = float(self._slots[local_rank])
        return value if value > 0.0 else None

    def steps(self, local_rank: int) -> int:
        """How many times this worker called :func:`progress` since :meth:`reset`."""
        self._check_rank(local_rank)
        return int(self._counts[local_rank])

    def sample(self) -> list[tuple[float, int]]:
        """``(time of the last progress, steps)`` of every slot since :meth:`reset`
        (``(0.0, 0)`` for a worker that did not report yet)."""
        self._require_open()
        return [(float(self._slots[i]), int(self._counts[i])) for i in range(self.nslots)]

    def reported(self) -> list[int]:
        """Local ranks that reported progress at least once since :meth:`reset`."""
        self._require_open()
        return [i for i in range(self.nslots) if self._slots[i] > 0.0]

    def seconds_since_progress(self, local_rank: int | None = None) -> float:
        """Seconds since the last progress of any worker (``local_rank=None``) or of one.

        Counts from the last :meth:`reset` when there was no progress since: a worker that
        hangs before its first report is a hang too.
        """
        if local_rank is None:
            self._require_open()
            latest = max(self._reset_at, max(self._slots))
        else:
            self._check_rank(local_rank)
            latest = max(self._reset_at, self._slots[local_rank])
        return max(0.0, self._clock() - latest)

    def is_hung(self, timeout: timedelta) -> bool:
        """Whether no worker has made progress for ``timeout``."""
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
        if timeout <= timedelta(0):
            raise ValueError(f"timeout must be positive, got {timeout}")
        return self.seconds_since_progress() >= timeout.total_seconds()

    def close(self) -> None:
        """Unmap and delete the file (workers that still map it keep their pages)."""
        if self._mm is None:
            return
        self._slots.release()
        self._counts.release()
        self._mm.close()
        self._mm = None
        self._finalizer()

    def _require_open(self) -> None:
        if self._mm is None:
            raise ValueError("the progress board is closed")

    def _check_rank(self, local_rank: int) -> None:
        self._require_open()
        check_int(local_rank, "local_rank")
        if not 0 <= local_rank < self.nslots:
            raise ValueError(f"local_rank must be in [0, {self.nslots}), got {local_rank}")
