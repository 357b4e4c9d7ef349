"""The public functions: bad input raises, the environment never does (outside
``rallypoint run`` snapshots live in the process, said once), and DCP persistence."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rallypoint import snapshot
from rallypoint._snapshot import _api


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process without rallypoint run's environment and a new snapshot session."""
    for name in ("RALLYPOINT_SNAPSHOT_SOCKET", "RALLYPOINT_SNAPSHOT_DIR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_api, "_STATE", _api._State())
    yield
    snapshot.wait()


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "epoch": seed}


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (({},), {"step": -1}, ValueError, "step must be >= 0"),
        (({},), {"step": 1.0}, TypeError, "step must be an int"),
        (({},), {"step": True}, TypeError, "step must be an int"),
        (([],), {"step": 1}, TypeError, "state must be a dict"),
        (({2: 1},), {"step": 1}, TypeError, "keys must be str"),
    ],
)
def test_save_rejects_bad_input(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        snapshot.save(*args, **kwargs)


def test_save_needs_a_keyword_step_that_increases() -> None:
    with pytest.raises(TypeError):
        snapshot.save({}, 3)  # type: ignore[misc]
    snapshot.save({"x": 1}, step=3)
    with pytest.raises(ValueError, match="step must increase from one save to the next: got 3"):
        snapshot.save({"x": 1}, step=3)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ((("model", 1),), "state must be a dict"),
        ({"a": torch.nn.Linear(1, 1).state_dict}, None),
    ],
)
def test_restore_rejects_bad_input(state: Any, match: str | None) -> None:
    if match is None:
        assert snapshot.restore(state) is None  # a method is a value: nothing to restore
        return
    with pytest.raises(TypeError, match=match):
        snapshot.restore(state)


def test_restore_refuses_objects_it_cannot_load_into() -> None:
    class SaveOnly:
        def state_dict(self) -> dict[str, int]:
            return {}

    with pytest.raises(TypeError, match=r"state\['s'\] has state_dict\(\) but no load_state_dict"):
        snapshot.restore({"s": SaveOnly()})
    with pytest.raises(TypeError, match="mutable mapping"):
        from types import MappingProxyType

        snapshot.restore(MappingProxyType({}))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"every": 0}, ValueError), ({"dir": 5}, TypeError), ({"often": 1}, TypeError)],
)
def test_configure_rejects_bad_input(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        snapshot.configure(**kwargs)


def test_configure_refuses_a_file_as_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        snapshot.configure(dir=tmp_path / "f")


def test_outside_rallypoint_run_snapshots_live_in_the_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    snapshot.wait()  # nothing yet: no error
    state = _state(1)
    assert snapshot.restore(state) is None
    snapshot.save(state, step=5)
    state["epoch"] = 99
    snapshot.save(_state(2), step=6)
    target = _state(3)
    assert snapshot.restore(target) == 6
    assert target["epoch"] == 2
    for a, b in zip(target["model"].parameters(), _state(2)["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    err = capsys.readouterr().err
    assert err.count("not running under `rallypoint run`") == 1, err


def test_an_unreachable_node_server_falls_back_with_one_message(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RALLYPOINT_SNAPSHOT_SOCKET", str(tmp_path / "gone.sock"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("RALLYPOINT_RPC_SECRET", "s")
    snapshot.save({"x": torch.ones(2)}, step=1)
    snapshot.save({"x": torch.ones(2)}, step=2)
    err = capsys.readouterr().err
    assert err.count("cannot use this node's snapshot server") == 1, err


@pytest.mark.timeout(120)
def test_dcp_persistence_and_a_fresh_process_restores_from_it(tmp_path: Path) -> None:
    snapshot.configure(dir=tmp_path / "ck", every=2)
    state = _state(4)
    at4: dict[str, torch.Tensor] = {}
    for step in range(1, 6):
        state["epoch"] = step
        with torch.no_grad():
            state["model"].weight += 1.0  # a different state every step
        snapshot.save(state, step=step)
        if step == 4:
            at4["w"] = state["model"].weight.detach().clone()
            at4["m"] = state["optimizer"].state_dict()["state"][0]["momentum_buffer"].clone()
    snapshot.wait()
    [ns] = (tmp_path / "ck").iterdir()  # this process's namespace: run-local-<random>
    assert ns.name.startswith("run-local-")
    assert sorted(p.name for p in ns.glob("step-*")) == ["step-000000000002", "step-000000000004"]
    snapshot.configure(dir=None)  # this "job" ends: a live job's checkpoints are never read
    code = f"""
import torch
from rallypoint import snapshot
snapshot.configure(dir={str(tmp_path / "ck")!r})
torch.manual_seed(9)
model = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
state = {{"model": model, "optimizer": opt, "epoch": None}}
print("STEP", snapshot.restore(state), state["epoch"], flush=True)
momentum = opt.state_dict()["state"][0]["momentum_buffer"]
torch.save({{"w": model.weight, "m": momentum}}, {str(tmp_path / "r.pt")!r})
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RALLYPOINT_SNAPSHOT")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env
    )
    assert "STEP 4 4" in out.stdout, out.stdout + out.stderr
    got = torch.load(tmp_path / "r.pt")
    assert torch.equal(got["w"], at4["w"]) and torch.equal(got["m"], at4["m"])
