"""``rallypoint.ft``: torchft's user API on rallypoint's stack (per-step quorum).

Replica groups train data-parallel; a failed group drops out of the next step's quorum
while the others keep stepping, and comes back healed from a live peer at their step. A
torchft program runs with ``import torchft`` replaced by ``import rallypoint.ft as
torchft``. Usage, the differences from torchft and the trust model: docs/ft.md.
"""

from rallypoint._core.public import set_public_module
from rallypoint.ft._data import DistributedSampler
from rallypoint.ft._ddp import DistributedDataParallel
from rallypoint.ft._manager import Manager
from rallypoint.ft._optim import OptimizerWrapper as Optimizer
from rallypoint.ft._process_group import (
    ProcessGroupBabyNCCL,
    ProcessGroupBabyXCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupXCCL,
)

__all__ = [
    "DistributedDataParallel",
    "DistributedSampler",
    "Manager",
    "Optimizer",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupXCCL",
]

set_public_module(__name__, globals(), __all__)  # the one place: __module__ is this face
del set_public_module
