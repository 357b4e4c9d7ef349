"""torchft's ``torchft.process_group`` module path."""

from rallypoint.ft._process_group import (
    ProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupBabyXCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupXCCL,
)

__all__ = [
    "ProcessGroup",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupXCCL",
]
