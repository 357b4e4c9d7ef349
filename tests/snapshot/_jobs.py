"""Shared by the snapshot tests: running the training of ``_train.py`` (one node: with
:func:`rallypoint.launcher.launch`, which starts the same processes as ``rallypoint run``),
reading what its workers wrote, and the uninterrupted references."""

from __future__ import annotations

import importlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from _train import train

from rallypoint._core import envvars
from rallypoint._supervise._warm._server import LATER_MODULES
from rallypoint.launcher import launch

TRAIN = Path(__file__).with_name("_train.py")


def _import_what_a_first_step_imports() -> None:
    """Each job's workers are forked from a warm process forked from this one, and each
    worker's first Adam imports ``torch._dynamo`` (some 1.6 s of CPU, per worker and job;
    the warm process imports it and the rest of :data:`LATER_MODULES` once idle, per job
    too): imported once here, they find it done, as the workers of a script that imported
    it before its ``launch()`` do."""
    for name in LATER_MODULES:
        importlib.import_module(name)


def run(
    nproc: int,
    out: Path,
    mode: str,
    steps: int,
    *,
    max_restarts: int = 0,
    snapshot_dir: Path | None = None,
    every: int = 10,
    virtual_local_rank: bool = False,
    run_id: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> str:
    """The job of ``rallypoint run --nproc-per-node NPROC _train.py OUT MODE STEPS``, with
    workers forked from this process (torch already imported: no interpreter start per
    worker); returns what the workers wrote."""
    _import_what_a_first_step_imports()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(extra_env or {})
    if snapshot_dir is not None:
        env.update({envvars.SNAPSHOT_DIR: str(snapshot_dir), envvars.SNAPSHOT_EVERY: str(every)})
    logs = out / "logs"
    launch(
        train, str(out), mode, steps,
        nproc=nproc, max_restarts=max_restarts, shutdown_timeout=timedelta(seconds=2),
        timeout=timedelta(seconds=120), env=env, log_dir=logs, redirects="3",
        virtual_local_rank=virtual_local_rank, run_id=run_id,
    )  # fmt: skip
    return "".join(p.read_text() for p in sorted(logs.rglob("*.log")))


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
