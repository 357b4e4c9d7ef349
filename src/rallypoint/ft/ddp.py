"""torchft's ``torchft.ddp`` module path."""

from rallypoint.ft._ddp import DistributedDataParallel, PureDistributedDataParallel

__all__ = ["DistributedDataParallel", "PureDistributedDataParallel"]
