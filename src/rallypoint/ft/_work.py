"""The Manager's works, under the name its module imports them by: they live in
:mod:`rallypoint.ft.work` (torchft's path), ``DummyWork`` is its ``_DummyWork``."""

from rallypoint.ft.work import ManagedWork, _DummyWork, wrap_future

DummyWork = _DummyWork

__all__ = ["DummyWork", "ManagedWork", "wrap_future"]
