"""A torch distributed-autograd program runs on rallypoint with only its imports changed.

The program (rallypoint.testing._rpc._program_rnn, pytorch/examples' model-parallel RNN)
runs as torch's own program (its import block swapped for torch's, nothing else changed)
on TensorPipe and with rallypoint's imports on rallypoint's backend: both must train to
the same numbers, and those must match the same model trained in one process. (The
contract test runs it through rallypoint.rpc on both backends too: test_rpc_contract.)
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import pytest
import torch

from rallypoint.testing._rpc import _program_rnn as program
from rallypoint.testing._rpc._contract import run_rpc_pattern
from rallypoint.testing._rpc._torch_program import run_written_program
from rallypoint.testing._workers import run_reference_workers, run_workers


def _one_process() -> dict[str, Any]:
    """The same model and data, trained with plain autograd and SGD in this process."""
    emb = program.EmbeddingTable(program.NTOKEN, program.NINP)
    torch.manual_seed(3)
    rnn = torch.nn.LSTM(program.NINP, program.NHID, program.NLAYERS)
    dec = program.Decoder(program.NTOKEN, program.NHID)
    params = [*emb.parameters(), *rnn.parameters(), *dec.parameters()]
    opt = torch.optim.SGD(params, lr=0.5)
    hidden = (
        torch.zeros(program.NLAYERS, program.BATCH, program.NHID),
        torch.zeros(program.NLAYERS, program.BATCH, program.NHID),
    )
    losses = []
    for data, target in program._batches():
        hidden = (hidden[0].detach(), hidden[1].detach())
        output, hidden = rnn(emb(data), hidden)
        loss = torch.nn.functional.cross_entropy(dec(output).view(-1, program.NTOKEN), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach() for p in params]}


def test_the_torch_version_differs_only_in_its_imports(tmp_path: Path) -> None:
    ours = Path(program.__file__).read_text().splitlines()
    theirs = program.torch_version(tmp_path).read_text().splitlines()
    changed = [
        line[1:].strip()
        for line in difflib.unified_diff(ours, theirs, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert sorted(changed) == sorted(
        [
            "from rallypoint import rpc",
            "from rallypoint.rpc import RRef, dist_autograd",
            "from rallypoint.rpc.optim import DistributedOptimizer",
            *program.TORCH_IMPORTS.splitlines(),
        ]
    )


@pytest.mark.timeout(240)
def test_training_equals_torchs_program_on_both_backends(tmp_path: Path) -> None:
    torchs = run_reference_workers(
        run_written_program, 2, str(program.torch_version(tmp_path)), "TENSORPIPE", timeout=90
    )
    ours = run_rpc_pattern("RALLYPOINT", "model_parallel_rnn", timeout=90)
    assert ours[1] is None and torchs[1] is None
    assert ours[0] == torchs[0]

    result = ours[0]
    assert len(result["losses"]) == program.STEPS
    assert result["losses"][-1] < result["losses"][0]
    assert any(any(v != 0 for v in torch.tensor(g).flatten()) for g in result["first_grads"])
    # in a worker: torch's intra-op threads started in the pytest process make workers
    # that later tests fork hang in their first parallel operator
    reference = run_workers(_one_process, 1, timeout=60)[0]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]))
    for got, expected in zip(result["params"], reference["params"], strict=True):
        torch.testing.assert_close(torch.tensor(got), expected)
