"""The warm process's side: import torch once, then fork workers and run the store on command.

:func:`serve` runs in the child that :meth:`WarmProcess.fork` made. It stays clean (no
process group, no tensor op, no thread), so it can fork again for every restart. It is a
child subreaper: it reaps the workers and whatever they start, and reports each worker's
exit the moment it happens. The job's ``TCPStore`` server lives in a separate child, so
that workers never inherit its listening socket and a restart can rebind the same port.
If the supervisor dies without a word (``kill -9``, the OOM killer), the warm process
hears it at once, kills every descendant, removes the supervisor's temporary paths and
exits (:func:`serve` says how).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib
import os
import selectors
import shutil
import signal
import socket
import time
import traceback
from typing import NoReturn

from rallypoint._core.envvars import FT_NOTICE
from rallypoint._core.net import port_is_free
from rallypoint._core.procs import become_subreaper, kill_descendants, set_parent_death_signal
from rallypoint._supervise._errors import WarmErrorKind
from rallypoint._supervise._summary import describe_status
from rallypoint._supervise._warm._messages import (
    CpusFound,
    Exited,
    Failed,
    FindCpus,
    Init,
    Ready,
    RemoveOnExit,
    Reply,
    Request,
    ResetStore,
    Shutdown,
    SnapshotsStarted,
    Spawn,
    Spawned,
    StartSnapshots,
    StartStore,
    StoreStarted,
    recv,
    send,
)
from rallypoint._supervise._warm._name_lookup import settle_reverse_lookup
from rallypoint._supervise._warm._notices import NoticeWriters
from rallypoint._supervise._warm._snapshots import SnapshotServer, fork_snapshot_server
from rallypoint._supervise._worker import WorkerSpec, child_main

__all__ = ["WARM_MODULES", "serve"]

WARM_MODULES = ("torch", "torch.distributed", "torch.nn.parallel")
LATER_MODULES = (
    "sympy",
    "torch.fx.experimental.symbolic_shapes",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch._dynamo",
)
"""What a worker's first training step imports (a torch optimizer imports ``torch._dynamo``,
about 1.6 s of CPU): imported once the first workers are forked and the warm process is
idle (:data:`IDLE`), so that a replacement or a spare forked later pays nothing, and the
first workers start as soon as before. One module at a time, each when the process is idle
again: a fork asked for meanwhile waits for one piece (0.05 to 0.6 s here; 5x that on a
loaded machine), not for the whole (a replacement waited 5.5 s). Before the first, the
process that tells ``rallypoint.ft`` replica groups that a worker died is forked
(``_notices``)."""
IDLE = 0.3
"""Seconds without a request after which the warm process imports :data:`LATER_MODULES`."""
_ORPHANED_KILL_TIMEOUT = 1.5
"""Seconds the warm process of a dead supervisor spends killing its descendants."""
_NOTICES_TIMEOUT = 2.0
"""Seconds the notices in flight have to be written when this process ends (a notice
takes ~40 ms; more only if the lighthouse is unreachable)."""
SAME_DEATH = 10.0
"""Seconds in which more deaths of one replica group member (the same record: a member id
is new in each process that makes a ``Manager``) are the first one's consequences."""


def serve(sock: socket.socket, import_torch: bool) -> NoReturn:
    """Run the warm process on ``sock`` until the supervisor shuts it down or goes away.

    Until it is ready (its imports done: nothing else exists yet, and a Python handler would
    wait for ``import torch``'s long C calls) its parent-death signal is ``SIGKILL``; from
    ``Ready`` on it is ``SIGTERM``, which it catches (as it does the end of its socket). A
    SIGTERM while its parent lives (sent to the launcher's process group) is ignored: the
    supervisor stops the workers gracefully. Once orphaned, it SIGKILLs every descendant it
    finds in ``/proc`` (as a child subreaper it inherits orphans that daemonized or started
    their own session), reaps them, removes the paths of ``RemoveOnExit`` and exits.
    """
    _Server(sock, import_torch).serve()


def _store_main(conn: socket.socket) -> NoReturn:
    """The store process: hosts one TCPStore server at a time, replaced on each reset."""
    set_parent_death_signal(signal.SIGKILL)
    from rallypoint._core.torch_c import TCPStore

    store: TCPStore | None = None
    host, port = "127.0.0.1", 0
    while True:
        msg, _ = recv(conn)
        match msg:
            case None:
                os._exit(0)
            case StartStore(host=host, port=port):
                pass
            case ResetStore():
                pass  # the same host and port, an empty store
            case _:
                send(conn, Failed(WarmErrorKind.PROTOCOL, f"store: unexpected {msg!r}"))
                continue
        store = None  # closes the previous server before rebinding its port
        try:
            store = TCPStore(host, port, None, True, wait_for_workers=False, use_libuv=True)
            port = store.port
            send(conn, StoreStarted(port, os.getpid()))
        except Exception as exc:
            busy = port != 0 and not port_is_free(port)
            kind = WarmErrorKind.PORT_IN_USE if busy else WarmErrorKind.STORE
            send(conn, Failed(kind, f"{type(exc).__name__}: {exc}"))


