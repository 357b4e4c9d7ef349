"""What ``Manager.allreduce`` returns: a work whose failure is recorded, never raised.

A collective that fails (a peer died, the group was aborted) records the error on the
manager, which fails the step's commit; the caller's ``wait()`` returns ``False`` and the
tensor is left as it is. torchft's DDP hook asserted on such a work and crashed the healthy
group; here the hook gets a completed future either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from rallypoint.ft.manager import Manager

__all__ = ["DummyWork", "ManagedWork", "wrap_future"]

T = TypeVar("T")


class DummyWork:
    """A work that is done: the step has failed already."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(self._tensor)
        return fut


class ManagedWork:
    """A collective of the manager's process group; AVG divides by ``divide`` once done."""

    def __init__(
        self, manager: Manager, work: Any, tensor: torch.Tensor, divide: int | None
    ) -> None:
        self._manager, self._work, self._tensor, self._divide = manager, work, tensor, divide
        self._done: bool | None = None

    def wait(self, timeout: Any = None) -> bool:
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

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        self.wait()
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(self._tensor)
        return fut


def wrap_future(manager: Manager, fut: Any, default: T) -> Any:
    """``fut`` whose failure is recorded on ``manager`` and replaced by ``default``."""
    out: torch.futures.Future[Any] = torch.futures.Future()

    def done(f: Any) -> None:
        try:
            out.set_result(f.value())
        except Exception as exc:
            manager.report_error(exc)
            out.set_result(default)

    fut.add_done_callback(done)
    return out
