"""A single-threaded process that forks test workers on request: the worker zygote.

``fork()`` copies only the calling thread, so a lock another thread held stays held in the
child. Python's locks can be made fork-safe (:mod:`rallypoint._core.forking`), C
libraries' cannot: a worker forked while a store thread was inside glibc's resolver blocks
in its own first connect. So the zygote is forked from the test process once, before any
test ran, and then does nothing but fork: no tests, no threads, no name lookups. Workers'
functions and arguments travel pickled (the function must be importable by name), their
pipes and stdout/stderr as file descriptors. The zygote reaps its children
(:class:`ZygoteChild`) and kills them and exits when the test process goes away.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["Zygote", "ZygoteChild", "ZygoteError"]

_HEADER = struct.Struct("!I")
_MAX_FDS = 8
_JOIN_POLL = 0.02  # seconds between two status questions while a join waits
_ASYNC_SIGNALS = {
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGALRM,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
}


class ZygoteError(RuntimeError):
    """The zygote is gone or answered nonsense (it died, or was killed)."""


def _send(sock: socket.socket, message: Any, fds: list[int] | None = None) -> None:
    body = pickle.dumps(message)
    data = _HEADER.pack(len(body)) + body
    sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the descriptors that came with it; ``EOFError`` at the end."""
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    if not head:
        raise EOFError
    while len(head) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(head))
        if not more:
            raise EOFError
        head += more
    (size,) = _HEADER.unpack(head)
    body = bytearray()
    while len(body) < size:
        chunk = sock.recv(min(size - len(body), 1 << 20))
        if not chunk:
            raise EOFError
        body += chunk
    return pickle.loads(body), fds


class ZygoteChild:
    """A worker the zygote forked: what the caller knows of a process of its own."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        """``None`` while it runs; its exit status, or ``-signal`` if a signal ended it."""
        if self._exitcode is None:
            self._exitcode = self._zygote.status(self.pid)
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        if self._exitcode is None:  # not reaped yet, so the pid is still this worker's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None:
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(_JOIN_POLL)


class Zygote:
    """Fork a zygote from this process now (see the module's doc); :meth:`close` ends it.

    Start it while this process has no other Python threads: the zygote inherits whatever
    they hold, like any child (``threads_at_start`` says how many there were, this one
    included). Idle pools of native libraries are harmless (``import torch`` starts
    OpenBLAS's, which handles fork itself).
    """

    def __init__(self) -> None:
        self.threads_at_start = threading.active_count()
        parent_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lock = threading.Lock()
        pid = os.fork()
        if pid == 0:  # the zygote
            parent_end.close()
            _serve(zygote_end)  # never returns
        zygote_end.close()
        self.pid = pid
        self._sock: socket.socket | None = parent_end
        self._owner = os.getpid()
        self._asked = 0  # requests sent (see _ask)

    def fork(
        self, target: Callable[..., Any], args: tuple[Any, ...], fds: list[int]
    ) -> ZygoteChild:
        """Fork a worker that runs ``target(received_fds, *args)`` and exits.

        ``fds`` are handed to the worker (their numbers there differ): the first two become
        its stdout and stderr, the rest are passed to ``target`` in order. ``target`` and
        ``args`` must pickle (``TypeError`` otherwise)."""
        try:
            payload = pickle.dumps((target, args))
        except (pickle.PicklingError, AttributeError, TypeError, RuntimeError) as exc:
            raise TypeError(
                f"the worker zygote needs the function and its arguments to pickle "
                f"(define the function at module level, pass plain values): {exc}"
            ) from exc
        pid = self._ask(("fork", payload), fds)
        assert isinstance(pid, int)
        return ZygoteChild(self, pid)

    def status(self, pid: int) -> int | None:
        """``None`` while ``pid`` runs, else its exit code (``-signal`` for a signal)."""
        code = self._ask(("status", pid))
        assert code is None or isinstance(code, int)
        return code

    def _ask(self, message: tuple[str, Any], fds: list[int] | None = None) -> Any:
        """Send a request and return its reply.

        Asynchronous signals wait until the exchange is done (a Python handler that raised
        in the middle of a send, as pytest-timeout's does, would leave half a message in
        the stream). Requests are numbered too, and the zygote echoes the number: a reply
        left unread all the same is skipped by the next request, not taken for its own."""
        with self._lock:
            if self._sock is None or os.getpid() != self._owner:
                raise ZygoteError("the worker zygote was closed (or belongs to another process)")
            self._asked += 1
            number = self._asked
            deferred = signal.pthread_sigmask(signal.SIG_BLOCK, _ASYNC_SIGNALS)
            try:
                _send(self._sock, (number, *message), fds)
                while True:
                    (answered, reply), _ = _recv(self._sock)
                    if answered == number:
                        break
            except (OSError, EOFError) as exc:
                raise ZygoteError(f"the worker zygote (pid {self.pid}) is gone: {exc!r}") from exc
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, deferred)
        if isinstance(reply, BaseException):
            raise ZygoteError(f"the worker zygote failed: {reply!r}")
        return reply

    def close(self) -> None:
        """End the zygote (it kills the workers it still has) and reap it."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is None or os.getpid() != self._owner:
            return
        sock.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


# --- in the zygote -------------------------------------------------------------------


def _serve(sock: socket.socket) -> None:
    """The zygote's loop: fork workers and report their statuses until the caller goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the test process's to handle
    statuses: dict[int, int | None] = {}
    while True:
        try:
            message, fds = _recv(sock)
        except (EOFError, OSError):
            break
        number, kind, body = message
        try:
            if kind == "fork":
                reply: Any = _fork_worker(sock, body, fds)
                statuses[reply] = None
            else:
                reply = _status(statuses, body)
        except Exception as exc:
            reply = exc
        finally:
            for fd in fds:
                os.close(fd)
        try:
            _send(sock, (number, reply))
        except OSError:
            break
    for pid, code in statuses.items():
        if code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    os._exit(0)


def _status(statuses: dict[int, int | None], pid: int) -> int | None:
    if statuses.get(pid) is None:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            statuses[pid] = os.waitstatus_to_exitcode(status)
    return statuses[pid]


def _take_output(out_fd: int, err_fd: int) -> None:
    """Make ``out_fd``/``err_fd`` the worker's stdout/stderr, at both levels: the zygote's
    ``sys.stdout`` may be a file of pytest's capture for the test that ran when the
    zygote was forked, not descriptor 1."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in (out_fd, err_fd):
        if fd > 2:
            os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), line_buffering=True, errors="backslashreplace"
    )


def _fork_worker(sock: socket.socket, payload: bytes, fds: list[int]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        sock.close()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _take_output(fds[0], fds[1])
        target, args = pickle.loads(payload)
        target(fds[2:], *args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a forked child reports anything before it exits
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
