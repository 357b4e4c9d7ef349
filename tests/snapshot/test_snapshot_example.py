"""The documented restartable script (examples/snapshot_train.py) resumes bit-identically."""

from __future__ import annotations

import runpy
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from _support import cli_zygote
from rallypoint.launcher import launch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "snapshot_train.py"


def _run(*args: str) -> str:
    cmd = [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "2", *args]
    proc = cli_zygote.run(cmd, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


@pytest.mark.timeout(320)
def test_example_killed_at_37_ends_with_the_uninterrupted_model(tmp_path: Path) -> None:
    crashed = _run(
        "--max-restarts", "1", str(EXAMPLE), "--crash-at", "37", "--out", str(tmp_path / "b.pt")
    )
    assert "restored step 37 from memory on every rank (2 ranks" in crashed, crashed
    assert "starting at step 37 (restart 1)" in crashed
    # uninterrupted: the same script in workers forked from this process (torch imported)
    launch(_example, "--out", str(tmp_path / "a.pt"), nproc=2, timeout=timedelta(seconds=120))
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _example(*argv: str) -> None:
    sys.argv = [str(EXAMPLE), *argv]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
