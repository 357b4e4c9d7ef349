"""The supervisor's handle on its warm process ("zygote"), which imports torch once and then
forks workers on command.

The supervisor forks it first thing (the CLI before it even parses its arguments, so that
``import torch`` overlaps the launcher's own start-up) and talks to it over a Unix
``SOCK_SEQPACKET`` socketpair: one pickled message per packet (``_messages``), pipe ends
passed with ``SCM_RIGHTS``. The warm process's own side is ``_server``.

Kept light on purpose: the CLI imports this module before forking, so everything heavier
(the messages, the worker side, the exceptions) is imported after the fork, where used.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from rallypoint._supervise._errors import WarmErrorKind, WarmProcessError
    from rallypoint._supervise._warm._messages import Exited, Request
    from rallypoint._supervise._worker import WorkerSpec

__all__ = ["REPLY_TIMEOUT", "WarmProcess"]

REPLY_TIMEOUT = 60.0
"""Seconds to wait for the warm process to answer a spawn or store request."""
_MAX_MESSAGE = 1 << 22  # the same as _messages.MAX_MESSAGE (not imported before the fork)

_R = TypeVar("_R")


def _error(message: str, kind: WarmErrorKind | None = None) -> WarmProcessError:
    from rallypoint._supervise._errors import WarmErrorKind, WarmProcessError

    return WarmProcessError(message, kind=kind or WarmErrorKind.DIED)


def _die_with(parent: int) -> None:
    """First thing in the warm process: die with ``parent`` (``serve`` arms it again)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that
        os._exit(1)


