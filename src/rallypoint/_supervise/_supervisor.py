"""The supervisor: one node's workers, one attempt at a time, under the caller's policy.

:class:`Supervisor` owns the warm process's side of a launch (the store it hosts, the
workers' environment, where their output goes, the launcher's signals) and runs attempts:
:meth:`Supervisor.run_attempt` starts the local workers of a group from the warm process,
watches them (``_attempt``) and returns how the attempt ended, an
:class:`~rallypoint._supervise._state.Outcome`. It never decides about restarts: the
coordinator that owns it does (``rallypoint._elastic``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rallypoint._core import envvars
from rallypoint._core.closing import Closing
from rallypoint._core.disk import check_writable
from rallypoint._core.net import port_is_free
from rallypoint._core.tempdirs import make_owned_dir
from rallypoint._supervise._attempt import Attempt, AttemptTools
from rallypoint._supervise._env import base_env
from rallypoint._supervise._errors import (
    BadTargetError,
    PortInUseError,
    WarmErrorKind,
    WarmProcessError,
    WorkerFailedError,
)
from rallypoint._supervise._inprocess._agent_side import InProcess
from rallypoint._supervise._inprocess._spares import SparePool
from rallypoint._supervise._kept import KeptWorkers
from rallypoint._supervise._limits import check_worker_limits
from rallypoint._supervise._options import OutputOptions, StopOptions, WorkerOptions
from rallypoint._supervise._output import OutputRouter, write_console
from rallypoint._supervise._peer_loss import LOCAL_CAUSE_WAIT, CauseWait
from rallypoint._supervise._signals import SignalQueue
from rallypoint._supervise._starter import WorkerStarter
from rallypoint._supervise._state import GroupInfo, Outcome, Worker
from rallypoint._supervise._stop import Stopper
from rallypoint._supervise._stop_reasons import AttemptPolicy
from rallypoint._supervise._warm._exits import ExitReports
from rallypoint._supervise._warm._process import WarmProcess
from rallypoint._supervise._worker import Target
from rallypoint._watch._observer import Observer

__all__ = ["Supervisor", "prepare_warm"]


def prepare_warm(
    warm: WarmProcess, preload: tuple[str, ...], signals: SignalQueue, later: bool = True
) -> None:
    """Wait for the warm process's imports (``preload``); a signal stops the wait.
    ``later``: the job may fork workers after its first ones (``WarmProcess.init``).

    Call it before anything makes temporary files: until it answers, the warm process
    dies with its parent and could not remove them (``_warm._server``).
    """
    try:
        poll = lambda: signals.raise_if_signalled("the warm process")  # noqa: E731
        warm.init(preload, poll=poll, later=later)
    except WarmProcessError as exc:
        if exc.kind is WarmErrorKind.PRELOAD:
            raise BadTargetError(str(exc)) from None
        raise


def _log_root(output: OutputOptions, nproc: int, run_id: str) -> Path | None:
    """A fresh directory of this launch's logs (mode 0700), ``None`` when none is wanted.

    As torchrun's, it is made under ``--log-dir`` (or a temporary directory) for each
    launch, so runs that share a run id never mix; its name starts with the run id and the
    start time, so the newest sorts last: ``LOG_DIR/RUN_ID_20261125-203512_x1y2z3/``.
    """
    if output.log_dir is not None:
        base = check_writable(output.log_dir, "--log-dir")
    elif output.wants_files(nproc):
        base = Path(tempfile.mkdtemp(prefix="torchelastic_"))
    else:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        root = Path(tempfile.mkdtemp(prefix=f"{run_id}_{stamp}_", dir=base))
    except OSError as exc:
        raise ValueError(
            f"--log-dir {base}: cannot write there ({exc.strerror}); pass a writable directory"
        ) from None
    write_console(2, f"rallypoint: log directory is {root}\n".encode())
    return root


class Supervisor(Closing):
    """Runs attempts of this node's workers; :meth:`close` restores the signal handlers.

    ``run_id`` starts the name of this launch's log directory
    (``LOG_DIR/RUN_ID_TIME_XXXX/attempt_N/LOCAL_RANK/``, see :func:`_log_root`);
    ``collect_results`` makes :meth:`results` return what ``launch()`` workers returned.
    """

    def __init__(
        self,
        warm: WarmProcess,
        target: Target,
        *,
        workers: WorkerOptions,
        output: OutputOptions,
        stop: StopOptions,
        observer: Observer,
        run_id: str,
        collect_results: bool = False,
        warn_omp: bool = False,
        signals: SignalQueue | None = None,
    ) -> None:
        check_worker_limits(workers.nproc)
        self.warm = warm
        self.workers = workers
        self.stop_options = stop
        self.observer = observer
        self.host = observer.node
        self.collect_results = collect_results
        self.started = time.monotonic()
        self.deadline = (
            None if stop.timeout is None else self.started + stop.timeout.total_seconds()
        )
        self.exits = ExitReports(warm)
        """The one reader of the warm process's exit reports."""
        self.stopper = Stopper(warm, stop.shutdown_timeout, self.exits)
        log_root = _log_root(output, workers.nproc, run_id)
        snapshot_dir = workers.env.get(envvars.SNAPSHOT_DIR, os.environ.get(envvars.SNAPSHOT_DIR))
        if snapshot_dir:  # launch(env=...) too, not only the CLI: one line at start
            check_writable(snapshot_dir, "--snapshot-dir")
        self._scratch = Path(make_owned_dir("rallypoint_"))
        # removed by the warm process should this process be killed (close() does it else);
        # a warm process that is gone already is reported by the first real request
        with contextlib.suppress(WarmProcessError):
            warm.remove_on_exit([str(self._scratch), *observer.temp_paths()])
        self.starter = WorkerStarter(
            warm,
            target,
            workers=workers,
            output=output,
            observer=observer,
            base_env=base_env(workers, warn_omp=warn_omp, signals_to_handle=stop.signals_to_handle),
            log_root=log_root,
            scratch=self._scratch,
        )
        self.signals = SignalQueue(stop.signal_numbers) if signals is None else signals
        self._snapshots_tried = False
        spares = SparePool(
            workers.spare_workers,
            starter=self.starter,
            stopper=self.stopper,
            exits=self.exits,
            observer=observer,
        )
        self.kept = KeptWorkers(spares, stopper=self.stopper, exits=self.exits)
        """The workers kept between attempts: parked ones and spares."""
        self.tools = AttemptTools(
            exits=self.exits,
            stopper=self.stopper,
            signals=self.signals,
            observer=observer,
            interval=stop.monitor_interval.total_seconds(),
            deadline=self.deadline,
            started=self.started,
        )

    @property
    def nproc(self) -> int:
        return self.workers.nproc

    # ------------------------------------------------------------------ the warm process
    def init_warm(self) -> None:
        """Wait for the warm process's imports (``preload``); once. Then, once, start the
        snapshot server and find the CPUs of each local rank under ``numa_binding``."""
        prepare_warm(self.warm, self.workers.preload, self.signals)
        if not self._snapshots_tried:
            self._snapshots_tried = True
            self._start_snapshots()
        mode = self.workers.numa_binding
        if mode is not None and not self.starter.cpus:
            self.starter.cpus = self.warm.find_cpus(mode, self.nproc, self.starter.base_env)

    def _start_snapshots(self) -> None:
        """The node's snapshot server (``rallypoint.snapshot``), or a new one if it died
        (checked before every attempt); without one, workers keep snapshots in their own
        memory and say so."""
        try:
            path, self.stopper.snapshot_pid, replaced = self.warm.start_snapshots()
        except WarmProcessError as exc:
            if exc.kind is not WarmErrorKind.SNAPSHOTS:
                raise
            write_console(2, f"rallypoint: no snapshot server on this node: {exc}\n".encode())
            self.starter.base_env.pop(envvars.SNAPSHOT_SOCKET, None)
            return
        if replaced:
            write_console(
                2,
                f"rallypoint: the node's snapshot server {replaced}; started a new one (the "
                "snapshots it held are gone: workers restore from a peer's replica or "
                "--snapshot-dir, else from the start)\n".encode(),
            )
        self.starter.base_env[envvars.SNAPSHOT_SOCKET] = path

    def start_store(self, host: str, port: int) -> int:
        """Host the workers' store on ``host:port`` (0: a free port); returns the port."""
        if port and not port_is_free(port):
            raise PortInUseError(port)
        self.init_warm()
        try:
            bound, self.stopper.store_pid = self.warm.start_store(host, port)
        except WarmProcessError as exc:
            if exc.kind is WarmErrorKind.PORT_IN_USE:
                raise PortInUseError(port) from None
            raise
        return bound

    def reset_store(self) -> None:
        """An empty store on the same port, for the next attempt."""
        self.warm.reset_store()

    def next_signal(self) -> int | None:
        """A signal the launcher received while no attempt was running, or ``None``."""
        return self.signals.pop()

    def signal_pending(self) -> bool:
        """Whether the launcher received a signal not handled yet (it stays queued)."""
        return self.signals.pending()

    # ------------------------------------------------------------------ attempts
    def run_attempt(
        self,
        group: GroupInfo,
        number: int,
        policy: AttemptPolicy,
        *,
        restart_in_process: bool = False,
        cause_wait: float | None = None,
    ) -> Outcome:
        """Start the local workers of ``group`` (but the ones kept from the last attempt,
        which get its environment), watch them until they are gone; with
        ``restart_in_process``, workers of a ``@rallypoint.restartable`` function are kept
        for the next attempt instead (``Outcome.kept``). ``cause_wait``: how long a
        failure that says a peer vanished waits for its cause (another node's failure or
        loss, in a multi-node job), counted from the attempt's first one and shared with
        the caller, which waits the rest (``Failure.peer_loss``); ``None``: one node's
        (``_peer_loss.LOCAL_CAUSE_WAIT``)."""
        if envvars.SNAPSHOT_SOCKET in self.starter.base_env:
            self._start_snapshots()  # replaced if it died since the last attempt
        router = OutputRouter()
        workers: list[Worker] = []
        kept, spared = self.kept.take(self.nproc, number)
        try:
            workers = self.starter.start(group, number, router, kept)
        except BaseException:  # Ctrl-C too: no half-started worker outlives it
            self.stopper.kill_trees([*workers, *kept.values()], signal.SIGKILL)
            self.stopper.wait_all(workers, 5.0)
            router.close()
            raise
        self.observer.reset()
        for w in workers:
            fields = {"round": number, "rank": w.rank, "local_rank": w.local_rank, "pid": w.pid}
            if w.local_rank in spared:
                self.observer.emit("worker_start", **fields, spare=True)
            elif w.local_rank in kept:
                self.observer.emit("worker_kept", **fields)
            else:
                self.observer.emit("worker_start", **fields)
        grace = self.stop_options.restart_grace.total_seconds() if restart_in_process else None
        spares = self.kept.spares
        top_up = functools.partial(spares.top_up, group) if spares.count else None
        outcome = self._attempt(workers, router, policy, number, grace, cause_wait, top_up)
        self.kept.park(outcome.kept)
        outcome.in_process = grace is not None and any(w.restartable for w in workers)
        return outcome

    def start_standby(self, group: GroupInfo) -> None:
        """Start this node's workers ahead, as a hot spare's: they run the script's set-up
        and wait for the ranks of the round that admits the node (the next
        :meth:`run_attempt` gives them, as to workers kept by an in-process restart)."""
        if self.kept.parked:
            return
        self.init_warm()
        workers = self.starter.start_standby(group)
        self.kept.park(workers)
        pids = ", ".join(str(w.pid) for w in workers)
        write_console(
            2,
            f"rallypoint: hot spare: {len(workers)} worker(s) run the script's set-up now "
            f"and wait for ranks (pids {pids})\n".encode(),
        )
        for w in workers:
            self.observer.emit("worker_standby", local_rank=w.local_rank, pid=w.pid)

    def stop_kept(self) -> None:
        """Stop the workers kept for an in-process restart that will not come, and the
        spares (:meth:`KeptWorkers.stop`)."""
        self.kept.stop()

    def _attempt(
        self,
        workers: list[Worker],
        router: OutputRouter,
        policy: AttemptPolicy,
        number: int,
        grace: float | None,
        cause_wait: float | None,
        on_restartable: Callable[[], object] | None,
    ) -> Outcome:
        # across nodes, the liveness window and the half second an exit waits for a cause
        # on its node: a lost node noticed at the window's very end (a loaded machine) is
        # still a cause, not a restart spent
        causes = CauseWait(LOCAL_CAUSE_WAIT + (cause_wait or 0.0))
        inproc = InProcess(
            workers,
            grace,
            causes=causes,
            reset_store=self.warm.reset_store if self.stopper.store_pid else None,
            on_restartable=on_restartable,
        )
        attempt = Attempt(
            self.tools,
            workers=workers,
            router=router,
            policy=policy,
            inproc=inproc,
            causes=causes,
            number=number,
        )
        return attempt.run()

    def results(self, outcome: Outcome) -> list[Any]:
        """What each worker of a successful attempt returned (``None`` for scripts)."""
        if not self.collect_results:
            return [None] * len(outcome.workers)
        values = []
        for state, raw in zip(outcome.workers, outcome.results, strict=True):
            if len(raw) < 8:
                raise WorkerFailedError(
                    f"rank {state.rank} exited with 0 without sending a result",
                    rank=state.rank,
                    local_rank=state.local_rank,
                    pid=state.pid,
                    host=self.host,
                    exitcode=0,
                    remote_traceback="",
                    summary="",
                )
            values.append(pickle.loads(raw[8:])[1])
        return values

    def close(self) -> None:
        self.stop_kept()
        self.signals.close()
        shutil.rmtree(self._scratch, ignore_errors=True)
