"""Telling ``rallypoint.ft`` replica groups that a worker of this node died, at once.

A dead worker of a replica group wrote where its lighthouse is and who it was
(``RALLYPOINT_FT_NOTICE``); a process other than the warm process's loop writes the notice
(``rallypoint.ft.agent``). Before the warm process imports ``torch._dynamo`` (a second or
more, during which deaths are reaped from SIGCHLD's handler) it forks a writer process for
every later notice: a child forked during that import would inherit its locks and could
hang without a word, and the other groups would wait out the dead one's heartbeat. Until
then each notice gets a child of its own. Notices in flight are finished when the warm
process ends (:meth:`NoticeWriters.finish`): the last death is often what ends the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence

__all__ = ["WRITER_NAME", "NoticeWriters"]

WRITER_NAME = "rp-ft-notice"
"""The name (``/proc/PID/comm``) of a process that writes notices: the workers' stopper
leaves it alone (it is a descendant of the warm process, as the workers are)."""


def _named() -> None:
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(WRITER_NAME)


def _tell(record: str, why: str, rank: int = 0, stopped: bool | None = None) -> int:
    """Mark the rank stopped or running in its group's store (``stopped``), then tell the
    lighthouse ``why`` (if any)."""
    try:
        from rallypoint.ft.agent import tell_gone, tell_stopped

        if stopped is not None:
            tell_stopped(record, rank, stopped)
        return 0 if not why or tell_gone(record, why) else 1
    except BaseException as exc:  # the groups wait out its heartbeat instead: say so
        with contextlib.suppress(BaseException):
            print(
                f"rallypoint: could not tell the other replica groups that {why}: "
                f"{type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )
        return 1


def _writer_main(read: int, close: Sequence[int]) -> None:
    """The writer process: a notice per JSON line, until the pipe closes."""
    _named()
    for fd in close:
        with contextlib.suppress(OSError):
            os.close(fd)
    with os.fdopen(read, "r", encoding="utf-8") as lines:
        for line in lines:
            note = json.loads(line)
            _tell(str(note["record"]), str(note["why"]), int(note["rank"]), note["stopped"])


class NoticeWriters:
    """The processes that write this warm process's notices."""

    def __init__(self) -> None:
        self._pipe = -1
        """The writer process's input, once started."""
        self._pids: set[int] = set()

    @property
    def started(self) -> bool:
        return self._pipe != -1

    def start_writer(self, close: Sequence[int]) -> None:
        """Fork the writer process now (``close``: this process's descriptors it must not
        keep), with ``rallypoint.ft.agent`` imported first: the writer imports nothing."""
        import rallypoint.ft.agent  # noqa: F401

        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _writer_main(read, [*close, write])
                code = 0
            finally:
                os._exit(code)
        os.close(read)
        self._pipe = write
        self._pids.add(pid)

    def tell(self, record: str, why: str, rank: int = 0, stopped: bool | None = None) -> None:
        """Have the notice written (by the writer process, or a child of its own); with
        ``stopped``, the rank is first marked stopped or running in its group's store."""
        if self._pipe >= 0:
            note = {"record": record, "why": why, "rank": rank, "stopped": stopped}
            line = (json.dumps(note) + "\n").encode()
            try:
                os.write(self._pipe, line)  # a record is small: the pipe takes it whole
                return
            except OSError:  # the writer is gone: a child of its own, as before it
                self._pipe = -1
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _named()
                code = _tell(record, why, rank, stopped)
            finally:
                os._exit(code)
        self._pids.add(pid)

    def finish(self, timeout: float) -> None:
        """Let the notices in flight be written, for up to ``timeout`` seconds."""
        if self._pipe >= 0:
            with contextlib.suppress(OSError):
                os.close(self._pipe)  # the writer ends once it wrote what it has
            self._pipe = -1
        deadline = time.monotonic() + timeout
        while self._pids and time.monotonic() < deadline:
            for pid in list(self._pids):
                try:
                    done = os.waitpid(pid, os.WNOHANG)[0] != 0
                except ChildProcessError:  # reaped already (the loop reaps every child)
                    done = True
                if done:
                    self._pids.discard(pid)
            if self._pids:
                time.sleep(0.005)
