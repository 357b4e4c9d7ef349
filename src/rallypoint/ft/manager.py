"""torchft's ``torchft.manager`` module path (for programs and tests that import it)."""

from rallypoint.ft._manager import ExceptionWithTraceback, Manager, WorldSizeMode

__all__ = ["ExceptionWithTraceback", "Manager", "WorldSizeMode"]
