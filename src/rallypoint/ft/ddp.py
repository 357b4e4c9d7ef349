"""``DistributedDataParallel(manager, module)``: torch's DDP, averaged by the manager.

torch's DDP buckets the gradients and calls a communication hook per bucket; here the hook
is ``manager.allreduce`` (the average over the quorum's participants), and DDP's own
process group is one of a single rank, which only absorbs its start-up broadcast. Unused
parameters are looked for on every step (a group's graph may differ after a heal).
"""

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from rallypoint.ft.process_group import dummy_process_group

if TYPE_CHECKING:
    from rallypoint.ft.manager import Manager

__all__ = ["DistributedDataParallel", "PureDistributedDataParallel"]


# torch checks the hook's annotations at run time: no postponed (string) annotations here
def _comm_hook(
    manager: "Manager",
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    return manager.allreduce(bucket.buffer()).get_future()  # type: ignore[no-any-return]


class DistributedDataParallel(_TorchDDP):
    """torchft's ``DistributedDataParallel(manager, module, **kwargs)``."""

    def __init__(self, manager: "Manager", module: torch.nn.Module, **kwargs: Any) -> None:
        kwargs.setdefault("find_unused_parameters", True)
        super().__init__(module, process_group=dummy_process_group(), **kwargs)
        self.register_comm_hook(manager, _comm_hook)


class PureDistributedDataParallel(torch.nn.Module):
    """Each gradient averaged on its own as it is made (no buckets): for small models and
    for tests."""

    def __init__(self, manager: "Manager", module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

        def hook(param: torch.Tensor) -> None:
            if param.grad is not None:
                manager.allreduce(param.grad).wait()

        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
