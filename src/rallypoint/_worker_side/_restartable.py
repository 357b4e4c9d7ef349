"""``@rallypoint.restartable``: the worker's side of an in-process restart.

Under ``rallypoint run`` or ``rallypoint.launch`` the wrapper tells the agent it can
restart in process and calls the function. When another rank fails, the agent's
``Interrupt`` aborts the NCCL communicators and raises :class:`RestartInterrupt` in the
main thread; the wrapper tears torch.distributed down, parks, waits for the next
attempt's environment and calls the function again, so what ran before the function
(imports, CUDA, data, compile) runs once per process. Anywhere else (plain ``python``,
torchrun, a thread other than the main one) the wrapper calls the function once. Usage:
docs/launcher.md.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib._bootstrap
import importlib._bootstrap_external
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from queue import SimpleQueue
from types import FrameType
from typing import Any, ParamSpec, TypeVar

from rallypoint._core import envvars
from rallypoint._core.cpp_log import cpp_warnings_off
from rallypoint._core.net import await_listener
from rallypoint._worker_side._control import (
    MAX_MESSAGE,
    Assign,
    Done,
    Hello,
    Interrupt,
    Message,
    Parked,
    Raised,
    Stop,
    Verdict,
    decode,
    encode,
)
from rallypoint._worker_side._cut import cut_attempt, release, sockets_now

__all__ = ["STOP_SEEN_WAIT", "WAKE_SIGNAL", "RestartInterrupt", "restartable", "told_to_stop"]

P = ParamSpec("P")
R = TypeVar("R")

WAKE_SIGNAL = signal.SIGRTMIN + 3
"""Raises :class:`RestartInterrupt` in the main thread while the function runs (a real-time
signal: training code does not use it, and a sleep or a lock wait it interrupts)."""


HELD_RETRY = 0.02
"""Seconds between wake-ups while the main thread is in an import (``importing``)."""
RECUT_FIRST, RECUT_MAX = 0.02, 0.5
"""Seconds from an interruption to its attempt's next cut while the main thread is still in
the function; each gap doubles, up to ``RECUT_MAX`` (a cut reads ``/proc/net/tcp``, which
took 0.1 s on a loaded host)."""
STOP_SEEN_WAIT = 0.5
"""Most seconds a worker ending in a ``KeyboardInterrupt`` waits for its reader thread to
say whether a :class:`Stop` came (the agent sends it before the signal)."""
STOP_CUT_AFTER = 1.0
"""Seconds after a :class:`Stop` before a worker still there leaves its attempt (``_stop``):
its SIGINT handlers may use the connections until then."""
SIGINT_WAIT = 1.0
"""Most seconds a worker told to stop between attempts (parked, or waiting for the next
attempt's store) waits for the SIGINT that follows the :class:`Stop`, so that its own
SIGINT handler runs, as anywhere else, before it leaves."""
STORE_WAIT = 300.0
"""Most seconds a new attempt waits for its store to take connections (``_await_store``;
c10d's own connect retries for its timeout, 300 s for a TCPStore by default)."""
STORE_RETRY = 0.05
"""Seconds between two tries of a store that refused, or did not answer."""


class RestartInterrupt(BaseException):
    """Raised in the restartable function when another rank failed: the job restarts in
    process. A ``BaseException``, so that ``except Exception`` in training code does not
    swallow it."""


def restartable(fn: Callable[P, R]) -> Callable[P, R]:
    """Make ``fn`` restart in this process when another rank of the job fails (see the
    module docstring); anywhere but under ``rallypoint run``/``launch``, call it once."""
    if not callable(fn):
        raise TypeError(f"restartable() takes a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        channel = _channel()
        if channel is None or channel.running:  # nested: the outermost call restarts
            return fn(*args, **kwargs)
        if channel.returned:  # a second call: said once, then a plain call
            channel.say_second_call(getattr(fn, "__qualname__", repr(fn)))
            return fn(*args, **kwargs)
        return channel.run(fn, args, kwargs)

    return wrapper


_CHANNEL: _Channel | None = None


def _channel() -> _Channel | None:
    """This process's channel to its agent; ``None`` outside ``rallypoint run``, off the
    main thread, or when torch.distributed was set up before the function (then the
    function could not set it up again: it runs once, said once)."""
    global _CHANNEL
    if _CHANNEL is not None and _CHANNEL.pid == os.getpid():
        return _CHANNEL
    fd = os.environ.get(envvars.CONTROL_FD, "")
    if not fd.isdigit() or threading.current_thread() is not threading.main_thread():
        return None
    if _distributed_ready():
        sys.stderr.write(
            "rallypoint: torch.distributed was initialised before the @restartable function; "
            "it cannot be restarted in process (init_process_group belongs inside it): a "
            "failure restarts this process\n"
        )
        return None
    try:
        sock = socket.socket(fileno=int(fd))
    except OSError:
        return None
    _CHANNEL = _Channel(sock)
    return _CHANNEL


def told_to_stop(wait: float = 0.0) -> bool:
    """Whether the agent said that the job stops (:class:`Stop`, sent before it forwards a
    Ctrl-C): what this process prints as it ends is the stop's, not a failure's. ``wait``:
    seconds to give the reader thread, which may have the message and not have said so
    yet (it was busy, or the main thread held the GIL)."""
    channel = _CHANNEL
    if channel is not None and channel.pid == os.getpid() and channel.stop_seen.wait(wait):
        return True
    fd = os.environ.get(envvars.CONTROL_FD, "")
    if not fd.isdigit():
        return False
    try:  # the reader has not taken it yet, or there is none (no restartable function)
        with socket.fromfd(int(fd), socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            data = sock.recv(MAX_MESSAGE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        return isinstance(decode(data), Stop)
    except (OSError, ValueError):
        return False


def _distributed_ready() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


class _Channel:
    """The worker's end: one reader thread, the main thread's restart loop."""

    def __init__(self, sock: socket.socket) -> None:
        self.pid = os.getpid()
        self.sock = sock
        self.lock = threading.RLock()  # the signal handler takes it in the main thread too
        self.in_fn = False
        self.interrupted = False
        self.entry_sockets: frozenset[int] = frozenset()  # this process's, when fn was entered
        self.held: list[socket.socket] = []  # the cut sockets, open until the next attempt
        self.running = False  # in run(): a restartable call nested in it is a plain call
        self.returned = False  # the first call returned: later calls are plain calls
        self.said_second = False
        self.woken = False  # the wake-up signal was sent and its handler has not run yet
        self.stopping = False  # the agent said the job stops (a Ctrl-C): nothing restarts
        self.stop_seen = threading.Event()  # set with ``stopping``
        self.quiet: contextlib.ExitStack | None = None  # C++ warnings off while leaving
        self.replies: SimpleQueue[Message | None] = SimpleQueue()
        self.reader = threading.Thread(target=self._read, name="rallypoint-restart", daemon=True)
        self.reader.start()
        self._send(Hello(self.pid))

    def _send(self, msg: Message) -> None:
        with contextlib.suppress(OSError):
            self.sock.send(encode(msg))

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:  # the agent is gone: whoever waits gets None
                self.replies.put(None)
                return
            try:
                msg = decode(data)
            except ValueError:
                continue
            if isinstance(msg, Stop):
                with self.lock:
                    self.stopping = True
                self.stop_seen.set()
            if isinstance(msg, Interrupt):
                self._interrupt()
            self.replies.put(msg)
            if isinstance(msg, Stop):
                self._stop()

    def _interrupt(self) -> None:
        """From the reader thread: abort NCCL, cut the attempt's gloo and store connections
        (``_cut``: whoever waits on them fails at once), then raise in the main thread if it
        is in the function (else the restart loop reads the message). The signal goes
        while the lock is held, so the main thread cannot leave the function in between.

        Until the main thread has left the function, the signal is sent again every
        :data:`HELD_RETRY` seconds if an import held it (``_on_wake``), and the attempt is
        cut again (:data:`RECUT_FIRST`). The handler runs between Python instructions only:
        a main thread in C++ (or in an import, once it is done) may make a connection after
        the cut and wait on it, the signal pending. An ``init_process_group`` under way
        makes its store connection, then ``ProcessGroupGloo``'s constructor waits there for
        the address of a rank that failed before writing it: cut once, that survivor was
        replaced after the restart's grace."""
        with self.lock:
            self.interrupted = True
        self._leave_attempt()
        gap = RECUT_FIRST
        recut_at = time.monotonic() + gap
        while True:
            with self.lock:
                if not self.in_fn:
                    return
                if not self.woken:
                    self.woken = True
                    with contextlib.suppress(OSError, ValueError):
                        signal.pthread_kill(threading.main_thread().ident or 0, WAKE_SIGNAL)
            time.sleep(HELD_RETRY)
            if time.monotonic() >= recut_at:
                self._cut()
                gap = min(2 * gap, RECUT_MAX)
                recut_at = time.monotonic() + gap

    def _stop(self) -> None:
        """From the reader thread, on :class:`Stop` (a Ctrl-C comes): nothing restarts from
        now on. A main thread that has not left :data:`STOP_CUT_AFTER` seconds later, as its
        SIGINT handler says, is blocked in C++ (a collective, a store wait), where the
        handler cannot run: the attempt is left (``_leave_attempt``), its wait fails, and
        the handler runs."""
        time.sleep(STOP_CUT_AFTER)
        self._leave_attempt()

    def _leave_attempt(self) -> None:
        """Once per attempt: quiet torch's C++ warnings until the next one (the attempt's
        store calls fail now, each with a C++ backtrace, in this rank's snapshot thread
        too), abort NCCL, and cut the attempt's gloo and store connections (``_cut``)."""
        with self.lock:
            if self.quiet is not None:
                return
            self.quiet = contextlib.ExitStack()
            self.quiet.enter_context(cpp_warnings_off())
        abort_nccl()
        self._cut()

    def _cut(self) -> None:
        """Cut what the attempt made and is not cut yet (``held`` has a copy of each cut)."""
        port = os.environ.get("MASTER_PORT", "")
        done = self.entry_sockets | {os.fstat(s.fileno()).st_ino for s in self.held}
        cut_attempt(done, int(port) if port.isdigit() else None, self.held)

    def _on_wake(self, signum: int, frame: FrameType | None) -> None:
        with self.lock:
            raise_now = self.in_fn and self.interrupted
            self.woken = False
            if raise_now and importing(frame):
                return  # the reader sends it again
            if raise_now:
                self.in_fn = False  # once: the wrapper's own code is never interrupted
        if raise_now:
            raise RestartInterrupt("another rank failed: restarting in process")

    # ------------------------------------------------------------------ the main thread
    def say_second_call(self, name: str) -> None:
        """Said by rank 0 alone (every rank of the script calls the function again: one
        line per rank said the same thing four or eight times)."""
        if self.said_second or os.environ.get("RANK", "0") != "0":
            return
        self.said_second = True
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(
                f"rallypoint: @restartable {name}() called again in this process: only the "
                "first call restarts in process; a failure from here on replaces the "
                "process\n"
            )

    def run(self, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        self.running = True
        try:
            return self._run(fn, args, kwargs)
        finally:
            self.running = False

    def _run(self, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        # installed for good: a wake-up that races the function's return must find it
        # (the default action of a real-time signal ends the process); it raises only
        # while the function runs
        signal.signal(WAKE_SIGNAL, self._on_wake)
        # what the set-up made lives as long as the process: a restart's collection (the
        # failed attempt's frames) need not walk it again (tens of ms after torch._dynamo)
        gc.freeze()
        if os.environ.pop(envvars.STANDBY, ""):  # a hot spare: set up, now wait for ranks
            warm_cuda()
            self._take_assignment()
        while True:
            try:
                value, failed = self._call(fn, args, kwargs)
            except RestartInterrupt:  # came as the function returned: restart anyway
                value, failed = None, True
            if not failed:
                self.returned = True
                self._send(Done())
                return value  # type: ignore[return-value]
            self._restart()

    def _call(
        self, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[R | None, bool]:
        """``(value, False)``, or ``(None, True)`` when the job restarts in process; the
        function's own failure propagates."""
        self.entry_sockets = sockets_now()
        with self.lock:
            self.in_fn = not self.interrupted
            self.woken = False
        try:
            if not self.in_fn:
                raise RestartInterrupt("another rank failed before the function started")
            return fn(*args, **kwargs), False
        except RestartInterrupt:
            return None, True
        except Exception as exc:  # KeyboardInterrupt, SystemExit: the process ends as asked
            with self.lock:
                self.in_fn = False
                interrupted, stopping = self.interrupted, self.stopping
            if not stopping and (interrupted or self._consequence(exc)):
                return None, True
            raise
        finally:
            with self.lock:
                self.in_fn = False

    def _consequence(self, exc: Exception) -> bool:
        """Ask the agent whether ``exc`` was caused by a fault elsewhere."""
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self._send(Raised(text[-8000:]))
        while True:
            msg = self.replies.get()
            if msg is None or isinstance(msg, Verdict):
                return msg is not None and msg.restart
            if isinstance(msg, Stop):
                return False
            if isinstance(msg, Interrupt):
                return True

    def _restart(self) -> None:
        """Tear down, park, take the next attempt's environment."""
        self._leave_attempt()  # a rank whose function raised was not interrupted
        try:
            teardown()
        except Exception as exc:  # a poisoned CUDA context, say: this process is done
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(f"rallypoint: in-process restart: teardown failed: {exc!r}\n")
            os._exit(1)
        self._send(Parked())
        self._take_assignment()

    def _take_assignment(self) -> None:
        """Wait for the next attempt's environment and put it in ``os.environ``."""
        while True:
            msg = self.replies.get()
            if msg is None:  # the agent is gone
                os._exit(1)
            if isinstance(msg, Stop):  # a Ctrl-C: the process ends as one ends it
                _await_sigint()
                raise KeyboardInterrupt
            if isinstance(msg, Assign):
                break
        # every rank of the attempt has left it (or was replaced): its peers can no longer
        # be writing on the cut connections (_cut)
        release(self.held)
        os.environ.update(msg.env)
        with self.lock:
            self.interrupted = False
            quiet, self.quiet = self.quiet, None
        if quiet is not None:
            quiet.close()
        self._await_store()

    def _await_store(self) -> None:
        """Until the attempt's store (``MASTER_ADDR:MASTER_PORT``) takes a TCP connection,
        tried here, where a Ctrl-C is heard: c10d retries a refused connect in C++, deaf to
        signals, and the node that hosts the store may be stopping (its agent took the store
        with it). A :class:`Stop` ends the wait as a Ctrl-C, an :class:`Interrupt` lets the
        attempt fail before the function starts; then the function's own connect follows."""
        host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
        if not host or not port.isdigit():
            return

        def given_up() -> bool:
            with self.lock:
                stopping, interrupted = self.stopping, self.interrupted
            if stopping:  # a Ctrl-C: the process ends as one ends it
                _await_sigint()
                raise KeyboardInterrupt
            return interrupted

        await_listener(host, int(port), time.monotonic() + STORE_WAIT, every=STORE_RETRY,
                       pause=self.stop_seen.wait, give_up=given_up)  # fmt: skip


def _await_sigint() -> None:
    """Told to stop outside the function: the SIGINT the agent forwards next runs the
    process's own handler here, where the main thread can (a handler that raises, as the
    default one does, ends the wait; one that returns leaves it to its end,
    :data:`SIGINT_WAIT`). Leaving at once, the handler would run at best while the process
    exits, and at worst not at all. A signal ends the sleep only to run its handler (PEP
    475): one that returns lets it sleep on to its end."""
    time.sleep(SIGINT_WAIT)


_IMPORT_FILES = frozenset(
    (
        importlib._bootstrap.module_from_spec.__code__.co_filename,
        importlib._bootstrap_external.SourceFileLoader.get_data.__code__.co_filename,
    )
)


def importing(frame: FrameType | None) -> bool:
    """Whether the main thread, stopped at ``frame``, is importing a module inside the
    function. An exception there would leave the module, or a package it was being made
    a member of, half-initialised in ``sys.modules`` for every later attempt (``module
    'sympy' has no attribute 'printing'``, ``partially initialized module
    'torch._dynamo'``): Python's import system does not expect one. An import outside the
    function (its caller's) does not count: the walk stops at the wrapper."""
    while frame is not None and frame.f_code is not _CALL_CODE:
        if frame.f_code.co_filename in _IMPORT_FILES:
            return True
        frame = frame.f_back
    return False


_CALL_CODE = _Channel._call.__code__


def abort_nccl() -> None:
    """Abort every NCCL communicator (a collective blocked on one returns with an error);
    gloo has no abort (pytorch#130345): its collectives fail when a peer's connection
    closes."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    with contextlib.suppress(Exception):
        import torch
        from torch.distributed import distributed_c10d as c10d

        if not c10d.is_nccl_available():
            return
        for pg in list(c10d._world.pg_map):
            with contextlib.suppress(Exception):
                backend = pg._get_backend(torch.device("cuda"))
                if isinstance(backend, c10d.ProcessGroupNCCL):
                    backend.abort()


def warm_cuda() -> None:
    """In a spare whose set-up started CUDA: run, once, what every first training step runs
    on the GPU and a set-up does not (a matrix product forward and backward in float32 and
    bfloat16, which makes the cuBLAS handles and their workspace and loads their kernels;
    an Adam step, whose multi-tensor kernels load lazily too), so that the rank it takes
    over does not wait for it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    with contextlib.suppress(Exception):
        device = torch.device("cuda", torch.cuda.current_device())
        for dtype in (torch.float32, torch.bfloat16):
            weight = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
            x = torch.randn(16, 64, device=device, dtype=dtype, requires_grad=True)
            torch.nn.functional.linear(x, weight).float().pow(2).mean().backward()
            torch.optim.Adam([weight], lr=1e-3).step()
        torch.cuda.synchronize(device)


def teardown() -> None:
    """What a kept process leaves behind of an attempt: nothing. Every process group is
    destroyed (``rallypoint.distributed`` forgets its layout with them) and garbage (the
    failed attempt's frames) is collected. ``rallypoint.snapshot`` starts a new session by
    itself when the restart count changes. An ``init_process_group`` that was interrupted
    in its rendezvous left torch's group counter raised: it is reset as a destroy would,
    or the next attempt's default group would take another name than the new ranks'."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available():
        if dist.is_initialized():
            dist.destroy_process_group()
        else:
            from torch.distributed import distributed_c10d as c10d

            c10d._world.group_count = 0
    gc.collect()
