"""``Optimizer(manager, optim)``: a step's quorum starts at ``zero_grad`` and the step is
taken only if the quorum commits it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rallypoint.ft.manager import Manager

__all__ = ["Optimizer", "OptimizerWrapper"]


class OptimizerWrapper(torch.optim.Optimizer):
    """torchft's ``Optimizer``: wraps ``optim`` (its state and groups are the wrapped one's)."""

    def __init__(self, manager: Manager, optim: torch.optim.Optimizer) -> None:
        # torch.optim.Optimizer.__init__ is not called: the wrapped optimizer holds the state
        self.optim = optim
        self.manager = manager

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is None, "optimizers that use closures are not supported"
        if self.manager.should_commit():
            self.optim.step()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state


Optimizer = OptimizerWrapper
"""torchft's name for it on its face (``torchft.Optimizer``)."""
