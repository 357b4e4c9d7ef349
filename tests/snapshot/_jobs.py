"""Shared by the snapshot tests: running the training script of ``_train.py`` under
``rallypoint run``, reading what its workers wrote, and the uninterrupted references."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

TRAIN = Path(__file__).with_name("_train.py")


def run(nproc: int, out: Path, mode: str, steps: int, *flags: str, timeout: float = 120) -> str:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", str(nproc),
        "--shutdown-timeout", "2", *flags, str(TRAIN), str(out), mode, str(steps),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def starts(out: Path) -> list[tuple[int, int, int]]:
    """``(start step, steps seen by the restored state, world)`` of every worker started."""
    return sorted(tuple(map(int, p.read_text().split())) for p in out.glob("start-*"))  # type: ignore[misc]


def same_params(a: Path, b: Path) -> None:
    x, y = torch.load(a), torch.load(b)
    assert x.keys() == y.keys()
    for name in x:
        assert torch.equal(x[name], y[name]), name


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of 60 steps, two workers."""
    out = tmp_path_factory.mktemp("reference")
    run(2, out, "none", 60)
    return out / "final.pt"


@pytest.fixture(scope="session")
def reference4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 uninterrupted steps in a world of four ranks."""
    out = tmp_path_factory.mktemp("reference4")
    run(4, out, "none", 60)
    return out / "final.pt"
