"""torchft's ``torchft.data`` module path."""

from rallypoint.ft._data import DistributedSampler

__all__ = ["DistributedSampler"]