class WarmProcess:
    """The supervisor's handle on its warm process."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock
        self.events: deque[Exited] = deque()
        self.started = time.monotonic()
        self.ready = False
        """Whether the warm process answered :meth:`init` (its imports are done)."""
        self._closed = False

    @classmethod
    def fork(cls, *, import_torch: bool = True) -> WarmProcess:
        """Fork the warm process from the current process and return a handle on it."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (parent, child):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _MAX_MESSAGE)
        launcher = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                _die_with(launcher)
                parent.close()
                from rallypoint._supervise._warm._server import serve

                serve(child, import_torch)
            except BaseException:  # a forked child reaches os._exit whatever it caught
                with contextlib.suppress(BaseException):
                    traceback.print_exc()
            finally:
                os._exit(1)
        child.close()
        return cls(pid, parent)

    def fileno(self) -> int:
        return self.sock.fileno()

    # ------------------------------------------------------------------ requests
    def init(
        self,
        preload: tuple[str, ...],
        *,
        poll: Callable[[], None] | None = None,
        later: bool = True,
    ) -> None:
        """Import ``preload`` in the warm process; waits for its ``import torch`` too.
        ``later``: the job may fork workers after its first ones (restarts, spares): the
        warm process imports what a first step imports once it is idle.

        ``poll()`` is called every 50 ms while waiting (raise from it to stop waiting).
        Does nothing once the warm process is :attr:`ready`.
        """
        from rallypoint._supervise._warm._messages import Init, Ready

        if self.ready:
            return
        self._send(Init(tuple(preload), later))
        while poll is not None and not select.select([self.sock], [], [], 0.05)[0]:
            poll()
        self._reply(Ready)
        self.ready = True

    def start_store(self, host: str, port: int) -> tuple[int, int]:
        """Start the store server; returns ``(port, store_pid)``."""
        from rallypoint._supervise._warm._messages import StartStore, StoreStarted

        reply = self._request(StartStore(host, port), StoreStarted)
        return reply.port, reply.pid

    def reset_store(self) -> int:
        """Replace the store server by an empty one on the same port."""
        from rallypoint._supervise._warm._messages import ResetStore, StoreStarted

        return self._request(ResetStore(), StoreStarted).port

    def start_snapshots(self) -> tuple[str, int, str]:
        """Start the node's snapshot server, or a new one if it died; returns ``(socket
        path, pid, how the previous server ended or "")``."""
        from rallypoint._supervise._warm._messages import SnapshotsStarted, StartSnapshots

        reply = self._request(StartSnapshots(), SnapshotsStarted)
        return reply.path, reply.pid, reply.replaced

    def find_cpus(self, mode: str, nproc: int, env: dict[str, str]) -> tuple[frozenset[int], ...]:
        """The CPUs of each local rank under ``numa_binding`` ``mode`` for workers with
        environment ``env`` (torch's rules, run in a child of the warm process)."""
        from rallypoint._supervise._warm._messages import CpusFound, FindCpus

        return self._request(FindCpus(mode, nproc, env), CpusFound).cpus

    def remove_on_exit(self, paths: list[str]) -> None:
        """Have the warm process remove ``paths`` should this process die without closing."""
        from rallypoint._supervise._warm._messages import RemoveOnExit

        self._send(RemoveOnExit(tuple(paths)))

    def spawn_many(self, requests: list[tuple[WorkerSpec, list[int]]]) -> list[int]:
        """Start several workers: all requests go out first, so forks start back to back."""
        from rallypoint._supervise._warm._messages import Spawn, Spawned

        for spec, fds in requests:
            self._send(Spawn(spec), fds)
        pids: dict[int, int] = {}
        while len(pids) < len(requests):
            reply = self._reply(Spawned)
            pids[reply.local_rank] = reply.pid
        return [pids[spec.local_rank] for spec, _ in requests]

    def _request(self, msg: Request, expect: type[_R]) -> _R:
        self._send(msg)
        return self._reply(expect)

    def _send(self, msg: Request, fds: list[int] | None = None) -> None:
        from rallypoint._supervise._warm._messages import send

        try:
            send(self.sock, msg, fds)
        except OSError as exc:
            raise _error(f"lost the warm process: {exc}") from exc

    def _reply(self, expect: type[_R]) -> _R:
        from rallypoint._supervise._errors import WarmErrorKind
        from rallypoint._supervise._warm._messages import Exited, Failed, Ready, recv

        # ``Init`` waits for ``import torch`` and the preloads (no limit); anything else is
        # a fork or a store bind and answers in milliseconds unless the process is stuck.
        self.sock.settimeout(None if expect is Ready else REPLY_TIMEOUT)
        try:
            while True:
                reply, _ = recv(self.sock)
                match reply:
                    case None:
                        raise _error(self._death_reason())
                    case Exited():
                        self.events.append(reply)
                    case Failed(kind=kind, text=text):
                        raise _error(text, kind)
                    case _ if isinstance(reply, expect):
                        return reply
                    case _:
                        raise _error(f"unexpected reply: {reply!r}", WarmErrorKind.PROTOCOL)
        except TimeoutError:
            raise _error(
                f"the warm process did not answer within {REPLY_TIMEOUT:.0f} s",
                WarmErrorKind.TIMEOUT,
            ) from None
        except OSError as exc:
            raise _error(f"lost the warm process: {exc}") from exc
        finally:
            self.sock.settimeout(None)

    def read_events(self) -> list[Exited]:
        """Workers reaped since the last call; call when ``fileno()`` is readable."""
        from rallypoint._supervise._warm._messages import Exited, decode

        out = list(self.events)
        self.events.clear()
        while True:
            try:
                data = self.sock.recv(_MAX_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return out
            except OSError as exc:
                raise _error(f"lost the warm process: {exc}") from exc
            if not data:
                if out:
                    return out
                raise _error(self._death_reason())
            msg = decode(data)
            if isinstance(msg, Exited):
                out.append(msg)

    def _death_reason(self) -> str:
        with contextlib.suppress(ChildProcessError):
            pid, status = os.waitpid(self.pid, 0)
            if pid and os.WIFSIGNALED(status):
                return f"the warm process died by {signal.Signals(os.WTERMSIG(status)).name}"
            if pid:
                return f"the warm process exited with {os.WEXITSTATUS(status)}"
        return "the warm process died"

    # ------------------------------------------------------------------ ending
    def close(self) -> None:
        """Shut the warm process (and its store process) down and reap it."""
        if self._closed:
            return
        if not self.ready:  # busy importing (nothing to stop yet): it would answer late
            self.kill()
            return
        self._closed = True
        from rallypoint._supervise._warm._messages import Shutdown, send

        with contextlib.suppress(OSError):
            send(self.sock, Shutdown())
        self.sock.close()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if pid:
                return
            time.sleep(0.005)
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)

    def kill(self) -> None:
        """Kill the warm process without waiting for it (bad input before it was used)."""
        self._closed = True
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self.sock.close()
