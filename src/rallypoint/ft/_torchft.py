"""torchft's ``torchft._torchft`` names that its tests use: the lighthouse server."""

from rallypoint.ft._lighthouse import LighthouseServer

__all__ = ["LighthouseServer"]
