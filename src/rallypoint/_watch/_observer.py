"""What the agent watches besides exits: progress (hangs, stragglers), stacks and the event log.

One :class:`Observer` per agent owns the three building blocks and keeps the agent loop
free of their details:

- a :class:`~rallypoint.observe.ProgressBoard` when ``hang_timeout`` is set or straggler
  detection is on (the default), and a :class:`StragglerWatch` per attempt for the latter;
- a directory for the workers' stack dumps (``RALLYPOINT_STACKS_DIR``, always set, so that
  ``rallypoint stacks`` works on any running job);
- an :class:`~rallypoint.observe.EventLog` when ``events`` is set; an event that cannot
  be written never ends the job (:meth:`Observer.emit`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from rallypoint._core.checks import check_int
from rallypoint._core.closing import Closing
from rallypoint._core.envvars import EVENTS_FILE, EVENTS_NODE
from rallypoint._core.procs import pid_running
from rallypoint._core.store import Store
from rallypoint._watch._flight._final import (
    has_final_trace,
    read_final_trace,
    remove_final_traces,
)
from rallypoint._watch._flight._recorder import (
    FlightRequest,
    flight_recorder_env,
    remove_flight_files,
)
from rallypoint._watch._idle import Idle
from rallypoint._watch._stacks import StackDump, collect_stacks, remove_dump_file, stacks_env
from rallypoint._watch._stragglers._watch import StragglerWatch
from rallypoint.observe import EventLog, ProgressBoard

__all__ = ["Observer", "WatchOptions"]

STACKS_TIMEOUT = 5.0
"""Seconds to wait for a worker's stack dump."""
SETUP_FACTOR = 5
"""The default ``setup_timeout``: this many times ``hang_timeout``, ..."""
SETUP_MINIMUM = 60.0
"""... and at least this many seconds (a first step's imports took over 8 s on a loaded
2-core machine)."""
FLIGHT_TIMEOUT = 10.0
"""Seconds after the request to wait for the workers' Flight Recorder dumps with their
issuing frames (torch's first takes about a second; without frames, milliseconds)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchOptions:
    """What the agent watches besides exits (``LaunchConfig`` options of the same names)."""

    hang_timeout: timedelta | None
    """No progress from any worker for this long is a hang (``None``: not watched)."""
    setup_timeout: timedelta | None
    """The bound of a hang while a worker has not reported progress yet in the attempt (it
    is in its set-up: imports, data, a first step that compiles), and once a worker of the
    attempt finished (the others wind down: a last save, the teardown); ``None``:
    :data:`SETUP_FACTOR` times ``hang_timeout``, at least :data:`SETUP_MINIMUM` seconds."""
    events: str | None
    """Append the job's events (JSON lines) to this file; ``rallypoint report`` draws them."""
    straggler_threshold: float | None
    """A rank (or node) whose step time exceeds this many times the median of the others'
    is reported once (``None``, also given as ``"off"``: not watched)."""
    straggler_window: timedelta
    """Step times are averaged over this much recent history (at least 5 steps)."""
    flight_recorder: int | None
    """Collectives each worker's Flight Recorder keeps (``None``: none); the user's own
    ``TORCH_FR_BUFFER_SIZE`` wins."""

    def __post_init__(self) -> None:
        hang = _seconds(self.hang_timeout)
        setup = _seconds(self.setup_timeout)
        if setup is not None and hang is None:
            raise ValueError("setup_timeout bounds a hang in the set-up: set hang_timeout too")
        if setup is not None and hang is not None and setup < hang:
            raise ValueError(
                f"setup_timeout must be at least hang_timeout ({hang:g} s), got {setup:g} s"
            )


def _seconds(value: timedelta | None) -> float | None:
    return None if value is None else value.total_seconds()


