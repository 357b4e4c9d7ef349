"""Works (torchft's ``torchft.work``): torch ``Work`` objects, so that C++ callers (DDP's
reducer, functional collectives) take them too. :class:`ManagedWork`, ``Manager.allreduce``'s,
records a failure on the manager (the step's commit fails) and never raises it: ``wait()``
returns ``False`` and the tensor is left as it is (torchft's DDP hook asserted, crashing the
healthy group). Its wait also ends when the process group it ran on is aborted, done or
not (gloo can leave a collective whose peer died unended until its timeout)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from rallypoint.ft._quorum.watch import Ending
    from rallypoint.ft.manager import Manager

__all__ = ["ManagedWork", "wrap_future"]

T = TypeVar("T")


class _DummyWork(dist.Work):
    """A work that is done, with ``result`` as its future's value (torchft's name)."""

    def __init__(self, result: object) -> None:
        super().__init__()
        self.result_ = result
        self.future_: torch.futures.Future[object] = torch.futures.Future()
        self.future_.set_result(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[object]:
        return self.future_


class ManagedWork(dist.Work):
    """A collective of the manager's process group; AVG divides by ``divide`` once done."""

    def __init__(
        self,
        manager: Manager,
        work: Any,
        tensor: torch.Tensor,
        divide: int | None,
        ending: Ending | None = None,
    ) -> None:
        super().__init__()
        self._manager, self._work, self._tensor, self._divide = manager, work, tensor, divide
        self._ending = ending
        self._done: bool | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done is None:
            try:
                if self._ending is not None:
                    _wait_or_end(self._work, self._ending)
                self._work.wait()
                if self._divide:
                    self._tensor /= self._divide
                self._done = True
            except Exception as exc:  # a peer died or the group was aborted: no commit
                self._manager.report_error(exc)
                self._done = False
        return self._done

    def get_future(self) -> torch.futures.Future[object]:
        self.wait()
        fut: torch.futures.Future[object] = torch.futures.Future()
        fut.set_result(self._tensor)
        return fut


def _wait_or_end(work: Any, ending: Ending) -> None:
    """Until ``work`` is done, or ``ending`` is set (then raise: the group was aborted)."""
    try:
        future = work.get_future()
    except (RuntimeError, NotImplementedError):  # a work without a future: its wait only
        return
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    if not ending.wait(done) and not future.done():
        raise RuntimeError("the process group was aborted")


class _ManagedWork(ManagedWork):
    """torchft's ``manager._ManagedWork(manager, work, value)``: a collective whose failure
    is recorded on the manager (no division)."""

    def __init__(self, manager: Manager, work: Any, value: torch.Tensor) -> None:
        super().__init__(manager, work, value, None)


def wrap_future(manager: Manager, fut: Any, default: T) -> Any:
    """``fut`` whose failure is recorded on ``manager`` and replaced by ``default``."""
    out: torch.futures.Future[Any] = torch.futures.Future()

    def done(f: Any) -> None:
        try:
            out.set_result(f.value())
        except Exception as exc:  # recorded on the manager: the step's commit fails
            manager.report_error(exc)
            out.set_result(default)

    fut.add_done_callback(done)
    return out
