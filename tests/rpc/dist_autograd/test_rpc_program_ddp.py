"""pytorch/examples' DDP+RPC program runs on rallypoint with only its imports changed.

The program (rallypoint.testing._rpc._program_ddp: a RemoteModule embedding on a
parameter server, a DDP linear on two trainers, distributed autograd and
DistributedOptimizer) runs as torch's own program (its import block swapped for torch's)
on TensorPipe, and with rallypoint's imports on rallypoint's backend: both must train
to the same numbers, DDP's all-reduced gradients included. (The contract test runs it
through rallypoint.rpc on both backends too: test_rpc_contract.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint.testing._rpc import _program_ddp as program
from rallypoint.testing._rpc import _torch_program
from rallypoint.testing._rpc._contract import run_rpc_pattern
from rallypoint.testing._workers import run_reference_workers


def _split(text: str) -> tuple[str, str]:
    """(the program without its import block, the import block)."""
    head, rest = text.split(_torch_program.START + "\n")
    block, tail = rest.split("\n" + _torch_program.END)
    return head + tail, block


def test_the_torch_version_differs_only_in_its_imports(tmp_path: Path) -> None:
    ours, our_imports = _split(Path(program.__file__).read_text())
    theirs, their_imports = _split(program.torch_version(tmp_path).read_text())
    assert ours == theirs
    assert their_imports == program.TORCH_IMPORTS
    assert our_imports.splitlines() == [
        "from rallypoint import rpc",
        "from rallypoint.rpc import RRef, dist_autograd",
        "from rallypoint.rpc.nn import RemoteModule",
        "from rallypoint.rpc.optim import DistributedOptimizer",
    ]


@pytest.mark.timeout(200)
def test_training_equals_torchs_program(tmp_path: Path) -> None:
    torchs = run_reference_workers(
        _torch_program.run_written_program,
        program.WORLD_SIZE,
        str(program.torch_version(tmp_path)),
        "TENSORPIPE",
        timeout=90,
    )
    ours = run_rpc_pattern("RALLYPOINT", "ddp_rpc", timeout=90)
    assert [r is None for r in ours] == [r is None for r in torchs] == [True, True, False, True]
    program.assert_same_training(ours[2], torchs[2])

    trainers = ours[2]["trainers"]
    assert len(trainers[0]["losses"]) == program.EPOCHS * program.BATCHES
    # DDP: both replicas got the same (all-reduced) gradients and stayed equal
    assert trainers[0]["first_fc_grads"] == trainers[1]["first_fc_grads"]
    assert trainers[0]["fc"] == trainers[1]["fc"]
    # and those are not one trainer's own gradients: the trainers' data differ
    assert trainers[0]["losses"][0] != trainers[1]["losses"][0]