def _json_safe(value: Any) -> Any:
    """``value`` with every float that JSON cannot hold (NaN, infinity) as ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write(line)
        sys.stderr.flush()


class Observer(Closing):
    """Progress board, stack dumps and event log of one agent."""

    def __init__(self, *, nproc: int, watch: WatchOptions, node: str) -> None:
        hang_timeout = watch.hang_timeout
        self.hang_timeout = hang_timeout
        self.setup_timeout = watch.setup_timeout
        if self.setup_timeout is None and hang_timeout is not None:
            default = max(SETUP_FACTOR * hang_timeout.total_seconds(), SETUP_MINIMUM)
            self.setup_timeout = timedelta(seconds=default)
        self.straggler_threshold = watch.straggler_threshold
        self.straggler_window = watch.straggler_window.total_seconds()
        self.node = node
        assert not isinstance(watch.flight_recorder, str)
        self.flight_recorder = watch.flight_recorder
        self.stacks_dir = Path(tempfile.mkdtemp(prefix="rallypoint-stacks-"))
        wants_board = hang_timeout is not None or self.straggler_threshold is not None
        self.board = ProgressBoard(nproc) if wants_board else None
        self.log: EventLog | None = None
        self._dropped: set[str] = set()  # the kinds of events dropped (said once each)
        self._exited: dict[int, int] = {}  # rank -> pid, this attempt's
        try:
            self.log = EventLog(watch.events, node=node) if watch.events else None
        except BaseException:  # Ctrl-C too: what was opened is closed
            self.close()
            raise

    def temp_paths(self) -> list[str]:
        """What this observer made in temporary directories (:meth:`close` removes it)."""
        return [str(self.stacks_dir), *([self.board.path] if self.board is not None else [])]

    def worker_env(self, local_rank: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """What to add to a worker's environment ``base`` (the user's settings win)."""
        env = flight_recorder_env(
            base or {},
            self.flight_recorder,
            str(self.stacks_dir),
            timing=self.board is not None and self.straggler_threshold is not None,
        )
        env.update(stacks_env(self.stacks_dir))
        if self.log is not None:  # rallypoint.ft writes its quorum changes there too
            env[EVENTS_FILE] = os.path.abspath(self.log.path)
            env[EVENTS_NODE] = self.node
        if self.board is not None:
            env.update(self.board.env(local_rank))
        return env

    def emit(self, kind: str, /, **fields: Any) -> None:
        """Append an event to the ``events`` file, if one is open. An event never ends the
        job: a number that is no JSON value (NaN, infinity) is written as ``null``, and an
        event that still cannot be written (a field of another type, a full disk) is
        dropped, said in one line on stderr for the first of its kind."""
        if self.log is None:
            return
        try:
            self.log.emit(kind, **{name: _json_safe(v) for name, v in fields.items()})
        except (TypeError, ValueError, OSError) as exc:
            if kind not in self._dropped:
                self._dropped.add(kind)
                _say(
                    f"rallypoint: warning: a {kind!r} event was not written to "
                    f"{self.log.path}: {exc}; the job goes on (this is said once per kind)\n"
                )

    def reset(self) -> None:
        """A new attempt/round starts: idle time counts from now; the last attempt's exited
        workers and the traces they left are forgotten."""
        if self.board is not None:
            self.board.reset()
        for rank, pid in self._exited.items():
            remove_final_traces(self.stacks_dir, rank, pid)
        self._exited.clear()

    def straggler_watch(
        self,
        *,
        round: int,
        rank_offset: int,
        group_rank: int = 0,
        nnodes: int = 1,
        clock_store: Callable[[], Store] | None = None,
    ) -> StragglerWatch | None:
        """Straggler detection for one attempt, which starts now (``None`` when it is off);
        ``clock_store`` opens a run-store connection of its own (``StragglerWatch``)."""
        if self.board is None or self.straggler_threshold is None:
            return None
        check_int(rank_offset, "rank_offset", minimum=0)
        return StragglerWatch(
            self.board,
            threshold=self.straggler_threshold,
            host=self.node,
            round=round,
            rank_offset=rank_offset,
            emit=self.emit,
            group_rank=group_rank,
            nnodes=nnodes,
            window_s=self.straggler_window,
            arrivals=self._arrivals if self.flight_recorder else None,
            clock_store=clock_store,
            started_ns=time.time_ns(),  # the workers' Flight Recorders use this clock
        )

    def _arrivals(self, pids_by_rank: Mapping[int, int]) -> FlightRequest:
        """Ask the workers for their recorded collectives (no frames) for straggler
        detection; :class:`StragglerWatch` reads the answers a period later."""
        window = self.straggler_window  # nothing older is judged (``judge_arrivals``)
        return FlightRequest(pids_by_rank, self.stacks_dir, arrivals=True, window_s=window)

    def idle(self, live: Mapping[int, int], finished: Sequence[int], nodes: int) -> Idle:
        """How long no worker reported progress, with what bounds it: of ``live`` (``{local
        rank: global rank}``), the ranks in their set-up (:meth:`in_setup`); the ranks of
        this node and the nodes that ``finished`` (the others wind down)."""
        return Idle(self.idle_seconds(), self.in_setup(live), finished, nodes)

    def hung(self, idle: Idle) -> bool:
        """Whether ``idle`` passes ``hang_timeout``, or ``setup_timeout`` while a worker is
        in its set-up or the others wind down (``idle.long``)."""
        bound = self.setup_timeout if idle.long else self.hang_timeout
        return bound is not None and idle.seconds >= bound.total_seconds()

    def in_setup(self, ranks: Mapping[int, int]) -> list[int]:
        """Of ``ranks`` (``{local rank: global rank}``), the global ranks that have not
        reported progress yet in this attempt (:meth:`reset`)."""
        if self.board is None or self.hang_timeout is None:
            return []
        reported = set(self.board.reported())
        return sorted(rank for local, rank in ranks.items() if local not in reported)

    def idle_seconds(self) -> float:
        return 0.0 if self.board is None else self.board.seconds_since_progress()

    def collect(self, pids_by_rank: Mapping[int, int]) -> dict[int, StackDump]:
        """This node's workers' stacks and Flight Recorder dumps, keyed by global rank, and
        the traces that workers of this attempt left as they failed (``_flight._final``)."""
        # a worker that is leaving its trace fails on a collective timeout: it is not asked
        # (its thread would wait behind the imports of its own last dump); it is given until
        # the deadline to exit, then its trace is read
        leaving = {r: p for r, p in pids_by_rank.items() if has_final_trace(self.stacks_dir, r, p)}
        live = {r: p for r, p in pids_by_rank.items() if r not in leaving}
        # stacks first: faulthandler reads every thread's frames from a signal handler, which
        # can crash a worker whose Flight Recorder thread is busy importing (torch's first
        # symbolisation imports some 800 modules) at that moment
        dumps = collect_stacks(live, STACKS_TIMEOUT, directory=self.stacks_dir)
        request = FlightRequest(live, self.stacks_dir)
        traces = request.results(FLIGHT_TIMEOUT)
        out = {r: dataclasses.replace(d, flight=traces.get(r)) for r, d in dumps.items()}
        deadline = request.started + FLIGHT_TIMEOUT
        while any(pid_running(p) for p in leaving.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        for rank, pid in {**self._exited, **leaving}.items():
            final = None if rank in out else read_final_trace(self.stacks_dir, rank, pid)
            if final is not None:
                why = "exited (a collective timed out: its error follows)"
                out[rank] = StackDump(rank=rank, host=self.node, pid=pid, error=why, flight=final)
        return dict(sorted(out.items()))

    def stacks(self, pids_by_rank: Mapping[int, int]) -> dict[int, StackDump]:
        """Only these workers' stacks (no Flight Recorder): where a rank is stuck."""
        return collect_stacks(pids_by_rank, STACKS_TIMEOUT, directory=self.stacks_dir)

    def left_trace(self, rank: int, pid: int) -> bool:
        """Whether exited worker ``pid`` left a trace: it failed on a collective timeout
        (its own, or the one NCCL's watchdog wrote before it aborted the process)."""
        return has_final_trace(self.stacks_dir, rank, pid)

    def forget(self, pid: int, rank: int | None = None) -> None:
        """Worker ``pid`` exited: its files go, but for a trace it left (kept for a report
        on this attempt's failure until :meth:`reset`)."""
        remove_dump_file(self.stacks_dir, pid)
        remove_flight_files(self.stacks_dir, pid)
        if rank is not None:
            self._exited[rank] = pid

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
        if self.log is not None:
            with contextlib.suppress(ValueError):
                self.log.close()
        shutil.rmtree(self.stacks_dir, ignore_errors=True)
