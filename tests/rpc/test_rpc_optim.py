"""``DistributedOptimizer``: what it shows while it creates the owners' optimizers."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.testing._workers import runner_for


class _WarningSGD(torch.optim.SGD):
    """An optimizer of the user's own that warns when it is made."""

    def __init__(self, params: Any, lr: float) -> None:
        warnings.warn("the user's own warning", UserWarning, stacklevel=2)
        super().__init__(params, lr=lr)


def _shown_while_creating(backend: str) -> list[str]:
    rank = int(os.environ["RANK"])
    kind = rpc.BackendType[backend]
    rpc.init_rpc(f"w{rank}", backend=kind, rank=rank, world_size=1)
    shown: list[str] = []
    warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
    try:
        if backend == "TENSORPIPE":
            from torch.distributed.optim import DistributedOptimizer
        else:
            DistributedOptimizer = rpc.DistributedOptimizer
        param = torch.nn.Parameter(torch.ones(2))
        DistributedOptimizer(torch.optim.SGD, [rpc.RRef(param)], lr=0.1)
        DistributedOptimizer(_WarningSGD, [rpc.RRef(param)], lr=0.1)
    finally:
        rpc.shutdown()
    return shown


@pytest.mark.timeout(90)
def test_no_torchscript_deprecation_warning_and_the_users_warnings_still_show() -> None:
    env = {RPC_SECRET: "optim-secret"}
    torchs = runner_for("TENSORPIPE")(_shown_while_creating, 1, "TENSORPIPE", env=env)[0]
    ours = runner_for("RALLYPOINT")(_shown_while_creating, 1, "RALLYPOINT", env=env)[0]
    # torch scripts functional SGD and says TorchScript is deprecated; rallypoint does not
    assert any("`TorchScript` support" in text for text in torchs)
    assert not any("`TorchScript` support" in text for text in ours), ours
    assert "the user's own warning" in ours and "the user's own warning" in torchs
