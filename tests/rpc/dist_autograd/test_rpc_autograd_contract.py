"""Distributed autograd through rallypoint.rpc: rallypoint's own against torch's, one run.

The contract (rallypoint.testing._rpc._autograd_contract) runs on both backends; each run
checks its gradients against a single-process reference. Here the two runs are compared
with each other: the same gradients, the same errors (type and message), and the same
parameters after training with DistributedOptimizer (SGD and Adam).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rallypoint.testing._rpc._autograd_contract import run_rpc_autograd_contract, train_reference

CHECKS = 32


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    return {backend: run_rpc_autograd_contract(backend) for backend in ("RALLYPOINT", "TENSORPIPE")}


@pytest.mark.timeout(300)
def test_both_backends_pass_the_contract(runs: dict[str, dict[str, Any]]) -> None:
    ours, torchs = runs["RALLYPOINT"], runs["TENSORPIPE"]
    assert ours["checks"] == torchs["checks"]
    assert len(ours["checks"]) == CHECKS, ours["checks"]


@pytest.mark.timeout(300)
def test_gradients_and_errors_equal_torchs(runs: dict[str, dict[str, Any]]) -> None:
    ours, torchs = runs["RALLYPOINT"]["seen"], runs["TENSORPIPE"]["seen"]
    assert ours.keys() == torchs.keys()
    errors = 0
    for name, value in ours.items():
        if isinstance(value, tuple) and isinstance(value[0], str):  # (type name, first line)
            assert value == torchs[name], name
            errors += 1
        else:
            torch.testing.assert_close(value, torchs[name], rtol=0, atol=0, msg=name)
    assert errors == 12


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "plain"])
def test_training_equals_torch_and_one_process(
    runs: dict[str, dict[str, Any]], optimizer: str
) -> None:
    ours, torchs = runs["RALLYPOINT"]["train"][optimizer], runs["TENSORPIPE"]["train"][optimizer]
    reference = train_reference(optimizer)
    # the embedding stage runs 4 times a step, so its gradient is the sum of 4 backward
    # messages added in arrival order (on either backend): runs agree up to float rounding
    # after the first update, and exactly before it
    assert ours["losses"][0] == torchs["losses"][0]
    assert ours["losses"] == pytest.approx(torchs["losses"], rel=1e-6)
    for mine, theirs, local in zip(
        ours["params"], torchs["params"], reference["params"], strict=True
    ):
        torch.testing.assert_close(mine, theirs)
        torch.testing.assert_close(mine, local)
    assert ours["losses"][-1] < ours["losses"][0]
