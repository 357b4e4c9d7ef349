"""``rallypoint.ft``: torchft's user API on rallypoint's stack (per-step quorum).

Replica groups train data-parallel; a failed group drops out of the next step's quorum
while the others keep stepping, and comes back healed from a live peer at their step. A
torchft program runs with ``import torchft`` replaced by ``import rallypoint.ft as
torchft``; torchft's module paths (``rallypoint.ft.manager``, ``.ddp``, ``.optim``,
``.data``, ``.process_group``, ``.coordination``) are the modules that define the names.
Usage, the differences from torchft and the trust model: docs/ft.md.
"""

from rallypoint._core.public import set_public_module
from rallypoint.ft.data import DistributedSampler as DistributedSampler
from rallypoint.ft.ddp import DistributedDataParallel as DistributedDataParallel
from rallypoint.ft.manager import Manager as Manager
from rallypoint.ft.optim import Optimizer as Optimizer
from rallypoint.ft.process_group import ProcessGroupBabyNCCL as ProcessGroupBabyNCCL
from rallypoint.ft.process_group import ProcessGroupBabyXCCL as ProcessGroupBabyXCCL
from rallypoint.ft.process_group import ProcessGroupGloo as ProcessGroupGloo
from rallypoint.ft.process_group import ProcessGroupNCCL as ProcessGroupNCCL
from rallypoint.ft.process_group import ProcessGroupXCCL as ProcessGroupXCCL

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

set_public_module(__name__, globals(), __all__)  # names of public modules keep theirs
del set_public_module
