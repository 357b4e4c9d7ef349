"""The Manager's works by the names it imports: they live in :mod:`rallypoint.ft.work`."""

from rallypoint.ft.work import ManagedWork, _DummyWork, wrap_future

DummyWork = _DummyWork

__all__ = ["DummyWork", "ManagedWork", "wrap_future"]
