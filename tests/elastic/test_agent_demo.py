"""The demo on two simulated nodes: a crash, a restart from the checkpoint, the same model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _support import cli_zygote

DEMO = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def _agents(argvs: list[list[str]], timeout: float = 150) -> list[str]:
    # One intra-op thread in every worker, as the uninterrupted run's two workers on one node
    # get from the launcher: with two threads on a loaded machine, torch's CPU kernels do not
    # always round a step's gradients the same way twice (seen: the very first backward
    # differing in its 7th digit), so the runs could not be compared bit for bit.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        cli_zygote.Popen(
            [sys.executable, "-m", "rallypoint", "run", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for argv in argvs
    ]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, out
            outs.append(out)
    finally:
        for p in procs:
            p.kill()
    return outs


@pytest.mark.timeout(240)
def test_demo_resumed_on_two_nodes_ends_with_the_uninterrupted_model(tmp_path: Path) -> None:
    import torch
    import torch.distributed as dist

    common = ["--preload", "torch._dynamo", "--shutdown-timeout", "5", "--hang-timeout", "120"]
    script = [str(DEMO), "--epochs", "3", "--batch-size", "256"]
    # uninterrupted: one node, two workers (the same world size as below)
    _agents([[*common, "--nproc-per-node", "2", *script, "--checkpoint-dir", str(tmp_path / "a")]])

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    elastic = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "demo",
        "--rdzv-conf", "is_host=false", "--max-restarts", "1",
    ]  # fmt: skip
    crash = [*script, "--crash-at-epoch", "1", "--checkpoint-dir", str(tmp_path / "b")]
    outs = _agents([[*common, *elastic, *crash] for _ in range(2)])
    joined = "".join(outs)
    assert "simulated crash in epoch 1" in joined
    assert "after epoch 0 (restart 1)" in joined  # resumed from the checkpoint of epoch 0
    a = torch.load(tmp_path / "a" / "last.pt", map_location="cpu")
    b = torch.load(tmp_path / "b" / "last.pt", map_location="cpu")
    assert a["epoch"] == b["epoch"] == 2
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
