"""The warm process ("zygote"): imports torch once, then forks workers on command.

The supervisor forks it first thing (the CLI before it even parses its arguments, so that
``import torch`` overlaps the launcher's own start-up) and talks to it over a Unix
``SOCK_SEQPACKET`` socketpair: one pickled message per packet, pipe ends passed with
``SCM_RIGHTS``. The warm process stays clean (it never initialises a process group, runs a
tensor op or starts a thread), so it can fork again for every restart. It is a child
subreaper: workers and anything they start stay its descendants, and it reaps them on
``SIGCHLD`` and reports each worker's exit to the supervisor the moment it happens.

The job's ``TCPStore`` server lives in a separate child of the warm process (forked after
``import torch``), so that workers never inherit its listening socket and a restart can
rebind the same port with an empty store.

Messages (supervisor -> warm process, reply):
``("init", preload)`` -> ``("ready", pid)`` | ``("error", text)``;
``("store", host, port)`` and ``("store_reset",)`` -> ``("store", port)`` | ``("error", text)``;
``("spawn", spec)`` + 3 fds -> ``("spawned", local_rank, pid)``; ``("shutdown",)``.
Unsolicited: ``("exit", pid, wait_status)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import pickle
import selectors
import signal
import socket
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from rallypoint.launcher._worker import WorkerSpec

# Kept light on purpose: the CLI imports this module before forking the warm process, so
# everything heavier (the worker-side module, exceptions) is imported where it is used.

__all__ = ["WarmProcess"]

_MAX_MSG = 1 << 22
_PR_SET_CHILD_SUBREAPER = 36
WARM_MODULES = ("torch", "torch.distributed", "torch.nn.parallel")
REPLY_TIMEOUT = 60.0
"""Seconds to wait for the warm process to answer a spawn or store request."""


def _send(sock: socket.socket, msg: tuple[Any, ...], fds: list[int] | None = None) -> None:
    data = pickle.dumps(msg)
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _recv(sock: socket.socket, maxfds: int = 0) -> tuple[tuple[Any, ...] | None, list[int]]:
    if maxfds:
        data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MSG, maxfds)
    else:
        data, fds = sock.recv(_MAX_MSG), []
    if not data:
        return None, list(fds)
    msg = pickle.loads(data)
    assert isinstance(msg, tuple)
    return msg, list(fds)


# ----------------------------------------------------------------------------- server side


def _store_main(conn: socket.socket) -> NoReturn:
    """The store process: hosts one TCPStore server at a time, replaced on each reset."""
    from rallypoint.launcher._worker import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported at runtime

    store: Any = None
    host, port = "127.0.0.1", 0
    while True:
        msg, _ = _recv(conn)
        if msg is None:
            os._exit(0)
        if msg[0] == "start":
            host, port = msg[1], msg[2]
        store = None  # closes the previous server before rebinding its port
        try:
            store = TCPStore(host, port, None, True, wait_for_workers=False, use_libuv=True)
            port = store.port
            _send(conn, ("store", port, os.getpid()))
        except Exception as exc:
            _send(conn, ("error", f"{type(exc).__name__}: {exc}"))


class _Server:
    def __init__(self, sock: socket.socket, import_torch: bool) -> None:
        self.sock = sock
        self.import_torch = import_torch
        self.workers: dict[int, int] = {}
        self.store_pid = 0
        self.store_sock: socket.socket | None = None
        self.wake_r, self.wake_w = os.pipe()

    def serve(self) -> NoReturn:
        from rallypoint.launcher._worker import set_parent_death_signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's ^C is the supervisor's
        set_parent_death_signal(signal.SIGKILL)
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        if self.import_torch:
            for name in WARM_MODULES:
                importlib.import_module(name)
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        sel.register(self.wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                if key.fileobj is self.sock:
                    self._on_message()
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
                    self._reap()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.workers:
                del self.workers[pid]
                _send(self.sock, ("exit", pid, status))

    def _on_message(self) -> None:
        msg, fds = _recv(self.sock, maxfds=3)
        if msg is None:
            self._shutdown()
        kind = msg[0]
        if kind == "init":
            try:
                for name in msg[1]:
                    importlib.import_module(name)
            except BaseException as exc:
                text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                _send(self.sock, ("error", f"--preload: cannot import: {text}"))
                return
            # children then share the warm heap without copy-on-write churn from their
            # collections (no gc.collect() first: it costs ~80 ms on the critical path)
            gc.freeze()
            _send(self.sock, ("ready", os.getpid()))
        elif kind in ("store", "store_reset"):
            _send(self.sock, self._store(msg))
        elif kind == "spawn":
            from rallypoint.launcher._worker import child_main

            spec: WorkerSpec = msg[1]
            close = [self.sock.fileno(), self.wake_r, self.wake_w]
            if self.store_sock is not None:
                close.append(self.store_sock.fileno())
            pid = os.fork()
            if pid == 0:
                child_main(spec, fds, close)
            for fd in fds:
                os.close(fd)
            self.workers[pid] = spec.local_rank
            _send(self.sock, ("spawned", spec.local_rank, pid))
        elif kind == "shutdown":
            self._shutdown()

    def _store(self, msg: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.store_sock is None:
            if msg[0] != "store":
                return ("error", "store reset before start")
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                try:
                    parent.close()
                    self.sock.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    _store_main(child)
                finally:
                    os._exit(1)
            child.close()
            self.store_pid, self.store_sock = pid, parent
        request = ("start", msg[1], msg[2]) if msg[0] == "store" else ("reset",)
        _send(self.store_sock, request)
        reply, _ = _recv(self.store_sock)
        return reply if reply is not None else ("error", "the store process died")

    def _shutdown(self) -> NoReturn:
        for pid in list(self.workers):
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        if self.store_pid:
            with contextlib.suppress(OSError):
                os.kill(self.store_pid, signal.SIGKILL)
        os._exit(0)


# ----------------------------------------------------------------------------- client side


def _error(message: str) -> Exception:
    from rallypoint.launcher._errors import WarmProcessError

    return WarmProcessError(message)


class WarmProcess:
    """The supervisor's handle on its warm process."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock
        self.events: deque[tuple[int, int]] = deque()
        self.started = time.monotonic()
        self._closed = False

    @classmethod
    def fork(cls, *, import_torch: bool = True) -> WarmProcess:
        """Fork the warm process from the current process and return a handle on it."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (parent, child):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _MAX_MSG)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                parent.close()
                _Server(child, import_torch).serve()
            except BaseException:
                with contextlib.suppress(BaseException):
                    traceback.print_exc()
            finally:
                os._exit(code)
        child.close()
        return cls(pid, parent)

    def fileno(self) -> int:
        return self.sock.fileno()

    def _request(
        self, msg: tuple[Any, ...], expect: str, fds: list[int] | None = None
    ) -> tuple[Any, ...]:
        try:
            _send(self.sock, msg, fds)
        except OSError as exc:
            raise _error(f"lost the warm process: {exc}") from exc
        return self._request_reply(expect)

    def _death_reason(self) -> str:
        with contextlib.suppress(ChildProcessError):
            pid, status = os.waitpid(self.pid, 0)
            if pid and os.WIFSIGNALED(status):
                return f"the warm process died by {signal.Signals(os.WTERMSIG(status)).name}"
            if pid:
                return f"the warm process exited with {os.WEXITSTATUS(status)}"
        return "the warm process died"

    def init(self, preload: tuple[str, ...]) -> None:
        self._request(("init", tuple(preload)), "ready")

    def start_store(self, host: str, port: int) -> tuple[int, int]:
        """Start the store server; returns ``(port, store_pid)``."""
        reply = self._request(("store", host, port), "store")
        return int(reply[1]), int(reply[2])

    def reset_store(self) -> int:
        """Replace the store server by an empty one on the same port."""
        return int(self._request(("store_reset",), "store")[1])

    def spawn(self, spec: WorkerSpec, fds: list[int]) -> int:
        return int(self._request(("spawn", spec), "spawned", fds)[2])

    def spawn_many(self, requests: list[tuple[WorkerSpec, list[int]]]) -> list[int]:
        """Start several workers: all requests go out first, so forks start back to back."""
        try:
            for spec, fds in requests:
                _send(self.sock, ("spawn", spec), fds)
        except OSError as exc:
            raise _error(f"lost the warm process: {exc}") from exc
        pids: dict[int, int] = {}
        while len(pids) < len(requests):
            reply = self._request_reply("spawned")
            pids[int(reply[1])] = int(reply[2])
        return [pids[spec.local_rank] for spec, _ in requests]

    def _request_reply(self, expect: str) -> tuple[Any, ...]:
        # ``init`` waits for ``import torch`` and the preloads (no limit); anything else is
        # a fork or a store bind and answers in milliseconds unless the process is stuck.
        self.sock.settimeout(None if expect == "ready" else REPLY_TIMEOUT)
        try:
            while True:
                reply, _ = _recv(self.sock)
                if reply is None:
                    raise _error(self._death_reason())
                if reply[0] == "exit":
                    self.events.append((reply[1], reply[2]))
                    continue
                if reply[0] == "error":
                    raise _error(reply[1])
                if reply[0] != expect:
                    raise _error(f"unexpected reply from the warm process: {reply!r}")
                return reply
        except TimeoutError:
            raise _error(f"the warm process did not answer within {REPLY_TIMEOUT:.0f} s") from None
        except OSError as exc:
            raise _error(f"lost the warm process: {exc}") from exc
        finally:
            self.sock.settimeout(None)

    def read_events(self) -> list[tuple[int, int]]:
        """Exit events ``(pid, wait_status)``; call when ``fileno()`` is readable."""
        out = list(self.events)
        self.events.clear()
        while True:
            try:
                data = self.sock.recv(_MAX_MSG, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return out
            except OSError as exc:
                raise _error(f"lost the warm process: {exc}") from exc
            if not data:
                if out:
                    return out
                raise _error(self._death_reason())
            msg = pickle.loads(data)
            if msg[0] == "exit":
                out.append((msg[1], msg[2]))

    def close(self) -> None:
        """Shut the warm process (and its store process) down and reap it."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            _send(self.sock, ("shutdown",))
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
