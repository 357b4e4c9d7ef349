"""A stand-in for torchft's test-only ``FakeProcessGroupWrapper``, which ``rallypoint.ft``
does not offer: it wraps a process group and fails the next allreduce with an error
reported to it (``report_future_error``), so that the step's commit fails everywhere."""

from __future__ import annotations

from typing import Any


class _FailedWork:
    def __init__(self, work: Any, error: Exception) -> None:
        self._work, self._error = work, error

    def wait(self, timeout: Any = None) -> bool:
        self._work.wait()
        raise self._error


class FakeProcessGroupWrapper:
    def __init__(self, pg: Any) -> None:
        self._pg = pg
        self._future_error: Exception | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)

    def configure(self, *args: Any, **kwargs: Any) -> None:
        self._future_error = None
        self._pg.configure(*args, **kwargs)

    def report_future_error(self, e: Exception) -> None:
        self._future_error = e

    def allreduce(self, tensors: list[Any], opts: Any) -> Any:
        work = self._pg.allreduce(tensors, opts)
        error, self._future_error = self._future_error, None
        return work if error is None else _FailedWork(work, error)
