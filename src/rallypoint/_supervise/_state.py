"""The supervisor's records: who this node is in the job (:class:`GroupInfo`), one running
worker (:class:`Worker`), and how an attempt ended (:class:`Outcome`; what an in-process
restart kept, :func:`in_process_line`)."""

from __future__ import annotations

import contextlib
import enum
import os
import re
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rallypoint._core.status import WorkerStatus
from rallypoint._supervise._errors import WorkerSummary
from rallypoint._supervise._peer_loss import PeerLoss
from rallypoint._supervise._summary import describe_status, error_info

__all__ = [
    "Culprit",
    "Failure",
    "GroupInfo",
    "Outcome",
    "OutcomeKind",
    "Stop",
    "Worker",
    "in_process_line",
]


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """This node's place in the job for one attempt: what the workers' environment says."""

    group_rank: int
    group_world_size: int
    world_size: int
    rank_offset: int
    """Global rank of local rank 0."""
    master_addr: str
    master_port: int
    run_id: str
    restart_count: int = 0
    """``TORCHELASTIC_RESTART_COUNT``: restarts of the job's budget spent so far."""
    max_restarts: int = 0
    rpc_secret: str = ""
    """The job's RPC secret shared by every node (multi-node jobs); empty: the node's own
    (the user's ``RALLYPOINT_RPC_SECRET``, or one generated for this launch)."""


class OutcomeKind(enum.Enum):
    """How one attempt of the local workers ended."""

    OK = "ok"
    """Every worker exited 0."""
    FAILED = "failed"
    """A worker raised, exited non-zero or died by a signal (``Outcome.failure``)."""
    BAD_TARGET = "bad_target"
    """The script, module or command could not be started; never restarted."""
    FATAL = "fatal"
    """A worker raised ``FatalError``; never restarted."""
    SIGNAL = "signal"
    """The launcher received a signal (``Outcome.signum``) and forwarded it."""
    TIMEOUT = "timeout"
    """The job ran past its ``timeout``."""
    HANG = "hang"
    """No worker reported progress for ``hang_timeout``."""
    RESTART = "restart"
    """The policy stopped the workers for a restart (a decision, or a membership change)."""
    LOST = "lost"
    """The policy lost the job's store: this node cannot go on."""


@dataclass(frozen=True, slots=True)
class Stop:
    """A policy's reason to stop the running workers."""

    kind: OutcomeKind
    reason: str
    culprit: int | None = None
    """A hang's root rank by the Flight Recorder (an in-process restart replaces it alone)."""


@dataclass(frozen=True, slots=True)
class Culprit:
    """The rank a collective that timed out waited for, by the Flight Recorder."""

    line: str = ""
    """For the failure summary (``""``: not known)."""
    rank: int | None = None
    """Its global rank, when this node knows it."""


@dataclass(frozen=True, slots=True)
class Failure:
    """The first worker failure of an attempt (its root cause) and what it left behind."""

    worker: WorkerSummary
    traceback: str
    exception: BaseException | None
    time: float
    """Unix time of the worker's exit."""
    elapsed: float
    """Seconds from the supervisor's start to that exit."""
    bad_target: str = ""
    """Why the target could not start (``BAD_TARGET`` only)."""
    culprit: str = ""
    """When a collective timed out: the rank the others waited for, by the Flight Recorder
    (``_watch._flight._format.hang_report``), where this node made that report."""
    peer_loss: PeerLoss | None = None
    """Its error says a peer vanished under it: its wait for a cause, of which the attempt
    spent some (``_peer_loss``); ``None``: a failure of its own."""


@dataclass(slots=True)
class Outcome:
    kind: OutcomeKind
    workers: list[WorkerSummary]
    failure: Failure | None = None
    signum: int = 0
    reason: str = ""
    results: list[bytes] = field(default_factory=list)
    """Each worker's raw result message by local rank (``launch()`` only)."""
    kept: list[Worker] = field(default_factory=list)
    """Workers that left their ``@rallypoint.restartable`` function and wait, alive, for
    the next attempt (an in-process restart); the supervisor holds them until then."""
    in_process: bool = False
    """The attempt could restart in process (its workers run a ``@rallypoint.restartable``
    function): a restart is in process even where ``kept`` is empty (every worker of this
    node failed or was replaced; the other nodes keep theirs)."""


