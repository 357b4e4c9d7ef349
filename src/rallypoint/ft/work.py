"""Works (torchft's ``torchft.work``): torch ``Work`` objects, so that C++ callers (DDP's
reducer, functional collectives) take them too. :class:`ManagedWork`, ``Manager.allreduce``'s,
records a failure on the manager (the step's commit fails) and never raises it: ``wait()``
returns ``False`` and the tensor is left as it is (torchft's DDP hook asserted, crashing the
healthy group)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
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
        self, manager: Manager, work: Any, tensor: torch.Tensor, divide: int | None
    ) -> None:
        super().__init__()
        self._manager, self._work, self._tensor, self._divide = manager, work, tensor, divide
        self._done: bool | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done is None:
            try:
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
