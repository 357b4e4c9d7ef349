"""torchft's ``torchft.optim`` module path."""

from rallypoint.ft._optim import OptimizerWrapper

__all__ = ["OptimizerWrapper"]