_STOP_EXCEPTION = re.compile(r"^\s*(\w+\.)*(KeyboardInterrupt|SignalException)\b")
"""What a worker's last traceback line says when a stop's signal raised it."""


@dataclass(slots=True)
class Worker:
    """One running (or exited) worker of the current attempt."""

    local_rank: int
    rank: int
    pid: int
    error_file: Path
    res_fd: int
    status: int | None = None
    exited_at: float = 0.0
    signalled: int | None = None
    result: bytearray = field(default_factory=bytearray)
    pipes: tuple[int, int] = (-1, -1)
    """The read ends of its stdout and stderr (routed by the attempt's ``OutputRouter``)."""
    control: socket.socket | None = None
    """The agent's end of its control channel (``_control``)."""
    restartable: bool = False
    """It entered ``@rallypoint.restartable``: it can restart in process."""
    returned: bool = False
    """Its restartable function returned: only its first call restarts in process."""
    interrupted_at: float | None = None
    """When the agent told it to leave its function (an in-process restart)."""
    parked: bool = False
    """It left its function and waits for the next attempt."""
    raised: str = ""
    """The traceback of an exception its function raised, awaiting the agent's verdict."""
    kept_since: int | None = None
    """The attempt it was started in, when it was kept from an earlier one."""

    @property
    def gone_or_parked(self) -> bool:
        return self.status is not None or self.parked

    def close_channels(self) -> None:
        """Close the supervisor's ends of its pipes and control channel (it is gone, or no
        attempt will watch it)."""
        for fd in (*self.pipes, self.res_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self.control is not None:
            self.control.close()
            self.control = None

    @property
    def returncode(self) -> int | None:
        return None if self.status is None else describe_status(self.status)[0]

    def state(self) -> WorkerSummary:
        if self.status is None and self.parked:
            kept = WorkerStatus.KEPT
            text = "kept for an in-process restart"
            return WorkerSummary(self.rank, self.local_rank, self.pid, kept, None, text)
        if self.status is None:
            running = WorkerStatus.RUNNING
            return WorkerSummary(self.rank, self.local_rank, self.pid, running, None, "running")
        code, text = describe_status(self.status)
        kind = WorkerStatus.SUCCEEDED if code == 0 else WorkerStatus.FAILED
        if code != 0 and self.signalled is not None:
            own = self._own_error(code)
            if own:  # it failed on its own while (or before) rallypoint's signal came
                text = f"{text} ({own})"
            else:
                kind = WorkerStatus.TERMINATED
                name = signal.Signals(self.signalled).name
                text = f"{text} (stopped by rallypoint with {name})"
        return WorkerSummary(self.rank, self.local_rank, self.pid, kind, code, text)

    def _own_error(self, code: int) -> str:
        """Why a worker that rallypoint signalled failed, if not because of the signal:
        a fatal signal of its own (SIGSEGV, SIGABRT...), or an exception other than the
        ones a stop raises (``KeyboardInterrupt``, torch's ``SignalException``); ``""``
        when the stop explains its exit."""
        if code < 0:
            sig = -code
            if sig in (self.signalled, signal.SIGKILL):
                return ""
            return "its own failure, before rallypoint's signal took effect"
        traceback_text, _ = error_info(bytes(self.result), self.error_file)
        last = next((ln for ln in reversed(traceback_text.splitlines()) if ln.strip()), "")
        if not last or _STOP_EXCEPTION.search(last):
            return ""
        return f"its own failure: {last.strip()}"


def in_process_line(outcome: Outcome) -> tuple[str, dict[str, Any]]:
    """What an in-process restart keeps and replaces, in one line and as event fields:
    ``ranks 0, 2, 3 kept (pids 11, 12, 13); rank 1 replaced (was killed by SIGKILL)``."""
    kept = sorted(outcome.kept, key=lambda w: w.rank)
    pids = {w.pid for w in kept}
    replaced = sorted((w for w in outcome.workers if w.pid not in pids), key=lambda w: w.rank)
    ranks = ", ".join(str(w.rank) for w in kept)
    pids_text = ", ".join(str(w.pid) for w in kept)
    many = "s" if len(kept) > 1 else ""
    line = f"rank{many} {ranks} kept (pid{many} {pids_text})"
    if replaced:
        line += "; " + "; ".join(f"rank {w.rank} replaced ({w.detail})" for w in replaced)
    fields = {
        "kept": [w.rank for w in kept],
        "replaced": [w.rank for w in replaced],
    }
    return line, fields