def _import_quietly(names: list[str]) -> None:
    """Import ``names``; one that fails is left to the workers that need it."""
    for name in names:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _find_cpus(mode: str, nproc: int, env: dict[str, str]) -> Reply:
    """Each local rank's CPUs under ``numa_binding``, found in a child (CUDA stays out)."""
    from rallypoint._supervise._warm._numa_probe import NumaProbeError, find_cpu_sets

    try:
        return CpusFound(find_cpu_sets(mode, nproc, env))
    except (NumaProbeError, OSError) as exc:
        return Failed(WarmErrorKind.NUMA, str(exc))


class _Server:
    def __init__(self, sock: socket.socket, import_torch: bool) -> None:
        self.sock = sock
        self.import_torch = import_torch
        self.workers: dict[int, int] = {}
        self.importing = False
        self.later: list[str] = []
        """What to import once idle (:data:`LATER_MODULES`), unless Init said no."""
        self.deferred: list[tuple[Request | Reply | None, list[int]]] = []
        """Requests read while importing (:meth:`_import_later`), answered after it."""
        self.notices: dict[int, tuple[str, int]] = {}
        """Workers that may run a ``rallypoint.ft`` Manager: their notice file, their rank."""
        self.told: dict[str, float] = {}
        """Each replica group member told dead lately, and when (``_tell_replica_groups``)."""
        self.notice_writers = NoticeWriters()
        """What tells the other replica groups that one of those workers died."""
        self.store_pid = 0
        self.store_sock: socket.socket | None = None
        self.snapshots: SnapshotServer | None = None
        self.snapshots_ended = ""
        """How the last snapshot server died, until a new one is started."""
        self.wake_r, self.wake_w = os.pipe()
        self.remove_on_exit: list[str] = []
        self.pid = os.getpid()
        self.parent = 0

    def serve(self) -> NoReturn:
        # The terminal's ^C and hang-up, and whatever reaches the launcher's process group,
        # are the supervisor's to handle (it stops the workers gracefully): this process
        # must outlive their shutdown handlers. SIGTERM gets a handler at Ready.
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
        set_parent_death_signal(signal.SIGKILL)  # until Ready (see serve())
        self.parent = os.getppid()
        become_subreaper()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, self._on_child)
        if self.import_torch:
            for name in WARM_MODULES:
                importlib.import_module(name)
            settle_reverse_lookup()  # before any fork: each worker would wait it out
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        sel.register(self.wake_r, selectors.EVENT_READ)
        self.later = list(LATER_MODULES) if self.import_torch else []
        while True:
            ready = sel.select(IDLE if self.later and self.workers else None)
            if not ready and self.later:
                if not self.notice_writers.started:  # forked before the imports (_notices)
                    self.notice_writers.start_writer(self._own_fds())
                self._import_later([self.later.pop(0)])
                gc.freeze()  # as after Init: forked children share it without churn
            while self.deferred:
                self._on_message(self.deferred.pop(0))
            for key, _ in ready:
                if key.fileobj is self.sock:
                    self._on_message()
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
                    self._reap()

    def _import_later(self, names: list[str]) -> None:
        """Import ``names`` (a second or more in which the loop does not run): meanwhile a
        worker's death is reported from SIGCHLD's handler and requests are read from
        SIGIO's, a shutdown done at once, the rest answered after the import."""
        fd = self.sock.fileno()
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        signal.signal(signal.SIGIO, self._on_io)
        fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_ASYNC)
        self.importing = True
        try:
            self._on_io(signal.SIGIO, None)  # a request that came before the signal was armed
            _import_quietly(names)
        finally:
            self.importing = False
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            signal.signal(signal.SIGIO, signal.SIG_IGN)

    def _on_io(self, signum: int, frame: object) -> None:
        """SIGIO while importing: read what came; a shutdown (or a gone supervisor) now."""
        if not self.importing:
            return
        self.sock.setblocking(False)
        try:
            while True:
                try:
                    got = recv(self.sock, maxfds=4)
                except BlockingIOError:
                    return
                if got[0] is None or isinstance(got[0], Shutdown):
                    self._on_message(got)  # exits
                self.deferred.append(got)
        finally:
            self.sock.setblocking(True)

    def _on_child(self, signum: int, frame: object) -> None:
        """SIGCHLD: the main loop reaps (the wake-up fd wakes it), except while it imports
        :data:`LATER_MODULES`, a second or more in which nothing else runs: a worker's
        death is then reported from here at once (nothing else sends meanwhile)."""
        if self.importing:
            self._reap()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | os.WUNTRACED | os.WCONTINUED)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if os.WIFSTOPPED(status) or os.WIFCONTINUED(status):
                self._stopped(pid, status)
                continue
            if pid in self.workers:
                del self.workers[pid]
                # read before the launcher hears of the exit: a job that ends on it removes
                # the worker's directory (and the other groups would wait out a heartbeat)
                record = self._replica_record(pid)
                send(self.sock, Exited(pid, status))
                if record is not None:
                    self._tell_replica_groups(*record, status)
            elif self.snapshots is not None and pid == self.snapshots.pid:
                self._snapshots_ended(status)

    def _on_message(self, got: tuple[Request | Reply | None, list[int]] | None = None) -> None:
        msg, fds = recv(self.sock, maxfds=4) if got is None else got
        match msg:
            case None:
                self._orphaned()
            case Shutdown():
                self._shutdown()
            case RemoveOnExit(paths=paths):
                self.remove_on_exit.extend(paths)
            case Init(preload=preload, later=later):
                send(self.sock, self._init(preload))
                if not later:
                    self.later.clear()
            case StartStore() | ResetStore():
                send(self.sock, self._store(msg))
            case Spawn(spec=spec):
                send(self.sock, self._spawn(spec, fds))
            case StartSnapshots():
                send(self.sock, self._snapshots())
            case FindCpus(mode=mode, nproc=nproc, env=env):
                send(self.sock, _find_cpus(mode, nproc, env))
            case _:
                send(self.sock, Failed(WarmErrorKind.PROTOCOL, f"unexpected {msg!r}"))

    def _init(self, preload: tuple[str, ...]) -> Reply:
        try:
            for name in preload:
                importlib.import_module(name)
        except BaseException as exc:  # a preload's SystemExit too is a failed preload
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            return Failed(WarmErrorKind.PRELOAD, f"--preload: cannot import: {text}")
        # children then share the warm heap without copy-on-write churn from their
        # collections (no gc.collect() first: it costs ~80 ms on the critical path)
        gc.freeze()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != self.parent:  # it died before the signal was armed
            self._orphaned()
        return Ready(os.getpid())

    def _own_fds(self) -> list[int]:
        """What a child of this process closes: the supervisor's channel, the wake-up
        pipe, the store process's channel."""
        close = [self.sock.fileno(), self.wake_r, self.wake_w]
        if self.store_sock is not None:
            close.append(self.store_sock.fileno())
        return close

    def _spawn(self, spec: WorkerSpec, fds: list[int]) -> Reply:
        close = self._own_fds()
        pid = os.fork()
        if pid == 0:
            child_main(spec, fds, close)
        for fd in fds:
            os.close(fd)
        self.workers[pid] = spec.local_rank
        if FT_NOTICE in spec.env:
            self.notices[pid] = (spec.env[FT_NOTICE], spec.rank)
        return Spawned(spec.local_rank, pid)

    def _replica_record(self, pid: int) -> tuple[str, int] | None:
        """What a dead worker of a ``rallypoint.ft`` replica group wrote (its lighthouse and
        member id), and its rank; ``None`` for any other worker."""
        path, rank = self.notices.pop(pid, ("", 0))
        try:
            with open(path) as fp:
                return fp.read(65536), rank
        except OSError:
            return None  # not a replica group's worker, or it never got that far

    def _stopped(self, pid: int, status: int) -> None:
        """A worker of a replica group was stopped (SIGSTOP, ^Z): the other groups go on
        without it now, not after its heartbeat times out; run again (SIGCONT), it is
        marked running in its group's store, asks again and the lighthouse takes it back
        (``rallypoint.ft._group.stopped``)."""
        path, rank = self.notices.get(pid, ("", 0))
        try:
            with open(path) as fp:
                record = fp.read(65536)
        except OSError:
            return  # not a replica group's worker, or it never got that far
        if os.WIFCONTINUED(status):
            self.notice_writers.tell(record, "", rank=rank, stopped=False)
            return
        stop = signal.Signals(os.WSTOPSIG(status)).name
        self.notice_writers.tell(record, f"rank {rank} stopped ({stop})", rank=rank, stopped=True)

    def _tell_replica_groups(self, record: str, rank: int, status: int) -> None:
        """A worker of a replica group died: tell the other groups now (``_notices``),
        without holding this loop up."""
        # its other ranks, stopped by their agent because of it, are not news: their
        # notices could overtake the first (separate writers) and name the wrong cause
        now = time.monotonic()
        self.told = {r: t for r, t in self.told.items() if now - t < SAME_DEATH}
        if record in self.told:
            return
        self.told[record] = now
        why = f"rank {rank} {describe_status(status)[1]}"
        self.notice_writers.tell(record, why)

    def _store(self, msg: Request) -> Reply:
        if self.store_sock is None:
            if not isinstance(msg, StartStore):
                return Failed(WarmErrorKind.STORE, "store reset before start")
            self.store_sock = self._fork_store()
        send(self.store_sock, msg)
        reply, _ = recv(self.store_sock)
        if reply is None:
            return Failed(WarmErrorKind.STORE, "the store process died")
        assert isinstance(reply, StoreStarted | Failed), reply
        return reply

    def _snapshots_ended(self, status: int) -> None:
        """The snapshot server died (killed, OOM): the next request starts a new one."""
        assert self.snapshots is not None
        shutil.rmtree(self.snapshots.directory, ignore_errors=True)  # not stop(): reaped
        self.remove_on_exit.remove(self.snapshots.directory)
        self.snapshots = None
        self.snapshots_ended = describe_status(status)[1]

    def _snapshots(self) -> Reply:
        if self.snapshots is not None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.snapshots.pid, os.WNOHANG)
                if pid:  # died since the last reap
                    self._snapshots_ended(status)
        replaced, self.snapshots_ended = self.snapshots_ended, ""
        if self.snapshots is None:
            close = [self.sock.fileno(), self.wake_r, self.wake_w]
            if self.store_sock is not None:
                close.append(self.store_sock.fileno())
            try:
                self.snapshots = fork_snapshot_server(close)
                self.remove_on_exit.append(self.snapshots.directory)
            except OSError as exc:
                return Failed(WarmErrorKind.SNAPSHOTS, f"{type(exc).__name__}: {exc}")
        return SnapshotsStarted(self.snapshots.path, self.snapshots.pid, replaced)

    def _fork_store(self) -> socket.socket:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            try:
                parent.close()
                self.sock.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                # the store outlives a SIGTERM to every process of the job (SLURM) while
                # workers run their handlers; it dies with this process (PDEATHSIG)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                _store_main(child)
            finally:
                os._exit(1)
        child.close()
        self.store_pid = pid
        return parent

    def _on_sigterm(self, signum: int, _frame: object) -> None:
        if os.getpid() != self.pid:  # a worker just forked, before it reset its handlers
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if os.getppid() == self.parent:
            # Not the parent-death signal: a SIGTERM sent to the launcher's process group
            # (``timeout``, ``kill -- -PGID``) or to every process of the job (SLURM). The
            # supervisor got it too and stops the workers gracefully; killing them here
            # would cut their own handlers short (the kernel re-parents this process
            # before it sends the parent-death signal, so a dead parent shows here).
            return
        self._orphaned()

    def _orphaned(self) -> NoReturn:
        """The supervisor is gone (parent-death signal, or the end of the socket): leave
        nothing of the job behind (see :func:`serve`)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with contextlib.suppress(BaseException):
            self.notice_writers.finish(_NOTICES_TIMEOUT)
        with contextlib.suppress(BaseException):
            kill_descendants(_ORPHANED_KILL_TIMEOUT)
        with contextlib.suppress(BaseException):
            self._take_pending_paths()
        for path in self.remove_on_exit:
            with contextlib.suppress(BaseException):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
        os._exit(1)

    def _take_pending_paths(self) -> None:
        """Paths the supervisor sent that the main loop has not read yet."""
        self.sock.setblocking(False)
        while True:
            try:
                msg, fds = recv(self.sock, maxfds=4)
            except BlockingIOError:
                return
            for fd in fds:
                os.close(fd)
            if msg is None:
                return
            if isinstance(msg, RemoveOnExit):
                self.remove_on_exit.extend(msg.paths)

    def _shutdown(self) -> NoReturn:
        for pid in list(self.workers):
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        if self.store_pid:
            with contextlib.suppress(OSError):
                os.kill(self.store_pid, signal.SIGKILL)
        if self.snapshots is not None:
            self.snapshots.stop()
        with contextlib.suppress(BaseException):
            self.notice_writers.finish(_NOTICES_TIMEOUT)
        os._exit(0)
