"""Every ``Manager`` argument honoured as torchft honours it, or refused in one line; and a
heal over the transport that ``checkpoint_transport=`` names.

Each side-by-side case runs one scenario of ``_ft_side_by_side.py`` on torchft 0.2.0 and on
``rallypoint.ft`` (each in a child process, its groups threads of it, as torchft's
``manager_integ_test.py`` runs them) and wants the same result from both.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).with_name("_ft_side_by_side.py")
needs_torchft = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None, reason="needs torchft==0.2.0"
)


def _run(stack: str, scenario: str) -> Any:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), stack, scenario],
        capture_output=True, text=True, timeout=150, env=env,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert lines, f"{stack} {scenario}: rc {done.returncode}\n{done.stderr[-4000:]}"
    return json.loads(lines[-1])


def _side_by_side(scenario: str) -> Any:
    theirs, ours = _run("torchft", scenario), _run("rallypoint", scenario)
    assert ours == theirs, f"torchft: {theirs}\nrallypoint.ft: {ours}"
    return ours


@needs_torchft
@pytest.mark.timeout(360)
def test_fixed_with_spares_one_takes_part_and_the_spare_steps_with_it() -> None:
    """min_replica_size 1, two groups: one participant and a spare (zeros), average 1.0."""
    groups = _side_by_side("spares")
    for group in groups:
        assert group["step"] == 3
        for step in group["steps"]:
            assert step["participants"] == 1 and step["average"] == 1.0 and step["commit"]
    assert [s["participating"] for s in groups[0]["steps"]] == [True] * 3
    assert [s["participating"] for s in groups[1]["steps"]] == [False] * 3


@needs_torchft
@pytest.mark.timeout(360)
def test_a_users_transport_carries_the_heal_with_torchfts_calls() -> None:
    """Group 1 heals from group 0 at step 0 (init_sync) through the user's transport: the
    same calls, ranks, metadata and steps as torchft makes, and the same parameters."""
    groups = _side_by_side("user_transport")
    assert groups[0]["calls"] == [["send", [1], 0], ["disallow"], ["shutdown"]]
    assert groups[1]["calls"] == [["recv", 0, "shelf:0", 0], ["disallow"], ["shutdown"]]
    assert groups[0]["w"] == groups[1]["w"] == [8.0] * 4


@needs_torchft
@pytest.mark.timeout(360)
@pytest.mark.parametrize("scenario", ["http_transport", "pg_transport"])
def test_a_heal_over_http_or_the_process_group_ends_equal(scenario: str) -> None:
    groups = _side_by_side(scenario)
    assert [g["w"] for g in groups] == [[8.0] * 4] * 2 and [g["step"] for g in groups] == [2, 2]


@needs_torchft
@pytest.mark.timeout(360)
def test_wrap_future_gives_the_default_after_its_timeout() -> None:
    (group,) = _side_by_side("wrap_future_timeout")
    assert group == {"value": 7, "after the timeout": True, "errored": True, "completed": 3}


@needs_torchft
@pytest.mark.timeout(360)
def test_a_state_whose_reads_are_disallowed_is_not_read_until_allowed() -> None:
    (group,) = _side_by_side("state_reads")
    assert group == {
        "refused": "TimeoutError",
        "waited its timeout": True,
        "after": ["torchft", "user"],
    }


@needs_torchft
@pytest.mark.timeout(360)
def test_port_is_where_rank_0_listens() -> None:
    assert _side_by_side("port") == [{"listens": True}]


def test_quorum_retries_ask_again_after_a_failed_ask() -> None:
    from rallypoint.ft._group.manager_parts import ask

    class Flaky:
        calls = 0

        def quorum(self, req: Any, wait: float) -> str:
            self.calls += 1
            if self.calls < 3:
                raise TimeoutError("no quorum yet")
            return "quorum"

    assert ask(Flaky(), None, 1.0, 2, "0") == "quorum"
    with pytest.raises(TimeoutError, match="no quorum yet"):
        ask(Flaky(), None, 1.0, 1, "0")


@pytest.mark.timeout(60)
def test_what_cannot_be_honoured_is_refused_in_one_line() -> None:
    import rallypoint.ft as ft

    base: dict[str, Any] = {"pg": None, "load_state_dict": None, "state_dict": None}
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"world_size_mode": 1}, TypeError, "world_size_mode must be a WorldSizeMode"),
        ({"checkpoint_transport": object()}, TypeError, "has no metadata, send_checkpoint"),
        ({"port": 70000}, ValueError, "port must be a TCP port"),
        ({"quorum_retries": -1}, ValueError, "quorum_retries must be 0 or more"),
    ]
    for extra, kind, text in cases:
        with pytest.raises(kind, match=text) as info:
            ft.Manager(**base, min_replica_size=1, **extra)
        assert "\n" not in str(info.value)


@pytest.mark.timeout(120)
def test_torchfts_train_ddp_gets_past_its_imports_with_the_import_swapped() -> None:
    """train_ddp.py's imports (torchft 0.2.0), swapped, and its transport made as it makes it."""
    code = (
        "from datetime import timedelta\n"
        "import torch\n"
        "from rallypoint.ft import DistributedDataParallel, DistributedSampler, Manager, "
        "Optimizer, ProcessGroupBabyNCCL, ProcessGroupGloo\n"
        "from rallypoint.ft.checkpointing.pg_transport import PGTransport\n"
        "from rallypoint.ft.checkpointing import CheckpointTransport, HTTPTransport\n"
        "pg = ProcessGroupGloo(timeout=timedelta(seconds=5))\n"
        "t = PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device('cpu'))\n"
        "assert isinstance(t, CheckpointTransport) and t.metadata() == '<n/a>'\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100, env=env)  # fmt: skip
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_default_heal_stream_is_a_checkpoint_transport() -> None:
    from rallypoint.ft._heal import HealServer
    from rallypoint.ft.checkpointing import CheckpointTransport

    server = HealServer(b"a job's secret", host="127.0.0.1", timeout=5.0)
    try:
        assert isinstance(server, CheckpointTransport)
        state = {"w": torch.arange(4.0), "note": ("x", 1)}
        server.send_checkpoint([1], 3, state, timedelta(seconds=5))
        got = server.recv_checkpoint(0, server.metadata(), 3, timedelta(seconds=5))
        assert torch.equal(got["w"], state["w"]) and got["note"] == ("x", 1)
        server.disallow_checkpoint()
    finally:
        server.shutdown()


def test_a_pg_transport_refuses_a_process_group_without_send_and_recv() -> None:
    from rallypoint.ft.checkpointing.pg_transport import PGTransport

    with pytest.raises(TypeError, match="PGTransport needs a process group with send and recv"):
        PGTransport(object(), timeout=timedelta(seconds=1), device=torch.device("cpu"))


@pytest.mark.timeout(120)
def test_no_transport_unpickles_what_a_peer_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP, the process group and the heal stream each carry a state with a DTensor, an
    optimizer-like nest and bytes while every unpickling entry point raises."""
    import pickle
    import threading

    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, distribute_tensor

    import rallypoint.ft as ft
    from rallypoint.ft._heal import HealServer
    from rallypoint.ft.checkpointing import HTTPTransport
    from rallypoint.ft.checkpointing.pg_transport import PGTransport

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        state = {
            "w": torch.arange(6.0).reshape(2, 3),
            "d": distribute_tensor(torch.tensor([5, 6, 7]), DeviceMesh("cpu", 1), []),
            "optim": {
                "state": {0: {"step": torch.tensor(3.0)}},
                "groups": [{"betas": (0.9, 0.99)}],
            },
            "raw": b"\x00\x01",
        }

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("a transport unpickled what a peer sent")

        for name in ("loads", "load", "Unpickler"):
            monkeypatch.setattr(pickle, name, refuse)
        monkeypatch.setattr(torch, "load", refuse)

        def same(got: Any) -> None:
            assert torch.equal(got["w"], state["w"]) and got["raw"] == b"\x00\x01"
            assert torch.equal(got["d"].to_local(), state["d"].to_local())
            assert got["d"]._spec == state["d"]._spec
            assert got["optim"]["groups"][0]["betas"] == (0.9, 0.99)
            assert torch.equal(got["optim"]["state"][0]["step"], torch.tensor(3.0))

        wait = timedelta(seconds=10)
        for transport in (HTTPTransport(wait, num_chunks=0), HTTPTransport(wait, num_chunks=2)):
            transport.send_checkpoint([1], 4, state, wait)
            same(transport.recv_checkpoint(0, transport.metadata(), 4, wait))
            transport.shutdown()
        heal = HealServer(b"secret", host="127.0.0.1", timeout=10.0)
        heal.send_checkpoint([1], 4, state, wait)
        same(heal.recv_checkpoint(0, heal.metadata(), 4, wait))
        heal.shutdown()

        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        got: list[Any] = []

        def rank(r: int) -> None:
            pg = ft.ProcessGroupGloo(timeout=wait)
            pg.configure(f"localhost:{store.port}/nopickle", "0", r, 2)
            transport = PGTransport(pg, timeout=wait, device=torch.device("cpu"))
            if r == 0:
                transport.send_checkpoint([1], 4, state, wait)
            else:
                got.append(transport.recv_checkpoint(0, transport.metadata(), 4, wait))

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(got) == 1, "the process group transport did not deliver"
        same(got[0])
    finally:
        dist.destroy_process_group()


@needs_torchft
@pytest.mark.timeout(360)
def test_a_group_that_sets_up_after_making_its_manager_does_not_pause_the_others() -> None:
    """A group made its manager (it says hello and beats) and then sets up for 5 s before
    its first step, under the command line's 60 s join timeout: torchft's fast quorum does
    not wait for it, and neither may ours (it held every other group for its whole set-up,
    up to the join timeout)."""
    [result] = _side_by_side("late_setup")
    assert all(result.values()), result
