"""The result pipes of ``launch()`` workers: each sends its pickled return value (or the
exception it raised) through one, read as it fills into ``Worker.result``."""

from __future__ import annotations

import contextlib
import os
import selectors

from rallypoint._supervise._state import Worker

__all__ = ["ResultPipes"]


class ResultPipes:
    """One attempt's result pipes, registered in its selector ``sel`` as ``"res"``."""

    def __init__(self, workers: list[Worker], sel: selectors.BaseSelector) -> None:
        self.sel = sel
        self.by_fd = {w.res_fd: w for w in workers if w.res_fd >= 0}
        for fd in self.by_fd:
            sel.register(fd, selectors.EVENT_READ, "res")

    def open(self) -> bool:
        """Whether a pipe is still open at the worker's end."""
        return bool(self.by_fd)

    def on_readable(self, fd: int) -> None:
        self._read(self.by_fd[fd])

    def read_all(self, w: Worker) -> None:
        """Read what ``w`` (which exited) left in its pipe."""
        while w.res_fd in self.by_fd and self._read(w, until_empty=True):
            pass

    def release(self, w: Worker) -> None:
        """``w`` is kept for the next attempt, which reads its pipe."""
        if w.res_fd in self.by_fd:
            self.sel.unregister(w.res_fd)
            del self.by_fd[w.res_fd]

    def close(self) -> None:
        for fd in self.by_fd:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _read(self, w: Worker, *, until_empty: bool = False) -> bool:
        """Read what is in ``w``'s result pipe (closed at its end); whether more may come
        now (``until_empty``: False once the pipe is empty for the moment, too)."""
        try:
            data = os.read(w.res_fd, 1 << 20)
        except BlockingIOError:
            return not until_empty
        except OSError:
            data = b""
        if data:
            w.result += data
            return True
        self.sel.unregister(w.res_fd)
        del self.by_fd[w.res_fd]
        os.close(w.res_fd)
        w.res_fd = -1
        return False
